/*
 * Physical allocations, reserved ranges and the mappings between them (SPEC §4 rules 1-8), with the acl layer's
 * own checks first (§4a: 100000, a NULL out-pointer among them), then the runtime's (107000 ...), in the order
 * vmmshare.acl makes them.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "vs.h"
#include "vs_cuda.h"

#define ARENA_SIZE ((size_t)(VS_ARENA_END - VS_ARENA_START))

/* ---------------------------------------------------------------- information */

VS_API aclError aclrtGetMemInfo(aclrtMemAttr attr, size_t *free_bytes, size_t *total)
{
    const char *call = "aclrtGetMemInfo";
    START(call);
    ACL_REQUIRE(free_bytes != NULL, call, "free is NULL");
    ACL_REQUIRE(total != NULL, call, "total is NULL");
    if ((unsigned)attr >= 18)
        return vs_fail(ACL_ERROR_RT_INVALID_MEMORY_TYPE, call,
                       "attr=%d is not an aclrtMemAttr (0 ACL_DDR_MEM .. 17 ACL_MEM_P2P_HUGE1G)", (int)attr);
    int device = 0;
    if (vs_current_device(&err, &device) || vs_device_id(&err, device))
        return vs_raise(&err, call);
    uint64_t f, t;
    if (vs_rt.config.cuda ? vs_cuda_mem_info(&err, vs_logical(device), &f, &t) /* the GPU's, as its driver counts */
                          : vs_node_mem_info(&err, vs_logical(device), &f, &t))
        return vs_raise(&err, call);
    *free_bytes = f;
    *total = t;
    return ACL_SUCCESS;
}

VS_API aclError aclrtMemGetAllocationGranularity(aclrtPhysicalMemProp *prop, aclrtMemGranularityOptions option,
                                                 size_t *granularity)
{
    const char *call = "aclrtMemGetAllocationGranularity";
    START(call);
    ACL_REQUIRE(prop != NULL, call, "prop is NULL: pass an aclrtPhysicalMemProp");
    ACL_REQUIRE(granularity != NULL, call, "granularity is NULL");
    vs_prop p = vs_prop_from(prop);
    if (vs_check_prop_acl(&err, &p, false))
        return vs_raise(&err, call);
    if (option != ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM && option != ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                       "option=%u: use ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM (0) or RECOMMENDED (1)", (unsigned)option);
    if (vs_check_prop_rt(&err, &p))
        return vs_raise(&err, call);
    *granularity = vs_prop_granularity(&p);
    return ACL_SUCCESS;
}

/* ---------------------------------------------------------------- physical memory */

VS_API aclError aclrtMallocPhysical(aclrtDrvMemHandle *handle, size_t size, const aclrtPhysicalMemProp *prop,
                                    uint64_t flags)
{
    const char *call = "aclrtMallocPhysical";
    START(call);
    ACL_REQUIRE(handle != NULL, call, "handle is NULL");
    ACL_REQUIRE(prop != NULL, call, "prop is NULL: pass an aclrtPhysicalMemProp");
    ACL_REQUIRE(size != 0, call, "size is 0: allocate a positive multiple of the granularity");
    ACL_REQUIRE(flags == 0, call, "flags=%llu: reserved, must be 0", (unsigned long long)flags);
    vs_prop p = vs_prop_from(prop);
    if (vs_check_prop_acl(&err, &p, true))
        return vs_raise(&err, call);
    int device = 0;
    if (p.loc_type == ACL_MEM_LOCATION_TYPE_HOST_NUMA && vs_current_device(&err, &device))
        return vs_raise(&err, call);
    if (vs_check_prop_rt(&err, &p))
        return vs_raise(&err, call);
    size_t g = vs_prop_granularity(&p);
    if (size % g)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                       "size %zu must be a positive multiple of the granularity %zu (%zu MiB)", size, g, g >> 20);
    vs_alloc *a;
    if (vs_make_alloc(&err, size, &p, VS_VMM, &a))
        return vs_raise(&err, call);
    vs_lock();
    vs_register(a);
    vs_unlock();
    *handle = (aclrtDrvMemHandle)(uintptr_t)a->handle;
    return ACL_SUCCESS;
}

static aclError unknown_handle(uint64_t h, const char *call)
{
    return vs_fail(ACL_ERROR_RT_INVALID_HANDLE, call, "handle %#llx is not a live physical allocation of this process",
                   (unsigned long long)h);
}

