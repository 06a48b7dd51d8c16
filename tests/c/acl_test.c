/*
 * The C library from a C program, built with the sanitizers (tests/test_c_library.py compiles it with the
 * library's sources and -fsanitize=address,undefined): two processes sharing with and without a trustlist, IPC
 * keys, every kind of bad argument returning its code with a message and nothing leaked, eight threads sharing at
 * once, streams and copies, and fork. Each check prints a line only when it fails; the program exits non-zero if
 * any did.
 */
#include <dirent.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "acl/acl.h"

#include "checks.h"

static aclrtPhysicalMemProp device_prop(void)
{
    aclrtPhysicalMemProp p;
    memset(&p, 0, sizeof p);
    p.handleType = ACL_MEM_HANDLE_TYPE_NONE;
    p.allocationType = ACL_MEM_ALLOCATION_TYPE_PINNED;
    p.memAttr = ACL_HBM_MEM_HUGE;
    p.location.type = ACL_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = 0;
    return p;
}

/* Allocate, reserve and map 2 MiB; fill it with `byte`. */
static void *alloc_mapped(aclrtDrvMemHandle *h, unsigned char byte)
{
    aclrtPhysicalMemProp p = device_prop();
    void *ptr = NULL;
    EXPECT(aclrtMallocPhysical(h, MIB2, &p, 0), 0);
    EXPECT(aclrtReserveMemAddress(&ptr, MIB2, 0, NULL, 0), 0);
    EXPECT(aclrtMapMem(ptr, MIB2, 0, *h, 0), 0);
    if (ptr != NULL)
        memset(ptr, byte, MIB2);
    return ptr;
}

static void unmap_free(void *ptr, aclrtDrvMemHandle h)
{
    EXPECT(aclrtUnmapMem(ptr), 0);
    EXPECT(aclrtReleaseMemAddress(ptr), 0);
    EXPECT(aclrtFreePhysical(h), 0);
}

/* ---------------------------------------------------------------- two processes */

/* The child imports `shareable` (expecting `code`), checks the pattern and writes one byte back. */
static int child_import(uint64_t shareable, aclError code, int go, int done)
{
    char c;
    if (read(go, &c, 1) != 1)
        return 2;
    if (aclrtSetDevice(0) != 0)
        return 3;
    aclrtDrvMemHandle h = NULL;
    aclError got = aclrtMemImportFromShareableHandleV2(&shareable, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, 0, &h);
    if (got != code)
        return 4;
    if (code == 0) {
        void *p = NULL;
        if (aclrtReserveMemAddress(&p, MIB2, 0, NULL, 0) || aclrtMapMem(p, MIB2, 0, h, 0))
            return 5;
        if (((unsigned char *)p)[MIB2 - 1] != 0x5A)
            return 6;
        ((unsigned char *)p)[0] = 0x77;
        if (aclrtUnmapMem(p) || aclrtReleaseMemAddress(p) || aclrtFreePhysical(h))
            return 7;
    }
    return write(done, "d", 1) == 1 ? 0 : 8;
}

static void share_between_processes(uint64_t flags, bool trust, aclError child_code)
{
    aclrtDrvMemHandle h;
    unsigned char *p = alloc_mapped(&h, 0x5A);
    uint64_t shareable = 0;
    EXPECT(aclrtMemExportToShareableHandleV2(h, flags, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, &shareable), 0);
    int go[2], done[2];
    TRUE(pipe(go) == 0 && pipe(done) == 0);
    fflush(stdout);
    pid_t child = fork();
    if (child == 0)
        _exit(child_import(shareable, child_code, go[0], done[1]));
    if (trust) {
        int32_t pid = child;
        EXPECT(aclrtMemSetPidToShareableHandleV2(&shareable, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, &pid, 1), 0);
    }
    TRUE(write(go[1], "g", 1) == 1);
    int status = -1;
    waitpid(child, &status, 0);
    TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    if (child_code == 0)
        TRUE(p[0] == 0x77); /* the child's write is seen here: one memory */
    close(go[0]), close(go[1]), close(done[0]), close(done[1]);
    unmap_free(p, h);
}

