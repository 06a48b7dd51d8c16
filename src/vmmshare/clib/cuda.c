/*
 * The CUDA backend (vs_cuda.h): under VMMSHARE_BACKEND=cuda, device-location memory is GPU memory made, shared,
 * mapped and copied through the CUDA driver's virtual memory calls, as vmmshare.backends.cuda does them, so a C and a
 * Python process share GPU memory through the same broker (the broker holds the allocation's POSIX fd and is told it
 * is GPU memory; it never looks inside).
 *
 * The driver is loaded at run time, once: dlopen("libcuda.so.1") and its functions looked up by cuGetProcAddress_v2
 * (the driver's own lookup, which gives each call's current version), else by dlsym. Nothing links against it, so the
 * library loads on machines without a GPU; there a process with VMMSHARE_BACKEND=cuda fails every call with 207000
 * and a message that says what to install. The few driver types and values used are declared here from the
 * driver's published interface (names, signatures, values).
 *
 * Each call runs with its device's primary context current in the calling thread and gives back the context that
 * was current before (other code in the thread keeps the device it chose), as the Python backend's `on(device)`.
 */
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "vs_cuda.h"

/* ---------------------------------------------------------------- the driver's interface, as far as used */

typedef int cu_result;
typedef int cu_device;
typedef void *cu_context;
typedef unsigned long long cu_ptr;
typedef unsigned long long cu_handle;

enum {
    CU_SUCCESS = 0, CU_INVALID_VALUE = 1, CU_OUT_OF_MEMORY = 2, CU_NOT_INITIALIZED = 3, CU_NO_DEVICE = 100,
    CU_INVALID_DEVICE = 101, CU_INVALID_CONTEXT = 201, CU_INVALID_HANDLE = 400, CU_NOT_FOUND = 500,
    CU_ILLEGAL_ADDRESS = 700, CU_NOT_PERMITTED = 800, CU_NOT_SUPPORTED = 801,
};
enum { CU_ALLOCATION_PINNED = 1, CU_LOCATION_DEVICE = 1, CU_HANDLE_POSIX_FD = 1, CU_GRANULARITY_MINIMUM = 0 };
enum { CU_PROT_NONE = 0, CU_PROT_READ = 1, CU_PROT_READWRITE = 3 };

typedef struct cu_location {
    int type;
    int id;
} cu_location;

typedef struct cu_prop { /* CUmemAllocationProp */
    int type;
    int requested_handle_types;
    cu_location location;
    void *win32_metadata;
    struct {
        unsigned char compression_type, gpu_direct_rdma_capable;
        unsigned short usage;
        unsigned char reserved[4];
    } alloc_flags;
} cu_prop;

typedef struct cu_access { /* CUmemAccessDesc */
    cu_location location;
    int flags;
} cu_access;

/* The driver's functions this backend calls (NULL until loaded; GetErrorName may stay NULL). */
static struct {
    cu_result (*Init)(unsigned);
    cu_result (*DeviceGetCount)(int *);
    cu_result (*DeviceGet)(cu_device *, int);
    cu_result (*DeviceCanAccessPeer)(int *, cu_device, cu_device);
    cu_result (*DevicePrimaryCtxRetain)(cu_context *, cu_device);
    cu_result (*CtxGetCurrent)(cu_context *);
    cu_result (*CtxSetCurrent)(cu_context);
    cu_result (*CtxSynchronize)(void);
    cu_result (*MemGetInfo)(size_t *, size_t *);
    cu_result (*MemGetAllocationGranularity)(size_t *, const cu_prop *, int);
    cu_result (*MemCreate)(cu_handle *, size_t, const cu_prop *, unsigned long long);
    cu_result (*MemRelease)(cu_handle);
    cu_result (*MemExportToShareableHandle)(void *, cu_handle, int, unsigned long long);
    cu_result (*MemImportFromShareableHandle)(cu_handle *, void *, int);
    cu_result (*MemAddressReserve)(cu_ptr *, size_t, size_t, cu_ptr, unsigned long long);
    cu_result (*MemAddressFree)(cu_ptr, size_t);
    cu_result (*MemMap)(cu_ptr, size_t, size_t, cu_handle, unsigned long long);
    cu_result (*MemUnmap)(cu_ptr, size_t);
    cu_result (*MemSetAccess)(cu_ptr, size_t, const cu_access *, size_t);
    cu_result (*Memcpy)(cu_ptr, cu_ptr, size_t);
    cu_result (*MemsetD8)(cu_ptr, unsigned char, size_t);
    cu_result (*GetErrorName)(cu_result, const char **);
} cu;