VS_API aclError aclrtFreePhysical(aclrtDrvMemHandle handle)
{
    const char *call = "aclrtFreePhysical";
    START(call);
    ACL_REQUIRE(handle != NULL, call, "handle is NULL");
    vs_lock();
    vs_alloc *a = vs_allocation((uintptr_t)handle);
    if (a != NULL)
        vs_drop(a);
    vs_unlock();
    return a == NULL ? unknown_handle((uintptr_t)handle, call) : ACL_SUCCESS;
}

/* ---------------------------------------------------------------- reservations */

static const char *owned_by(enum vs_owner owner)
{
    if (owner == VS_MALLOC)
        return " (it is memory from aclrtMalloc: release it with aclrtFree)";
    if (owner == VS_IPC)
        return " (it is imported IPC memory: release it with aclrtIpcMemClose)";
    return "";
}

static aclError check_range_size(vs_err *err, size_t size)
{
    if (size > ARENA_SIZE)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID,
                      "size %zu is more than one reservation holds, %zu (8 TiB, where the runtime's drivers other "
                      "than A3's stop): reserve the size you will map, or several ranges", size, ARENA_SIZE);
    if (size == 0 || size % VS_MIN_GRANULARITY)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "size %zu must be a positive multiple of %zu (2 MiB)", size,
                      VS_MIN_GRANULARITY);
    return ACL_SUCCESS;
}

static aclError reserve(void **virPtr, size_t size, size_t alignment, void *expectPtr, uint64_t flags,
                        const char *call)
{
    START(call);
    ACL_REQUIRE(virPtr != NULL, call, "virPtr is NULL");
    ACL_REQUIRE(size != 0, call, "size is 0: reserve a positive multiple of the granularity");
    ACL_REQUIRE(flags == 0 || flags == 1, call, "flags=%llu: must be 0 (1 is accepted for compatibility and means 0)",
                (unsigned long long)flags);
    uintptr_t want = (uintptr_t)expectPtr;
    if (alignment != 0)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "alignment=%zu is out of range [0, 0]", alignment);
    if (check_range_size(&err, size))
        return vs_raise(&err, call);
    if (want % VS_MIN_GRANULARITY)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "expectPtr %#lx must be aligned to %zu (2 MiB)",
                       (unsigned long)want, VS_MIN_GRANULARITY);
    size_t align = size % VS_HUGE1G_GRANULARITY == 0 ? VS_HUGE1G_GRANULARITY : VS_MIN_GRANULARITY;
    if (vs_rt.config.cuda) /* the device's address space is the GPUs' */
        return vs_cuda_reserve(virPtr, size, align, want, call);
    vs_lock();
    uintptr_t base;
    int rc = vs_arena_reserve(size, align, want, -1, PROT_NONE, &base);
    int e = errno;
    if (rc == 0)
        vs_add_reservation(base, size, VS_VMM);
    vs_unlock();
    if (rc != 0) {
        if (want)
            return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                           "cannot reserve at expectPtr %#lx: %s; pass NULL to let the runtime choose",
                           (unsigned long)want, e == EEXIST ? "the range is in use" : strerror(e));
        return vs_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call, "cannot reserve %zu bytes of address space: %s", size,
                       strerror(e));
    }
    *virPtr = (void *)base;
    return ACL_SUCCESS;
}

VS_API aclError aclrtReserveMemAddress(void **virPtr, size_t size, size_t alignment, void *expectPtr, uint64_t flags)
{
    return reserve(virPtr, size, alignment, expectPtr, flags, "aclrtReserveMemAddress");
}

/* Host memory has no uncached (UC) kind: the range is an ordinary reservation. */
VS_API aclError aclrtReserveMemAddressNoUCMemory(void **virPtr, size_t size, size_t alignment, void *expectPtr,
                                                 uint64_t flags)
{
    return reserve(virPtr, size, alignment, expectPtr, flags, "aclrtReserveMemAddressNoUCMemory");
}

/* Release a reservation of `owner` (the lock held); 0 or an error in `err`. */
static aclError release(vs_err *err, uintptr_t ptr, enum vs_owner owner)
{
    vs_range *r = vs_reservation_exact(ptr);
    if (r == NULL || r->owner != owner)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "%#lx is not the start of a reservation of this process%s",
                      (unsigned long)ptr, owned_by(r != NULL ? r->owner : VS_VMM));
    if (vs_mappings_overlap(ptr, r->size))
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID,
                      "the reservation at %#lx still holds mappings: unmap them first (aclrtUnmapMem)", (unsigned long)ptr);
    if (r->gpu ? vs_cuda_release_range(err, ptr, r->size) != ACL_SUCCESS : munmap((void *)ptr, r->size) != 0)
        return r->gpu ? err->code : vs_set(err, ACL_ERROR_RT_INTERNAL_ERROR, "munmap: %s", strerror(errno));
    vs_remove_reservation(ptr);
    return ACL_SUCCESS;
}

