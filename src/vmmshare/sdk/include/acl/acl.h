/*
 * vmmshare: the Ascend runtime's C interface, as programs include it ("acl/acl.h"): the base types and codes and
 * every runtime call (acl_rt.h). Written for vmmshare from the published facts.
 */
#ifndef VMMSHARE_ACL_H
#define VMMSHARE_ACL_H

#include "acl_base.h"
#include "acl_rt.h"

#endif /* VMMSHARE_ACL_H */