/* Each function's name, the versioned symbol dlsym must take where the plain one is an older ABI, and its slot. */
static const struct symbol {
    const char *name, *versioned;
    void **slot;
    bool optional;
} SYMBOLS[] = {
#define SYM(f, v) {"cu" #f, v, (void **)&cu.f, false}
    SYM(Init, NULL), SYM(DeviceGetCount, NULL), SYM(DeviceGet, NULL), SYM(DeviceCanAccessPeer, NULL),
    SYM(DevicePrimaryCtxRetain, NULL), SYM(CtxGetCurrent, NULL), SYM(CtxSetCurrent, NULL),
    SYM(CtxSynchronize, NULL), SYM(MemGetInfo, "cuMemGetInfo_v2"), SYM(MemGetAllocationGranularity, NULL),
    SYM(MemCreate, NULL), SYM(MemRelease, NULL), SYM(MemExportToShareableHandle, NULL),
    SYM(MemImportFromShareableHandle, NULL), SYM(MemAddressReserve, NULL), SYM(MemAddressFree, NULL),
    SYM(MemMap, NULL), SYM(MemUnmap, NULL), SYM(MemSetAccess, NULL), SYM(Memcpy, NULL),
    SYM(MemsetD8, "cuMemsetD8_v2"),
#undef SYM
    {"cuGetErrorName", NULL, (void **)&cu.GetErrorName, true},
};

typedef cu_result (*get_proc_fn)(const char *, void **, int, unsigned long long, int *);

static pthread_once_t loaded = PTHREAD_ONCE_INIT;
static aclError load_code;       /* 0, or why the driver cannot be used (every call fails with it) */
static char load_message[512];
static int gpu_count;
static pthread_mutex_t ctx_lock = PTHREAD_MUTEX_INITIALIZER;
static cu_context contexts[VS_MAX_DEVICES]; /* each GPU's primary context, retained once for the process's life */

