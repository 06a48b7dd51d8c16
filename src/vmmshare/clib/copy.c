/*
 * Memory by pointer (aclrtMalloc blocks, aclrtMallocHost), and the copies and fills between any memory of this
 * process, now or queued on a stream (vmmshare.runtime.copies and blocks): a range mapped end to end across several
 * mappings is one range (rule 7), and a copy or fill checks every byte of both ranges before it moves one.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "vs.h"
#include "vs_cuda.h"

#define MAX_HOST_ALLOC ((size_t)1 << 46)
#define MAX_MALLOC (SIZE_MAX - VS_HUGE1G_GRANULARITY)

/* ---------------------------------------------------------------- aclrtMalloc */

/* The memory attribute of the physical allocation behind an aclrtMalloc block (blocks.policy_attr). */
static uint32_t policy_attr(uint32_t policy)
{
    switch (policy & 0xFF) {
    case ACL_MEM_MALLOC_NORMAL_ONLY: return ACL_HBM_MEM_NORMAL;
    case ACL_MEM_MALLOC_HUGE_FIRST_P2P: case ACL_MEM_MALLOC_HUGE_ONLY_P2P: return ACL_MEM_P2P_HUGE;
    case ACL_MEM_MALLOC_NORMAL_ONLY_P2P: return ACL_MEM_P2P_NORMAL;
    case ACL_MEM_MALLOC_HUGE1G_ONLY: return ACL_HBM_MEM_HUGE1G;
    case ACL_MEM_MALLOC_HUGE1G_ONLY_P2P: return ACL_MEM_P2P_HUGE1G;
    default: return ACL_HBM_MEM_HUGE;
    }
}

static aclError malloc_block(void **devPtr, size_t size, aclrtMemMallocPolicy policy, const char *call)
{
    START(call);
    ACL_REQUIRE(devPtr != NULL, call, "devPtr is NULL");
    ACL_REQUIRE(size != 0, call, "size is 0");
    ACL_REQUIRE(size <= MAX_MALLOC, call, "size=%zu overflows when rounded up to the page size", size);
    int device = 0;
    if (vs_current_device(&err, &device))
        return vs_raise(&err, call);
    vs_prop p = {ACL_MEM_HANDLE_TYPE_NONE, ACL_MEM_ALLOCATION_TYPE_PINNED, policy_attr((uint32_t)policy),
                 ACL_MEM_LOCATION_TYPE_DEVICE, device, 0};
    if (vs_check_prop_rt(&err, &p))
        return vs_raise(&err, call);
    size_t g = vs_prop_granularity(&p);
    vs_alloc *a;
    if (vs_make_alloc(&err, (size + g - 1) / g * g, &p, VS_MALLOC, &a))
        return vs_raise(&err, call);
    vs_lock();
    vs_register(a);
    uintptr_t ptr;
    aclError rc = vs_map_block(&err, a, size, &ptr);
    vs_unlock();
    if (rc)
        return vs_raise(&err, call);
    *devPtr = (void *)ptr;
    return ACL_SUCCESS;
}

VS_API aclError aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy)
{
    return malloc_block(devPtr, size, policy, "aclrtMalloc");
}

/* Every block is page-aligned, so 32-byte aligned too. */
VS_API aclError aclrtMallocAlign32(void **devPtr, size_t size, aclrtMemMallocPolicy policy)
{
    return malloc_block(devPtr, size, policy, "aclrtMallocAlign32");
}

/* Host memory is cached memory. */
VS_API aclError aclrtMallocCached(void **devPtr, size_t size, aclrtMemMallocPolicy policy)
{
    return malloc_block(devPtr, size, policy, "aclrtMallocCached");
}

VS_API aclError aclrtFree(void *devPtr)
{
    const char *call = "aclrtFree";
    START(call);
    ACL_REQUIRE(devPtr != NULL, call, "devPtr is NULL");
    vs_lock();
    aclError rc = vs_free_block(&err, (uintptr_t)devPtr, VS_MALLOC);
    vs_unlock();
    return rc ? vs_raise(&err, call) : ACL_SUCCESS;
}

/* ---------------------------------------------------------------- host memory */

