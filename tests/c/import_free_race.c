/*
 * A second import of a handle this process holds, while the main thread frees the handle twice (the second free
 * is a caller's mistake that must get 107017): the import must neither read nor drop a freed allocation. The test
 * side steps it: it writes a byte on standard input once the second import is at its (scripted) broker, and the
 * broker answers once both frees are printed. Prints each call's code.
 */
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>

#include "acl/acl.h"

static aclrtDrvMemHandle second;
static aclError second_rc;

static void *import_again(void *unused)
{
    (void)unused;
    aclrtSetDevice(0);
    second_rc = aclrtMemImportFromShareableHandle(0x1234, 0, &second);
    return NULL;
}

int main(void)
{
    setvbuf(stdout, NULL, _IONBF, 0);
    aclrtSetDevice(0);
    aclrtDrvMemHandle first;
    printf("import %d\n", aclrtMemImportFromShareableHandle(0x1234, 0, &first));
    pthread_t t;
    pthread_create(&t, NULL, import_again, NULL);
    char go;
    if (read(0, &go, 1) != 1) /* the second import is at the broker */
        return 2;
    printf("free %d\n", aclrtFreePhysical(first));
    printf("free-again %d\n", aclrtFreePhysical(first));
    pthread_join(t, NULL);
    printf("import-again %d\n", second_rc);
    if (second_rc == 0)
        printf("free-second %d\n", aclrtFreePhysical(second));
    return 0;
}
