/*
 * What a pointer is (aclrtPointerGetAttributes), host memory registered for the device (aclrtHostRegister and its
 * kin) and batches of copies between host and device memory (aclrtMemcpyBatch), as vmmshare.runtime.pointers has
 * them: a mapping says its allocation's location and page size, an aclrtMallocHost block or a registered range is
 * host memory, and any other address is ordinary host memory the runtime did not make (UNREGISTERED). On host
 * memory the device reaches registered memory at its own address.
 */
#include <stdio.h>
#include <string.h>

#include "vs.h"

#define PAGE 4096u
#define MAX_BATCH 4096 /* copies in one batch, as the driver takes them */
#define REGISTER_FLAGS (ACL_HOST_REGISTER_IOMEMORY | ACL_HOST_REGISTER_READONLY)

static bool huge_2m(uint32_t attr)
{
    return attr == ACL_DDR_MEM_HUGE || attr == ACL_HBM_MEM_HUGE || attr == ACL_DDR_MEM_P2P_HUGE ||
           attr == ACL_HBM_MEM_P2P_HUGE || attr == ACL_MEM_HUGE || attr == ACL_MEM_P2P_HUGE;
}

static vs_hostblock *range_at(vs_vec *v, uintptr_t ptr)
{
    for (size_t i = 0; i < v->count; i++) {
        vs_hostblock *b = &VS_AT(*v, vs_hostblock, i);
        if (b->ptr <= ptr && ptr - b->ptr < b->size)
            return b;
    }
    return NULL;
}

/* Where `ptr` lives: its location type and id and its page size (the lock held); 107000 for a reserved range with
 * nothing mapped there. */
static aclError locate(vs_err *err, uintptr_t ptr, uint32_t *type, uint32_t *id, uint32_t *page)
{
    vs_mapping *m = vs_mapping_at(ptr);
    *id = 0;
    *page = PAGE;
    if (m != NULL) {
        const vs_prop *p = &m->alloc->prop;
        if (vs_prop_granularity(p) == VS_HUGE1G_GRANULARITY)
            *page = (uint32_t)VS_HUGE1G_GRANULARITY;
        else if (huge_2m(p->mem_attr))
            *page = (uint32_t)VS_MIN_GRANULARITY;
        *type = p->loc_type == ACL_MEM_LOCATION_TYPE_DEVICE ? ACL_MEM_LOCATION_TYPE_DEVICE : ACL_MEM_LOCATION_TYPE_HOST;
        if (p->loc_type == ACL_MEM_LOCATION_TYPE_DEVICE)
            *id = (uint32_t)p->loc_id;
        return ACL_SUCCESS;
    }
    if (vs_reservation_at(ptr) != NULL)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "%#lx is reserved but not mapped: it has no memory to describe",
                      (unsigned long)ptr);
    if (range_at(&vs_rt.host_blocks, ptr) != NULL || range_at(&vs_rt.registered, ptr) != NULL)
        *type = ACL_MEM_LOCATION_TYPE_HOST;
    else
        *type = ACL_MEM_LOCATION_TYPE_UNREGISTERED;
    return ACL_SUCCESS;
}

VS_API aclError aclrtPointerGetAttributes(const void *ptr, aclrtPtrAttributes *attributes)
{
    const char *call = "aclrtPointerGetAttributes";
    START(call);
    ACL_REQUIRE(ptr != NULL, call, "ptr is NULL");
    ACL_REQUIRE(attributes != NULL, call, "attributes is NULL");
    uint32_t type, id, page;
    vs_lock();
    aclError rc = locate(&err, (uintptr_t)ptr, &type, &id, &page);
    vs_unlock();
    if (rc)
        return vs_raise(&err, call);
    memset(attributes, 0, sizeof *attributes);
    attributes->location.type = (aclrtMemLocationType)type;
    attributes->location.id = id;
    attributes->pageSize = page;
    return ACL_SUCCESS;
}

/* ---------------------------------------------------------------- host registration */