VS_API aclError aclrtMallocHost(void **hostPtr, size_t size)
{
    const char *call = "aclrtMallocHost";
    START(call);
    ACL_REQUIRE(hostPtr != NULL, call, "hostPtr is NULL");
    ACL_REQUIRE(size != 0, call, "size is 0");
    if (size > MAX_HOST_ALLOC)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "size=%zu is out of range [1, %zu]", size, MAX_HOST_ALLOC);
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return vs_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call, "cannot allocate %zu bytes of host memory: %s", size,
                       strerror(errno));
    vs_lock();
    vs_hostblock *b = vs_vec_push(&vs_rt.host_blocks, sizeof(vs_hostblock));
    b->ptr = (uintptr_t)p;
    b->size = size;
    vs_unlock();
    *hostPtr = p;
    return ACL_SUCCESS;
}

VS_API aclError aclrtFreeHost(void *hostPtr)
{
    const char *call = "aclrtFreeHost";
    START(call);
    ACL_REQUIRE(hostPtr != NULL, call, "hostPtr is NULL");
    vs_lock();
    aclError rc = ACL_SUCCESS;
    size_t i = 0;
    while (i < vs_rt.host_blocks.count && VS_AT(vs_rt.host_blocks, vs_hostblock, i).ptr != (uintptr_t)hostPtr)
        i++;
    if (i == vs_rt.host_blocks.count) {
        rc = vs_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                     "%#lx is not memory from aclrtMallocHost (or it was freed already)", (unsigned long)(uintptr_t)hostPtr);
    } else {
        munmap(hostPtr, VS_AT(vs_rt.host_blocks, vs_hostblock, i).size);
        vs_vec_remove(&vs_rt.host_blocks, i);
    }
    vs_unlock();
    return rc;
}

static const char *side_names(int sides)
{
    return sides == VS_SIDE_HOST ? "host" : sides == VS_SIDE_DEVICE ? "device" : "host and device";
}

/* Check a copy's ranges and kind (the lock held). */
static aclError plan_copy(vs_err *err, uintptr_t dst, uintptr_t src, size_t count, int kind, vs_pieces *pto,
                          vs_pieces *pof)
{
    int to = 0, of = 0;
    if (vs_check_range(err, dst, count, true, "dst", &to, pto) ||
        vs_check_range(err, src, count, false, "src", &of, pof))
        return err->code;
    int want_dst, want_src;
    switch (kind) {
    case ACL_MEMCPY_HOST_TO_HOST: want_dst = VS_SIDE_HOST; want_src = VS_SIDE_HOST; break;
    case ACL_MEMCPY_HOST_TO_DEVICE: case ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE:
        want_dst = VS_SIDE_DEVICE; want_src = VS_SIDE_HOST; break;
    case ACL_MEMCPY_DEVICE_TO_HOST: want_dst = VS_SIDE_HOST; want_src = VS_SIDE_DEVICE; break;
    case ACL_MEMCPY_DEVICE_TO_DEVICE: want_dst = VS_SIDE_DEVICE; want_src = VS_SIDE_DEVICE; break;
    default: return ACL_SUCCESS; /* ACL_MEMCPY_DEFAULT: the runtime decides */
    }
    if (to != want_dst || of != want_src)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID,
                      "kind %d copies %s->%s but src is %s memory and dst is %s memory (use ACL_MEMCPY_DEFAULT to let "
                      "the runtime decide)", kind, want_src == VS_SIDE_DEVICE ? "device" : "host",
                      want_dst == VS_SIDE_DEVICE ? "device" : "host", side_names(of), side_names(to));
    return ACL_SUCCESS;
}

static bool known_kind(int kind)
{
    return kind >= ACL_MEMCPY_HOST_TO_HOST && kind <= ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE;
}

/* ---------------------------------------------------------------- copies and fills */

#define BOUNCE ((size_t)16 << 20) /* bytes of a bounce buffer: remote to remote, and fills of remote memory */

/* Bytes of [p, ...) up to the end of the mapping holding `p`, or (memory outside the mappings) SIZE_MAX. */
static size_t mapped_after(uintptr_t p)
{
    vs_mapping *m = vs_mapping_at(p);
    return m != NULL ? m->ptr + m->size - p : SIZE_MAX;
}