VS_API aclError aclrtReleaseMemAddress(void *virPtr)
{
    const char *call = "aclrtReleaseMemAddress";
    START(call);
    ACL_REQUIRE(virPtr != NULL, call, "ptr is NULL");
    vs_lock();
    aclError rc = release(&err, (uintptr_t)virPtr, VS_VMM);
    vs_unlock();
    return rc ? vs_raise(&err, call) : ACL_SUCCESS;
}

/* ---------------------------------------------------------------- mappings */

static void advise(uintptr_t ptr, size_t size, uint64_t access)
{
    if (access && vs_rt.config.prepopulate)
        madvise((void *)ptr, size, 22 /* MADV_POPULATE_READ */);
}

/* Map an allocation over a reserved range (the lock held). */
aclError vs_map_alloc(vs_err *err, uintptr_t ptr, size_t size, vs_alloc *a, uint64_t access)
{
    if (size != a->size)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "size %zu must equal the physical allocation's size %zu", size,
                      a->size);
    vs_range *r = vs_reservation_at(ptr);
    if (r == NULL)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID,
                      "%#lx is not inside a reservation: aclrtReserveMemAddress first", (unsigned long)ptr);
    if (r->owner != a->owner)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "%#lx is not inside a reservation of aclrtReserveMemAddress%s",
                      (unsigned long)ptr, owned_by(r->owner));
    if (ptr + size > r->base + r->size || ptr + size < ptr)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "[%#lx, %#lx) runs past the reservation [%#lx, %#lx)",
                      (unsigned long)ptr, (unsigned long)(ptr + size), (unsigned long)r->base,
                      (unsigned long)(r->base + r->size));
    size_t g = vs_prop_granularity(&a->prop);
    if (ptr % g)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "ptr %#lx must be aligned to the allocation's granularity %zu",
                      (unsigned long)ptr, g);
    if (vs_mappings_overlap(ptr, size))
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID,
                      "[%#lx, %#lx) overlaps an existing mapping: aclrtUnmapMem it first", (unsigned long)ptr,
                      (unsigned long)(ptr + size));
    if (a->remote != NULL) { /* another server's memory: the range only stands for it, and stays inaccessible */
        vs_add_mapping(ptr, size, a, access);
        return ACL_SUCCESS;
    }
    if (a->gpu != NULL || r->gpu) { /* GPU memory, or a GPU range: the driver maps (both must be GPU) */
        if (vs_cuda_map(err, ptr, size, a, r, access))
            return err->code;
    } else if (mmap((void *)ptr, size, vs_prot_of(access), MAP_SHARED | MAP_FIXED, a->fd, 0) == MAP_FAILED)
        return vs_set(err, ACL_ERROR_RT_MEMORY_ALLOCATION, "cannot map %zu bytes at %#lx: %s", size,
                      (unsigned long)ptr, strerror(errno));
    else
        advise(ptr, size, access); /* host pages only: GPU memory is no page the CPU faults in (as backends.cuda) */
    vs_add_mapping(ptr, size, a, access);
    return ACL_SUCCESS;
}

/* Reserve a range of the allocation's size and map it there in one system call (aclrtMalloc blocks, IPC imports). */
aclError vs_map_new(vs_err *err, vs_alloc *a, uint64_t access, enum vs_owner owner, uintptr_t *out)
{
    if (check_range_size(err, a->size))
        return err->code;
    if (a->gpu != NULL) /* GPU memory: reserved and mapped by the driver */
        return vs_cuda_map_new(err, a, access, owner, out);
    size_t align = a->size % VS_HUGE1G_GRANULARITY == 0 ? VS_HUGE1G_GRANULARITY : VS_MIN_GRANULARITY;
    uintptr_t ptr;
    if (vs_arena_reserve(a->size, align, 0, a->fd, vs_prot_of(access), &ptr) != 0)
        return vs_set(err, ACL_ERROR_RT_MEMORY_ALLOCATION, "cannot reserve and map %zu bytes: %s", a->size,
                      strerror(errno));
    advise(ptr, a->size, access);
    vs_add_reservation(ptr, a->size, owner);
    vs_add_mapping(ptr, a->size, a, access);
    *out = ptr;
    return ACL_SUCCESS;
}

