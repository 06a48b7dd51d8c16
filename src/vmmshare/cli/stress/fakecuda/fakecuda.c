/*
 * A CPU stand-in for the CUDA driver (libcuda.so.1), for machines without a GPU.
 *
 * It implements, on host memory, the slice of the driver API that vmmshare's CUDA backend uses, so that the
 * real cuda-bindings package, the real broker and real second processes can run the backend end to end in CI.
 * It checks vmmshare's use of the API (arguments, call order, error paths); it says nothing about a GPU.
 *
 * Faithful where it matters to a caller:
 * - physical memory is a memfd per cuMemCreate; a POSIX-fd export is a new fd the caller owns; an import does
 *   not take the caller's fd; cuMemRelease of mapped memory frees it at the last unmap;
 * - reservations are PROT_NONE address space the CPU cannot touch: mapping device memory there does not make
 *   it CPU-readable (a GPU pointer is not a host pointer); only cuMemcpy / cuMemsetD8 reach it, and only
 *   through mappings whose access was granted with cuMemSetAccess;
 * - FABRIC handles are refused with CUDA_ERROR_NOT_PERMITTED, as on a node without an IMEX channel;
 * - copies and memsets need a current context, and a range that passes between device and host memory faults
 *   (CUDA_ERROR_ILLEGAL_ADDRESS: the driver takes each pointer as one kind of memory); a cuMemcpy whose ranges
 *   overlap is refused (CUDA_ERROR_INVALID_VALUE: the driver's copies "may not overlap", and on a GPU give
 *   whatever bytes the copy engine's order leaves);
 *
 * Settings: FAKECUDA_DEVICES (default 1), FAKECUDA_MEMORY per device in bytes (default 16 GiB), FAKECUDA_NO_PEER
 * (set: no two GPUs can access each other's memory), FAKECUDA_RETAIN_DELAY_MS (each cuDevicePrimaryCtxRetain takes that
 * long, as a context's creation does on a GPU).
 * The bindings find the functions through cuGetProcAddress_v2, as they do with the real driver.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct { int device; } CUctx;

enum {
    SUCCESS = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, NO_DEVICE = 100,
    INVALID_DEVICE = 101, INVALID_CONTEXT = 201, NOT_FOUND = 500, ILLEGAL_ADDRESS = 700,
    NOT_PERMITTED = 800, NOT_SUPPORTED = 801,
};
enum { HANDLE_POSIX_FD = 1, HANDLE_FABRIC = 8 };
enum { ALLOC_PINNED = 1, LOC_DEVICE = 1 };
enum { PROT_NONE_ = 0, PROT_READ_ = 1, PROT_READWRITE_ = 3 };

typedef struct { int type; int id; } CUmemLocation;
typedef struct {
    int type;
    int requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    struct { unsigned char compressionType, gpuDirectRDMACapable; unsigned short usage; unsigned char reserved[4]; }
        allocFlags;
} CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;

#define GRANULARITY (2ULL << 20)
#define MAX_DEVICES 16

typedef struct Alloc {
    struct Alloc *next;
    int fd;            /* the memfd */
    size_t size;
    int device;
    int handle_types;
    int refs;          /* the handle (until cuMemRelease) + one per mapping */
    int released;
    char *view;        /* the fake's own view, for copies */
} Alloc;

typedef struct Range {
    struct Range *next;
    CUdeviceptr base;
    size_t size;
    Alloc *alloc;      /* mappings only */
    int access;        /* mappings only: PROT_* granted to any device */
} Range;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int initialized, device_count = 1;
static size_t device_memory = 16ULL << 30, used[MAX_DEVICES];
static Alloc *allocs;
static Range *reservations, *mappings;
static CUctx contexts[MAX_DEVICES];
static __thread CUctx *current;

/* ------------------------------------------------------------------ init and devices */

CUresult cuDriverGetVersion(int *version) {
    if (!version) return INVALID_VALUE;
    *version = 13000;
    return SUCCESS;
}

