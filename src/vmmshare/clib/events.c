/*
 * Events and IPC events (aclrtCreateEvent*, record, query, synchronize, stream wait, the 64-byte handle, destroy),
 * as vmmshare.runtime.events has them: word ISSUED counts the records made (a ticket each), word 0 holds the ticket
 * of the last record its stream reached; a wait waits for the ticket last issued when it was called.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sync.h"

/* ---------------------------------------------------------------- events */

#define EX_FLAGS (ACL_EVENT_SYNC | 0x2u | 0x4u | ACL_EVENT_TIME_LINE | ACL_EVENT_IPC)
#define PLAIN_FLAGS (ACL_EVENT_SYNC | 0x2u | 0x4u | ACL_EVENT_TIME_LINE | 0x10u | 0x20u)
#define DEFAULT_FLAGS 0x0Eu

static aclError create_event(aclrtEvent *event, uint32_t flags, bool ex, const char *call)
{
    START(call);
    ACL_REQUIRE(event != NULL, call, "event is NULL");
    const uint32_t alone[] = {0x10u, 0x20u, ACL_EVENT_IPC};
    for (int i = 0; i < 3; i++)
        if ((flags & alone[i]) && (flags & ~alone[i]))
            return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "flag=%#x: %#x must be used alone", flags, alone[i]);
    uint32_t allowed = ex ? EX_FLAGS : PLAIN_FLAGS;
    if (!(flags & allowed) || flags > allowed)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, ex ? "flag=%#x: use ACL_EVENT_SYNC, CAPTURE_STREAM_PROGRESS "
                       "and TIME_LINE combined, or ACL_EVENT_IPC (0x40) alone" : "flag=%#x: use ACL_EVENT_SYNC, "
                       "CAPTURE_STREAM_PROGRESS and TIME_LINE combined (aclrtCreateEventExWithFlag takes "
                       "ACL_EVENT_IPC)", flags);
    if (flags == 0x10u || flags == 0x20u)
        return vs_fail(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, call, "flag=%#x: vmmshare has no device-only or "
                       "graph-external events (no kernels or ACL graphs run here)", flags);
    int device;
    if (vs_current_device(&err, &device))
        return vs_raise(&err, call);
    sync_obj *o = calloc(1, sizeof *o);
    if (o == NULL)
        return vs_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call, "out of memory");
    aclError rc = flags == ACL_EVENT_IPC ? pg_create(&err, MAGIC_EVENT, &o->pg) : pg_private(&err, &o->pg);
    if (rc) {
        free(o);
        return vs_raise(&err, call);
    }
    o->flags = flags;
    o->device = device;
    *event = (aclrtEvent)(uintptr_t)so_add(o)->handle;
    return ACL_SUCCESS;
}

VS_API aclError aclrtCreateEvent(aclrtEvent *event)
{
    return create_event(event, DEFAULT_FLAGS, false, "aclrtCreateEvent");
}

VS_API aclError aclrtCreateEventWithFlag(aclrtEvent *event, uint32_t flag)
{
    return create_event(event, flag, false, "aclrtCreateEventWithFlag");
}

VS_API aclError aclrtCreateEventExWithFlag(aclrtEvent *event, uint32_t flag)
{
    return create_event(event, flag, true, "aclrtCreateEventExWithFlag");
}

VS_API aclError aclrtDestroyEvent(aclrtEvent event)
{
    const char *call = "aclrtDestroyEvent";
    START(call);
    ACL_REQUIRE(event != NULL, call, "event is NULL");
    return so_destroy(&err, (uintptr_t)event, false) ? vs_raise(&err, call) : ACL_SUCCESS;
}

typedef struct record_arg {
    sync_obj *o;
    uint32_t ticket;
} record_arg;

/* The stream reached the record: the state becomes its ticket, unless a newer one completed first. */
static aclError complete_record(void *arg, vs_err *err)
{
    (void)err;
    record_arg *r = arg;
    page *p = r->o->pg;
    pg_lock(p);
    uint32_t w = pg_get(p);
    if (sync_newer(r->ticket, w & STATE))
        pg_set(p, r->ticket | (w & ~(STATE | DEAD)));
    pg_unlock(p);
    return ACL_SUCCESS;
}

static void drop_record(void *arg)
{
    record_arg *r = arg;
    so_unuse(r->o);
    free(r);
}

