/*
 * Share 2 MiB between two C processes with a trustlist: the exporter allocates, maps and fills memory, exports it
 * as a DEFAULT shareable handle (a uint64_t, copied by value), forks an importer and lets exactly that process in.
 * Written for vmmshare from the runtime's API documentation.
 *
 *   cc share_with_trustlist.c $(pkg-config --cflags --libs ascendcl) -o share && ./share
 *   (after: source "$(vmmshare prefix)/set_env.sh")
 */
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

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

/* The importer: waits for the handle, imports, maps and reads the exporter's bytes, and writes one back. */
static int importer(int from_exporter, int to_exporter)
{
    uint64_t shareable;
    if (read(from_exporter, &shareable, sizeof shareable) != (ssize_t)sizeof shareable)
        return 1;
    CHECK(aclrtSetDevice(0));
    aclrtDrvMemHandle handle;
    CHECK(aclrtMemImportFromShareableHandleV2(&shareable, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, 0, &handle));
    void *ptr;
    CHECK(aclrtReserveMemAddress(&ptr, SIZE, 0, NULL, 0));
    CHECK(aclrtMapMem(ptr, SIZE, 0, handle, 0));
    unsigned char *bytes = ptr;
    printf("importer %d sees 0x%02x at the end of the exporter's memory\n", (int)getpid(), bytes[SIZE - 1]);
    fflush(stdout);
    bytes[0] = 0x77;
    CHECK(aclrtUnmapMem(ptr));
    CHECK(aclrtReleaseMemAddress(ptr));
    CHECK(aclrtFreePhysical(handle));
    CHECK(aclrtResetDevice(0));
    return write(to_exporter, "y", 1) == 1 ? 0 : 1;
}

int main(void)
{
    CHECK(aclInit(NULL));
    CHECK(aclrtSetDevice(0));
    aclrtPhysicalMemProp prop;
    memset(&prop, 0, sizeof prop);
    prop.handleType = ACL_MEM_HANDLE_TYPE_NONE;
    prop.allocationType = ACL_MEM_ALLOCATION_TYPE_PINNED;
    prop.memAttr = ACL_HBM_MEM_HUGE;
    prop.location.type = ACL_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    aclrtDrvMemHandle handle;
    CHECK(aclrtMallocPhysical(&handle, SIZE, &prop, 0));
    void *ptr;
    CHECK(aclrtReserveMemAddress(&ptr, SIZE, 0, NULL, 0));
    CHECK(aclrtMapMem(ptr, SIZE, 0, handle, 0));
    memset(ptr, 0x5A, SIZE);
    uint64_t shareable;
    CHECK(aclrtMemExportToShareableHandleV2(handle, ACL_RT_VMM_EXPORT_FLAG_DEFAULT, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT,
                                           &shareable));

    int to_importer[2], from_importer[2];
    if (pipe(to_importer) != 0 || pipe(from_importer) != 0)
        return 1;
    fflush(stdout);
    pid_t child = fork();
    if (child == 0)
        _exit(importer(to_importer[0], from_importer[1]));
    int32_t pid;
    CHECK(aclrtDeviceGetBareTgid(&pid));
    int32_t trusted = child; /* (in a container, the importer would send its aclrtDeviceGetBareTgid) */
    CHECK(aclrtMemSetPidToShareableHandleV2(&shareable, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, &trusted, 1));
    if (write(to_importer[1], &shareable, sizeof shareable) != (ssize_t)sizeof shareable)
        return 1;
    char done = 'n';
    if (read(from_importer[0], &done, 1) != 1)
        done = 'n';
    int status = 1;
    waitpid(child, &status, 0);
    printf("exporter %d: handle %#llx, importer %s, first byte now 0x%02x\n", (int)pid,
           (unsigned long long)shareable, done == 'y' ? "done" : "failed", ((unsigned char *)ptr)[0]);
    int good = done == 'y' && WIFEXITED(status) && WEXITSTATUS(status) == 0 && ((unsigned char *)ptr)[0] == 0x77;
    CHECK(aclrtUnmapMem(ptr));
    CHECK(aclrtReleaseMemAddress(ptr));
    CHECK(aclrtFreePhysical(handle)); /* the handle is revoked: importers keep what they mapped */
    CHECK(aclrtResetDevice(0));
    CHECK(aclFinalize());
    return good ? 0 : 1;
}