/* The driver's name of a CUresult (its own cuGetErrorName where it has one), for messages. */
static const char *error_name(cu_result r, char *buf, size_t cap)
{
    const char *name = NULL;
    if (cu.GetErrorName != NULL && cu.GetErrorName(r, &name) == CU_SUCCESS && name != NULL)
        return name;
    static const struct { cu_result r; const char *name; } NAMES[] = {
        {CU_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE"}, {CU_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY"},
        {CU_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED"}, {CU_NO_DEVICE, "CUDA_ERROR_NO_DEVICE"},
        {CU_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE"}, {CU_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT"},
        {CU_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE"}, {CU_NOT_FOUND, "CUDA_ERROR_NOT_FOUND"},
        {CU_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS"}, {CU_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED"},
        {CU_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED"},
    };
    for (size_t i = 0; i < sizeof NAMES / sizeof NAMES[0]; i++)
        if (NAMES[i].r == r)
            return NAMES[i].name;
    snprintf(buf, cap, "CUresult %d", r);
    return buf;
}

/* The acl code of a driver failure, as the Python backend's `check` maps it; 0 for success. */
static aclError check(vs_err *err, cu_result r, const char *what)
{
    if (r == CU_SUCCESS)
        return ACL_SUCCESS;
    char buf[32];
    aclError code = ACL_ERROR_RT_INTERNAL_ERROR;
    if (r == CU_OUT_OF_MEMORY)
        code = ACL_ERROR_RT_MEMORY_ALLOCATION;
    else if (r == CU_INVALID_VALUE || r == CU_INVALID_HANDLE)
        code = ACL_ERROR_RT_PARAM_INVALID;
    else if (r == CU_NOT_SUPPORTED || r == CU_NOT_PERMITTED)
        code = ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    return vs_set(err, code, "%s failed: %s", what, error_name(r, buf, sizeof buf));
}

/* ---------------------------------------------------------------- loading */

/* Look every function up (the driver's versioned lookup first); the name of one that is missing, else NULL. */
static const char *resolve(void *lib)
{
    get_proc_fn get_proc = (get_proc_fn)dlsym(lib, "cuGetProcAddress_v2");
    for (size_t i = 0; i < sizeof SYMBOLS / sizeof SYMBOLS[0]; i++) {
        const struct symbol *s = &SYMBOLS[i];
        void *fn = NULL;
        int status = 0;
        if (get_proc != NULL && get_proc(s->name, &fn, 12000, 0, &status) != CU_SUCCESS)
            fn = NULL;
        if (fn == NULL && s->versioned != NULL)
            fn = dlsym(lib, s->versioned);
        if (fn == NULL)
            fn = dlsym(lib, s->name);
        if (fn == NULL && !s->optional)
            return s->name;
        *s->slot = fn;
    }
    return NULL;
}

static void load_driver(void);

/* Load the driver (once, by vs_cuda_start); under VMMSHARE_BACKEND=auto a driver or GPU that is not there means host
 * memory, as the Python runtime's choice. */
static void load(void)
{
    load_driver();
    if (load_code && vs_rt.config.cuda_auto) {
        load_code = 0;
        vs_rt.config.cuda = false;
    }
}

/* Open the driver, look its functions up, initialise it and count the GPUs. */
static void load_driver(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        const char *why = dlerror();
        load_code = ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
        snprintf(load_message, sizeof load_message,
                 "VMMSHARE_BACKEND=cuda but no CUDA driver on this machine: cannot load libcuda.so.1 (%.200s); "
                 "install the NVIDIA driver (it provides libcuda.so.1), or unset VMMSHARE_BACKEND for device memory "
                 "on the host", why != NULL ? why : "not found");
        return;
    }
    const char *missing = resolve(lib);
    if (missing != NULL) {
        load_code = ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
        snprintf(load_message, sizeof load_message,
                 "VMMSHARE_BACKEND=cuda: the CUDA driver libcuda.so.1 has no %s (virtual memory management needs "
                 "CUDA 10.2 or later; CUDA 12 or later is supported): update the NVIDIA driver", missing);
        return; /* (the library stays loaded: something of it may be in use elsewhere in the process) */
    }
    vs_err err;
    if (check(&err, cu.Init(0), "cuInit") || check(&err, cu.DeviceGetCount(&gpu_count), "cuDeviceGetCount")) {
        load_code = ACL_ERROR_RT_FEATURE_NOT_SUPPORT; /* a driver without a usable GPU: no GPU memory here */
        snprintf(load_message, sizeof load_message, "VMMSHARE_BACKEND=cuda but the CUDA driver offers no usable GPU "
                 "(%.300s): check nvidia-smi, or unset VMMSHARE_BACKEND for device memory on the host", err.message);
        return;
    }
    if (gpu_count <= 0) {
        load_code = ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
        snprintf(load_message, sizeof load_message, "VMMSHARE_BACKEND=cuda but no GPU is visible");
        return;
    }
    if (gpu_count > VS_MAX_DEVICES)
        gpu_count = VS_MAX_DEVICES;
    vs_config *c = &vs_rt.config; /* the devices this process sees are the GPUs (not VMMSHARE_DEVICES) */
    c->devices = gpu_count;
    c->visible_error[0] = '\0'; /* ASCEND_RT_VISIBLE_DEVICES read again over the GPUs, as the Python runtime reads it */
    vs_read_visible(c);
}

/* The driver, loaded once: 0, or why it cannot be used (every call of the process fails with it). */
aclError vs_cuda_start(vs_err *err)
{
    pthread_once(&loaded, load);
    if (load_code)
        return vs_set(err, load_code, "%s", load_message);
    return ACL_SUCCESS;
}

/* The GPUs the driver counted. */
int vs_cuda_device_count(void)
{
    return gpu_count;
}

/* ---------------------------------------------------------------- contexts */

/* What `enter` changed, for `leave` to give back. */
typedef struct ctx_guard {
    cu_context previous;
    bool switched;
} ctx_guard;

/* The primary context of node GPU `device` (retained on first use). */
static aclError context_of(vs_err *err, int device, cu_context *out)
{
    if (device < 0 || device >= gpu_count)
        return vs_set(err, ACL_ERROR_RT_INVALID_DEVICEID, "GPU %d is not a GPU of this node: it has %d", device,
                      gpu_count);
    *out = __atomic_load_n(&contexts[device], __ATOMIC_ACQUIRE);
    if (*out != NULL) /* made already: no lock (a child forked while another thread made one must not wait on it) */
        return ACL_SUCCESS;
    pthread_mutex_lock(&ctx_lock);
    aclError rc = ACL_SUCCESS;
    cu_context made = contexts[device];
    if (made == NULL) {
        cu_device dev;
        rc = check(err, cu.DeviceGet(&dev, device), "cuDeviceGet");
        if (rc == ACL_SUCCESS)
            rc = check(err, cu.DevicePrimaryCtxRetain(&made, dev), "cuDevicePrimaryCtxRetain");
        if (rc == ACL_SUCCESS)
            __atomic_store_n(&contexts[device], made, __ATOMIC_RELEASE);
    }
    *out = made;
    pthread_mutex_unlock(&ctx_lock);
    return rc;
}

/* In a forked child: the lock of contexts afresh (a thread of the parent may have held it at the fork). */
void vs_cuda_after_fork(void)
{
    pthread_mutex_init(&ctx_lock, NULL);
}

/* Make `device`'s context current in this thread (the driver asked each time: nothing is cached per thread). */
static aclError enter(vs_err *err, int device, ctx_guard *g)
{
    cu_context ctx = NULL, previous = NULL;
    g->switched = false;
    if (context_of(err, device, &ctx) || check(err, cu.CtxGetCurrent(&previous), "cuCtxGetCurrent"))
        return err->code;
    if (previous != ctx) {
        if (check(err, cu.CtxSetCurrent(ctx), "cuCtxSetCurrent"))
            return err->code;
        g->switched = true;
        g->previous = previous;
    }
    return ACL_SUCCESS;
}

/* Give back the context another part of the program had current (none: ours stays, for the next call). */
static void leave(const ctx_guard *g)
{
    if (g->switched && g->previous != NULL)
        cu.CtxSetCurrent(g->previous);
}

/* ---------------------------------------------------------------- physical memory */

/* A pinned allocation's properties on `device`, shareable as a POSIX fd. */
static cu_prop prop_on(int device)
{
    cu_prop p;
    memset(&p, 0, sizeof p);
    p.type = CU_ALLOCATION_PINNED;
    p.location.type = CU_LOCATION_DEVICE;
    p.location.id = device;
    p.requested_handle_types = CU_HANDLE_POSIX_FD;
    return p;
}

/* GPU memory of `size` bytes on node GPU `device` (granularity checked, charged on the node as GPU memory). */
aclError vs_cuda_make_alloc(vs_err *err, size_t size, const vs_prop *prop, int device, enum vs_owner owner,
                            vs_alloc **out)
{
    cu_prop p = prop_on(device);
    size_t g = 0;
    if (check(err, cu.MemGetAllocationGranularity(&g, &p, CU_GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity"))
        return err->code;
    if (g == 0 || size % g)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "size %zu is not a multiple of the GPU's granularity %zu", size,
                      g);
    uint64_t token;
    if (vs_node_charge_gpu(err, device, size, &token))
        return err->code;
    vs_alloc *a = calloc(1, sizeof *a);
    struct vs_gpu *gpu = calloc(1, sizeof *gpu);
    ctx_guard guard;
    cu_handle h = 0;
    aclError rc = a == NULL || gpu == NULL ? vs_set(err, ACL_ERROR_RT_MEMORY_ALLOCATION, "out of memory")
                                           : enter(err, device, &guard);
    if (rc == ACL_SUCCESS) {
        rc = check(err, cu.MemCreate(&h, size, &p, 0), "cuMemCreate");
        leave(&guard);
    }
    if (rc) {
        free(a);
        free(gpu);
        vs_node_release(token);
        return rc;
    }
    gpu->handle = h;
    gpu->device = device;
    a->fd = -1; /* its POSIX fd is made on its first export */
    a->size = size;
    a->prop = *prop;
    a->token = token;
    a->refs = 1;
    a->owner = owner;
    a->gpu = gpu;
    *out = a;
    return ACL_SUCCESS;
}

/* Give the driver's allocation back as the allocation is destroyed (an export's fd is closed by the caller). */
void vs_cuda_release(vs_alloc *a)
{
    if (a->gpu == NULL)
        return;
    cu.MemRelease(a->gpu->handle); /* (a failure leaves nothing to do: the memory is not ours any more) */
    free(a->gpu);
    a->gpu = NULL;
}

/* The allocation's POSIX fd for the broker, made on its first export and kept until it is destroyed. */
aclError vs_cuda_export_fd(vs_err *err, vs_alloc *a)
{
    if (a->fd >= 0)
        return ACL_SUCCESS;
    ctx_guard guard;
    int fd = -1;
    if (enter(err, a->gpu->device, &guard))
        return err->code;
    aclError rc = check(err, cu.MemExportToShareableHandle(&fd, a->gpu->handle, CU_HANDLE_POSIX_FD, 0),
                        "cuMemExportToShareableHandle");
    leave(&guard);
    if (rc == ACL_SUCCESS)
        a->fd = fd;
    return rc;
}

/* Import the broker's fd of GPU memory on the importer's device (the fd closed either way). */
aclError vs_cuda_adopt(vs_err *err, vs_alloc *a, int device)
{
    int fd = a->fd, node = vs_logical(device);
    a->fd = -1;
    struct vs_gpu *gpu = calloc(1, sizeof *gpu);
    ctx_guard guard;
    cu_handle h = 0;
    aclError rc = gpu == NULL ? vs_set(err, ACL_ERROR_RT_MEMORY_ALLOCATION, "out of memory") : enter(err, node, &guard);
    if (rc == ACL_SUCCESS) {
        cu_result r = cu.MemImportFromShareableHandle(&h, (void *)(intptr_t)fd, CU_HANDLE_POSIX_FD);
        leave(&guard);
        char buf[32];
        if (r != CU_SUCCESS && r != CU_OUT_OF_MEMORY)
            rc = vs_set(err, ACL_ERROR_RT_PARAM_INVALID,
                        "cuMemImportFromShareableHandle failed: %s (the exporter's fd is not a CUDA allocation this "
                        "GPU can import)", error_name(r, buf, sizeof buf));
        else
            rc = check(err, r, "cuMemImportFromShareableHandle");
    }
    close(fd); /* the driver keeps its own reference to the memory */
    if (rc) {
        free(gpu);
        return rc;
    }
    gpu->handle = h;
    gpu->device = node;
    a->gpu = gpu;
    return ACL_SUCCESS;
}

/* ---------------------------------------------------------------- address space and mappings */

/* aclrtReserveMemAddress's range under the CUDA backend: GPU address space, recorded as a GPU reservation. */
aclError vs_cuda_reserve(void **virPtr, size_t size, size_t align, uintptr_t want, const char *call)
{
    vs_err err;
    cu_ptr p = 0;
    if (check(&err, cu.MemAddressReserve(&p, size, align, want, 0), "cuMemAddressReserve"))
        return vs_raise(&err, call);
    if (want && p != want) { /* the driver takes the address as a hint */
        cu.MemAddressFree(p, size);
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                       "cannot reserve at expectPtr %#lx: the GPU address range at %#lx is not free; pass NULL to let "
                       "the runtime choose", (unsigned long)want, (unsigned long)want);
    }
    vs_lock();
    vs_add_reservation((uintptr_t)p, size, VS_VMM);
    VS_AT(vs_rt.reservations, vs_range, vs_rt.reservations.count - 1).gpu = true;
    vs_unlock();
    *virPtr = (void *)(uintptr_t)p;
    return ACL_SUCCESS;
}

/* Give a GPU range back to the driver. */
aclError vs_cuda_release_range(vs_err *err, uintptr_t ptr, size_t size)
{
    return check(err, cu.MemAddressFree(ptr, size), "cuMemAddressFree");
}

/* The driver's access flags for aclrtMemAccessFlags `access`. */
static int flags_of(uint64_t access)
{
    if (access == ACL_RT_MEM_ACCESS_FLAGS_READWRITE)
        return CU_PROT_READWRITE;
    return access == ACL_RT_MEM_ACCESS_FLAGS_READ ? CU_PROT_READ : CU_PROT_NONE;
}

/* cuMemSetAccess of [ptr, ptr+size) for `device` (its context current). */
static aclError set_access(vs_err *err, uintptr_t ptr, size_t size, int device, uint64_t access)
{
    cu_access d;
    memset(&d, 0, sizeof d);
    d.location.type = CU_LOCATION_DEVICE;
    d.location.id = device;
    d.flags = flags_of(access);
    return check(err, cu.MemSetAccess(ptr, size, &d, 1), "cuMemSetAccess");
}

/* Map GPU memory over a GPU range and grant `access` (host memory or a host range on either side: 207000). */
aclError vs_cuda_map(vs_err *err, uintptr_t ptr, size_t size, vs_alloc *a, const vs_range *r, uint64_t access)
{
    if (a->gpu == NULL || !r->gpu)
        return vs_set(err, ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
                      "%s memory cannot be mapped into a %s reservation: reserve the range for the memory's location",
                      a->gpu != NULL ? "GPU" : "host", r->gpu ? "GPU" : "host");
    ctx_guard guard;
    if (enter(err, a->gpu->device, &guard))
        return err->code;
    aclError rc = check(err, cu.MemMap(ptr, size, 0, a->gpu->handle, 0), "cuMemMap");
    if (rc == ACL_SUCCESS && access && set_access(err, ptr, size, a->gpu->device, access)) {
        rc = err->code;
        cu.MemUnmap(ptr, size);
    }
    leave(&guard);
    return rc;
}

/* A GPU range of its own with the allocation mapped over it (aclrtMalloc blocks, IPC imports). */
aclError vs_cuda_map_new(vs_err *err, vs_alloc *a, uint64_t access, enum vs_owner owner, uintptr_t *out)
{
    size_t align = a->size % VS_HUGE1G_GRANULARITY == 0 ? VS_HUGE1G_GRANULARITY : VS_MIN_GRANULARITY;
    cu_ptr p = 0;
    if (check(err, cu.MemAddressReserve(&p, a->size, align, 0, 0), "cuMemAddressReserve"))
        return err->code;
    vs_range r = {(uintptr_t)p, a->size, owner, true};
    if (vs_cuda_map(err, (uintptr_t)p, a->size, a, &r, access)) {
        cu.MemAddressFree(p, a->size);
        return err->code;
    }
    vs_add_reservation((uintptr_t)p, a->size, owner);
    VS_AT(vs_rt.reservations, vs_range, vs_rt.reservations.count - 1).gpu = true;
    vs_add_mapping((uintptr_t)p, a->size, a, access);
    *out = (uintptr_t)p;
    return ACL_SUCCESS;
}

/* Unmap GPU memory (its range stays reserved). */
aclError vs_cuda_unmap(vs_err *err, uintptr_t ptr, size_t size)
{
    return check(err, cu.MemUnmap(ptr, size), "cuMemUnmap");
}

/* Set a GPU mapping's access for its device (aclrtMemSetAccess). */
aclError vs_cuda_protect(vs_err *err, uintptr_t ptr, size_t size, const vs_alloc *a, uint64_t access)
{
    ctx_guard guard;
    if (enter(err, a->gpu->device, &guard))
        return err->code;
    aclError rc = set_access(err, ptr, size, a->gpu->device, access);
    leave(&guard);
    return rc;
}

/* ---------------------------------------------------------------- copies and fills */

/* The GPU allocation a copy between `dst` and `src` touches (the destination's first), or NULL for the CPU. */
vs_alloc *vs_cuda_mover(uintptr_t dst, uintptr_t src)
{
    if (!vs_rt.config.cuda)
        return NULL;
    vs_mapping *m = vs_mapping_at(dst);
    if (m != NULL && m->alloc->gpu != NULL)
        return m->alloc;
    m = vs_mapping_at(src);
    return m != NULL && m->alloc->gpu != NULL ? m->alloc : NULL;
}

#define BOUNCE ((size_t)16 << 20) /* bytes of the host buffer an overlapping copy goes through */

/* An overlapping copy (the driver's copies "may not overlap") through a host buffer, part by part, the last part
 * first where dst lies above src: memmove's bytes (the context current). */
static aclError overlapping_copy(vs_err *err, uintptr_t dst, uintptr_t src, size_t count)
{
    size_t chunk = count < BOUNCE ? count : BOUNCE;
    uint8_t *bounce = malloc(chunk);
    if (bounce == NULL)
        return vs_set(err, ACL_ERROR_RT_MEMORY_ALLOCATION, "out of memory for a %zu-byte bounce buffer", chunk);
    aclError rc = ACL_SUCCESS;
    for (size_t moved = 0; rc == ACL_SUCCESS && moved < count;) {
        size_t k = count - moved < chunk ? count - moved : chunk;
        size_t at = src < dst ? count - moved - k : moved;
        rc = check(err, cu.Memcpy((cu_ptr)(uintptr_t)bounce, src + at, k), "cuMemcpy");
        if (rc == ACL_SUCCESS)
            rc = check(err, cu.Memcpy(dst + at, (cu_ptr)(uintptr_t)bounce, k), "cuMemcpy");
        moved += k;
    }
    free(bounce);
    return rc;
}

/* A synchronous copy through the driver, in the GPU memory's device's context (memmove's bytes where the ranges
 * overlap, as the host backend's copies). */
aclError vs_cuda_copy(vs_err *err, const vs_alloc *mover, uintptr_t dst, uintptr_t src, size_t count)
{
    if (dst == src)
        return ACL_SUCCESS; /* nothing moves */
    ctx_guard guard;
    if (enter(err, mover->gpu->device, &guard))
        return err->code;
    aclError rc = dst < src + count && src < dst + count ? overlapping_copy(err, dst, src, count)
                                                         : check(err, cu.Memcpy(dst, src, count), "cuMemcpy");
    if (rc == ACL_SUCCESS) /* cuMemcpy may return before a device-side copy is done */
        rc = check(err, cu.CtxSynchronize(), "cuCtxSynchronize");
    leave(&guard);
    return rc;
}

/* A synchronous byte fill of GPU memory through the driver. */
aclError vs_cuda_fill(vs_err *err, const vs_alloc *mover, uintptr_t ptr, int value, size_t count)
{
    ctx_guard guard;
    if (enter(err, mover->gpu->device, &guard))
        return err->code;
    aclError rc = check(err, cu.MemsetD8(ptr, (unsigned char)(value & 0xFF), count), "cuMemsetD8");
    if (rc == ACL_SUCCESS) /* a memset of device memory is asynchronous */
        rc = check(err, cu.CtxSynchronize(), "cuCtxSynchronize");
    leave(&guard);
    return rc;
}

/* ---------------------------------------------------------------- the GPUs */

/* Free and total bytes of node GPU `device`, as its driver counts them. */
aclError vs_cuda_mem_info(vs_err *err, int device, uint64_t *free_bytes, uint64_t *total)
{
    ctx_guard guard;
    size_t f = 0, t = 0;
    if (enter(err, device, &guard))
        return err->code;
    aclError rc = check(err, cu.MemGetInfo(&f, &t), "cuMemGetInfo");
    leave(&guard);
    *free_bytes = f;
    *total = t;
    return rc;
}

/* Whether node GPU `device` can access node GPU `peer`'s memory. */
aclError vs_cuda_can_access_peer(vs_err *err, int device, int peer, int *can)
{
    cu_device d, p;
    if (check(err, cu.DeviceGet(&d, device), "cuDeviceGet") || check(err, cu.DeviceGet(&p, peer), "cuDeviceGet"))
        return err->code;
    return check(err, cu.DeviceCanAccessPeer(can, d, p), "cuDeviceCanAccessPeer");
}
