/*
 * Allocation properties (vmmshare.props): the memory attributes and locations an aclrtPhysicalMemProp may name,
 * the acl layer's checks of one (100000) and the runtime's (107000 ...), in the order vmmshare.acl makes them, the
 * granularity it implies, and the attribute the runtime reports back for it.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "vs.h"

static const char *const ATTR_NAMES[18] = {
    "ACL_DDR_MEM", "ACL_HBM_MEM", "ACL_DDR_MEM_HUGE", "ACL_DDR_MEM_NORMAL", "ACL_HBM_MEM_HUGE",
    "ACL_HBM_MEM_NORMAL", "ACL_DDR_MEM_P2P_HUGE", "ACL_DDR_MEM_P2P_NORMAL", "ACL_HBM_MEM_P2P_HUGE",
    "ACL_HBM_MEM_P2P_NORMAL", "ACL_HBM_MEM_HUGE1G", "ACL_HBM_MEM_P2P_HUGE1G", "ACL_MEM_NORMAL", "ACL_MEM_HUGE",
    "ACL_MEM_HUGE1G", "ACL_MEM_P2P_NORMAL", "ACL_MEM_P2P_HUGE", "ACL_MEM_P2P_HUGE1G",
};

static bool huge1g(uint32_t attr)
{
    return attr == ACL_HBM_MEM_HUGE1G || attr == ACL_HBM_MEM_P2P_HUGE1G || attr == ACL_MEM_HUGE1G ||
           attr == ACL_MEM_P2P_HUGE1G;
}

static bool ddr(uint32_t attr)
{
    return attr == ACL_DDR_MEM_HUGE || attr == ACL_DDR_MEM_NORMAL || attr == ACL_DDR_MEM_P2P_HUGE ||
           attr == ACL_DDR_MEM_P2P_NORMAL;
}

static bool physical_attr(uint32_t attr)
{
    return attr < 18 && attr != ACL_DDR_MEM && attr != ACL_HBM_MEM && attr != ACL_HBM_MEM_P2P_HUGE &&
           attr != ACL_HBM_MEM_P2P_NORMAL && attr != ACL_HBM_MEM_P2P_HUGE1G;
}

static bool host_location(uint32_t type)
{
    return type == ACL_MEM_LOCATION_TYPE_HOST || type == ACL_MEM_LOCATION_TYPE_HOST_NUMA;
}

size_t vs_prop_granularity(const vs_prop *p)
{
    return huge1g(p->mem_attr) ? VS_HUGE1G_GRANULARITY : VS_MIN_GRANULARITY;
}

vs_prop vs_prop_from(const aclrtPhysicalMemProp *p)
{
    vs_prop v;
    v.handle_type = (uint32_t)p->handleType;
    v.allocation_type = (uint32_t)p->allocationType;
    v.mem_attr = (uint32_t)p->memAttr;
    v.loc_type = (uint32_t)p->location.type;
    v.loc_id = p->location.type == ACL_MEM_LOCATION_TYPE_DEVICE ? (int64_t)(int32_t)p->location.id
                                                                 : (int64_t)p->location.id;
    v.reserve = p->reserve;
    return v;
}

/* The acl layer's checks of a property (100000), in its order (vmmshare.wire.props.check_prop). */
aclError vs_check_prop_acl(vs_err *err, const vs_prop *p, bool for_malloc)
{
    if (for_malloc) {
        if (p->handle_type != ACL_MEM_HANDLE_TYPE_NONE)
            return vs_set(err, ACL_ERROR_INVALID_PARAM,
                          "prop.handleType=%u: physical memory takes ACL_MEM_HANDLE_TYPE_NONE (0)", p->handle_type);
        if (p->allocation_type != ACL_MEM_ALLOCATION_TYPE_PINNED)
            return vs_set(err, ACL_ERROR_INVALID_PARAM, "prop.allocationType=%u: only ACL_MEM_ALLOCATION_TYPE_PINNED (0)",
                          p->allocation_type);
        if (p->loc_type == ACL_MEM_LOCATION_TYPE_UNREGISTERED || p->loc_type == ACL_MEM_LOCATION_TYPE_MANAGED)
            return vs_set(err, ACL_ERROR_INVALID_PARAM,
                          "prop.location.type=%u: physical memory lives on the HOST (0), a DEVICE (1) or a HOST_NUMA "
                          "node (4), not UNREGISTERED (2) or MANAGED (3) memory", p->loc_type);
    }
    if (p->loc_type == ACL_MEM_LOCATION_TYPE_DEVICE && ddr(p->mem_attr))
        return vs_set(err, ACL_ERROR_INVALID_PARAM,
                      "prop.memAttr=%u (%s) is host (DDR) memory: a DEVICE location takes an HBM or ACL_MEM_* "
                      "attribute", p->mem_attr, ATTR_NAMES[p->mem_attr]);
    if (!physical_attr(p->mem_attr))
        return vs_set(err, ACL_ERROR_INVALID_PARAM,
                      "prop.memAttr=%u is not a physical memory attribute: use one of ACL_DDR_MEM_HUGE, "
                      "ACL_DDR_MEM_NORMAL, ACL_HBM_MEM_HUGE, ACL_HBM_MEM_NORMAL, ACL_DDR_MEM_P2P_HUGE, "
                      "ACL_DDR_MEM_P2P_NORMAL, ACL_HBM_MEM_HUGE1G, ACL_MEM_NORMAL, ACL_MEM_HUGE, ACL_MEM_HUGE1G, "
                      "ACL_MEM_P2P_NORMAL, ACL_MEM_P2P_HUGE, ACL_MEM_P2P_HUGE1G", p->mem_attr);
    return ACL_SUCCESS;
}

