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

/* ---------------------------------------------------------------- checking a range */

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

enum { SIDE_HOST = 1, SIDE_DEVICE = 2 };

/* Check that [ptr, ptr+size) is memory this process may read (or write): the mappings it runs through end to end,
 * or a malloc_host block, or memory the process mapped itself. `sides` collects whether host or device memory is in
 * it. The lock is held. */
static aclError check_range(vs_err *err, uintptr_t ptr, size_t size, bool write, const char *what, int *sides)
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
        *sides |= SIDE_HOST;
        for (size_t i = 0; i < vs_rt.host_blocks.count; i++) {
            vs_hostblock *b = &VS_AT(vs_rt.host_blocks, vs_hostblock, i);
            if (b->ptr <= ptr && ptr - b->ptr < b->size) {
                if (ptr + size > b->ptr + b->size)
                    return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "%s range %#lx+%zu runs past its aclrtMallocHost "
                                  "block", what, (unsigned long)ptr, size);
                return ACL_SUCCESS;
            }
        }
        if (!vs_process_range_ok(ptr, size, write))
            return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "%s %#lx+%zu is not %s memory", what, (unsigned long)ptr,
                          size, write ? "writable" : "readable");
        return ACL_SUCCESS;
    }
    uint64_t need = write ? ACL_RT_MEM_ACCESS_FLAGS_READWRITE : ACL_RT_MEM_ACCESS_FLAGS_READ;
    uintptr_t cursor = ptr, end = ptr + size;
    for (;;) {
        if ((m->effective & need) != need)
            return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "%s mapping at %#lx is not %s", what, (unsigned long)m->ptr,
                          write ? "writable" : "readable");
        *sides |= m->alloc->prop.loc_type == ACL_MEM_LOCATION_TYPE_DEVICE ? SIDE_DEVICE : SIDE_HOST;
        uintptr_t stop = m->ptr + m->size;
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

static const char *side_names(int sides)
{
    return sides == SIDE_HOST ? "host" : sides == SIDE_DEVICE ? "device" : "host and device";
}

/* Check a copy's ranges and kind (the lock held). */
static aclError plan_copy(vs_err *err, uintptr_t dst, uintptr_t src, size_t count, int kind)
{
    int to = 0, of = 0;
    if (check_range(err, dst, count, true, "dst", &to) || check_range(err, src, count, false, "src", &of))
        return err->code;
    int want_dst, want_src;
    switch (kind) {
    case ACL_MEMCPY_HOST_TO_HOST: want_dst = SIDE_HOST; want_src = SIDE_HOST; break;
    case ACL_MEMCPY_HOST_TO_DEVICE: case ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE:
        want_dst = SIDE_DEVICE; want_src = SIDE_HOST; break;
    case ACL_MEMCPY_DEVICE_TO_HOST: want_dst = SIDE_HOST; want_src = SIDE_DEVICE; break;
    case ACL_MEMCPY_DEVICE_TO_DEVICE: want_dst = SIDE_DEVICE; want_src = SIDE_DEVICE; break;
    default: return ACL_SUCCESS; /* ACL_MEMCPY_DEFAULT: the runtime decides */
    }
    if (to != want_dst || of != want_src)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID,
                      "kind %d copies %s->%s but src is %s memory and dst is %s memory (use ACL_MEMCPY_DEFAULT to let "
                      "the runtime decide)", kind, want_src == SIDE_DEVICE ? "device" : "host",
                      want_dst == SIDE_DEVICE ? "device" : "host", side_names(of), side_names(to));
    return ACL_SUCCESS;
}

static bool known_kind(int kind)
{
    return kind >= ACL_MEMCPY_HOST_TO_HOST && kind <= ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE;
}

/* ---------------------------------------------------------------- copies and fills */

aclError vs_memcpy(vs_err *err, void *dst, size_t destMax, const void *src, size_t count, int kind)
{
    if (count > destMax)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "count %zu is larger than destMax %zu", count, destMax);
    vs_lock();
    aclError rc = plan_copy(err, (uintptr_t)dst, (uintptr_t)src, count, kind);
    vs_alloc *gpu = rc == ACL_SUCCESS ? vs_cuda_mover((uintptr_t)dst, (uintptr_t)src) : NULL; /* GPU memory in it */
    if (gpu != NULL)
        rc = vs_cuda_copy(err, gpu, (uintptr_t)dst, (uintptr_t)src, count);
    else if (rc == ACL_SUCCESS)
        memmove(dst, src, count);
    vs_unlock();
    return rc;
}

static aclError do_memset(vs_err *err, void *ptr, size_t maxCount, int32_t value, size_t count)
{
    if (count > maxCount)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "count %zu is larger than maxCount %zu", count, maxCount);
    int sides = 0;
    vs_lock();
    aclError rc = check_range(err, (uintptr_t)ptr, count, true, "devPtr", &sides);
    vs_alloc *gpu = rc == ACL_SUCCESS ? vs_cuda_mover((uintptr_t)ptr, (uintptr_t)ptr) : NULL; /* GPU memory */
    if (gpu != NULL)
        rc = vs_cuda_fill(err, gpu, (uintptr_t)ptr, value, count);
    else if (rc == ACL_SUCCESS)
        memset(ptr, value & 0xFF, count);
    vs_unlock();
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

static aclError queue_copy(vs_err *err, vs_stream *s, const char *what, copy_task *t)
{
    copy_task *mine = malloc(sizeof *mine);
    if (mine == NULL)
        return vs_set(err, ACL_ERROR_RT_MEMORY_ALLOCATION, "out of memory");
    *mine = *t;
    return vs_stream_do(err, s, what, run_copy, free, mine);
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
    aclError rc = s == NULL ? err.code : plan_copy(&err, (uintptr_t)dst, (uintptr_t)src, count, (int)kind);
    if (rc == ACL_SUCCESS) {
        copy_task t = {false, dst, destMax, src, count, (int)kind, 0};
        rc = queue_copy(&err, s, call, &t);
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
    aclError rc = s == NULL ? err.code : check_range(&err, (uintptr_t)devPtr, count, true, "devPtr", &sides);
    if (rc == ACL_SUCCESS) {
        copy_task t = {true, devPtr, maxCount, NULL, count, 0, value};
        rc = queue_copy(&err, s, call, &t);
    }
    vs_unlock();
    return rc ? vs_raise(&err, call) : ACL_SUCCESS;
}