/* Bytes of [..., end) back to the start of the mapping holding its last byte, or SIZE_MAX. */
static size_t mapped_before(uintptr_t end)
{
    vs_mapping *m = vs_mapping_at(end - 1);
    return m != NULL ? end - m->ptr : SIZE_MAX;
}

/* One part within one mapping (or none) on each side: the driver moves it where a side is GPU memory. */
static aclError move_one(vs_err *err, uint8_t *dst, const uint8_t *src, size_t n, int32_t value)
{
    vs_alloc *gpu = vs_cuda_mover((uintptr_t)dst, (uintptr_t)(src == NULL ? dst : src));
    if (gpu != NULL)
        return src == NULL ? vs_cuda_fill(err, gpu, (uintptr_t)dst, value, n)
                           : vs_cuda_copy(err, gpu, (uintptr_t)dst, (uintptr_t)src, n);
    if (src == NULL)
        memset(dst, value & 0xFF, n);
    else
        memmove(dst, src, n);
    return ACL_SUCCESS;
}

/* A copy (or, with `src` NULL, a fill) of local memory whose ranges are checked (the lock held). Under the CUDA
 * backend a range may run from host memory into GPU memory (rule 7): it is cut where either side passes from one
 * mapping to the next, and each part is moved by the driver where a side of it is GPU memory, else by the CPU,
 * which cannot address GPU memory (as the Python surface: copies._plan and _local_copy). A copy whose dst lies
 * above an overlapping src goes last part first, as memmove does. */
static aclError move_local(vs_err *err, uint8_t *dst, const uint8_t *src, size_t count, int32_t value)
{
    if (!vs_rt.config.cuda)
        return move_one(err, dst, src, count, value);
    aclError rc = ACL_SUCCESS;
    if (src != NULL && src < dst && (size_t)(dst - src) < count) {
        for (size_t end = count; rc == ACL_SUCCESS && end > 0;) {
            size_t n = end, a = mapped_before((uintptr_t)(dst + end)), b = mapped_before((uintptr_t)(src + end));
            n = a < n ? a : n;
            n = b < n ? b : n;
            rc = move_one(err, dst + end - n, src + end - n, n, value);
            end -= n;
        }
        return rc;
    }
    for (size_t done = 0; rc == ACL_SUCCESS && done < count;) {
        size_t n = count - done, a = mapped_after((uintptr_t)(dst + done));
        size_t b = src != NULL ? mapped_after((uintptr_t)(src + done)) : SIZE_MAX;
        n = a < n ? a : n;
        n = b < n ? b : n;
        rc = move_one(err, dst + done, src != NULL ? src + done : NULL, n, value);
        done += n;
    }
    return rc;
}

/* One part of a copy where both sides are local: moved under the lock, once both are checked again (the tables
 * may have changed since the copy was planned). */
static aclError local_part(vs_err *err, uint8_t *dst, const uint8_t *src, size_t n, bool fill, int32_t value)
{
    int sides = 0;
    vs_pieces to, of;
    vs_pieces_init(&to);
    vs_pieces_init(&of);
    vs_lock();
    aclError rc = vs_check_range(err, (uintptr_t)dst, n, true, "dst", &sides, &to);
    if (rc == ACL_SUCCESS && !fill)
        rc = vs_check_range(err, (uintptr_t)src, n, false, "src", &sides, &of);
    if (rc == ACL_SUCCESS && (to.remote || of.remote))
        rc = vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "the memory at %#lx was remapped while the copy ran",
                    (unsigned long)(uintptr_t)dst);
    if (rc == ACL_SUCCESS)
        rc = move_local(err, dst, fill ? NULL : src, n, value);
    vs_unlock();
    vs_pieces_free(&to);
    vs_pieces_free(&of);
    return rc;
}

/* One side of a part moved through host memory: memory of another server (`far`, at `at`), or local memory. */
typedef struct side {
    const vs_remote *far;
    uint64_t at;
    uint8_t *local;
} side;

static aclError side_move(vs_err *err, const side *s, size_t done, uint8_t *host, size_t k, bool into_side)
{
    if (s->far != NULL)
        return vs_fabric_move(err, s->far, s->at + done, host, k, into_side);
    return into_side ? local_part(err, s->local + done, host, k, false, 0)
                     : local_part(err, host, s->local + done, k, false, 0);
}

