/*
 * Reserve a range, map physical memory into it, export it, import it again in the same process (a second handle
 * to the same memory) and map that too: both mappings show the same bytes. Written for vmmshare from the runtime's
 * API documentation; built by CMakeLists.txt from ASCEND_HOME_PATH.
 */
#include <stdio.h>
#include <string.h>

#include "acl/acl.h"

#define SIZE ((size_t)2 << 20)
#define CHECK(call)                                                                          \
    do {                                                                                     \
        aclError rc_ = (call);                                                               \
        if (rc_ != ACL_SUCCESS) {                                                            \
            fprintf(stderr, "%s failed: %d: %s\n", #call, rc_, aclGetRecentErrMsg());        \
            return 1;                                                                        \
        }                                                                                    \
    } while (0)

int main(void)
{
    CHECK(aclInit(NULL));
    CHECK(aclrtSetDevice(0));
    aclrtPhysicalMemProp prop;
    memset(&prop, 0, sizeof prop);
    prop.memAttr = ACL_HBM_MEM_HUGE;
    prop.location.type = ACL_MEM_LOCATION_TYPE_DEVICE;
    size_t granularity;
    CHECK(aclrtMemGetAllocationGranularity(&prop, ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM, &granularity));
    aclrtDrvMemHandle handle, again;
    CHECK(aclrtMallocPhysical(&handle, SIZE, &prop, 0));
    uint64_t shareable;
    CHECK(aclrtMemExportToShareableHandleV2(handle, ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION,
                                           ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, &shareable));
    CHECK(aclrtMemImportFromShareableHandleV2(&shareable, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, 0, &again));
    void *a, *b;
    CHECK(aclrtReserveMemAddress(&a, SIZE, 0, NULL, 0));
    CHECK(aclrtReserveMemAddress(&b, SIZE, 0, NULL, 0));
    CHECK(aclrtMapMem(a, SIZE, 0, handle, 0));
    CHECK(aclrtMapMem(b, SIZE, 0, again, 0));
    strcpy((char *)a, "written through the first mapping");
    printf("granularity %zu, %s: %s\n", granularity, aclrtGetSocName(), (const char *)b);
    int same = strcmp((const char *)a, (const char *)b) == 0;
    CHECK(aclrtUnmapMem(a));
    CHECK(aclrtUnmapMem(b));
    CHECK(aclrtReleaseMemAddress(a));
    CHECK(aclrtReleaseMemAddress(b));
    CHECK(aclrtFreePhysical(again));
    CHECK(aclrtFreePhysical(handle));
    CHECK(aclrtResetDevice(0));
    CHECK(aclFinalize());
    return same ? 0 : 1;
}