VS_API aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream)
{
    const char *call = "aclrtRecordEvent";
    START(call);
    ACL_REQUIRE(event != NULL, call, "event is NULL");
    vs_stream *s;
    sync_obj *o = so_use_on(&err, (uintptr_t)event, false, stream, &s);
    if (o == NULL)
        return vs_raise(&err, call);
    record_arg *r = malloc(sizeof *r);
    if (r == NULL) {
        so_unuse(o);
        return vs_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call, "out of memory");
    }
    page *p = o->pg;
    pg_lock(p); /* the next ticket, now; this process the producer; a DEAD left by an earlier record cleared */
    uint32_t ticket = (*pg_word(p, W_ISSUED) % STATE) + 1;
    *pg_word(p, W_ISSUED) = ticket;
    if (p->fd >= 0) {
        ident mine = sync_me();
        pg_set_holders(p, &mine, 1);
    }
    uint32_t w = pg_get(p);
    if (w & DEAD)
        pg_set(p, w & ~DEAD);
    pg_unlock(p);
    r->o = o;
    r->ticket = ticket;
    return sync_queue(&err, s, call, complete_record, drop_record, r, true) ? vs_raise(&err, call) : ACL_SUCCESS;
}

VS_API aclError aclrtQueryEventStatus(aclrtEvent event, aclrtEventRecordedStatus *status)
{
    const char *call = "aclrtQueryEventStatus";
    START(call);
    ACL_REQUIRE(event != NULL, call, "event is NULL");
    ACL_REQUIRE(status != NULL, call, "status is NULL");
    sync_obj *o = so_use(&err, (uintptr_t)event, false);
    if (o == NULL)
        return vs_raise(&err, call);
    bool busy = sync_newer(*pg_word(o->pg, W_ISSUED), pg_get(o->pg) & STATE);
    so_unuse(o);
    *status = busy ? ACL_EVENT_RECORDED_STATUS_NOT_READY : ACL_EVENT_RECORDED_STATUS_COMPLETE;
    return ACL_SUCCESS;
}

static aclError wait_failed(vs_err *err, int got, sync_obj *o, const char *what, double timeout)
{
    if (got == TIMEOUT)
        return vs_set(err, ACL_ERROR_RT_EVENT_SYNC_TIMEOUT, "event %#llx did not complete within %g s",
                      (unsigned long long)o->handle, timeout);
    if (got == GONE)
        return vs_set(err, ACL_ERROR_RT_SUSPECT_REMOTE_ERROR, "the process that recorded event %#llx last exited "
                      "before its stream reached the record: it will never complete", (unsigned long long)o->handle);
    if (got == CANCELLED)
        return vs_set(err, ACL_ERROR_RT_STREAM_ABORT, "%s of event %#llx: the stream was destroyed while it waited",
                      what, (unsigned long long)o->handle);
    return ACL_SUCCESS;
}

static aclError synchronize(aclrtEvent event, double timeout, const char *call)
{
    START(call);
    ACL_REQUIRE(event != NULL, call, "event is NULL");
    sync_obj *o = so_use(&err, (uintptr_t)event, false);
    if (o == NULL)
        return vs_raise(&err, call);
    uint32_t target = *pg_word(o->pg, W_ISSUED);
    int got = pg_wait(o->pg, sync_event_ready, target, timeout, NULL);
    aclError rc = wait_failed(&err, got, o, "synchronize", timeout);
    so_unuse(o);
    return rc ? vs_raise(&err, call) : ACL_SUCCESS;
}

VS_API aclError aclrtSynchronizeEvent(aclrtEvent event)
{
    return synchronize(event, -1, "aclrtSynchronizeEvent");
}

VS_API aclError aclrtSynchronizeEventWithTimeout(aclrtEvent event, int32_t timeout)
{
    const char *call = "aclrtSynchronizeEventWithTimeout";
    if (timeout < -1)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "timeout=%d: must be in [-1, INT_MAX]", timeout);
    if (event == NULL)
        return vs_fail(ACL_ERROR_INVALID_PARAM, call, "event is NULL");
    if (timeout == 0)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                       "timeout=0: must be -1 (no limit) or a positive number of milliseconds");
    return synchronize(event, timeout == -1 ? -1 : timeout / 1000.0, call);
}


static aclError stream_wait(void *arg, vs_err *err)
{
    wait_arg *a = arg;
    pthread_mutex_lock(&a->s->m);
    a->s->waiting = a->o->pg;
    pthread_mutex_unlock(&a->s->m);
    int got = pg_wait(a->o->pg, sync_event_ready, a->target, -1, a->s);
    pthread_mutex_lock(&a->s->m);
    a->s->waiting = NULL;
    pthread_mutex_unlock(&a->s->m);
    return wait_failed(err, got, a->o, "aclrtStreamWaitEvent", -1);
}


