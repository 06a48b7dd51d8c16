/*
 * The stand-ins of the calls vmmshare does not provide (stubs_gen.c, misc.c).
 */
#ifndef VMMSHARE_CLIB_STUBS_H
#define VMMSHARE_CLIB_STUBS_H

#include "vs.h"

/* 207000, with a message naming the call. */
aclError vs_stand_in(const char *call);
/* The same message, for a call that returns a value (0, NULL) rather than a code. */
void *vs_stand_in_value(const char *call);

#endif /* VMMSHARE_CLIB_STUBS_H */