VS_API aclError aclrtHostRegister(void *ptr, uint64_t size, aclrtHostRegisterType type, void **devPtr)
{
    const char *call = "aclrtHostRegister";
    START(call);
    ACL_REQUIRE(ptr != NULL, call, "ptr is NULL");
    ACL_REQUIRE(size != 0, call, "size is 0");
    ACL_REQUIRE(devPtr != NULL, call, "devPtr is NULL");
    uint32_t flags = (uint32_t)type;
    if (flags & ~(uint32_t)REGISTER_FLAGS)
        return vs_fail(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, call, "type=%#x is not supported: use "
                       "ACL_HOST_REGISTER_MAPPED (0), or IOMEMORY (0x4) and READONLY (0x8) combined", flags);
    int device;
    if (vs_current_device(&err, &device))
        return vs_raise(&err, call);
    if (vs_rt.config.cuda) /* as the Python runtime under the CUDA backend */
        return vs_fail(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, call, "the CUDA backend's GPUs do not map registered host "
                       "memory: use aclrtMallocHost memory and copies");
    uintptr_t p = (uintptr_t)ptr;
    bool write = !(flags & ACL_HOST_REGISTER_READONLY);
    if (size > UINTPTR_MAX - p || !vs_process_range_ok(p, (size_t)size, write))
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "%#lx+%llu is not %s memory of this process",
                       (unsigned long)p, (unsigned long long)size, write ? "writable" : "readable");
    vs_lock();
    aclError rc = ACL_SUCCESS;
    for (size_t i = 0; i < vs_rt.registered.count && rc == ACL_SUCCESS; i++) {
        vs_hostblock *b = &VS_AT(vs_rt.registered, vs_hostblock, i);
        if (b->ptr < p + size && p < b->ptr + b->size)
            rc = vs_fail(ACL_ERROR_HOST_MEMORY_ALREADY_REGISTERED, call, "%#lx+%llu overlaps a range registered "
                         "already: aclrtHostUnregister it first", (unsigned long)p, (unsigned long long)size);
    }
    if (rc == ACL_SUCCESS) {
        vs_hostblock *b = vs_vec_push(&vs_rt.registered, sizeof(vs_hostblock));
        b->ptr = p;
        b->size = (size_t)size;
        *devPtr = ptr;
    }
    vs_unlock();
    return rc;
}

VS_API aclError aclrtHostUnregister(void *ptr)
{
    const char *call = "aclrtHostUnregister";
    START(call);
    ACL_REQUIRE(ptr != NULL, call, "ptr is NULL");
    int device;
    if (vs_current_device(&err, &device))
        return vs_raise(&err, call);
    vs_lock();
    aclError rc = vs_fail(ACL_ERROR_HOST_MEMORY_NOT_REGISTERED, call, "%#lx is not the start of a registered host range",
                          (unsigned long)(uintptr_t)ptr);
    for (size_t i = 0; i < vs_rt.registered.count; i++)
        if (VS_AT(vs_rt.registered, vs_hostblock, i).ptr == (uintptr_t)ptr) {
            vs_vec_remove(&vs_rt.registered, i);
            rc = ACL_SUCCESS;
            break;
        }
    vs_unlock();
    return rc;
}

VS_API aclError aclrtHostGetDevicePointer(void *pHost, void **pDevice, uint32_t flag)
{
    const char *call = "aclrtHostGetDevicePointer";
    START(call);
    ACL_REQUIRE(pHost != NULL, call, "pHost is NULL");
    ACL_REQUIRE(pDevice != NULL, call, "pDevice is NULL");
    ACL_REQUIRE(flag == 0, call, "flag=%u: reserved, must be 0", flag);
    int device;
    if (vs_current_device(&err, &device))
        return vs_raise(&err, call);
    vs_lock();
    bool found = false;
    for (size_t i = 0; i < vs_rt.registered.count; i++)
        found |= VS_AT(vs_rt.registered, vs_hostblock, i).ptr == (uintptr_t)pHost;
    vs_unlock();
    if (!found)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "%#lx has not been registered for device address mapping "
                       "(pass the pointer aclrtHostRegister took)", (unsigned long)(uintptr_t)pHost);
    *pDevice = pHost;
    return ACL_SUCCESS;
}

/* ---------------------------------------------------------------- batched copies */

static const char *where(uint32_t type, uint32_t id, char *buf, size_t cap)
{
    if (type == ACL_MEM_LOCATION_TYPE_DEVICE)
        snprintf(buf, cap, "device %u", id);
    else if (type == ACL_MEM_LOCATION_TYPE_HOST)
        snprintf(buf, cap, "host");
    else
        snprintf(buf, cap, "location type %u", type);
    return buf;
}

/* One side of a pair checked against its attribute (unregistered host memory counts as host); the lock held. */
static aclError side(vs_err *err, uintptr_t ptr, const char *name, const aclrtMemLocation *want, uint32_t *type)
{
    uint32_t t, id, page;
    if (locate(err, ptr, &t, &id, &page))
        return err->code;
    if (t == ACL_MEM_LOCATION_TYPE_UNREGISTERED)
        t = ACL_MEM_LOCATION_TYPE_HOST;
    uint32_t wt = want->type == ACL_MEM_LOCATION_TYPE_HOST_NUMA ? ACL_MEM_LOCATION_TYPE_HOST : (uint32_t)want->type;
    if (t != wt || (t == ACL_MEM_LOCATION_TYPE_DEVICE && id != want->id)) {
        char a[32], b[32];
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "%s %#lx is %s memory, but its attribute says %s", name,
                      (unsigned long)ptr, where(t, id, a, sizeof a), where(wt, want->id, b, sizeof b));
    }
    *type = t;
    return ACL_SUCCESS;
}

