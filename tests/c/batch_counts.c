/*
 * aclrtMemcpyBatch with counts that do not match the arrays: numAttrs past numBatches, with an attribute array of
 * numBatches entries, must be refused (107000) from the counts before any attribute is read (the sanitizers catch a
 * read past the array). Prints the code and the message.
 */
#include <stdio.h>
#include <stdlib.h>

#include "acl/acl.h"

int main(void)
{
    aclrtSetDevice(0);
    char dst[64], src[64];
    void *dsts[1] = {dst}, *srcs[1] = {src};
    size_t sizes[1] = {8}, maxs[1] = {64}, indexes[4] = {0, 1, 2, 3}, fail = 0;
    aclrtMemcpyBatchAttr *attrs = calloc(1, sizeof *attrs); /* one attribute, where numAttrs says 4 */
    aclError rc = aclrtMemcpyBatch(dsts, maxs, srcs, sizes, 1, attrs, indexes, 4, &fail);
    printf("%d %s\n", rc, aclGetRecentErrMsg());
    free(attrs);
    return 0;
}
