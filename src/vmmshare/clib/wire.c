/*
 * The broker protocol's codec (wire.h): the layouts of vmmshare.wire.local, encoded and decoded strictly.
 */
#include "wire.h"

#include <stdio.h>
#include <string.h>

static const vs_layout LAYOUTS[] = {
    {VS_CHARGE, "CHARGE", "iQ", VS_TAIL_NONE, 0, 0},
    {VS_RELEASE, "RELEASE", "Q", VS_TAIL_NONE, 0, 0},
    {VS_MEM_INFO, "MEM_INFO", "I", VS_TAIL_NONE, 0, 0},
    {VS_EXPORT, "EXPORT", "QQBBIBBBBBi", VS_TAIL_U32, VS_WIRE_MAX_PIDS * 4, 1},
    {VS_REVOKE, "REVOKE", "Q", VS_TAIL_NONE, 0, 0},
    {VS_SET_PIDS, "SET_PIDS", "QB", VS_TAIL_U32, VS_WIRE_MAX_PIDS * 4, 0},
    {VS_IMPORT, "IMPORT", "QB32s", VS_TAIL_NONE, 0, 0},
    {VS_BARE_TGID, "BARE_TGID", "", VS_TAIL_NONE, 0, 0},
    {VS_LIST, "LIST", "I", VS_TAIL_NONE, 0, 0},
    {VS_CHARGE_GPU, "CHARGE_GPU", "IQ", VS_TAIL_NONE, 0, 0},
    {VS_REMOTE_IMPORT, "REMOTE_IMPORT", "128s", VS_TAIL_NONE, 0, 0},
    {VS_SET_REMOTE_PIDS, "SET_REMOTE_PIDS", "QBI", VS_TAIL_U32, VS_WIRE_MAX_PIDS * 4, 0},
    {VS_OK, "OK", "", VS_TAIL_NONE, 0, 0},
    {VS_ERROR, "ERROR", "I", VS_TAIL_TEXT, 4096, 0},
    {VS_TOKEN, "TOKEN", "Q", VS_TAIL_NONE, 0, 0},
    {VS_MEM, "MEM", "QQ", VS_TAIL_NONE, 0, 0},
    {VS_EXPORTED, "EXPORTED", "", VS_TAIL_BYTES, 128, 0},
    {VS_IMPORTED, "IMPORTED", "QQBBBBBi", VS_TAIL_NONE, 0, 1},
    {VS_PID, "PID", "I", VS_TAIL_NONE, 0, 0},
    {VS_LISTING, "LISTING", "", VS_TAIL_TEXT, VS_WIRE_MAX_BODY, 0},
    {VS_REMOTE_IMPORTED, "REMOTE_IMPORTED", "QQBBBBBiQH16sH", VS_TAIL_TEXT, 255, 0},
};

const vs_layout *vs_wire_layout(unsigned kind)
{
    for (size_t i = 0; i < sizeof LAYOUTS / sizeof LAYOUTS[0]; i++)
        if (LAYOUTS[i].kind == kind)
            return &LAYOUTS[i];
    return NULL;
}

/* The next field of a format: its code and, for bytes, its length; the format after it. */
static const char *next_field(const char *fmt, char *code, size_t *len)
{
    size_t n = 0;
    while (*fmt >= '0' && *fmt <= '9')
        n = n * 10 + (size_t)(*fmt++ - '0');
    *code = *fmt;
    switch (*fmt) {
    case 'Q': *len = 8; break;
    case 'I': case 'i': *len = 4; break;
    case 'H': *len = 2; break;
    case 'B': *len = 1; break;
    default: *len = n; break; /* 's' */
    }
    return fmt + 1;
}

size_t vs_wire_fixed_size(const vs_layout *layout)
{
    size_t total = 0, len;
    char code;
    for (const char *f = layout->format; *f;) {
        f = next_field(f, &code, &len);
        total += len;
    }
    return total;
}

