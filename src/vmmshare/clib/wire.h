/*
 * The broker protocol's framing in C (docs/protocol.md): a 12-byte header (magic "VB", version 2, message type,
 * request id, body length; little-endian) and a body of fixed fields and, for some types, a tail. The same table
 * of layouts as vmmshare.wire.local, so both languages write the same bytes (tests pin them to
 * tests/wire_golden.json). Encoding and decoding only: no I/O, so it can be fuzzed alone.
 */
#ifndef VMMSHARE_CLIB_WIRE_H
#define VMMSHARE_CLIB_WIRE_H

#include <stddef.h>
#include <stdint.h>

#define VS_WIRE_HEADER 12
#define VS_WIRE_MAX_FRAME (64 * 1024)
#define VS_WIRE_MAX_BODY (VS_WIRE_MAX_FRAME - VS_WIRE_HEADER)
#define VS_WIRE_MAX_FIELDS 16
#define VS_WIRE_MAX_PIDS 4096

enum vs_msg {
    VS_CHARGE = 1, VS_RELEASE = 2, VS_MEM_INFO = 3, VS_EXPORT = 4, VS_REVOKE = 5, VS_SET_PIDS = 6, VS_IMPORT = 7,
    VS_BARE_TGID = 8, VS_LIST = 9, VS_CHARGE_GPU = 10, VS_REMOTE_IMPORT = 11, VS_SET_REMOTE_PIDS = 12,
    VS_OK = 64, VS_ERROR = 65, VS_TOKEN = 66, VS_MEM = 67, VS_EXPORTED = 68, VS_IMPORTED = 69, VS_PID = 70,
    VS_LISTING = 71, VS_REMOTE_IMPORTED = 72
};

enum vs_tail { VS_TAIL_NONE = 0, VS_TAIL_BYTES = 1, VS_TAIL_U32 = 2, VS_TAIL_TEXT = 3 };

/* One message's values: its integer fields in wire order (a fixed-size bytes field takes a slot of `bytes` in
 * turn instead), and its tail (for a u32 tail, `tail` holds the little-endian words as they lie on the wire). */
typedef struct vs_fields {
    uint64_t v[VS_WIRE_MAX_FIELDS];
    const uint8_t *bytes[4];
    const uint8_t *tail;
    size_t tail_len;
} vs_fields;

typedef struct vs_layout {
    uint8_t kind;
    const char *name;
    const char *format;   /* struct codes: Q u64, I u32, i i32, H u16, B u8, <n>s n bytes */
    enum vs_tail tail;
    uint32_t max_tail;
    int fds;
} vs_layout;

const vs_layout *vs_wire_layout(unsigned kind);
/* The fixed body size of a layout. */
size_t vs_wire_fixed_size(const vs_layout *layout);
/* Encode a frame into `out` (at least VS_WIRE_MAX_FRAME bytes); its length, or 0 with `why` set when a value does
 * not fit its field or the tail is over its maximum. */
/* The little-endian unsigned integer of `len` bytes (at most 8) at p. */
uint64_t vs_wire_get_le(const uint8_t *p, size_t len);
size_t vs_wire_encode(unsigned kind, uint32_t req, const vs_fields *f, uint8_t *out, const char **why);
/* Decode one whole frame that came with `nfds` descriptors; 0 on success, else -1 with `why` (a static text or
 * `scratch`, which must hold 160 bytes) saying what is wrong. The fields point into `frame`. */
int vs_wire_decode(const uint8_t *frame, size_t n, int nfds, unsigned *kind, uint32_t *req, vs_fields *f,
                   const char **why, char *scratch);

#endif /* VMMSHARE_CLIB_WIRE_H */
