/*
 * The process's runtime: set up once (its configuration read, config.c), its tables (allocations, reservations,
 * mappings), the address-space arena reservations are placed in, and what a forked child lets go of.
 */
#include <errno.h>
#include <limits.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/utsname.h>
#include <unistd.h>

#include "vs.h"
#include "vs_cuda.h"

vs_runtime vs_rt;

static pthread_once_t started = PTHREAD_ONCE_INIT;

void vs_lock(void)
{
    pthread_mutex_lock(&vs_rt.lock);
}

void vs_unlock(void)
{
    pthread_mutex_unlock(&vs_rt.lock);
}

void *vs_vec_push(vs_vec *v, size_t size)
{
    if (v->count == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 16;
        void *items = realloc(v->items, cap * size);
        if (items == NULL)
            abort(); /* a table of a few records each: out of memory here is not survivable */
        v->items = items;
        v->cap = cap;
    }
    v->size = size;
    void *slot = (char *)v->items + v->count * size;
    memset(slot, 0, size);
    v->count++;
    return slot;
}

void vs_vec_remove(vs_vec *v, size_t index)
{
    char *base = v->items;
    memmove(base + index * v->size, base + (index + 1) * v->size, (v->count - index - 1) * v->size);
    v->count--;
}

static void after_fork_child(void);

static void start_once(void)
{
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&vs_rt.lock, &attr);
    pthread_mutex_init(&vs_rt.import_lock, &attr);
    vs_rt.next_handle = 0x7A0000000040ULL;
    vs_rt.next_id = 1;
    if (vs_read_config(&vs_rt.config) != 0)
        return; /* (its error is kept in the configuration: every call reports it) */
    vs_node_prepare();
    pthread_atfork(NULL, NULL, after_fork_child);
}

aclError vs_start(vs_err *err)
{
    pthread_once(&started, start_once);
    if (vs_rt.config.error[0])
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "configuration: %s", vs_rt.config.error);
    if (vs_rt.config.cuda && vs_cuda_start(err)) /* the CUDA driver, loaded once: without it no call works */
        return err->code;
    return ACL_SUCCESS;
}

/* In a forked child: the parent's memory is let go (its mappings stay), the tables start afresh, and the
 * broker connection and holds are not ours (the Python runtime's after-fork, mirrored). */
static void after_fork_child(void)
{
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&vs_rt.lock, &attr);
    pthread_mutex_init(&vs_rt.import_lock, &attr);
    for (vs_alloc *a = vs_rt.allocs; a != NULL; a = a->next)
        if (a->fd >= 0)
            close(a->fd);
    vs_rt.allocs = NULL; /* (the records are the parent's: left, not freed) */
    vs_rt.reservations.count = vs_rt.mappings.count = vs_rt.blocks.count = vs_rt.host_blocks.count = 0;
    vs_rt.registered.count = 0;
    vs_rt.ipc_exports.count = vs_rt.ipc_imports.count = vs_rt.ipc_attrs.count = 0;
    vs_devices_after_fork();
    vs_sync_after_fork();
    vs_node_after_fork();
    vs_fabric_after_fork();
    vs_cuda_after_fork();
}

/* Seconds on the monotonic clock (the connection's and the broker start's deadlines). */
double vs_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* ---------------------------------------------------------------- tables */

vs_range *vs_reservation_at(uintptr_t ptr)
{
    for (size_t i = 0; i < vs_rt.reservations.count; i++) {
        vs_range *r = &VS_AT(vs_rt.reservations, vs_range, i);
        if (r->base <= ptr && ptr - r->base < r->size)
            return r;
    }
    return NULL;
}

vs_range *vs_reservation_exact(uintptr_t ptr)
{
    vs_range *r = vs_reservation_at(ptr);
    return r != NULL && r->base == ptr ? r : NULL;
}

vs_mapping *vs_mapping_at(uintptr_t ptr)
{
    for (size_t i = 0; i < vs_rt.mappings.count; i++) {
        vs_mapping *m = &VS_AT(vs_rt.mappings, vs_mapping, i);
        if (m->ptr <= ptr && ptr - m->ptr < m->size)
            return m;
    }
    return NULL;
}

vs_mapping *vs_mapping_exact(uintptr_t ptr)
{
    vs_mapping *m = vs_mapping_at(ptr);
    return m != NULL && m->ptr == ptr ? m : NULL;
}

bool vs_mappings_overlap(uintptr_t ptr, size_t size)
{
    for (size_t i = 0; i < vs_rt.mappings.count; i++) {
        vs_mapping *m = &VS_AT(vs_rt.mappings, vs_mapping, i);
        if (m->ptr < ptr + size && ptr < m->ptr + m->size)
            return true;
    }
    return false;
}

void vs_add_reservation(uintptr_t base, size_t size, enum vs_owner owner)
{
    vs_range *r = vs_vec_push(&vs_rt.reservations, sizeof(vs_range));
    r->base = base;
    r->size = size;
    r->owner = owner;
}

