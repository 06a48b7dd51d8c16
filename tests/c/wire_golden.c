/*
 * The C codec against the golden frames (tests/wire_golden.json): each line of standard input is a frame in hex;
 * the program decodes it, prints its type, request id and fields, encodes those again and says whether the bytes
 * are the same. tests/test_c_library.py compares the fields with the ones the golden file records.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../src/vmmshare/clib/wire.h"

static size_t unhex(const char *text, uint8_t *out, size_t cap)
{
    size_t n = 0;
    while (text[0] && text[1] && n < cap) {
        unsigned v;
        if (sscanf(text, "%2x", &v) != 1)
            break;
        out[n++] = (uint8_t)v;
        text += 2;
    }
    return n;
}

int main(void)
{
    static char line[2 * VS_WIRE_MAX_FRAME + 16];
    static uint8_t frame[VS_WIRE_MAX_FRAME + 1], again[VS_WIRE_MAX_FRAME];
    while (fgets(line, sizeof line, stdin) != NULL) {
        line[strcspn(line, "\n")] = '\0';
        size_t n = unhex(line, frame, sizeof frame);
        const vs_layout *layout = n > 3 ? vs_wire_layout(frame[3]) : NULL;
        unsigned kind;
        uint32_t req;
        vs_fields f;
        const char *why;
        char scratch[160];
        int fds = layout != NULL ? layout->fds : 0;
        if (vs_wire_decode(frame, n, fds, &kind, &req, &f, &why, scratch) != 0) {
            printf("error %s\n", why);
            continue;
        }
        printf("%s %u", layout->name, req);
        int slot = 0, bytes = 0;
        for (const char *p = layout->format; *p; slot++) {
            size_t count = 0;
            while (*p >= '0' && *p <= '9')
                count = count * 10 + (size_t)(*p++ - '0');
            char code = *p++;
            if (code == 's') {
                printf(" b:");
                for (size_t k = 0; k < count; k++)
                    printf("%02x", f.bytes[bytes][k]);
                bytes++;
            } else if (code == 'i') {
                printf(" %lld", (long long)(int64_t)f.v[slot]);
            } else {
                printf(" %llu", (unsigned long long)f.v[slot]);
            }
        }
        printf(" t:");
        for (size_t k = 0; k < f.tail_len; k++)
            printf("%02x", f.tail[k]);
        size_t m = vs_wire_encode(kind, req, &f, again, &why);
        printf(" %s\n", m == n && memcmp(again, frame, n) == 0 ? "same" : "different");
    }
    return 0;
}