/* ---------------------------------------------------------------- IPC keys between two processes */

static void ipc_keys(void)
{
    void *block = NULL;
    EXPECT(aclrtMalloc(&block, 3 << 20, ACL_MEM_MALLOC_HUGE_FIRST), 0);
    memset(block, 0x33, 3 << 20);
    char key[65];
    EXPECT(aclrtIpcMemGetExportKey(block, 3 << 20, key, sizeof key, 0), 0);
    TRUE(strlen(key) == 24);
    int go[2], done[2];
    TRUE(pipe(go) == 0 && pipe(done) == 0);
    fflush(stdout);
    pid_t child = fork();
    if (child == 0) {
        char c;
        int rc = read(go[0], &c, 1) == 1 ? 0 : 2;
        void *q = NULL;
        if (rc == 0 && aclrtSetDevice(0) != 0)
            rc = 3;
        if (rc == 0 && aclrtIpcMemImportByKey(&q, key, 0) != 0)
            rc = 4;
        if (rc == 0 && ((unsigned char *)q)[(3 << 20) - 1] != 0x33)
            rc = 5;
        if (rc == 0 && aclrtIpcMemClose(key) != 0)
            rc = 6;
        if (write(done[1], "d", 1) != 1)
            rc = 7;
        _exit(rc);
    }
    int32_t pid = child;
    EXPECT(aclrtIpcMemSetImportPid(key, &pid, 1), 0);
    TRUE(write(go[1], "g", 1) == 1);
    int status = -1;
    waitpid(child, &status, 0);
    TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    EXPECT(aclrtIpcMemClose(key), 0);
    EXPECT(aclrtIpcMemClose(key), ACL_ERROR_RT_INVALID_HANDLE); /* closed already */
    EXPECT(aclrtFree(block), 0);
    close(go[0]), close(go[1]), close(done[0]), close(done[1]);
}

/* ---------------------------------------------------------------- bad arguments */