/* Whether NUMA node `node` is online (the kernel's node list in `text`, "0" on a kernel without NUMA). */
static bool numa_node_online(int64_t node, char *text, size_t cap)
{
    FILE *f = fopen("/sys/devices/system/node/online", "re");
    size_t n = 0;
    if (f != NULL) {
        n = fread(text, 1, cap - 1, f);
        fclose(f);
    }
    while (n && (text[n - 1] == '\n' || text[n - 1] == ' '))
        n--;
    text[n] = '\0';
    if (n == 0)
        snprintf(text, cap, "0");
    char *p = text;
    bool any = false;
    while (*p) {
        char *end;
        long lo = strtol(p, &end, 10);
        if (end == p)
            break;
        long hi = lo;
        p = end;
        if (*p == '-') {
            hi = strtol(p + 1, &end, 10);
            p = end;
        }
        any = true;
        if (node >= lo && node <= hi)
            return true;
        if (*p == ',')
            p++;
        else
            break;
    }
    return !any && node == 0;
}

/* What the runtime and driver check of a property after the acl layer (vmm.Vmm.check_prop). */
aclError vs_check_prop_rt(vs_err *err, const vs_prop *p)
{
    if (p->loc_type > ACL_MEM_LOCATION_TYPE_HOST_NUMA)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "prop.location.type=%u is not an aclrtMemLocationType",
                      p->loc_type);
    if (p->loc_type == ACL_MEM_LOCATION_TYPE_UNREGISTERED || p->loc_type == ACL_MEM_LOCATION_TYPE_MANAGED)
        return vs_set(err, ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
                      "prop.location.type=%u is not supported: use ACL_MEM_LOCATION_TYPE_DEVICE (1), HOST (0) or "
                      "HOST_NUMA (4)", p->loc_type);
    if (p->handle_type != ACL_MEM_HANDLE_TYPE_NONE && p->handle_type != ACL_MEM_HANDLE_TYPE_POSIX)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "prop.handleType=%u: use ACL_MEM_HANDLE_TYPE_NONE (0)",
                      p->handle_type);
    if (p->allocation_type != ACL_MEM_ALLOCATION_TYPE_PINNED)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "prop.allocationType=%u: only ACL_MEM_ALLOCATION_TYPE_PINNED",
                      p->allocation_type);
    if (p->mem_attr >= 18)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "prop.memAttr=%u is not an aclrtMemAttr", p->mem_attr);
    if (p->reserve)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "prop.reserve=%llu: it is reserved and must be 0",
                      (unsigned long long)p->reserve);
    if (p->loc_type == ACL_MEM_LOCATION_TYPE_DEVICE) {
        aclError rc = vs_device_id(err, p->loc_id);
        if (rc)
            return rc;
    } else if (p->loc_type == ACL_MEM_LOCATION_TYPE_HOST && p->loc_id != 0) {
        return vs_set(err, ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
                      "a HOST location's id is 0, not %lld: to place host memory on a NUMA node, use "
                      "ACL_MEM_LOCATION_TYPE_HOST_NUMA (4) with the node's id", (long long)p->loc_id);
    } else if (p->loc_type == ACL_MEM_LOCATION_TYPE_HOST_NUMA) {
        char nodes[256];
        if (!numa_node_online(p->loc_id, nodes, sizeof nodes))
            return vs_set(err, ACL_ERROR_RT_PARAM_INVALID,
                          "NUMA node %lld does not exist on this machine: its nodes are %s", (long long)p->loc_id, nodes);
    }
    if (huge1g(p->mem_attr) && host_location(p->loc_type))
        return vs_set(err, ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
                      "%s: 1 GiB pages are device memory only; host memory takes the normal or 2 MiB huge attributes",
                      ATTR_NAMES[p->mem_attr]);
    return ACL_SUCCESS;
}

/* The attribute the runtime reports for memory made with `p` (props.reported_attr). */
uint32_t vs_reported_attr(const vs_prop *p)
{
    uint32_t a = p->mem_attr;
    if (host_location(p->loc_type)) {
        if (a == ACL_DDR_MEM_HUGE) return ACL_MEM_HUGE;
        if (a == ACL_DDR_MEM_NORMAL) return ACL_MEM_NORMAL;
        if (a == ACL_DDR_MEM_P2P_HUGE) return ACL_MEM_P2P_HUGE;
        if (a == ACL_MEM_P2P_NORMAL) return ACL_DDR_MEM_P2P_NORMAL;
        return a;
    }
    if (a == ACL_MEM_NORMAL) return ACL_HBM_MEM_NORMAL;
    if (a == ACL_MEM_HUGE) return ACL_HBM_MEM_HUGE;
    if (a == ACL_MEM_HUGE1G) return ACL_HBM_MEM_HUGE1G;
    return a;
}