/* Undo vs_map_new: one munmap drops the mapping with its reservation (the lock held). */
aclError vs_unmap_release(vs_err *err, uintptr_t ptr, enum vs_owner owner)
{
    vs_mapping *m = vs_mapping_exact(ptr);
    vs_range *r = vs_reservation_exact(ptr);
    if (m == NULL || r == NULL || m->size != r->size || r->owner != owner || m->alloc->owner != owner)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "%#lx is not the start of a mapping of this process",
                      (unsigned long)ptr);
    vs_alloc *a = m->alloc;
    if (r->gpu) { /* the driver's two steps */
        if (vs_cuda_unmap(err, ptr, r->size) || vs_cuda_release_range(err, ptr, r->size))
            return err->code;
    } else if (munmap((void *)ptr, r->size) != 0)
        return vs_set(err, ACL_ERROR_RT_INTERNAL_ERROR, "cannot unmap %#lx: %s", (unsigned long)ptr, strerror(errno));
    vs_remove_mapping(ptr);
    vs_remove_reservation(ptr);
    vs_maybe_destroy(a);
    return ACL_SUCCESS;
}

static aclError map(void *virPtr, size_t size, size_t offset, aclrtDrvMemHandle handle, uint64_t flags,
                    uint64_t access, const char *call)
{
    START(call);
    ACL_REQUIRE(virPtr != NULL, call, "ptr is NULL");
    ACL_REQUIRE(handle != NULL, call, "handle is NULL");
    ACL_REQUIRE(size != 0, call, "size is 0: map the allocation's whole size");
    ACL_REQUIRE(flags == 0, call, "flags=%llu: reserved, must be 0", (unsigned long long)flags);
    if (offset != 0)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "offset=%zu is out of range [0, 0]", offset);
    vs_lock();
    vs_alloc *a = vs_allocation((uintptr_t)handle);
    aclError rc = a == NULL ? unknown_handle((uintptr_t)handle, call) : ACL_SUCCESS;
    if (a != NULL && vs_map_alloc(&err, (uintptr_t)virPtr, size, a, access))
        rc = vs_raise(&err, call);
    vs_unlock();
    return rc;
}

VS_API aclError aclrtMapMem(void *virPtr, size_t size, size_t offset, aclrtDrvMemHandle handle, uint64_t flags)
{
    return map(virPtr, size, offset, handle, flags, ACL_RT_MEM_ACCESS_FLAGS_READWRITE, "aclrtMapMem");
}

VS_API aclError aclrtMemMapNoAccess(void *virPtr, size_t size, size_t offset, aclrtDrvMemHandle handle,
                                    uint64_t flags)
{
    return map(virPtr, size, offset, handle, flags, ACL_RT_MEM_ACCESS_FLAGS_NONE, "aclrtMemMapNoAccess");
}

VS_API aclError aclrtUnmapMem(void *virPtr)
{
    const char *call = "aclrtUnmapMem";
    START(call);
    ACL_REQUIRE(virPtr != NULL, call, "ptr is NULL");
    uintptr_t ptr = (uintptr_t)virPtr;
    vs_lock();
    aclError rc = ACL_SUCCESS;
    vs_mapping *m = vs_mapping_exact(ptr);
    if (m == NULL || m->alloc->owner != VS_VMM) {
        rc = vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "%#lx is not the start of a mapping (aclrtMapMem made none "
                     "there)%s", (unsigned long)ptr, owned_by(m != NULL ? m->alloc->owner : VS_VMM));
    } else {
        vs_alloc *a = m->alloc;
        size_t size = m->size;
        if (a->remote != NULL) { /* another server's memory: the range never changed */
            vs_remove_mapping(ptr);
            vs_maybe_destroy(a);
        } else if (a->gpu != NULL) { /* GPU memory: the driver unmaps, the range stays reserved */
            if (vs_cuda_unmap(&err, ptr, size))
                rc = vs_raise(&err, call);
            else {
                vs_remove_mapping(ptr);
                vs_maybe_destroy(a);
            }
        } else if (mmap((void *)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) ==
            MAP_FAILED) {
            rc = vs_fail(ACL_ERROR_RT_INTERNAL_ERROR, call, "cannot unmap %#lx: %s", (unsigned long)ptr,
                         strerror(errno));
        } else {
            vs_remove_mapping(ptr);
            vs_maybe_destroy(a);
        }
    }
    vs_unlock();
    return rc;
}

