/*
 * Programs that bind the runtime at run time: dlopen("libascendcl.so") and dlsym of the calls a caching allocator
 * looks up by name, then a share through those pointers alone. Not linked against the library.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "acl/acl.h"

static const char *const NAMES[] = {
    "aclrtReserveMemAddress", "aclrtReleaseMemAddress", "aclrtMallocPhysical", "aclrtFreePhysical", "aclrtMapMem",
    "aclrtUnmapMem", "aclrtMemExportToShareableHandle", "aclrtMemImportFromShareableHandle",
    "aclrtMemSetPidToShareableHandle", "aclrtIpcMemGetExportKey", "aclrtIpcMemSetImportPid",
    "aclrtIpcMemImportByKey", "aclrtIpcMemClose", "aclrtDeviceGetBareTgid", "aclGetRecentErrMsg",
    "aclrtMemRetainAllocationHandle", "aclrtMemGetAddressRange", "aclrtReserveMemAddressNoUCMemory",
    "aclrtGetSocName", "aclrtPointerGetAttributes", "aclrtSetDevice", "aclrtCreateEvent",
};

int main(int argc, char **argv)
{
    const char *name = argc > 1 ? argv[1] : "libascendcl.so";
    void *lib = dlopen(name, RTLD_LAZY | RTLD_GLOBAL);
    if (lib == NULL) {
        printf("dlopen %s: %s\n", name, dlerror());
        return 1;
    }
    for (size_t i = 0; i < sizeof NAMES / sizeof NAMES[0]; i++)
        if (dlsym(lib, NAMES[i]) == NULL) {
            printf("missing %s\n", NAMES[i]);
            return 1;
        }
    if (dlsym(lib, "vs_start") != NULL || dlsym(lib, "vs_rt") != NULL) {
        printf("the library exports its internals\n");
        return 1;
    }
    aclError (*set_device)(int32_t) = (aclError(*)(int32_t))dlsym(lib, "aclrtSetDevice");
    aclError (*malloc_physical)(aclrtDrvMemHandle *, size_t, const aclrtPhysicalMemProp *, uint64_t) =
        (aclError(*)(aclrtDrvMemHandle *, size_t, const aclrtPhysicalMemProp *, uint64_t))dlsym(lib, "aclrtMallocPhysical");
    aclError (*export_v1)(aclrtDrvMemHandle, aclrtMemHandleType, uint64_t, uint64_t *) =
        (aclError(*)(aclrtDrvMemHandle, aclrtMemHandleType, uint64_t, uint64_t *))dlsym(
            lib, "aclrtMemExportToShareableHandle");
    aclError (*free_physical)(aclrtDrvMemHandle) = (aclError(*)(aclrtDrvMemHandle))dlsym(lib, "aclrtFreePhysical");
    const char *(*message)(void) = (const char *(*)(void))dlsym(lib, "aclGetRecentErrMsg");
    aclrtPhysicalMemProp prop;
    memset(&prop, 0, sizeof prop);
    prop.memAttr = ACL_HBM_MEM_HUGE;
    prop.location.type = ACL_MEM_LOCATION_TYPE_DEVICE;
    aclrtDrvMemHandle h;
    uint64_t shareable;
    if (set_device(0) || malloc_physical(&h, 2 << 20, &prop, 0) || export_v1(h, ACL_MEM_HANDLE_TYPE_NONE, 0, &shareable) ||
        free_physical(h)) {
        printf("a call through dlsym failed: %s\n", message());
        return 1;
    }
    printf("dlsym ok, shared %llx\n", (unsigned long long)shareable);
    return 0;
}