/* `n` bytes from one side to the other through a host bounce buffer: remote to remote, and GPU memory to or from
 * another server's (the transfer engine moves host memory, as in the Python runtime). */
static aclError through_host(vs_err *err, const side *from, const side *to, size_t n)
{
    size_t chunk = n < BOUNCE ? n : BOUNCE;
    uint8_t *bounce = malloc(chunk);
    if (bounce == NULL)
        return vs_set(err, ACL_ERROR_RT_MEMORY_ALLOCATION, "out of memory for a %zu-byte bounce buffer", chunk);
    /* the same engine's memory, dst above an overlapping src: the last chunk first, as memmove does */
    bool backwards = false;
    if (from->far != NULL && to->far != NULL && from->far->family == to->far->family &&
        from->far->port == to->far->port && memcmp(from->far->addr, to->far->addr, 16) == 0) {
        uint64_t of = from->far->address + from->at, into = to->far->address + to->at;
        backwards = of < into && into - of < n;
    }
    aclError rc = ACL_SUCCESS;
    for (size_t moved = 0; rc == ACL_SUCCESS && moved < n;) {
        size_t k = n - moved < chunk ? n - moved : chunk;
        size_t done = backwards ? n - moved - k : moved;
        rc = side_move(err, from, done, bounce, k, false);
        if (rc == ACL_SUCCESS)
            rc = side_move(err, to, done, bounce, k, true);
        moved += k;
    }
    free(bounce);
    return rc;
}

/* Whether GPU memory is mapped anywhere in [p, p+n) (the lock held). */
static bool gpu_within(uintptr_t p, size_t n)
{
    for (size_t i = 0; vs_rt.config.cuda && i < vs_rt.mappings.count; i++) {
        vs_mapping *m = &VS_AT(vs_rt.mappings, vs_mapping, i);
        if (m->alloc->gpu != NULL && m->ptr < p + n && p < m->ptr + m->size)
            return true;
    }
    return false;
}

/* One part of a copy with memory of another server on one side or both, after the lock is let go (a transfer may
 * take up to the fabric timeout; the local side is read or written by the kernel, so memory unmapped meanwhile
 * fails the copy, never the process). */
static aclError remote_part(vs_err *err, const vs_piece *to, uint64_t to_off, const vs_piece *of, uint64_t of_off,
                            uint8_t *dst, const uint8_t *src, size_t n)
{
    side from = {of->remote ? &of->where : NULL, of->offset + of_off, (uint8_t *)src};
    side into = {to->remote ? &to->where : NULL, to->offset + to_off, dst};
    if (to->remote && of->remote)
        return through_host(err, &from, &into, n);
    const side *far = to->remote ? &into : &from, *near = to->remote ? &from : &into;
    vs_lock();
    bool gpu = gpu_within((uintptr_t)near->local, n); /* any of it (a local part may run through several mappings) */
    vs_unlock();
    if (gpu)
        return through_host(err, &from, &into, n);
    return vs_fabric_move(err, far->far, far->at, near->local, n, to->remote);
}

/* A fill of part of memory of another server: written from a buffer of the value. */
static aclError remote_fill(vs_err *err, const vs_piece *to, uint64_t off, int32_t value, size_t n)
{
    size_t chunk = n < BOUNCE ? n : BOUNCE;
    uint8_t *bounce = malloc(chunk);
    if (bounce == NULL)
        return vs_set(err, ACL_ERROR_RT_MEMORY_ALLOCATION, "out of memory for a %zu-byte bounce buffer", chunk);
    memset(bounce, value & 0xFF, chunk);
    aclError rc = ACL_SUCCESS;
    for (size_t done = 0; rc == ACL_SUCCESS && done < n; done += chunk)
        rc = vs_fabric_move(err, &to->where, to->offset + off + done, bounce, n - done < chunk ? n - done : chunk,
                            true);
    free(bounce);
    return rc;
}

/* Bytes [at, at+n) of a copy (or, with `b` NULL, a fill), within part `a` of dst and part `b` of src. */
static aclError part(vs_err *err, uint8_t *dst, const uint8_t *src, size_t at, size_t n, const vs_piece *a,
                     const vs_piece *b, int32_t value)
{
    if (b == NULL)
        return a->remote ? remote_fill(err, a, at - a->at, value, n) : local_part(err, dst + at, NULL, n, true, value);
    if (!a->remote && !b->remote)
        return local_part(err, dst + at, src + at, n, false, 0);
    return remote_part(err, a, at - a->at, b, at - b->at, dst + at, src + at, n);
}

