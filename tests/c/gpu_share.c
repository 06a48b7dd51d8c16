/*
 * GPU memory from C under VMMSHARE_BACKEND=cuda (tests/test_c_cuda.py builds it with the library's sources and
 * -fsanitize=address,undefined, and runs it on a GPU or on the CPU stand-in for libcuda): a parent exports GPU
 * memory to a child on its trustlist, both copy through it, the parent frees and new imports are refused, and bad
 * input gets its code with nothing leaked. The child is forked before either process makes a call (a CUDA driver
 * is not usable across fork). Each check prints a line only when it fails; the program prints "ok" when none did.
 */
#include <dirent.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "acl/acl.h"

#include "checks.h"

/* A device-location property: GPU memory under the CUDA backend. */
static aclrtPhysicalMemProp gpu_prop(void)
{
    aclrtPhysicalMemProp p;
    memset(&p, 0, sizeof p);
    p.allocationType = ACL_MEM_ALLOCATION_TYPE_PINNED;
    p.memAttr = ACL_HBM_MEM_HUGE;
    p.location.type = ACL_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = 0;
    return p;
}

/* 2 MiB of GPU memory mapped at a fresh range (NULL where a step failed). */
static void *alloc_mapped(aclrtDrvMemHandle *h)
{
    aclrtPhysicalMemProp p = gpu_prop();
    void *ptr = NULL;
    EXPECT(aclrtMallocPhysical(h, MIB2, &p, 0), 0);
    EXPECT(aclrtReserveMemAddress(&ptr, MIB2, 0, NULL, 0), 0);
    EXPECT(aclrtMapMem(ptr, MIB2, 0, *h, 0), 0);
    return ptr;
}

/* Undo alloc_mapped. */
static void unmap_free(void *ptr, aclrtDrvMemHandle h)
{
    EXPECT(aclrtUnmapMem(ptr), 0);
    EXPECT(aclrtReleaseMemAddress(ptr), 0);
    EXPECT(aclrtFreePhysical(h), 0);
}

/* The importer: read the handle, import and map it, check the exporter's bytes, write its own back. */
static int child(int go, int done)
{
    uint64_t shareable = 0;
    if (read(go, &shareable, sizeof shareable) != (ssize_t)sizeof shareable)
        return 2;
    EXPECT(aclrtSetDevice(0), 0);
    aclrtDrvMemHandle h = NULL;
    void *p = NULL;
    char buf[64] = "", want[64];
    memset(want, 0x5A, sizeof want);
    EXPECT(aclrtMemImportFromShareableHandleV2(&shareable, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, 0, &h), 0);
    EXPECT(aclrtReserveMemAddress(&p, MIB2, 0, NULL, 0), 0);
    EXPECT(aclrtMapMem(p, MIB2, 0, h, 0), 0);
    EXPECT(aclrtMemcpy(buf, sizeof buf, (char *)p + MIB2 - 64, 64, ACL_MEMCPY_DEVICE_TO_HOST), 0);
    TRUE(memcmp(buf, want, 64) == 0);
    EXPECT(aclrtMemcpy(p, MIB2, "from the child", 14, ACL_MEMCPY_HOST_TO_DEVICE), 0);
    unmap_free(p, h);
    fflush(stdout);
    return write(done, "d", 1) == 1 && failures == 0 ? 0 : 1;
}

/* The exporter, and the bad input. */
static void parent(pid_t pid, int go, int done)
{
    EXPECT(aclrtSetDevice(0), 0);
    aclrtDrvMemHandle h = NULL;
    void *warm = alloc_mapped(&h); /* warm: the broker connection and the context made */
    unmap_free(warm, h);
    int fds = fd_count();

    void *p = alloc_mapped(&h);
    EXPECT(aclrtMemset(p, MIB2, 0x5A, MIB2), 0);
    uint64_t shareable = 0;
    EXPECT(aclrtMemExportToShareableHandleV2(h, 0, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, &shareable), 0);
    int32_t child_pid = pid;
    EXPECT(aclrtMemSetPidToShareableHandleV2(&shareable, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, &child_pid, 1), 0);
    TRUE(write(go, &shareable, sizeof shareable) == (ssize_t)sizeof shareable);
    char c = 0;
    TRUE(read(done, &c, 1) == 1);
    char buf[16] = "";
    EXPECT(aclrtMemcpy(buf, sizeof buf, p, 14, ACL_MEMCPY_DEVICE_TO_HOST), 0);
    TRUE(memcmp(buf, "from the child", 14) == 0);

    /* bad input: each its code, nothing changed */
    aclrtPhysicalMemProp prop = gpu_prop();
    aclrtDrvMemHandle other = NULL;
    EXPECT(aclrtMallocPhysical(&other, MIB2 + 4096, &prop, 0), ACL_ERROR_RT_PARAM_INVALID);
    EXPECT(aclrtMallocPhysical(&other, MIB2, NULL, 0), ACL_ERROR_INVALID_PARAM);
    EXPECT(aclrtMapMem(p, MIB2, 0, h, 0), ACL_ERROR_RT_PARAM_INVALID); /* overlaps its own mapping */
    EXPECT(aclrtMemcpy(buf, 8, p, 16, ACL_MEMCPY_DEVICE_TO_HOST), ACL_ERROR_RT_PARAM_INVALID);
    EXPECT(aclrtMemcpy(buf, 16, (char *)p + MIB2 - 8, 16, ACL_MEMCPY_DEVICE_TO_HOST), ACL_ERROR_RT_PARAM_INVALID);
    EXPECT(aclrtMemcpy(p, 16, buf, 16, ACL_MEMCPY_HOST_TO_HOST), ACL_ERROR_RT_PARAM_INVALID); /* wrong kind */
    EXPECT(aclrtMemExportToShareableHandleV2(h, 0, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, &shareable),
           ACL_ERROR_RT_PARAM_INVALID); /* a handle exports once */
    EXPECT(aclrtReleaseMemAddress(p), ACL_ERROR_RT_PARAM_INVALID); /* still mapped */

    /* free: a new import (even the exporter's own) is refused; everything is given back */
    unmap_free(p, h);
    aclrtDrvMemHandle again = NULL;
    EXPECT(aclrtMemImportFromShareableHandleV2(&shareable, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, 0, &again),
           ACL_ERROR_RT_INVALID_HANDLE);
    TRUE(fd_count() == fds);
}

int main(void)
{
    int go[2], done[2];
    if (pipe(go) != 0 || pipe(done) != 0)
        return 3;
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0)
        _exit(child(go[0], done[1]));
    parent(pid, go[1], done[0]);
    int status = 0;
    TRUE(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
    close(go[0]), close(go[1]), close(done[0]), close(done[1]);
    aclFinalize();
    if (failures == 0)
        printf("ok: %d checks\n", checks);
    return failures != 0;
}
