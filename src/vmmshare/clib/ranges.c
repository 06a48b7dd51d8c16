/*
 * A copy's or a fill's range, checked before a byte moves (vmmshare.runtime.copies): the mappings it runs through
 * end to end (rule 7: a range mapped across several mappings is one range), an aclrtMallocHost block, or memory
 * the process mapped itself. What it finds is kept as the range's parts, each local or in memory of another server
 * (SPEC §8), so that a copy moves local parts itself and sends remote ones through the transfer engine (fabric.c).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vs.h"

/* Whether /proc/self/maps shows [ptr, ptr+size) readable (and writable when asked), end to end. */
bool vs_process_range_ok(uintptr_t ptr, size_t size, bool write)
{
    FILE *f = fopen("/proc/self/maps", "re");
    if (f == NULL)
        return false;
    uintptr_t cursor = ptr, end = ptr + size;
    char line[512];
    bool ok = false;
    while (fgets(line, sizeof line, f) != NULL) {
        unsigned long lo, hi;
        char perms[8];
        if (sscanf(line, "%lx-%lx %7s", &lo, &hi, perms) != 3)
            break;
        if (hi <= cursor)
            continue;
        if (lo > cursor || perms[0] != 'r' || (write && perms[1] != 'w'))
            break;
        cursor = hi;
        if (cursor >= end) {
            ok = true;
            break;
        }
    }
    fclose(f);
    return ok;
}

void vs_pieces_init(vs_pieces *ps)
{
    ps->p = ps->few;
    ps->n = 0;
    ps->cap = sizeof ps->few / sizeof ps->few[0];
    ps->remote = false;
}

void vs_pieces_free(vs_pieces *ps)
{
    if (ps->p != ps->few)
        free(ps->p);
    vs_pieces_init(ps);
}

/* Add `len` bytes at `at` of the range: a local part joins a local part before it. */
static aclError add(vs_err *err, vs_pieces *ps, size_t at, size_t len, const vs_remote *where, uint64_t offset)
{
    if (where == NULL && ps->n > 0 && !ps->p[ps->n - 1].remote) {
        ps->p[ps->n - 1].len += len;
        return ACL_SUCCESS;
    }
    if (ps->n == ps->cap) {
        size_t cap = ps->cap * 2;
        vs_piece *grown = malloc(cap * sizeof *grown);
        if (grown == NULL)
            return vs_set(err, ACL_ERROR_RT_MEMORY_ALLOCATION, "out of memory");
        memcpy(grown, ps->p, ps->n * sizeof *grown);
        if (ps->p != ps->few)
            free(ps->p);
        ps->p = grown;
        ps->cap = cap;
    }
    vs_piece *p = &ps->p[ps->n++];
    memset(p, 0, sizeof *p);
    p->at = at;
    p->len = len;
    if (where != NULL) {
        p->remote = ps->remote = true;
        p->where = *where; /* a copy: the transfer outlives a free of the import meanwhile (the engine refuses it) */
        p->offset = offset;
    }
    return ACL_SUCCESS;
}

aclError vs_check_range(vs_err *err, uintptr_t ptr, size_t size, bool write, const char *what, int *sides,
                        vs_pieces *out)
{
    if (ptr == 0)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "%s is NULL", what);
    if (ptr + size < ptr)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "%s range %#lx+%zu wraps around the address space", what,
                      (unsigned long)ptr, size);
    vs_mapping *m = vs_mapping_at(ptr);
    if (m == NULL) {
        if (vs_reservation_at(ptr) != NULL)
            return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "%s %#lx is reserved but not mapped: aclrtMapMem it first",
                          what, (unsigned long)ptr);
        *sides |= VS_SIDE_HOST;
        for (size_t i = 0; i < vs_rt.host_blocks.count; i++) {
            vs_hostblock *b = &VS_AT(vs_rt.host_blocks, vs_hostblock, i);
            if (b->ptr <= ptr && ptr - b->ptr < b->size) {
                if (ptr + size > b->ptr + b->size)
                    return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "%s range %#lx+%zu runs past its aclrtMallocHost "
                                  "block", what, (unsigned long)ptr, size);
                return add(err, out, 0, size, NULL, 0);
            }
        }
        if (!vs_process_range_ok(ptr, size, write))
            return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "%s %#lx+%zu is not %s memory", what, (unsigned long)ptr,
                          size, write ? "writable" : "readable");
        return add(err, out, 0, size, NULL, 0);
    }
    uint64_t need = write ? ACL_RT_MEM_ACCESS_FLAGS_READWRITE : ACL_RT_MEM_ACCESS_FLAGS_READ;
    uintptr_t cursor = ptr, end = ptr + size;
    for (;;) {
        if ((m->effective & need) != need)
            return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "%s mapping at %#lx is not %s", what, (unsigned long)m->ptr,
                          write ? "writable" : "readable");
        /* a remote range is device memory for the memcpy kinds */
        *sides |= m->alloc->prop.loc_type == ACL_MEM_LOCATION_TYPE_DEVICE || m->alloc->remote != NULL ? VS_SIDE_DEVICE
                                                                                                       : VS_SIDE_HOST;
        uintptr_t stop = m->ptr + m->size;
        size_t part = (stop < end ? stop : end) - cursor;
        if (add(err, out, cursor - ptr, part, m->alloc->remote, cursor - m->ptr))
            return err->code;
        if (stop >= end)
            return ACL_SUCCESS;
        cursor = stop;
        m = vs_mapping_at(cursor);
        if (m == NULL)
            return vs_set(err, ACL_ERROR_RT_PARAM_INVALID,
                          "%s range %#lx+%zu runs into %#lx, which is %s: a copy may span mappings only where they "
                          "lie end to end", what, (unsigned long)ptr, size, (unsigned long)cursor,
                          vs_reservation_at(cursor) != NULL ? "reserved but not mapped" : "not mapped");
    }
}