/* A copy (or, with `of` NULL, a fill) whose ranges run through memory of another server: part by part, where the
 * parts of both sides meet (a local mapping next to a remote one is one range, rule 7). A copy whose dst lies above
 * an overlapping src goes last part first, as memmove does (and the Python surface: copies._plan), so that no part
 * reads bytes an earlier part wrote. */
static aclError crossing(vs_err *err, uint8_t *dst, const uint8_t *src, size_t count, const vs_pieces *to,
                         const vs_pieces *of, int32_t value)
{
    aclError rc = ACL_SUCCESS;
    if (of != NULL && (uintptr_t)src < (uintptr_t)dst && (uintptr_t)dst - (uintptr_t)src < count) {
        size_t i = to->n, j = of->n, end = count;
        while (rc == ACL_SUCCESS && end > 0) {
            const vs_piece *a = &to->p[i - 1], *b = &of->p[j - 1];
            size_t start = a->at > b->at ? a->at : b->at;
            rc = part(err, dst, src, start, end - start, a, b, value);
            end = start;
            if (end <= a->at)
                i--;
            if (end <= b->at)
                j--;
        }
        return rc;
    }
    size_t i = 0, j = 0, done = 0;
    while (rc == ACL_SUCCESS && done < count) {
        const vs_piece *a = &to->p[i], *b = of != NULL ? &of->p[j] : NULL;
        size_t a_end = a->at + a->len, b_end = b != NULL ? b->at + b->len : count;
        size_t stop = a_end < b_end ? a_end : b_end;
        size_t n = (stop < count ? stop : count) - done;
        rc = part(err, dst, src, done, n, a, b, value);
        done += n;
        if (done >= a_end)
            i++;
        if (b != NULL && done >= b_end)
            j++;
    }
    return rc;
}

aclError vs_memcpy(vs_err *err, void *dst, size_t destMax, const void *src, size_t count, int kind)
{
    if (count > destMax)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "count %zu is larger than destMax %zu", count, destMax);
    vs_pieces to, of;
    vs_pieces_init(&to);
    vs_pieces_init(&of);
    vs_lock();
    aclError rc = plan_copy(err, (uintptr_t)dst, (uintptr_t)src, count, kind, &to, &of);
    if (rc == ACL_SUCCESS && !to.remote && !of.remote)
        rc = move_local(err, dst, src, count, 0);
    vs_unlock();
    if (rc == ACL_SUCCESS && (to.remote || of.remote))
        rc = crossing(err, dst, src, count, &to, &of, 0);
    vs_pieces_free(&to);
    vs_pieces_free(&of);
    return rc;
}

static aclError do_memset(vs_err *err, void *ptr, size_t maxCount, int32_t value, size_t count)
{
    if (count > maxCount)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "count %zu is larger than maxCount %zu", count, maxCount);
    int sides = 0;
    vs_pieces to;
    vs_pieces_init(&to);
    vs_lock();
    aclError rc = vs_check_range(err, (uintptr_t)ptr, count, true, "devPtr", &sides, &to);
    if (rc == ACL_SUCCESS && !to.remote)
        rc = move_local(err, ptr, NULL, count, value);
    vs_unlock();
    if (rc == ACL_SUCCESS && to.remote)
        rc = crossing(err, ptr, NULL, count, &to, NULL, value);
    vs_pieces_free(&to);
    return rc;
}

VS_API aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind)
{
    const char *call = "aclrtMemcpy";
    if (count == 0)
        return ACL_SUCCESS; /* the acl layer's first check: nothing to copy succeeds */
    START(call);
    ACL_REQUIRE(dst != NULL, call, "dst is NULL");
    ACL_REQUIRE(src != NULL, call, "src is NULL");
    ACL_REQUIRE(known_kind((int)kind), call, "kind=%d is not an aclrtMemcpyKind (0..5)", (int)kind);
    return vs_memcpy(&err, dst, destMax, src, count, (int)kind) ? vs_raise(&err, call) : ACL_SUCCESS;
}