CUresult cuInit(unsigned int flags) {
    if (flags) return INVALID_VALUE;
    const char *n = getenv("FAKECUDA_DEVICES"), *m = getenv("FAKECUDA_MEMORY");
    pthread_mutex_lock(&lock);
    if (n) device_count = atoi(n);
    if (device_count < 0 || device_count > MAX_DEVICES) device_count = 1;
    if (m && strtoull(m, NULL, 10)) device_memory = strtoull(m, NULL, 10);
    for (int i = 0; i < MAX_DEVICES; i++) contexts[i].device = i;
    initialized = 1;
    pthread_mutex_unlock(&lock);
    return device_count ? SUCCESS : NO_DEVICE;
}

CUresult cuDeviceGetCount(int *count) {
    if (!initialized) return NOT_INITIALIZED;
    if (!count) return INVALID_VALUE;
    *count = device_count;
    return SUCCESS;
}

CUresult cuDeviceGet(CUdevice *dev, int ordinal) {
    if (!initialized) return NOT_INITIALIZED;
    if (!dev) return INVALID_VALUE;
    if (ordinal < 0 || ordinal >= device_count) return INVALID_DEVICE;
    *dev = ordinal;
    return SUCCESS;
}

CUresult cuDeviceTotalMem(size_t *bytes, CUdevice dev) {
    if (!initialized) return NOT_INITIALIZED;
    if (!bytes) return INVALID_VALUE;
    if (dev < 0 || dev >= device_count) return INVALID_DEVICE;
    *bytes = device_memory;
    return SUCCESS;
}

CUresult cuDeviceCanAccessPeer(int *can, CUdevice dev, CUdevice peer) {
    if (!initialized) return NOT_INITIALIZED;
    if (!can) return INVALID_VALUE;
    if (dev < 0 || dev >= device_count || peer < 0 || peer >= device_count) return INVALID_DEVICE;
    *can = dev != peer && !getenv("FAKECUDA_NO_PEER");  /* FAKECUDA_NO_PEER: GPUs without a peer path */
    return SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUctx **ctx, CUdevice dev) {
    if (!initialized) return NOT_INITIALIZED;
    if (!ctx) return INVALID_VALUE;
    if (dev < 0 || dev >= device_count) return INVALID_DEVICE;
    const char *delay = getenv("FAKECUDA_RETAIN_DELAY_MS");  /* a context's first retain takes a while on a GPU */
    if (delay) usleep((useconds_t)atoi(delay) * 1000);
    *ctx = &contexts[dev];
    return SUCCESS;
}

CUresult cuCtxSetCurrent(CUctx *ctx) {
    if (!initialized) return NOT_INITIALIZED;
    if (ctx && (ctx < contexts || ctx >= contexts + device_count)) return INVALID_CONTEXT;
    current = ctx;
    return SUCCESS;
}

CUresult cuCtxGetCurrent(CUctx **ctx) {
    if (!initialized) return NOT_INITIALIZED;
    if (!ctx) return INVALID_VALUE;
    *ctx = current;
    return SUCCESS;
}

CUresult cuCtxSynchronize(void) {
    if (!initialized) return NOT_INITIALIZED;
    return current ? SUCCESS : INVALID_CONTEXT;
}

CUresult cuMemGetInfo(size_t *free_bytes, size_t *total) {
    if (!initialized) return NOT_INITIALIZED;
    if (!current) return INVALID_CONTEXT;
    if (!free_bytes || !total) return INVALID_VALUE;
    pthread_mutex_lock(&lock);
    *free_bytes = device_memory - used[current->device];  /* this process's allocations only */
    *total = device_memory;
    pthread_mutex_unlock(&lock);
    return SUCCESS;
}

/* ------------------------------------------------------------------ physical memory */

static int prop_ok(const CUmemAllocationProp *p) {
    return p && p->type == ALLOC_PINNED && p->location.type == LOC_DEVICE && p->location.id >= 0
           && p->location.id < device_count;
}

CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop, int option) {
    if (!initialized) return NOT_INITIALIZED;
    if (!granularity || !prop_ok(prop) || (option != 0 && option != 1)) return INVALID_VALUE;
    *granularity = GRANULARITY;
    return SUCCESS;
}

static Alloc *find_alloc(CUmemGenericAllocationHandle h) {
    for (Alloc *a = allocs; a; a = a->next)
        if ((CUmemGenericAllocationHandle)(uintptr_t)a == h && !a->released) return a;
    return NULL;
}