void vs_remove_reservation(uintptr_t base)
{
    for (size_t i = 0; i < vs_rt.reservations.count; i++)
        if (VS_AT(vs_rt.reservations, vs_range, i).base == base) {
            vs_vec_remove(&vs_rt.reservations, i);
            return;
        }
}

void vs_add_mapping(uintptr_t ptr, size_t size, vs_alloc *alloc, uint64_t access)
{
    vs_mapping *m = vs_vec_push(&vs_rt.mappings, sizeof(vs_mapping));
    m->ptr = ptr;
    m->size = size;
    m->alloc = alloc;
    m->effective = access;
    alloc->maps++;
}

void vs_remove_mapping(uintptr_t ptr)
{
    for (size_t i = 0; i < vs_rt.mappings.count; i++) {
        vs_mapping *m = &VS_AT(vs_rt.mappings, vs_mapping, i);
        if (m->ptr == ptr) {
            m->alloc->maps--;
            free(m->access);
            vs_vec_remove(&vs_rt.mappings, i);
            return;
        }
    }
}

/* ---------------------------------------------------------------- the arena */

int vs_prot_of(uint64_t access)
{
    if (access == ACL_RT_MEM_ACCESS_FLAGS_READWRITE)
        return PROT_READ | PROT_WRITE;
    if (access == ACL_RT_MEM_ACCESS_FLAGS_READ)
        return PROT_READ;
    return PROT_NONE;
}

/* Map `size` bytes at `addr` exactly (the fd shared, or a reservation); 0, 1 when something is there, -1. */
static int try_at(uintptr_t addr, size_t size, int fd, int prot)
{
    int flags = (fd >= 0 ? MAP_SHARED : MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE) | MAP_FIXED_NOREPLACE;
    void *p = mmap((void *)addr, size, fd >= 0 ? prot : PROT_NONE, flags, fd, 0);
    if (p == MAP_FAILED)
        return errno == EEXIST ? 1 : -1;
    if ((uintptr_t)p != addr) { /* a kernel that takes MAP_FIXED_NOREPLACE as a hint */
        munmap(p, size);
        return 1;
    }
    return 0;
}

static uintptr_t align_up(uintptr_t v, size_t a)
{
    return (v + a - 1) / a * a;
}

/* Reserve in [16 TiB, 24 TiB), first fit past this process's own ranges, so the same addresses are usually free in
 * every process (as the runtime places them); at `want` exactly when non-zero (errno EEXIST when taken). */
int vs_arena_reserve(size_t size, size_t align, uintptr_t want, int fd, int prot, uintptr_t *out)
{
    if (want) {
        int rc = try_at(want, size, fd, prot);
        if (rc == 1)
            errno = EEXIST;
        if (rc)
            return -1;
        *out = want;
        return 0;
    }
    uintptr_t addr = VS_ARENA_START;
    int tries = 0;
    while (addr + size <= VS_ARENA_END && tries < 4096) {
        bool moved = false;
        for (size_t i = 0; i < vs_rt.reservations.count; i++) {
            vs_range *r = &VS_AT(vs_rt.reservations, vs_range, i);
            if (r->base < addr + size && addr < r->base + r->size) {
                addr = align_up(r->base + r->size, align);
                moved = true;
            }
        }
        if (moved)
            continue;
        tries++;
        int rc = try_at(addr, size, fd, prot);
        if (rc == 0) {
            *out = addr;
            return 0;
        }
        if (rc < 0)
            return -1;
        addr += align_up(size, align); /* something foreign is there: move on */
    }
    /* the arena is full or foreign: let the kernel choose, aligned by over-reserving */
    void *raw_p = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw_p == MAP_FAILED)
        return -1;
    uintptr_t rawp = (uintptr_t)raw_p, p = align_up(rawp, align);
    if (p > rawp)
        munmap(raw_p, p - rawp);
    if (rawp + size + align > p + size)
        munmap((void *)(p + size), rawp + size + align - (p + size));
    if (fd >= 0 && mmap((void *)p, size, prot, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
        int e = errno;
        munmap((void *)p, size);
        errno = e;
        return -1;
    }
    *out = p;
    return 0;
}

/* ---------------------------------------------------------------- allocations */

uint64_t vs_new_handle(void)
{
    uint64_t h = vs_rt.next_handle;
    vs_rt.next_handle += 0x40;
    return h;
}

vs_alloc *vs_allocation(uint64_t handle)
{
    for (vs_alloc *a = vs_rt.allocs; a != NULL; a = a->next)
        if (a->registered && a->handle == handle)
            return a;
    return NULL;
}

void vs_register(vs_alloc *a)
{
    a->handle = vs_new_handle();
    a->registered = a->owner == VS_VMM;
    a->next = vs_rt.allocs;
    vs_rt.allocs = a;
}

/* Whether a live import of another server's memory is served by the same engine as `r` (the lock held). */
bool vs_engine_in_use(const vs_remote *r)
{
    for (vs_alloc *a = vs_rt.allocs; a != NULL; a = a->next)
        if (a->remote != NULL && a->remote != r && a->remote->family == r->family && a->remote->port == r->port &&
            memcmp(a->remote->addr, r->addr, 16) == 0)
            return true;
    return false;
}

