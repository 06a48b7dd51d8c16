/*
 * The runtime's older sharing calls: memory from aclrtMalloc shared by an IPC key (a short string), with the
 * importing process set on the key's trustlist. Written for vmmshare from the runtime's API documentation.
 *
 *   cc ipc_keys.c $(pkg-config --cflags --libs ascendcl) -o ipc_keys && ./ipc_keys
 */
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "acl/acl.h"

#define SIZE ((size_t)4 << 20)
#define CHECK(call)                                                                          \
    do {                                                                                     \
        aclError rc_ = (call);                                                               \
        if (rc_ != ACL_SUCCESS) {                                                            \
            fprintf(stderr, "%s failed: %d: %s\n", #call, rc_, aclGetRecentErrMsg());        \
            return 1;                                                                        \
        }                                                                                    \
    } while (0)

static int importer(int from_exporter)
{
    char key[65];
    if (read(from_exporter, key, sizeof key) != (ssize_t)sizeof key)
        return 1;
    CHECK(aclrtSetDevice(0));
    void *ptr;
    CHECK(aclrtIpcMemImportByKey(&ptr, key, ACL_RT_IPC_MEM_IMPORT_FLAG_DEFAULT));
    unsigned char last = ((unsigned char *)ptr)[SIZE - 1];
    printf("importer %d maps key %s and reads 0x%02x\n", (int)getpid(), key, last);
    fflush(stdout);
    CHECK(aclrtIpcMemClose(key));
    CHECK(aclrtResetDevice(0));
    return last == 0x3C ? 0 : 1;
}

int main(void)
{
    CHECK(aclInit(NULL));
    CHECK(aclrtSetDevice(0));
    void *block;
    CHECK(aclrtMalloc(&block, SIZE, ACL_MEM_MALLOC_HUGE_FIRST));
    CHECK(aclrtMemset(block, SIZE, 0x3C, SIZE));
    char key[65];
    CHECK(aclrtIpcMemGetExportKey(block, SIZE, key, sizeof key, ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT));
    int pipefd[2];
    if (pipe(pipefd) != 0)
        return 1;
    fflush(stdout);
    pid_t child = fork();
    if (child == 0)
        _exit(importer(pipefd[0]));
    int32_t pid = child;
    CHECK(aclrtIpcMemSetImportPid(key, &pid, 1));
    if (write(pipefd[1], key, sizeof key) != (ssize_t)sizeof key)
        return 1;
    int status = 1;
    waitpid(child, &status, 0);
    CHECK(aclrtIpcMemClose(key)); /* the exporter's close revokes the key */
    CHECK(aclrtFree(block));
    CHECK(aclrtResetDevice(0));
    CHECK(aclFinalize());
    printf("exporter: key %s, importer %s\n", key, WIFEXITED(status) && WEXITSTATUS(status) == 0 ? "done" : "failed");
    return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
