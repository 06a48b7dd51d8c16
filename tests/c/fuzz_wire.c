/*
 * The C client's reply parsing, fuzzed (built with the sanitizers): random frames, and frames of every type with
 * random bytes changed, cut short or grown, go through the decoder; each must decode or be refused with a reason,
 * never read out of bounds. A decoded frame must encode back to the same bytes. Deterministic (a fixed seed).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../src/vmmshare/clib/wire.h"

static uint64_t state = 0x9E3779B97F4A7C15ULL;

static uint64_t next(void)
{
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
}

int main(int argc, char **argv)
{
    long rounds = argc > 1 ? atol(argv[1]) : 200000;
    static uint8_t frame[VS_WIRE_MAX_FRAME + 64], again[VS_WIRE_MAX_FRAME];
    static const unsigned kinds[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 64, 65, 66, 67, 68, 69, 70, 71, 72};
    long decoded = 0, refused = 0;
    for (long r = 0; r < rounds; r++) {
        size_t n;
        if (next() % 4 == 0) { /* pure noise */
            n = next() % 96;
            for (size_t i = 0; i < n; i++)
                frame[i] = (uint8_t)next();
        } else { /* a valid frame of some type, then mutated */
            const vs_layout *layout = vs_wire_layout(kinds[next() % (sizeof kinds / sizeof kinds[0])]);
            vs_fields f;
            memset(&f, 0, sizeof f);
            static uint8_t bytes[4][128], tail[512];
            for (int i = 0; i < VS_WIRE_MAX_FIELDS; i++)
                f.v[i] = next() & 0xFF;
            for (int i = 0; i < 4; i++) {
                for (int k = 0; k < 128; k++)
                    bytes[i][k] = (uint8_t)next();
                f.bytes[i] = bytes[i];
            }
            size_t tl = layout->tail == VS_TAIL_NONE ? 0 : next() % 64;
            if (layout->tail == VS_TAIL_U32)
                tl -= tl % 4;
            for (size_t k = 0; k < tl; k++)
                tail[k] = (uint8_t)('a' + next() % 26);
            f.tail = tail;
            f.tail_len = tl;
            const char *why;
            n = vs_wire_encode(layout->kind, (uint32_t)next(), &f, frame, &why);
            if (n == 0) {
                printf("could not encode a valid %s: %s\n", layout->name, why);
                return 1;
            }
            switch (next() % 4) {
            case 0: frame[next() % n] ^= (uint8_t)(1u << (next() % 8)); break;
            case 1: n = next() % (n + 1); break;
            case 2: for (int k = 0; k < 8; k++) frame[n + (size_t)k] = (uint8_t)next(); n += next() % 8; break;
            default: break;
            }
        }
        unsigned kind;
        uint32_t req;
        vs_fields f;
        const char *why;
        char scratch[160];
        int nfds = (int)(next() % 2);
        if (vs_wire_decode(frame, n, nfds, &kind, &req, &f, &why, scratch) == 0) {
            decoded++;
            size_t m = vs_wire_encode(kind, req, &f, again, &why);
            if (m != n || memcmp(again, frame, n) != 0) {
                printf("a decoded %s does not encode back to its bytes\n", vs_wire_layout(kind)->name);
                return 1;
            }
        } else {
            refused++;
            if (why == NULL || why[0] == '\0') {
                printf("a refusal without a reason\n");
                return 1;
            }
        }
    }
    printf("%ld decoded, %ld refused\n", decoded, refused);
    return 0;
}
