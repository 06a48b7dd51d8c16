/*
 * One call against whatever answers at VMMSHARE_SOCKET (the tests' lying brokers): prints the code and message.
 * argv[1]: "mem_info", "import" or "export". It must return, with an error code and a message, whatever the
 * broker does.
 */
#include <stdio.h>
#include <string.h>
#include <dirent.h>

#include "acl/acl.h"

static int fd_count(void)
{
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    while (d != NULL && readdir(d) != NULL)
        n++;
    if (d != NULL)
        closedir(d);
    return n;
}

int main(int argc, char **argv)
{
    const char *what = argc > 1 ? argv[1] : "mem_info";
    if (aclrtSetDevice(0) != 0) {
        printf("set_device %s\n", aclGetRecentErrMsg());
        return 2;
    }
    int before = fd_count();
    aclError rc;
    for (int i = 0; i < 2; i++) { /* twice: a failed exchange leaves the library able to try again */
        if (strcmp(what, "import") == 0) {
            uint64_t sh = 0x1234;
            aclrtDrvMemHandle h;
            rc = aclrtMemImportFromShareableHandleV2(&sh, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, 0, &h);
        } else {
            size_t f, t;
            rc = aclrtGetMemInfo(ACL_HBM_MEM, &f, &t);
        }
        printf("%d %s\n", rc, aclGetRecentErrMsg());
    }
    printf("fds %d\n", fd_count() - before);
    return 0;
}
