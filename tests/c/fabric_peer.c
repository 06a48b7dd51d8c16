/*
 * A C program on one server of a test cluster, driven line by line on standard input (tests/test_c_fabric.py): it
 * exports FABRIC memory of its own, or imports another server's, maps it and copies to and from it, as a C++ user of
 * the runtime would. Each command answers one line: "ret <code>" and what it found, so the test checks every code.
 *
 *   export SIZE PIDS    allocate, map and fill SIZE bytes (byte i = i % 251), export FABRIC, trust PIDS (a
 *                       comma-separated list; 0: no pid check)  -> ret CODE HEX(128 bytes)
 *   sum OFF LEN         this process's own memory               -> ret 0 FNV
 *   unexport            unmap and free what export made         -> ret CODE
 *   import HEX          import the handle, reserve and map it   -> ret CODE (the failing call's code)
 *   read OFF LEN        remote -> host (aclrtMemcpy)            -> ret CODE FNV
 *   write OFF LEN BYTE  host -> remote                          -> ret CODE
 *   fill OFF LEN BYTE   aclrtMemset of the remote range         -> ret CODE
 *   async OFF LEN BYTE  host -> remote on a stream, synchronized -> ret CODE
 *   between DST SRC LEN remote -> remote                        -> ret CODE
 *   local OFF LEN       remote -> a local VMM mapping and back to another remote range at OFF+LEN -> ret CODE
 *   free                unmap, release and free the import      -> ret CODE
 *   fds                 this process's open fds                 -> ret 0 COUNT
 *   quit                aclFinalize and exit (the sanitizers check for leaks then)
 */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "acl/acl.h"
#include "checks.h"

static void *mine, *theirs, *host;
static aclrtDrvMemHandle mine_h, theirs_h;
static size_t mine_size, theirs_size;

static const aclrtPhysicalMemProp PROP = {ACL_MEM_HANDLE_TYPE_NONE, ACL_MEM_ALLOCATION_TYPE_PINNED, ACL_HBM_MEM_HUGE,
                                          {0, ACL_MEM_LOCATION_TYPE_DEVICE}, 0};

static uint64_t fnv(const uint8_t *p, size_t n)
{
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 1099511628211ULL;
    return h;
}

static int export_cmd(size_t size, const char *list)
{
    int32_t pids[8];
    size_t n = 0;
    for (const char *p = list; n < 8 && *p;) {
        char *end;
        pids[n++] = (int32_t)strtol(p, &end, 10);
        p = *end == ',' ? end + 1 : end + strlen(end);
    }
    int32_t pid = n ? pids[0] : 0;
    aclError rc = aclrtMallocPhysical(&mine_h, size, &PROP, 0);
    if (rc == ACL_SUCCESS && (rc = aclrtReserveMemAddress(&mine, size, 0, NULL, 0)) == ACL_SUCCESS &&
        (rc = aclrtMapMem(mine, size, 0, mine_h, 0)) == ACL_SUCCESS) {
        for (size_t i = 0; i < size; i++)
            ((uint8_t *)mine)[i] = (uint8_t)(i % 251);
        mine_size = size;
        aclrtMemFabricHandle out;
        rc = aclrtMemExportToShareableHandleV2(mine_h, pid ? 0 : ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION,
                                               ACL_MEM_SHARE_HANDLE_TYPE_FABRIC, &out);
        if (rc == ACL_SUCCESS && pid)
            rc = aclrtMemSetPidToShareableHandleV2(&out, ACL_MEM_SHARE_HANDLE_TYPE_FABRIC, pids, n);
        if (rc == ACL_SUCCESS) {
            printf("ret 0 ");
            for (size_t i = 0; i < sizeof out; i++)
                printf("%02x", ((uint8_t *)&out)[i]);
            printf("\n");
            return 0;
        }
    }
    printf("ret %d\n", rc);
    return 0;
}

static aclError import_cmd(const char *hex)
{
    aclrtMemFabricHandle raw;
    if (strlen(hex) != 2 * sizeof raw)
        return 1;
    for (size_t i = 0; i < sizeof raw; i++)
        ((uint8_t *)&raw)[i] = (uint8_t)(hex_digit(hex[2 * i]) << 4 | hex_digit(hex[2 * i + 1]));
    aclError rc = aclrtMemImportFromShareableHandleV2(&raw, ACL_MEM_SHARE_HANDLE_TYPE_FABRIC, 0, &theirs_h);
    if (rc)
        return rc;
    aclrtPhysicalMemProp prop;
    size_t g = 0;
    if ((rc = aclrtMemGetAllocationPropertiesFromHandle(theirs_h, &prop)) ||
        (rc = aclrtMemGetAllocationGranularity(&prop, ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM, &g)))
        return rc;
    uint64_t size = 0;
    memcpy(&size, (uint8_t *)&raw + 24, 8); /* the handle's size field */
    theirs_size = size;
    if ((rc = aclrtReserveMemAddress(&theirs, theirs_size, 0, NULL, 0)))
        return rc;
    if ((rc = aclrtMapMem(theirs, theirs_size, 0, theirs_h, 0)))
        return rc;
    return aclrtMallocHost(&host, theirs_size);
}