static void unref(Alloc *a) {
    if (--a->refs) return;
    for (Alloc **pp = &allocs; *pp; pp = &(*pp)->next)
        if (*pp == a) { *pp = a->next; break; }
    munmap(a->view, a->size);
    close(a->fd);
    used[a->device] -= a->size;
    free(a);
}

static Alloc *new_alloc(int fd, size_t size, int device, int types) {
    char *view = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (view == MAP_FAILED) return NULL;
    Alloc *a = calloc(1, sizeof *a);
    if (!a) { munmap(view, size); return NULL; }
    *a = (Alloc){allocs, fd, size, device, types, 1, 0, view};
    allocs = a;
    used[device] += size;
    return a;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                     unsigned long long flags) {
    if (!initialized) return NOT_INITIALIZED;
    if (!handle || !prop_ok(prop) || flags || !size || size % GRANULARITY) return INVALID_VALUE;
    if (prop->requestedHandleTypes & ~(HANDLE_POSIX_FD | HANDLE_FABRIC)) return NOT_SUPPORTED;
    if (prop->requestedHandleTypes & HANDLE_FABRIC) return NOT_PERMITTED;  /* no IMEX channel here */
    CUresult rc = OUT_OF_MEMORY;
    pthread_mutex_lock(&lock);
    int dev = prop->location.id;
    if (used[dev] + size <= device_memory) {
        char name[32];
        snprintf(name, sizeof name, "fakecuda-dev%d", dev);
        int fd = memfd_create(name, MFD_CLOEXEC);
        if (fd >= 0 && ftruncate(fd, (off_t)size) == 0) {
            Alloc *a = new_alloc(fd, size, dev, prop->requestedHandleTypes);
            if (a) { *handle = (uintptr_t)a; rc = SUCCESS; fd = -1; }
        }
        if (fd >= 0) close(fd);
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    if (!initialized) return NOT_INITIALIZED;
    pthread_mutex_lock(&lock);
    Alloc *a = find_alloc(handle);
    if (a) { a->released = 1; unref(a); }
    pthread_mutex_unlock(&lock);
    return a ? SUCCESS : INVALID_VALUE;
}

CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle handle, int type,
                                      unsigned long long flags) {
    if (!initialized) return NOT_INITIALIZED;
    if (!out || flags) return INVALID_VALUE;
    CUresult rc = INVALID_VALUE;
    pthread_mutex_lock(&lock);
    Alloc *a = find_alloc(handle);
    if (a && type == HANDLE_POSIX_FD && (a->handle_types & HANDLE_POSIX_FD)) {
        int fd = fcntl(a->fd, F_DUPFD_CLOEXEC, 0);
        if (fd >= 0) { *(int *)out = fd; rc = SUCCESS; } else rc = OUT_OF_MEMORY;
    } else if (a && type == HANDLE_FABRIC) {
        rc = NOT_PERMITTED;
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *os_handle, int type) {
    if (!initialized) return NOT_INITIALIZED;
    if (!handle || type != HANDLE_POSIX_FD) return INVALID_VALUE;
    int fd = (int)(intptr_t)os_handle, dev = -1;
    char path[64], target[128];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(path, target, sizeof target - 1);
    if (n <= 0) return INVALID_VALUE;
    target[n] = 0;
    if (sscanf(target, "/memfd:fakecuda-dev%d", &dev) != 1 || dev < 0 || dev >= device_count) return INVALID_VALUE;
    struct stat st;
    if (fstat(fd, &st) || st.st_size <= 0) return INVALID_VALUE;
    int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);  /* the caller keeps (and closes) its fd */
    if (own < 0) return OUT_OF_MEMORY;
    pthread_mutex_lock(&lock);
    Alloc *a = new_alloc(own, (size_t)st.st_size, dev, HANDLE_POSIX_FD);
    pthread_mutex_unlock(&lock);
    if (!a) { close(own); return OUT_OF_MEMORY; }
    *handle = (uintptr_t)a;
    return SUCCESS;
}

/* ------------------------------------------------------------------ address space */