/* ---------------------------------------------------------------- access */

/* A location's checks (props.check_location, then the device's existence). */
static aclError check_location(vs_err *err, uint32_t type, int64_t id, const char *where)
{
    if (type > ACL_MEM_LOCATION_TYPE_HOST_NUMA)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "%s.type=%u is not an aclrtMemLocationType", where, type);
    if (type != ACL_MEM_LOCATION_TYPE_DEVICE && (id < 0 || id > INT32_MAX))
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "%s.id=%lld is out of range [0, %d]", where, (long long)id,
                      INT32_MAX);
    return ACL_SUCCESS;
}

static int64_t loc_id(const aclrtMemLocation *loc)
{
    return loc->type == ACL_MEM_LOCATION_TYPE_DEVICE ? (int64_t)(int32_t)loc->id : (int64_t)loc->id;
}

VS_API aclError aclrtMemSetAccess(void *virPtr, size_t size, aclrtMemAccessDesc *desc, size_t count)
{
    const char *call = "aclrtMemSetAccess";
    START(call);
    if (desc == NULL || count == 0)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                       "desc must be a non-empty array of aclrtMemAccessDesc (count %zu)", count);
    char where[48];
    for (size_t i = 0; i < count; i++) {
        uint32_t f = (uint32_t)desc[i].flags;
        if (f != ACL_RT_MEM_ACCESS_FLAGS_NONE && f != ACL_RT_MEM_ACCESS_FLAGS_READ &&
            f != ACL_RT_MEM_ACCESS_FLAGS_READWRITE)
            return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "desc[%zu].flags=%u: use ACL_RT_MEM_ACCESS_FLAGS_* (0, 1, 3)",
                           i, f);
        snprintf(where, sizeof where, "desc[%zu].location", i);
        if (check_location(&err, (uint32_t)desc[i].location.type, loc_id(&desc[i].location), where))
            return vs_raise(&err, call);
    }
    for (size_t i = 0; i < count; i++)
        if (desc[i].location.type == ACL_MEM_LOCATION_TYPE_DEVICE && vs_device_id(&err, loc_id(&desc[i].location)))
            return vs_raise(&err, call);
    uintptr_t ptr = (uintptr_t)virPtr;
    vs_lock();
    aclError rc = ACL_SUCCESS;
    vs_mapping *m = vs_mapping_exact(ptr);
    if (m == NULL || m->size != size || m->alloc->owner != VS_VMM) {
        rc = vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "(%#lx, %zu) is not exactly a mapping: pass aclrtMapMem's ptr "
                     "and size%s", (unsigned long)ptr, size, owned_by(m != NULL ? m->alloc->owner : VS_VMM));
        goto out;
    }
    vs_access *table = malloc(sizeof(vs_access) * (m->naccess + count));
    if (table == NULL) {
        rc = vs_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call, "out of memory");
        goto out;
    }
    size_t n = m->naccess;
    if (n)
        memcpy(table, m->access, sizeof(vs_access) * n);
    for (size_t i = 0; i < count; i++) {
        uint32_t t = (uint32_t)desc[i].location.type;
        int64_t id = loc_id(&desc[i].location);
        size_t k = 0;
        while (k < n && !(table[k].loc_type == t && table[k].loc_id == id))
            k++;
        if (k == n)
            n++;
        table[k].loc_type = t;
        table[k].loc_id = id;
        table[k].flags = (uint64_t)desc[i].flags;
    }
    uint64_t effective = (uint64_t)desc[count - 1].flags;
    for (size_t k = 0; k < n; k++)
        if (table[k].loc_type == m->alloc->prop.loc_type && table[k].loc_id == m->alloc->prop.loc_id)
            effective = table[k].flags;
    if (m->alloc->gpu != NULL && vs_cuda_protect(&err, ptr, size, m->alloc, effective)) { /* GPU: the driver's */
        free(table);
        rc = vs_raise(&err, call);
        goto out;
    }
    if (m->alloc->gpu == NULL && m->alloc->remote == NULL && mprotect((void *)ptr, size, vs_prot_of(effective)) != 0) {
        free(table);
        rc = vs_fail(ACL_ERROR_RT_INTERNAL_ERROR, call, "mprotect failed: %s", strerror(errno));
        goto out;
    }
    free(m->access);
    m->access = table;
    m->naccess = n;
    m->effective = effective;
out:
    vs_unlock();
    return rc;
}