static void put_le(uint8_t *p, uint64_t v, size_t len)
{
    for (size_t i = 0; i < len; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

uint64_t vs_wire_get_le(const uint8_t *p, size_t len)
{
    uint64_t v = 0;
    for (size_t i = 0; i < len; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

size_t vs_wire_encode(unsigned kind, uint32_t req, const vs_fields *f, uint8_t *out, const char **why)
{
    const vs_layout *layout = vs_wire_layout(kind);
    if (layout == NULL) {
        *why = "not a message of the broker protocol";
        return 0;
    }
    size_t at = VS_WIRE_HEADER, len;
    int slot = 0, bytes = 0;
    char code;
    for (const char *fmt = layout->format; *fmt; slot++) {
        fmt = next_field(fmt, &code, &len);
        if (code == 's') {
            memcpy(out + at, f->bytes[bytes++], len);
            at += len;
            continue;
        }
        uint64_t v = f->v[slot];
        if (code == 'i') {
            int64_t s = (int64_t)v;
            if (s < INT32_MIN || s > INT32_MAX) {
                *why = "a value does not fit its 32-bit field";
                return 0;
            }
            v = (uint32_t)(int32_t)s;
        } else if (len < 8 && v >> (8 * len)) {
            *why = "a value does not fit its field";
            return 0;
        }
        put_le(out + at, v, len);
        at += len;
    }
    if (layout->tail != VS_TAIL_NONE) {
        size_t n = f->tail_len;
        if (n > layout->max_tail || (layout->tail == VS_TAIL_U32 && n % 4)) {
            *why = "the tail is over its maximum";
            return 0;
        }
        if (n)
            memcpy(out + at, f->tail, n);
        at += n;
    }
    out[0] = 'V';
    out[1] = 'B';
    out[2] = 2;
    out[3] = (uint8_t)kind;
    put_le(out + 4, req, 4);
    put_le(out + 8, at - VS_WIRE_HEADER, 4);
    return at;
}

/* Whether `p[0..n)` is UTF-8 (no overlong forms, no surrogates, nothing above U+10FFFF). */
static int utf8_ok(const uint8_t *p, size_t n)
{
    size_t i = 0;
    while (i < n) {
        uint8_t c = p[i];
        size_t more;
        uint32_t cp;
        if (c < 0x80) { i++; continue; }
        if (c >= 0xC2 && c <= 0xDF) { more = 1; cp = c & 0x1F; }
        else if (c >= 0xE0 && c <= 0xEF) { more = 2; cp = c & 0x0F; }
        else if (c >= 0xF0 && c <= 0xF4) { more = 3; cp = c & 0x07; }
        else return 0;
        for (size_t k = 1; k <= more; k++) {
            if (i + k >= n || (p[i + k] & 0xC0) != 0x80)
                return 0;
            cp = cp << 6 | (p[i + k] & 0x3F);
        }
        if (more == 2 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF)))
            return 0;
        if (more == 3 && (cp < 0x10000 || cp > 0x10FFFF))
            return 0;
        i += more + 1;
    }
    return 1;
}

int vs_wire_decode(const uint8_t *frame, size_t n, int nfds, unsigned *kind, uint32_t *req, vs_fields *f,
                   const char **why, char *scratch)
{
    if (n < VS_WIRE_HEADER) {
        snprintf(scratch, 160, "frame of %zu bytes is shorter than the %d-byte header", n, VS_WIRE_HEADER);
        *why = scratch;
        return -1;
    }
    if (n > VS_WIRE_MAX_FRAME) {
        snprintf(scratch, 160, "frame of %zu bytes exceeds the %d-byte limit", n, VS_WIRE_MAX_FRAME);
        *why = scratch;
        return -1;
    }
    if (frame[0] != 'V' || frame[1] != 'B') {
        *why = "bad magic: not the broker protocol";
        return -1;
    }
    if (frame[2] != 2) {
        snprintf(scratch, 160, "broker protocol version %u is not supported (this side speaks 2)", frame[2]);
        *why = scratch;
        return -1;
    }
    const vs_layout *layout = vs_wire_layout(frame[3]);
    if (layout == NULL) {
        snprintf(scratch, 160, "unknown message type %u", frame[3]);
        *why = scratch;
        return -1;
    }
    uint64_t length = vs_wire_get_le(frame + 8, 4);
    size_t fixed = vs_wire_fixed_size(layout);
    if (length < fixed || length > fixed + layout->max_tail) {
        snprintf(scratch, 160, "%s body of %llu bytes: it takes %zu to %zu", layout->name,
                 (unsigned long long)length, fixed, fixed + layout->max_tail);
        *why = scratch;
        return -1;
    }
    if (length != n - VS_WIRE_HEADER) {
        snprintf(scratch, 160, "frame of %zu bytes, its header says %llu", n,
                 (unsigned long long)(VS_WIRE_HEADER + length));
        *why = scratch;
        return -1;
    }
    if (nfds != layout->fds) {
        snprintf(scratch, 160, "%s carries %d file descriptor(s), got %d", layout->name, layout->fds, nfds);
        *why = scratch;
        return -1;
    }
    memset(f, 0, sizeof *f);
    size_t at = VS_WIRE_HEADER, len;
    int slot = 0, bytes = 0;
    char code;
    for (const char *fmt = layout->format; *fmt; slot++) {
        fmt = next_field(fmt, &code, &len);
        if (code == 's')
            f->bytes[bytes++] = frame + at;
        else if (code == 'i')
            f->v[slot] = (uint64_t)(int64_t)(int32_t)(uint32_t)vs_wire_get_le(frame + at, 4);
        else
            f->v[slot] = vs_wire_get_le(frame + at, len);
        at += len;
    }
    f->tail = frame + at;
    f->tail_len = n - at;
    if (layout->tail == VS_TAIL_U32 && f->tail_len % 4) {
        snprintf(scratch, 160, "%s tail of %zu bytes is not a whole number of u32s", layout->name, f->tail_len);
        *why = scratch;
        return -1;
    }
    if (layout->tail == VS_TAIL_TEXT && !utf8_ok(f->tail, f->tail_len)) {
        snprintf(scratch, 160, "%s text is not UTF-8", layout->name);
        *why = scratch;
        return -1;
    }
    *kind = layout->kind;
    *req = (uint32_t)vs_wire_get_le(frame + 4, 4);
    return 0;
}