VS_API aclError aclrtMemset(void *devPtr, size_t maxCount, int32_t value, size_t count)
{
    const char *call = "aclrtMemset";
    if (count == 0)
        return ACL_SUCCESS;
    START(call);
    ACL_REQUIRE(devPtr != NULL, call, "devPtr is NULL");
    return do_memset(&err, devPtr, maxCount, value, count) ? vs_raise(&err, call) : ACL_SUCCESS;
}

/* A copy or fill queued on a stream: checked when queued, checked again and done when its turn comes (memory
 * unmapped meanwhile fails then, reported by the stream's synchronize). */
typedef struct copy_task {
    bool fill;
    void *dst;
    size_t max;
    const void *src;
    size_t count;
    int kind;
    int32_t value;
} copy_task;

static aclError run_copy(void *arg, vs_err *err)
{
    copy_task *t = arg;
    return t->fill ? do_memset(err, t->dst, t->max, t->value, t->count)
                   : vs_memcpy(err, t->dst, t->max, t->src, t->count, t->kind);
}

/* Queued with the runtime's lock held (it keeps the stream alive): a copy with a part in memory of another server
 * goes to the stream's worker even when the stream is idle, since run here it would move its bytes under that lock
 * (it is recursive: vs_memcpy's unlock would not let it go) and a stalled engine would stall the whole process. */
static aclError queue_copy(vs_err *err, vs_stream *s, const char *what, copy_task *t, bool remote)
{
    copy_task *mine = malloc(sizeof *mine);
    if (mine == NULL)
        return vs_set(err, ACL_ERROR_RT_MEMORY_ALLOCATION, "out of memory");
    *mine = *t;
    return remote ? vs_stream_submit(err, s, what, run_copy, free, mine, false)
                  : vs_stream_do(err, s, what, run_copy, free, mine);
}

VS_API aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind,
                                 aclrtStream stream)
{
    const char *call = "aclrtMemcpyAsync";
    if (count == 0)
        return ACL_SUCCESS;
    START(call);
    ACL_REQUIRE(dst != NULL, call, "dst is NULL");
    ACL_REQUIRE(src != NULL, call, "src is NULL");
    ACL_REQUIRE(known_kind((int)kind), call, "kind=%d is not an aclrtMemcpyKind (0..5)", (int)kind);
    if (count > destMax)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "count %zu is larger than destMax %zu", count, destMax);
    vs_lock();
    vs_stream *s = vs_stream_of(&err, (uintptr_t)stream, true);
    vs_pieces to, of;
    vs_pieces_init(&to);
    vs_pieces_init(&of);
    aclError rc = s == NULL ? err.code : plan_copy(&err, (uintptr_t)dst, (uintptr_t)src, count, (int)kind, &to, &of);
    bool remote = to.remote || of.remote;
    vs_pieces_free(&to);
    vs_pieces_free(&of);
    if (rc == ACL_SUCCESS) {
        copy_task t = {false, dst, destMax, src, count, (int)kind, 0};
        rc = queue_copy(&err, s, call, &t, remote);
    }
    vs_unlock();
    return rc ? vs_raise(&err, call) : ACL_SUCCESS;
}

VS_API aclError aclrtMemsetAsync(void *devPtr, size_t maxCount, int32_t value, size_t count, aclrtStream stream)
{
    const char *call = "aclrtMemsetAsync";
    if (count == 0)
        return ACL_SUCCESS;
    START(call);
    ACL_REQUIRE(devPtr != NULL, call, "devPtr is NULL");
    if (count > maxCount)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "count %zu is larger than maxCount %zu", count, maxCount);
    vs_lock();
    int sides = 0;
    vs_stream *s = vs_stream_of(&err, (uintptr_t)stream, true);
    vs_pieces to;
    vs_pieces_init(&to);
    aclError rc = s == NULL ? err.code : vs_check_range(&err, (uintptr_t)devPtr, count, true, "devPtr", &sides, &to);
    bool remote = to.remote;
    vs_pieces_free(&to);
    if (rc == ACL_SUCCESS) {
        copy_task t = {true, devPtr, maxCount, NULL, count, 0, value};
        rc = queue_copy(&err, s, call, &t, remote);
    }
    vs_unlock();
    return rc ? vs_raise(&err, call) : ACL_SUCCESS;
}