static Range *find_range(Range *list, CUdeviceptr p) {
    for (Range *r = list; r; r = r->next)
        if (p >= r->base && p < r->base + r->size) return r;
    return NULL;
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
    if (!initialized) return NOT_INITIALIZED;
    if (!ptr || flags || !size || size % GRANULARITY || (alignment & (alignment - 1))) return INVALID_VALUE;
    size_t align = alignment > GRANULARITY ? alignment : GRANULARITY;
    char *base = MAP_FAILED;
    int mflags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
    if (addr && addr % align == 0)  /* a hint, as with the real driver */
        base = mmap((void *)(uintptr_t)addr, size, PROT_NONE, mflags | MAP_FIXED_NOREPLACE, -1, 0);
    if (base == MAP_FAILED) {
        char *raw = mmap(NULL, size + align, PROT_NONE, mflags, -1, 0);
        if (raw == MAP_FAILED) return OUT_OF_MEMORY;
        uintptr_t start = ((uintptr_t)raw + align - 1) & ~(uintptr_t)(align - 1);
        if (start > (uintptr_t)raw) munmap(raw, start - (uintptr_t)raw);
        size_t tail = (uintptr_t)raw + size + align - (start + size);
        if (tail) munmap((void *)(start + size), tail);
        base = (char *)start;
    }
    Range *r = calloc(1, sizeof *r);
    if (!r) { munmap(base, size); return OUT_OF_MEMORY; }
    pthread_mutex_lock(&lock);
    *r = (Range){reservations, (uintptr_t)base, size, NULL, 0};
    reservations = r;
    pthread_mutex_unlock(&lock);
    *ptr = (uintptr_t)base;
    return SUCCESS;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    if (!initialized) return NOT_INITIALIZED;
    CUresult rc = INVALID_VALUE;
    pthread_mutex_lock(&lock);
    for (Range **pp = &reservations; *pp; pp = &(*pp)->next) {
        Range *r = *pp;
        if (r->base != ptr || r->size != size) continue;
        int mapped = 0;
        for (Range *m = mappings; m; m = m->next) mapped |= m->base >= ptr && m->base < ptr + size;
        if (!mapped) {
            *pp = r->next;
            munmap((void *)(uintptr_t)r->base, r->size);
            free(r);
            rc = SUCCESS;
        }
        break;
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
    if (!initialized) return NOT_INITIALIZED;
    if (flags || offset || !size || size % GRANULARITY || ptr % GRANULARITY) return INVALID_VALUE;
    CUresult rc = INVALID_VALUE;
    pthread_mutex_lock(&lock);
    Alloc *a = find_alloc(handle);
    Range *res = find_range(reservations, ptr);
    int overlap = 0;
    for (Range *m = mappings; m; m = m->next) overlap |= m->base < ptr + size && ptr < m->base + m->size;
    Range *m = NULL;
    if (a && res && ptr + size <= res->base + res->size && size <= a->size && !overlap
        && (m = calloc(1, sizeof *m))) {
        *m = (Range){mappings, ptr, size, a, PROT_NONE_};
        mappings = m;
        a->refs++;
        rc = SUCCESS;
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    if (!initialized) return NOT_INITIALIZED;
    if (!size) return INVALID_VALUE;
    CUresult rc = SUCCESS;
    pthread_mutex_lock(&lock);
    /* whole mappings only, and the range must be covered */
    for (CUdeviceptr p = ptr; p < ptr + size && rc == SUCCESS;) {
        Range *m = find_range(mappings, p);
        if (!m || m->base != p || m->base + m->size > ptr + size) rc = INVALID_VALUE;
        else p += m->size;
    }
    for (Range **pp = &mappings; rc == SUCCESS && *pp;) {
        Range *m = *pp;
        if (m->base >= ptr && m->base < ptr + size) {
            *pp = m->next;
            unref(m->alloc);
            free(m);
        } else {
            pp = &m->next;
        }
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    if (!initialized) return NOT_INITIALIZED;
    if (!desc || !count || !size) return INVALID_VALUE;
    int flags = -1;
    for (size_t i = 0; i < count; i++) {
        const CUmemAccessDesc *d = &desc[i];
        if (d->location.type != LOC_DEVICE || d->location.id < 0 || d->location.id >= device_count) return INVALID_VALUE;
        if (d->flags != PROT_NONE_ && d->flags != PROT_READ_ && d->flags != PROT_READWRITE_) return INVALID_VALUE;
        if (d->flags > flags) flags = d->flags;
    }
    CUresult rc = SUCCESS;
    pthread_mutex_lock(&lock);
    for (CUdeviceptr p = ptr; p < ptr + size && rc == SUCCESS;) {  /* a fully mapped range */
        Range *m = find_range(mappings, p);
        if (!m) rc = INVALID_VALUE;
        else p = m->base + m->size;
    }
    for (Range *m = mappings; rc == SUCCESS && m; m = m->next)
        if (m->base < ptr + size && ptr < m->base + m->size) m->access = flags;
    pthread_mutex_unlock(&lock);
    return rc;
}

/* ------------------------------------------------------------------ copies */

/* Where the fake touches `n` bytes at `p` (and n is clipped to one mapping): the fake's view of device memory,
 * or `p` itself for host memory; NULL for an address no context may touch. Called with the lock held. */
static char *resolve(CUdeviceptr p, size_t *n, int need) {
    Range *m = find_range(mappings, p);
    if (m) {
        if ((m->access & need) != need) return NULL;
        size_t left = m->base + m->size - p;
        if (*n > left) *n = left;
        return m->alloc->view + (p - m->base);
    }
    if (find_range(reservations, p)) return NULL;  /* reserved, nothing mapped */
    return (char *)(uintptr_t)p;                 /* pageable host memory */
}

/* Whether `p` is device memory (mapped or reserved), for a copy that must not pass between device and host memory:
 * the driver takes each pointer as one kind of memory, and a device range that runs on into host memory faults. */
static int on_device(CUdeviceptr p) {
    return find_range(mappings, p) != NULL || find_range(reservations, p) != NULL;
}

CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t count) {
    if (!initialized) return NOT_INITIALIZED;
    if (!current) return INVALID_CONTEXT;
    if (count && dst < src + count && src < dst + count) return INVALID_VALUE;  /* "may not overlap" */
    CUresult rc = SUCCESS;
    pthread_mutex_lock(&lock);
    int dst_dev = on_device(dst), src_dev = on_device(src);
    while (count && rc == SUCCESS) {
        size_t n = count, k;
        if (on_device(dst) != dst_dev || on_device(src) != src_dev) { rc = ILLEGAL_ADDRESS; break; }
        char *d = resolve(dst, &n, PROT_READWRITE_);
        k = n;
        char *s = d ? resolve(src, &k, PROT_READ_) : NULL;
        if (!d || !s) { rc = ILLEGAL_ADDRESS; break; }
        memmove(d, s, k);
        dst += k, src += k, count -= k;
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

CUresult cuMemsetD8(CUdeviceptr dst, unsigned char value, size_t count) {
    if (!initialized) return NOT_INITIALIZED;
    if (!current) return INVALID_CONTEXT;
    CUresult rc = SUCCESS;
    pthread_mutex_lock(&lock);
    int dst_dev = on_device(dst);
    while (count) {
        size_t n = count;
        if (on_device(dst) != dst_dev) { rc = ILLEGAL_ADDRESS; break; }
        char *d = resolve(dst, &n, PROT_READWRITE_);
        if (!d) { rc = ILLEGAL_ADDRESS; break; }
        memset(d, value, n);
        dst += n, count -= n;
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

/* ------------------------------------------------------------------ lookup */

static const struct { const char *name; void *fn; } table[] = {
#define F(name) {#name, (void *)name}
    F(cuDriverGetVersion), F(cuInit), F(cuDeviceGetCount), F(cuDeviceGet), F(cuDeviceTotalMem), F(cuDeviceCanAccessPeer),
    F(cuDevicePrimaryCtxRetain), F(cuCtxSetCurrent), F(cuCtxGetCurrent), F(cuCtxSynchronize), F(cuMemGetInfo), F(cuMemGetAllocationGranularity),
    F(cuMemCreate), F(cuMemRelease), F(cuMemExportToShareableHandle), F(cuMemImportFromShareableHandle),
    F(cuMemAddressReserve), F(cuMemAddressFree), F(cuMemMap), F(cuMemUnmap), F(cuMemSetAccess), F(cuMemcpy),
    F(cuMemsetD8),
#undef F
};

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags, int *status) {
    (void)version, (void)flags;
    if (!symbol || !pfn) return INVALID_VALUE;
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
        if (strcmp(table[i].name, symbol) == 0) {
            *pfn = table[i].fn;
            if (status) *status = 0;
            return SUCCESS;
        }
    }
    *pfn = NULL;
    if (status) *status = 1;  /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return NOT_FOUND;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags) {
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}