VS_API aclError aclrtMemcpyBatch(void **dsts, size_t *destMaxs, void **srcs, size_t *sizes, size_t numBatches,
                                 aclrtMemcpyBatchAttr *attrs, size_t *attrsIndexes, size_t numAttrs,
                                 size_t *failIndex)
{
    const char *call = "aclrtMemcpyBatch";
    START(call);
    ACL_REQUIRE(failIndex != NULL, call, "failIndex is NULL");
    *failIndex = SIZE_MAX;
    ACL_REQUIRE(sizes != NULL, call, "sizes is NULL");
    ACL_REQUIRE(numBatches != 0, call, "numBatches is 0");
    bool any = false;
    for (size_t i = 0; i < numBatches && !any; i++)
        any = sizes[i] != 0;
    if (!any)
        return ACL_SUCCESS; /* nothing to copy succeeds before any other check */
    ACL_REQUIRE(dsts != NULL, call, "dsts is NULL");
    ACL_REQUIRE(destMaxs != NULL, call, "destMaxs is NULL");
    ACL_REQUIRE(srcs != NULL, call, "srcs is NULL");
    ACL_REQUIRE(attrs != NULL, call, "attrs is NULL");
    ACL_REQUIRE(attrsIndexes != NULL, call, "attrsIndexes is NULL");
    for (size_t i = 0; i < numBatches; i++)
        ACL_REQUIRE(destMaxs[i] >= sizes[i], call, "sizes[%zu]=%zu exceeds destMaxs[%zu]=%zu", i, sizes[i], i,
                    destMaxs[i]);
    if (numAttrs == 0)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "numAttrs is 0");
    if (numAttrs > numBatches)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "numAttrs %zu must be less than or equal to count %zu",
                       numAttrs, numBatches);
    if (numBatches > MAX_BATCH)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "count %zu must be less than or equal to %d", numBatches,
                       MAX_BATCH);
    for (size_t i = 0; i < numAttrs; i++)
        for (int k = 0; k < 16; k++)
            ACL_REQUIRE(attrs[i].rsv[k] == 0, call, "attrs[%zu].rsv must be 0", i);
    if (attrsIndexes[0] != 0)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "attrsIndexes[0] is %zu: it must be 0", attrsIndexes[0]);
    for (size_t i = 1; i < numAttrs; i++) {
        if (attrsIndexes[i] <= attrsIndexes[i - 1])
            return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "attrsIndexes[%zu] (%zu) must be greater than "
                           "attrsIndexes[%zu]", i, attrsIndexes[i], i - 1);
        if (attrsIndexes[i] >= numBatches)
            return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "attrsIndexes[%zu] (%zu) must be less than count %zu",
                           i, attrsIndexes[i], numBatches);
    }
    vs_lock();
    aclError rc = ACL_SUCCESS;
    size_t which = 0;
    for (size_t i = 0; i < numBatches && rc == ACL_SUCCESS; i++) {
        if (which + 1 < numAttrs && i >= attrsIndexes[which + 1])
            which++;
        uint32_t dt = 0, st = 0;
        rc = side(&err, (uintptr_t)dsts[i], "dst", &attrs[which].dstLoc, &dt);
        if (rc == ACL_SUCCESS)
            rc = side(&err, (uintptr_t)srcs[i], "src", &attrs[which].srcLoc, &st);
        if (rc == ACL_SUCCESS && dt == st)
            rc = vs_set(&err, ACL_ERROR_RT_PARAM_INVALID, "only host-to-device and device-to-host copies are "
                        "batched; this one is %s to %s", st == ACL_MEM_LOCATION_TYPE_DEVICE ? "device" : "host",
                        dt == ACL_MEM_LOCATION_TYPE_DEVICE ? "device" : "host");
        if (rc) {
            *failIndex = i;
            vs_unlock();
            return vs_fail(rc, call, "pair %zu: %s", i, err.message);
        }
    }
    vs_unlock(); /* each copy checks its pair again under the lock, and moves bytes of another server outside it
                    (held here, the recursive lock would stay held through a stalled engine's transfer) */
    for (size_t i = 0; i < numBatches; i++) {
        if (sizes[i] == 0)
            continue;
        if (vs_memcpy(&err, dsts[i], sizes[i], srcs[i], sizes[i], ACL_MEMCPY_DEFAULT)) {
            *failIndex = i;
            return vs_fail(err.code, call, "pair %zu: %s", i, err.message);
        }
    }
    return ACL_SUCCESS;
}