static void bad_arguments(void)
{
    aclrtPhysicalMemProp p = device_prop();
    aclrtDrvMemHandle h = NULL;
    void *ptr = NULL;
    uint64_t sh = 0;
    size_t n = 0;
    int fds = fd_count();

    /* NULL out-pointers: the acl layer's 100000 */
    EXPECT(aclrtMallocPhysical(NULL, MIB2, &p, 0), ACL_ERROR_INVALID_PARAM);
    EXPECT(aclrtMallocPhysical(&h, MIB2, NULL, 0), ACL_ERROR_INVALID_PARAM);
    EXPECT(aclrtReserveMemAddress(NULL, MIB2, 0, NULL, 0), ACL_ERROR_INVALID_PARAM);
    EXPECT(aclrtMemGetAllocationGranularity(&p, 0, NULL), ACL_ERROR_INVALID_PARAM);
    EXPECT(aclrtGetDevice(NULL), ACL_ERROR_INVALID_PARAM);
    EXPECT(aclrtGetDeviceCount(NULL), ACL_ERROR_INVALID_PARAM);
    EXPECT(aclrtDeviceGetBareTgid(NULL), ACL_ERROR_INVALID_PARAM);
    EXPECT(aclrtGetMemInfo(ACL_HBM_MEM, NULL, &n), ACL_ERROR_INVALID_PARAM);
    EXPECT(aclrtMemExportToShareableHandleV2((aclrtDrvMemHandle)1, 0, 1, NULL), ACL_ERROR_INVALID_PARAM);
    EXPECT(aclrtMemImportFromShareableHandleV2(&sh, 1, 0, NULL), ACL_ERROR_INVALID_PARAM);
    EXPECT(aclrtMemImportFromShareableHandleV2(NULL, 1, 0, &h), ACL_ERROR_INVALID_PARAM);
    EXPECT(aclrtMemRetainAllocationHandle((void *)0x1000, NULL), ACL_ERROR_INVALID_PARAM);
    EXPECT(aclrtMemGetAddressRange((void *)0x1000, NULL, &n), ACL_ERROR_INVALID_PARAM);
    EXPECT(aclrtMalloc(NULL, 4096, 0), ACL_ERROR_INVALID_PARAM);
    EXPECT(aclrtMallocHost(NULL, 4096), ACL_ERROR_INVALID_PARAM);
    EXPECT(aclrtIpcMemImportByKey(NULL, "0", 0), ACL_ERROR_INVALID_PARAM);
    EXPECT(aclrtCreateStream(NULL), ACL_ERROR_INVALID_PARAM);
    EXPECT(aclrtMemGetAllocationPropertiesFromHandle((aclrtDrvMemHandle)1, NULL), ACL_ERROR_INVALID_PARAM);

    /* sizes, alignment, flags */
    EXPECT(aclrtMallocPhysical(&h, 0, &p, 0), ACL_ERROR_INVALID_PARAM);
    EXPECT(aclrtMallocPhysical(&h, MIB2 + 4096, &p, 0), ACL_ERROR_RT_PARAM_INVALID);
    EXPECT(aclrtMallocPhysical(&h, MIB2, &p, 1), ACL_ERROR_INVALID_PARAM);
    EXPECT(aclrtReserveMemAddress(&ptr, 0, 0, NULL, 0), ACL_ERROR_INVALID_PARAM);
    EXPECT(aclrtReserveMemAddress(&ptr, MIB2 + 1, 0, NULL, 0), ACL_ERROR_RT_PARAM_INVALID);
    EXPECT(aclrtReserveMemAddress(&ptr, MIB2, 4096, NULL, 0), ACL_ERROR_RT_PARAM_INVALID);
    EXPECT(aclrtReserveMemAddress(&ptr, MIB2, 0, NULL, 2), ACL_ERROR_INVALID_PARAM);
    EXPECT(aclrtReserveMemAddress(&ptr, MIB2, 0, (void *)0x1001, 0), ACL_ERROR_RT_PARAM_INVALID);
    p.memAttr = ACL_DDR_MEM_NORMAL; /* host memory on a device */
    EXPECT(aclrtMallocPhysical(&h, MIB2, &p, 0), ACL_ERROR_INVALID_PARAM);
    p.memAttr = (aclrtMemAttr)99;
    EXPECT(aclrtMallocPhysical(&h, MIB2, &p, 0), ACL_ERROR_INVALID_PARAM);
    p = device_prop();
    p.location.id = 4096; /* a device that does not exist */
    EXPECT(aclrtMallocPhysical(&h, MIB2, &p, 0), ACL_ERROR_RT_INVALID_DEVICEID);
    EXPECT(aclrtSetDevice(-1), ACL_ERROR_RT_INVALID_DEVICEID);
    EXPECT(aclrtSetDevice(1 << 20), ACL_ERROR_RT_INVALID_DEVICEID);

    /* bogus handles, unknown pointers */
    EXPECT(aclrtFreePhysical((aclrtDrvMemHandle)0x123456), ACL_ERROR_RT_INVALID_HANDLE);
    EXPECT(aclrtFreePhysical(NULL), ACL_ERROR_INVALID_PARAM);
    EXPECT(aclrtMapMem((void *)(16ULL << 40), MIB2, 0, (aclrtDrvMemHandle)0x123456, 0), ACL_ERROR_RT_INVALID_HANDLE);
    EXPECT(aclrtUnmapMem((void *)0x1000), ACL_ERROR_RT_PARAM_INVALID);
    EXPECT(aclrtReleaseMemAddress((void *)0x1000), ACL_ERROR_RT_PARAM_INVALID);
    EXPECT(aclrtFree((void *)0x1000), ACL_ERROR_RT_PARAM_INVALID);
    EXPECT(aclrtFreeHost((void *)0x1000), ACL_ERROR_RT_PARAM_INVALID);
    sh = 0x1122334455667788ULL;
    EXPECT(aclrtMemImportFromShareableHandleV2(&sh, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, 0, &h),
           ACL_ERROR_RT_INVALID_HANDLE);
    sh = 0;
    EXPECT(aclrtMemImportFromShareableHandleV2(&sh, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, 0, &h),
           ACL_ERROR_RT_INVALID_HANDLE);
    aclrtMemFabricHandle fabric;
    memset(&fabric, 0xAB, sizeof fabric); /* not a FABRIC handle at all */
    EXPECT(aclrtMemImportFromShareableHandleV2(&fabric, ACL_MEM_SHARE_HANDLE_TYPE_FABRIC, 0, &h),
           ACL_ERROR_RT_INVALID_HANDLE);
    EXPECT(aclrtMemImportFromShareableHandleV2(&sh, (aclrtMemSharedHandleType)7, 0, &h), ACL_ERROR_RT_PARAM_INVALID);
    EXPECT(aclrtIpcMemImportByKey(&ptr, "not a key", 0), ACL_ERROR_RT_PARAM_INVALID);
    EXPECT(aclrtIpcMemClose("00000000000000ff00000000"), ACL_ERROR_RT_INVALID_HANDLE);
    EXPECT(aclrtMemcpy((void *)0x1000, 16, &sh, 8, ACL_MEMCPY_HOST_TO_HOST), ACL_ERROR_RT_PARAM_INVALID);
    EXPECT(aclrtMemcpy(&sh, 8, &n, 8, (aclrtMemcpyKind)42), ACL_ERROR_INVALID_PARAM);
    EXPECT(aclrtMemcpy(&sh, 4, &n, 8, ACL_MEMCPY_HOST_TO_HOST), ACL_ERROR_RT_PARAM_INVALID);
    EXPECT(aclrtMemcpy(NULL, 0, NULL, 0, ACL_MEMCPY_HOST_TO_HOST), 0); /* count 0: nothing to do */
    EXPECT(aclrtSynchronizeStream((aclrtStream)0x999), ACL_ERROR_RT_INVALID_HANDLE);

    /* the unsupported calls exist and say so */
    EXPECT(aclrtResetEvent(NULL, NULL), ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    TRUE(fd_count() == fds); /* nothing leaked on the way */
}

/* ---------------------------------------------------------------- streams, copies, retain, properties */

static void copies_and_streams(void)
{
    aclrtDrvMemHandle h;
    unsigned char *p = alloc_mapped(&h, 0);
    void *host = NULL;
    EXPECT(aclrtMallocHost(&host, 4096), 0);
    memset(host, 0x42, 4096);
    aclrtStream s = NULL;
    EXPECT(aclrtCreateStream(&s), 0);
    EXPECT(aclrtMemcpyAsync(p + 100, MIB2 - 100, host, 4096, ACL_MEMCPY_HOST_TO_DEVICE, s), 0);
    EXPECT(aclrtMemsetAsync(p, MIB2, 0x11, 10, s), 0);
    EXPECT(aclrtSynchronizeStream(s), 0);
    TRUE(p[100] == 0x42 && p[4195] == 0x42 && p[9] == 0x11 && p[10] == 0);
    EXPECT(aclrtMemcpy(host, 4096, p, 4096, ACL_MEMCPY_HOST_TO_HOST), ACL_ERROR_RT_PARAM_INVALID); /* wrong kind */
    EXPECT(aclrtMemcpy(host, 4096, p, 4096, ACL_MEMCPY_DEVICE_TO_HOST), 0);
    aclrtStreamStatus status;
    EXPECT(aclrtStreamQuery(s, &status), 0);
    TRUE(status == ACL_STREAM_STATUS_COMPLETE);
    EXPECT(aclrtDestroyStream(s), 0);
    EXPECT(aclrtFreeHost(host), 0);
    aclrtDrvMemHandle again = NULL;
    EXPECT(aclrtMemRetainAllocationHandle(p + 12345, &again), 0);
    TRUE(again == h);
    EXPECT(aclrtFreePhysical(again), 0);
    void *base = NULL;
    size_t size = 0;
    EXPECT(aclrtMemGetAddressRange(p + 777, &base, &size), 0);
    TRUE(base == p && size == MIB2);
    aclrtPhysicalMemProp got;
    EXPECT(aclrtMemGetAllocationPropertiesFromHandle(h, &got), 0);
    TRUE(got.location.type == ACL_MEM_LOCATION_TYPE_DEVICE && got.memAttr == ACL_HBM_MEM_HUGE);
    aclrtMemAccessDesc desc;
    memset(&desc, 0, sizeof desc);
    desc.flags = ACL_RT_MEM_ACCESS_FLAGS_READ;
    desc.location.type = ACL_MEM_LOCATION_TYPE_DEVICE;
    EXPECT(aclrtMemSetAccess(p, MIB2, &desc, 1), 0);
    uint64_t flags = 0;
    EXPECT(aclrtMemGetAccess(p, &desc.location, &flags), 0);
    TRUE(flags == ACL_RT_MEM_ACCESS_FLAGS_READ);
    EXPECT(aclrtMemset(p, MIB2, 1, 16), ACL_ERROR_RT_PARAM_INVALID); /* read-only now */
    EXPECT(aclrtReleaseMemAddress(p), ACL_ERROR_RT_PARAM_INVALID);  /* still mapped */
    unmap_free(p, h);
}

/* ---------------------------------------------------------------- events and notifies across a fork */

/* The parent writes, then records an IPC event on a stream held by a local notify's wait; the child, which opened
 * the event by its handle, waits and then sees the write; the parent's other stream releases the held one. */
static void events_and_notifies(void)
{
    aclrtDrvMemHandle h;
    unsigned char *p = alloc_mapped(&h, 0);
    aclrtEvent ev;
    EXPECT(aclrtCreateEventExWithFlag(&ev, ACL_EVENT_IPC), 0);
    aclrtIpcEventHandle handle;
    EXPECT(aclrtIpcGetEventHandle(ev, &handle), 0);
    aclrtStream held, other;
    EXPECT(aclrtCreateStream(&held), 0);
    EXPECT(aclrtCreateStream(&other), 0);
    aclrtNotify gate;
    EXPECT(aclrtCreateNotify(&gate, 0), 0);
    EXPECT(aclrtWaitAndResetNotify(gate, held, 0), 0); /* work on `held` waits from here */
    int go[2];
    TRUE(pipe(go) == 0);
    fflush(stdout);
    pid_t child = fork();
    if (child == 0) {
        aclrtEvent mine;
        char c;
        int rc = aclrtSetDevice(0) || aclrtIpcOpenEventHandle(handle, &mine) ? 2 : 0;
        if (rc == 0 && read(go[0], &c, 1) != 1)
            rc = 3;
        if (rc == 0 && aclrtSynchronizeEventWithTimeout(mine, 30000) != 0)
            rc = 4;
        if (rc == 0 && p[100] != 0x5C) /* (the child's copy of the parent's mapping: the same memory) */
            rc = 5;
        if (rc == 0 && aclrtDestroyEvent(mine) != 0)
            rc = 6;
        _exit(rc);
    }
    memset(p, 0x5C, 4096);
    EXPECT(aclrtRecordEvent(ev, held), 0);
    aclrtEventRecordedStatus status;
    EXPECT(aclrtQueryEventStatus(ev, &status), 0);
    TRUE(status == ACL_EVENT_RECORDED_STATUS_NOT_READY); /* the stream has not got there */
    TRUE(write(go[1], "g", 1) == 1);
    EXPECT(aclrtRecordNotify(gate, other), 0); /* releases `held`: the record completes */
    EXPECT(aclrtSynchronizeEvent(ev), 0);
    int st = -1;
    waitpid(child, &st, 0);
    TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    EXPECT(aclrtSynchronizeStream(held), 0);
    EXPECT(aclrtDestroyStream(held), 0);
    EXPECT(aclrtDestroyStream(other), 0);
    EXPECT(aclrtDestroyNotify(gate), 0);
    EXPECT(aclrtDestroyEvent(ev), 0);
    EXPECT(aclrtDestroyEvent(ev), ACL_ERROR_RT_INVALID_HANDLE);
    close(go[0]), close(go[1]);
    unmap_free(p, h);
}

/* ---------------------------------------------------------------- fork */

/* A forked child, as a Python child: the parent's handles are not its own (107017), the mappings it inherited
 * still show the memory, and it allocates and shares afresh on its own connection. */
static void forked_child(void)
{
    aclrtDrvMemHandle h;
    unsigned char *p = alloc_mapped(&h, 0x4D);
    fflush(stdout);
    pid_t child = fork();
    if (child == 0) {
        int rc = 0;
        if (aclrtFreePhysical(h) != ACL_ERROR_RT_INVALID_HANDLE)
            rc = 2;
        if (p[MIB2 - 1] != 0x4D) /* the inherited mapping */
            rc = 3;
        aclrtDrvMemHandle mine;
        aclrtPhysicalMemProp prop = device_prop();
        if (aclrtSetDevice(0) || aclrtMallocPhysical(&mine, MIB2, &prop, 0) || aclrtFreePhysical(mine))
            rc = 4;
        _exit(rc);
    }
    int status = -1;
    waitpid(child, &status, 0);
    TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    unmap_free(p, h); /* the parent's are untouched */
}

/* ---------------------------------------------------------------- eight threads */

static void *thread_share(void *arg)
{
    (void)arg;
    if (aclrtSetDevice(0) != 0)
        return (void *)1;
    for (int round = 0; round < 4; round++) {
        aclrtPhysicalMemProp p = device_prop();
        aclrtDrvMemHandle h, ih;
        void *a = NULL, *b = NULL;
        uint64_t sh;
        if (aclrtMallocPhysical(&h, MIB2, &p, 0) || aclrtMemExportToShareableHandleV2(h, 1, 1, &sh) ||
            aclrtMemImportFromShareableHandleV2(&sh, 1, 0, &ih) || aclrtReserveMemAddress(&a, MIB2, 0, NULL, 0) ||
            aclrtReserveMemAddress(&b, MIB2, 0, NULL, 0) || aclrtMapMem(a, MIB2, 0, h, 0) ||
            aclrtMapMem(b, MIB2, 0, ih, 0))
            return (void *)2;
        ((unsigned char *)a)[round] = (unsigned char)(round + 1);
        int same = ((unsigned char *)b)[round] == round + 1;
        if (aclrtUnmapMem(a) || aclrtUnmapMem(b) || aclrtReleaseMemAddress(a) || aclrtReleaseMemAddress(b) ||
            aclrtFreePhysical(ih) || aclrtFreePhysical(h) || !same)
            return (void *)3;
    }
    return NULL;
}

static void eight_threads(void)
{
    pthread_t t[8];
    for (int i = 0; i < 8; i++)
        TRUE(pthread_create(&t[i], NULL, thread_share, NULL) == 0);
    for (int i = 0; i < 8; i++) {
        void *r = (void *)9;
        pthread_join(t[i], &r);
        TRUE(r == NULL);
    }
}

int main(void)
{
    EXPECT(aclInit(NULL), 0);
    EXPECT(aclInit(NULL), ACL_ERROR_REPEAT_INITIALIZE);
    EXPECT(aclrtSetDevice(0), 0);
    size_t free_bytes, total;
    EXPECT(aclrtGetMemInfo(ACL_HBM_MEM, &free_bytes, &total), 0); /* (the broker connection, made once, is kept) */
    int fds = fd_count();
    share_between_processes(0, true, 0);                                    /* a trustlist admits the child */
    share_between_processes(0, false, ACL_ERROR_RT_NO_PERMISSION);          /* none does not */
    share_between_processes(ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION, false, 0); /* validation off */
    ipc_keys();
    bad_arguments();
    copies_and_streams();
    forked_child();
    events_and_notifies();
    eight_threads();
    TRUE(fd_count() == fds);
    EXPECT(aclrtResetDevice(0), 0);
    EXPECT(aclFinalize(), 0);
    printf("%d checks, %d failures\n", checks, failures);
    return failures ? 1 : 0;
}
