/*
 * The CUDA backend of the C library (cuda.c): device memory as real GPU memory under VMMSHARE_BACKEND=cuda, through
 * the CUDA driver's virtual memory calls, loaded at run time (dlopen of libcuda.so.1, no link-time dependency), as
 * vmmshare.backends.cuda does through its bindings. The other files call these few hooks only where an allocation,
 * a range or a copy is GPU memory (vs_alloc.gpu, vs_range.gpu); host-location memory stays on the host.
 *
 * Every function here expects the runtime's lock (vs_lock) held where it reads or changes the tables.
 */
#ifndef VMMSHARE_CLIB_VS_CUDA_H
#define VMMSHARE_CLIB_VS_CUDA_H

#include "vs.h"

/* What the driver holds for one GPU allocation of this process (vs_alloc.gpu). */
struct vs_gpu {
    unsigned long long handle; /* the driver's CUmemGenericAllocationHandle */
    int device;                /* the node's GPU number it lives on (its importer's, for an import) */
};

/* Load the driver once (runtime start under VMMSHARE_BACKEND=cuda); 207000 and what to install when it cannot. */
aclError vs_cuda_start(vs_err *err);
/* The GPUs the driver sees (after vs_cuda_start succeeded). */
int vs_cuda_device_count(void);
/* In a forked child: no lock of this file held by a thread of the parent. */
void vs_cuda_after_fork(void);

/* GPU memory of `size` bytes on node device `device`, charged on the node as GPU memory (vs_make_alloc's). */
aclError vs_cuda_make_alloc(vs_err *err, size_t size, const vs_prop *prop, int device, enum vs_owner owner,
                            vs_alloc **out);
/* Give the driver's allocation back (the allocation is being destroyed). */
void vs_cuda_release(vs_alloc *a);
/* The POSIX fd of a GPU allocation, made on its first export and kept in a->fd (closed when it is destroyed). */
aclError vs_cuda_export_fd(vs_err *err, vs_alloc *a);
/* Adopt an imported GPU fd (a->fd, closed here either way) as memory of user device `device`. */
aclError vs_cuda_adopt(vs_err *err, vs_alloc *a, int device);

/* aclrtReserveMemAddress under the CUDA backend: a range of GPU address space, recorded as a reservation. */
aclError vs_cuda_reserve(void **virPtr, size_t size, size_t align, uintptr_t want, const char *call);
/* Give a GPU reservation's address space back to the driver (its mappings gone already). */
aclError vs_cuda_release_range(vs_err *err, uintptr_t ptr, size_t size);
/* Map `a` over [ptr, ptr+size) of reservation `r` with `access` (either of them GPU: both must be). */
aclError vs_cuda_map(vs_err *err, uintptr_t ptr, size_t size, vs_alloc *a, const vs_range *r, uint64_t access);
/* A new GPU range of a's size with `a` mapped over it, recorded (vs_map_new for GPU memory). */
aclError vs_cuda_map_new(vs_err *err, vs_alloc *a, uint64_t access, enum vs_owner owner, uintptr_t *out);
/* Unmap GPU memory at [ptr, ptr+size) (the range stays reserved). */
aclError vs_cuda_unmap(vs_err *err, uintptr_t ptr, size_t size);
/* Set the access of a GPU mapping of `a` (aclrtMemSetAccess's effective flags). */
aclError vs_cuda_protect(vs_err *err, uintptr_t ptr, size_t size, const vs_alloc *a, uint64_t access);

/* The GPU allocation that moves a copy between [dst] and [src] (the destination's first), or NULL: the CPU copies. */
vs_alloc *vs_cuda_mover(uintptr_t dst, uintptr_t src);
/* A synchronous copy or fill through the driver in `mover`'s device's context (aclrtMemcpy / aclrtMemset are). */
aclError vs_cuda_copy(vs_err *err, const vs_alloc *mover, uintptr_t dst, uintptr_t src, size_t count);
aclError vs_cuda_fill(vs_err *err, const vs_alloc *mover, uintptr_t ptr, int value, size_t count);

/* (free, total) bytes of node GPU `device`, as its driver counts them. */
aclError vs_cuda_mem_info(vs_err *err, int device, uint64_t *free_bytes, uint64_t *total);
/* Whether node GPU `device` can map memory of node GPU `peer` (cuDeviceCanAccessPeer). */
aclError vs_cuda_can_access_peer(vs_err *err, int device, int peer, int *can);

#endif /* VMMSHARE_CLIB_VS_CUDA_H */