VS_API aclError aclrtMemGetAccess(void *virPtr, aclrtMemLocation *location, uint64_t *flags)
{
    const char *call = "aclrtMemGetAccess";
    START(call);
    ACL_REQUIRE(virPtr != NULL, call, "ptr is NULL");
    ACL_REQUIRE(location != NULL, call, "location is NULL: pass an aclrtMemLocation");
    ACL_REQUIRE(flags != NULL, call, "flags is NULL");
    uint32_t t = (uint32_t)location->type;
    int64_t id = loc_id(location);
    if (check_location(&err, t, id, "location"))
        return vs_raise(&err, call);
    if (t == ACL_MEM_LOCATION_TYPE_DEVICE && vs_device_id(&err, id))
        return vs_raise(&err, call);
    vs_lock();
    vs_mapping *m = vs_mapping_at((uintptr_t)virPtr);
    aclError rc = ACL_SUCCESS;
    if (m == NULL || m->alloc->owner != VS_VMM) {
        rc = vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "%#lx is not inside a mapping of this process%s",
                     (unsigned long)(uintptr_t)virPtr, owned_by(m != NULL ? m->alloc->owner : VS_VMM));
    } else {
        uint64_t got = m->effective;
        for (size_t k = 0; k < m->naccess; k++)
            if (m->access[k].loc_type == t && m->access[k].loc_id == id)
                got = m->access[k].flags;
        *flags = got;
    }
    vs_unlock();
    return rc;
}

/* ---------------------------------------------------------------- handles of mapped memory */

VS_API aclError aclrtMemRetainAllocationHandle(void *virPtr, aclrtDrvMemHandle *handle)
{
    const char *call = "aclrtMemRetainAllocationHandle";
    START(call);
    ACL_REQUIRE(virPtr != NULL, call, "ptr is NULL");
    ACL_REQUIRE(handle != NULL, call, "handle is NULL");
    vs_lock();
    vs_mapping *m = vs_mapping_at((uintptr_t)virPtr);
    aclError rc = ACL_SUCCESS;
    if (m == NULL || m->alloc->owner != VS_VMM) {
        rc = vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "%#lx is not inside an aclrtMapMem mapping%s",
                     (unsigned long)(uintptr_t)virPtr, owned_by(m != NULL ? m->alloc->owner : VS_VMM));
    } else {
        vs_alloc *a = m->alloc;
        if (a->refs == 0)
            a->registered = true;
        a->refs++;
        *handle = (aclrtDrvMemHandle)(uintptr_t)a->handle;
    }
    vs_unlock();
    return rc;
}

VS_API aclError aclrtMemGetAllocationPropertiesFromHandle(aclrtDrvMemHandle handle, aclrtPhysicalMemProp *prop)
{
    const char *call = "aclrtMemGetAllocationPropertiesFromHandle";
    START(call);
    ACL_REQUIRE(handle != NULL, call, "handle is NULL");
    ACL_REQUIRE(prop != NULL, call, "prop is NULL");
    vs_lock();
    vs_alloc *a = vs_allocation((uintptr_t)handle);
    if (a != NULL) {
        memset(prop, 0, sizeof *prop);
        prop->handleType = ACL_MEM_HANDLE_TYPE_NONE;
        prop->allocationType = ACL_MEM_ALLOCATION_TYPE_PINNED;
        prop->memAttr = (aclrtMemAttr)vs_reported_attr(&a->prop);
        prop->location.type = (aclrtMemLocationType)a->prop.loc_type;
        prop->location.id = (uint32_t)a->prop.loc_id;
        prop->reserve = 0;
    }
    vs_unlock();
    return a == NULL ? unknown_handle((uintptr_t)handle, call) : ACL_SUCCESS;
}

VS_API aclError aclrtMemGetAddressRange(void *ptr, void **pbase, size_t *psize)
{
    const char *call = "aclrtMemGetAddressRange";
    START(call);
    ACL_REQUIRE(ptr != NULL, call, "ptr is NULL");
    ACL_REQUIRE(pbase != NULL, call, "pbase is NULL");
    ACL_REQUIRE(psize != NULL, call, "psize is NULL");
    vs_lock();
    vs_mapping *m = vs_mapping_at((uintptr_t)ptr);
    if (m != NULL) {
        *pbase = (void *)m->ptr;
        *psize = m->size;
    }
    vs_unlock();
    if (m == NULL)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "%#lx is not inside a mapping of this process",
                       (unsigned long)(uintptr_t)ptr);
    return ACL_SUCCESS;
}