int main(void)
{
    setvbuf(stdout, NULL, _IONBF, 0);
    if (aclInit(NULL) != ACL_SUCCESS || aclrtSetDevice(0) != ACL_SUCCESS)
        return 2;
    char line[512], cmd[16], hex[300];
    while (fgets(line, sizeof line, stdin) != NULL) {
        size_t off = 0, len = 0, size = 0;
        unsigned b = 0;
        if (sscanf(line, "%15s", cmd) != 1)
            continue;
        uint8_t *r = theirs;
        if (strcmp(cmd, "export") == 0 && sscanf(line, "%*s %zu %299s", &size, hex) == 2) {
            export_cmd(size, hex);
        } else if (strcmp(cmd, "sum") == 0 && sscanf(line, "%*s %zu %zu", &off, &len) == 2) {
            printf("ret 0 %llu\n", (unsigned long long)fnv((uint8_t *)mine + off, len));
        } else if (strcmp(cmd, "unexport") == 0) {
            aclError rc = aclrtUnmapMem(mine);
            if (rc == ACL_SUCCESS)
                rc = aclrtReleaseMemAddress(mine);
            printf("ret %d\n", rc ? rc : aclrtFreePhysical(mine_h));
        } else if (strcmp(cmd, "import") == 0 && sscanf(line, "%*s %299s", hex) == 1) {
            printf("ret %d\n", import_cmd(hex));
        } else if (strcmp(cmd, "read") == 0 && sscanf(line, "%*s %zu %zu", &off, &len) == 2) {
            memset(host, 0, len);
            aclError rc = aclrtMemcpy(host, theirs_size, r + off, len, ACL_MEMCPY_DEVICE_TO_HOST);
            printf("ret %d %llu\n", rc, (unsigned long long)fnv(host, len));
        } else if (strcmp(cmd, "write") == 0 && sscanf(line, "%*s %zu %zu %u", &off, &len, &b) == 3) {
            memset(host, (int)b, len);
            printf("ret %d\n", aclrtMemcpy(r + off, theirs_size - off, host, len, ACL_MEMCPY_HOST_TO_DEVICE));
        } else if (strcmp(cmd, "fill") == 0 && sscanf(line, "%*s %zu %zu %u", &off, &len, &b) == 3) {
            printf("ret %d\n", aclrtMemset(r + off, theirs_size - off, (int32_t)b, len));
        } else if (strcmp(cmd, "async") == 0 && sscanf(line, "%*s %zu %zu %u", &off, &len, &b) == 3) {
            aclrtStream s;
            memset(host, (int)b, len);
            aclError rc = aclrtCreateStream(&s);
            if (rc == ACL_SUCCESS) {
                rc = aclrtMemcpyAsync(r + off, theirs_size - off, host, len, ACL_MEMCPY_HOST_TO_DEVICE, s);
                aclError sync = aclrtSynchronizeStream(s);
                rc = rc ? rc : sync;
                aclrtDestroyStream(s);
            }
            printf("ret %d\n", rc);
        } else if (strcmp(cmd, "between") == 0 && sscanf(line, "%*s %zu %zu %zu", &off, &size, &len) == 3) {
            printf("ret %d\n", aclrtMemcpy(r + off, theirs_size - off, r + size, len, ACL_MEMCPY_DEVICE_TO_DEVICE));
        } else if (strcmp(cmd, "local") == 0 && sscanf(line, "%*s %zu %zu", &off, &len) == 2) {
            void *lp = NULL;
            aclrtDrvMemHandle lh;
            aclError rc = aclrtMallocPhysical(&lh, theirs_size, &PROP, 0);
            if (rc == ACL_SUCCESS) {
                if ((rc = aclrtReserveMemAddress(&lp, theirs_size, 0, NULL, 0)) == ACL_SUCCESS) {
                    if ((rc = aclrtMapMem(lp, theirs_size, 0, lh, 0)) == ACL_SUCCESS) {
                        rc = aclrtMemcpy(lp, theirs_size, r + off, len, ACL_MEMCPY_DEVICE_TO_DEVICE);
                        if (rc == ACL_SUCCESS)
                            rc = aclrtMemcpy(r + off + len, theirs_size - off - len, lp, len,
                                             ACL_MEMCPY_DEVICE_TO_DEVICE);
                        aclrtUnmapMem(lp);
                    }
                    aclrtReleaseMemAddress(lp);
                }
                aclrtFreePhysical(lh);
            }
            printf("ret %d\n", rc);
        } else if (strcmp(cmd, "free") == 0) {
            aclError rc = aclrtUnmapMem(theirs);
            if (rc == ACL_SUCCESS)
                rc = aclrtReleaseMemAddress(theirs);
            if (rc == ACL_SUCCESS)
                rc = aclrtFreePhysical(theirs_h);
            if (rc == ACL_SUCCESS && host != NULL) {
                rc = aclrtFreeHost(host);
                host = NULL;
            }
            printf("ret %d\n", rc);
        } else if (strcmp(cmd, "fds") == 0) {
            printf("ret 0 %d\n", fd_count());
        } else if (strcmp(cmd, "quit") == 0) {
            break;
        } else {
            printf("ret -1 unknown command: %s", line);
        }
    }
    if (host != NULL)
        aclrtFreeHost(host);
    aclFinalize();
    return 0;
}