VS_API aclError aclrtStreamWaitEvent(aclrtStream stream, aclrtEvent event)
{
    const char *call = "aclrtStreamWaitEvent";
    START(call);
    if (event == NULL)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "event is NULL");
    vs_stream *s;
    sync_obj *o = so_use_on(&err, (uintptr_t)event, false, stream, &s);
    if (o == NULL)
        return vs_raise(&err, call);
    uint32_t target = *pg_word(o->pg, W_ISSUED);
    if (!sync_newer(target, pg_get(o->pg) & STATE)) { /* nothing to wait for */
        so_unuse(o);
        return ACL_SUCCESS;
    }
    wait_arg *a = calloc(1, sizeof *a);
    if (a == NULL) {
        so_unuse(o);
        return vs_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call, "out of memory");
    }
    a->o = o;
    a->s = s;
    a->target = target;
    return sync_queue(&err, s, call, stream_wait, so_drop_wait, a, false) ? vs_raise(&err, call) : ACL_SUCCESS;
}

VS_API aclError aclrtIpcGetEventHandle(aclrtEvent event, aclrtIpcEventHandle *handle)
{
    const char *call = "aclrtIpcGetEventHandle";
    START(call);
    ACL_REQUIRE(event != NULL, call, "event is NULL");
    ACL_REQUIRE(handle != NULL, call, "handle is NULL");
    sync_obj *o = so_use(&err, (uintptr_t)event, false);
    if (o == NULL)
        return vs_raise(&err, call);
    aclError rc = ACL_SUCCESS;
    if (o->flags != ACL_EVENT_IPC)
        rc = vs_set(&err, ACL_ERROR_RT_PARAM_INVALID, "event %#llx was created with flag %#x: only an event of "
                    "aclrtCreateEventExWithFlag(ACL_EVENT_IPC) has an IPC handle", (unsigned long long)o->handle,
                    o->flags);
    so_lock();
    if (rc == ACL_SUCCESS && !o->pg->exported)
        rc = pg_export(&err, o->pg, false);
    so_unlock();
    if (rc == ACL_SUCCESS) {
        memset(handle, 0, sizeof *handle);
        uint32_t server = vs_rt.config.server_id, magic = MAGIC_EVENT;
        memcpy(handle->reserved, &o->pg->value, 8);
        memcpy(handle->reserved + 8, &server, 4);
        memcpy(handle->reserved + 12, &magic, 4);
    }
    so_unuse(o);
    return rc ? vs_raise(&err, call) : ACL_SUCCESS;
}

VS_API aclError aclrtIpcOpenEventHandle(aclrtIpcEventHandle handle, aclrtEvent *event)
{
    const char *call = "aclrtIpcOpenEventHandle";
    START(call);
    ACL_REQUIRE(event != NULL, call, "event is NULL");
    uint64_t value;
    uint32_t server, magic;
    memcpy(&value, handle.reserved, 8);
    memcpy(&server, handle.reserved + 8, 4);
    memcpy(&magic, handle.reserved + 12, 4);
    bool zeros = true;
    for (size_t i = 16; i < ACL_IPC_EVENT_HANDLE_SIZE; i++)
        zeros &= handle.reserved[i] == 0;
    if (magic != MAGIC_EVENT || value == 0 || !zeros)
        return vs_fail(ACL_ERROR_RT_INVALID_HANDLE, call, "these 64 bytes are not an IPC event handle (pass what "
                       "aclrtIpcGetEventHandle gave)");
    if (server != vs_rt.config.server_id)
        return vs_fail(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, call, "this IPC event handle comes from server %#x: an IPC "
                       "event synchronises processes of one server", server);
    int device = 0;
    vs_current_device(&err, &device);
    sync_obj *o = calloc(1, sizeof *o);
    if (o == NULL)
        return vs_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call, "out of memory");
    if (pg_open(&err, value, MAGIC_EVENT, &o->pg)) {
        free(o);
        return vs_raise(&err, call);
    }
    o->flags = ACL_EVENT_IPC;
    o->device = device;
    o->opened = true;
    *event = (aclrtEvent)(uintptr_t)so_add(o)->handle;
    return ACL_SUCCESS;
}