static void destroy(vs_alloc *a)
{
    for (vs_alloc **p = &vs_rt.allocs; *p != NULL; p = &(*p)->next)
        if (*p == a) {
            *p = a->next;
            break;
        }
    vs_cuda_release(a); /* GPU memory: the driver's allocation goes first, as the Python backend's close */
    if (a->fd >= 0)
        close(a->fd);
    vs_node_release(a->token); /* the node's hold goes with it (an export of it is revoked) */
    if (a->remote != NULL && !vs_engine_in_use(a->remote))
        vs_fabric_forget(a->remote);
    free(a->remote);
    free(a);
}

void vs_maybe_destroy(vs_alloc *a)
{
    if (a->refs == 0 && a->maps == 0 && a->pins == 0)
        destroy(a);
}

void vs_drop(vs_alloc *a)
{
    if (--a->refs > 0)
        return;
    a->registered = false;
    vs_forget_exports(a);
    vs_maybe_destroy(a);
}

/* The NUMA binding of a memfd's pages (mbind on a temporary mapping sets the object's shared policy). */
static int bind_numa(int fd, size_t size, int64_t node)
{
#ifdef SYS_mbind
    unsigned long mask[64] = {0};
    if (node < 0 || node >= 64 * 64) {
        errno = EINVAL;
        return -1;
    }
    mask[node / 64] = 1UL << (node % 64);
    void *p = mmap(NULL, size, PROT_NONE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
        return -1;
    long rc = syscall(SYS_mbind, p, size, 2 /* MPOL_BIND */, mask, 64 * 64 + 1, 0);
    int e = errno;
    munmap(p, size);
    errno = e;
    return rc == 0 ? 0 : -1;
#else
    (void)fd, (void)size, (void)node;
    errno = ENOSYS;
    return -1;
#endif
}

/* A memfd of `size` bytes sealed against resizing (what the broker wants of an export); huge pages are left to
 * the kernel's transparent huge pages here. */
static int make_memfd(size_t size, const char *name)
{
    int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0)
        return -1;
    if (ftruncate(fd, (off_t)size) != 0 || fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

aclError vs_make_alloc(vs_err *err, size_t size, const vs_prop *prop, enum vs_owner owner, vs_alloc **out)
{
    int device = -1;
    if (prop->loc_type == ACL_MEM_LOCATION_TYPE_DEVICE)
        device = vs_logical((int)prop->loc_id);
    if (device >= 0 && vs_rt.config.cuda)
        return vs_cuda_make_alloc(err, size, prop, device, owner, out); /* device memory is GPU memory */
    if (device >= 0 && size > vs_rt.config.device_memory)
        return vs_set(err, ACL_ERROR_RT_MEMORY_ALLOCATION,
                      "device %d has %llu of %llu bytes free; %zu bytes do not fit (free memory, or raise "
                      "VMMSHARE_DEVICE_MEMORY)", device, (unsigned long long)vs_rt.config.device_memory,
                      (unsigned long long)vs_rt.config.device_memory, size);
    char name[32];
    if (prop->loc_type == ACL_MEM_LOCATION_TYPE_HOST_NUMA)
        snprintf(name, sizeof name, "vmmshare:numa%lld", (long long)prop->loc_id);
    else
        snprintf(name, sizeof name, "vmmshare:%s%d", device >= 0 ? "dev" : "host", device >= 0 ? device : 0);
    uint64_t token;
    aclError rc = vs_node_charge(err, device, size, &token);
    if (rc)
        return rc;
    int fd = make_memfd(size, name);
    if (fd < 0) {
        int e = errno;
        vs_node_release(token);
        return vs_set(err, ACL_ERROR_RT_MEMORY_ALLOCATION, "cannot create %zu bytes of shared memory: %s", size,
                      strerror(e));
    }
    if (prop->loc_type == ACL_MEM_LOCATION_TYPE_HOST_NUMA && bind_numa(fd, size, prop->loc_id) != 0) {
        int e = errno;
        if (!(e == ENOSYS && prop->loc_id == 0)) {
            close(fd);
            vs_node_release(token);
            return vs_set(err, e == ENOSYS ? ACL_ERROR_RT_FEATURE_NOT_SUPPORT : ACL_ERROR_RT_PARAM_INVALID,
                          "cannot bind memory to NUMA node %lld: %s", (long long)prop->loc_id, strerror(e));
        }
    }
    vs_alloc *a = calloc(1, sizeof *a);
    if (a == NULL) {
        close(fd);
        vs_node_release(token);
        return vs_set(err, ACL_ERROR_RT_MEMORY_ALLOCATION, "out of memory");
    }
    a->fd = fd;
    a->size = size;
    a->prop = *prop;
    a->token = token;
    a->refs = 1;
    a->owner = owner;
    *out = a;
    return ACL_SUCCESS;
}
