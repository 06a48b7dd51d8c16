/*
 * A program that declares newer calls weak and tests them against NULL before use, as fabric-memory libraries do:
 * linked against libascendcl.so, both resolve.
 */
#include <stdio.h>

#include "acl/acl.h"

extern aclError aclrtReserveMemAddressNoUCMemory(void **, size_t, size_t, void *, uint64_t) __attribute__((weak));
extern aclError aclrtMemGetAddressRange(void *, void **, size_t *) __attribute__((weak));

int main(void)
{
    if (aclrtReserveMemAddressNoUCMemory == NULL || aclrtMemGetAddressRange == NULL) {
        printf("a weak symbol did not resolve\n");
        return 1;
    }
    void *p = NULL;
    if (aclrtReserveMemAddressNoUCMemory(&p, 2 << 20, 0, NULL, 0) != ACL_SUCCESS || aclrtReleaseMemAddress(p)) {
        printf("reserve: %s\n", aclGetRecentErrMsg());
        return 1;
    }
    printf("weak ok\n");
    return 0;
}
