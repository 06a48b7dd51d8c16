/*
 * The table of this process's events and notifies: handles, the waits and stream tasks using each, destroy (whose
 * page goes with its last user), and how many times each notify key was imported here.
 */
#include <stdlib.h>

#include "sync.h"

static pthread_mutex_t objs_lock = PTHREAD_MUTEX_INITIALIZER;
static vs_vec objs = {NULL, 0, 0, sizeof(sync_obj *)};
static uint64_t next_event = 1, next_notify = 1;
static vs_vec opens = {NULL, 0, 0, sizeof(uint64_t) * 2}; /* (value, imports here) of notify keys */

static sync_obj *so_find(uint64_t handle, bool notify)
{
    for (size_t i = 0; i < objs.count; i++) {
        sync_obj *o = VS_AT(objs, sync_obj *, i);
        if (o->handle == handle && o->notify == notify)
            return o;
    }
    return NULL;
}

aclError so_not_live(vs_err *err, uint64_t handle, bool notify)
{
    return vs_set(err, ACL_ERROR_RT_INVALID_HANDLE, "%s %#llx is not a live %s of this process (destroyed, or a "
                  "handle of another kind)", notify ? "notify" : "event", (unsigned long long)handle,
                  notify ? "notify" : "event");
}

sync_obj *so_add(sync_obj *o)
{
    pthread_mutex_lock(&objs_lock);
    o->handle = o->notify ? 0x4E000000ULL + next_notify++ : 0xE7000000ULL + next_event++;
    *(sync_obj **)vs_vec_push(&objs, sizeof(sync_obj *)) = o;
    pthread_mutex_unlock(&objs_lock);
    return o;
}

sync_obj *so_use(vs_err *err, uint64_t handle, bool notify)
{
    pthread_mutex_lock(&objs_lock);
    sync_obj *o = so_find(handle, notify);
    if (o != NULL)
        o->users++;
    else
        so_not_live(err, handle, notify);
    pthread_mutex_unlock(&objs_lock);
    return o;
}

void so_unuse(void *arg)
{
    sync_obj *o = arg;
    pthread_mutex_lock(&objs_lock);
    bool done = --o->users == 0 && o->destroyed;
    pthread_mutex_unlock(&objs_lock);
    if (done) {
        pg_close(o->pg);
        free(o);
    }
}

/* Forget a handle; its page goes once no wait or task uses it. */
aclError so_destroy(vs_err *err, uint64_t handle, bool notify)
{
    pthread_mutex_lock(&objs_lock);
    sync_obj *o = so_find(handle, notify);
    if (o == NULL) {
        pthread_mutex_unlock(&objs_lock);
        return so_not_live(err, handle, notify);
    }
    for (size_t i = 0; i < objs.count; i++)
        if (VS_AT(objs, sync_obj *, i) == o) {
            vs_vec_remove(&objs, i);
            break;
        }
    o->destroyed = true;
    bool last_open = false;
    if (o->notify && o->opened)
        for (size_t i = 0; i < opens.count; i++) {
            uint64_t *e = (uint64_t *)opens.items + 2 * i;
            if (e[0] == o->pg->value) {
                last_open = --e[1] == 0;
                if (last_open)
                    vs_vec_remove(&opens, i);
                break;
            }
        }
    o->users++; /* (a wait ending meanwhile must not free the page this still uses) */
    pthread_mutex_unlock(&objs_lock);
    if (last_open) { /* no longer one of its producers */
        pg_lock(o->pg);
        pg_remove_holder(o->pg, sync_me());
        pg_unlock(o->pg);
    }
    so_unuse(o);
    return ACL_SUCCESS;
}

/* The stream a record or wait goes on: `stream` (0: the default one) of the current context. */
vs_stream *sync_stream_here(vs_err *err, aclrtStream stream)
{
    int device;
    if (vs_current_device(err, &device))
        return NULL;
    vs_lock();
    vs_stream *s = vs_stream_of(err, (uintptr_t)stream, true);
    vs_unlock();
    return s;
}

/* The event or notify `handle`, in use, and the stream its work goes on (`stream`; 0: the default one); NULL, with
 * err set, when either is not there. */
sync_obj *so_use_on(vs_err *err, uint64_t handle, bool notify, aclrtStream stream, vs_stream **s)
{
    *s = sync_stream_here(err, stream);
    return *s == NULL ? NULL : so_use(err, handle, notify);
}

/* Queue `run` on stream s (a record: run at once when the stream is idle); `drop` gives `arg` back, on failure too.
 * Not under the runtime's lock: a record takes the page's lock, which an importing process can hold, and that must
 * stall this stream only, never the process's other calls. */
aclError sync_queue(vs_err *err, vs_stream *s, const char *call, aclError (*run)(void *, vs_err *), void (*drop)(void *),
                    void *arg, bool record)
{
    return record ? vs_stream_run_or_submit(err, s, call, run, drop, arg)
                  : vs_stream_submit(err, s, call, run, drop, arg, false);
}

/* A wait's task is done with: the object it used goes back. */
void so_drop_wait(void *arg)
{
    wait_arg *a = arg;
    so_unuse(a->o);
    free(a);
}

/* One more import of the notify `value` in this process (its last destroy stops this process being a producer). */
void so_opened(uint64_t value)
{
    pthread_mutex_lock(&objs_lock);
    bool counted = false;
    for (size_t i = 0; i < opens.count && !counted; i++) {
        uint64_t *e = (uint64_t *)opens.items + 2 * i;
        if (e[0] == value) {
            e[1]++;
            counted = true;
        }
    }
    if (!counted) {
        uint64_t *e = vs_vec_push(&opens, sizeof(uint64_t) * 2);
        e[0] = value;
        e[1] = 1;
    }
    pthread_mutex_unlock(&objs_lock);
}

void so_lock(void)
{
    pthread_mutex_lock(&objs_lock);
}

void so_unlock(void)
{
    pthread_mutex_unlock(&objs_lock);
}

/* In a forked child: the parent's events and notifies are not its own. */
void so_after_fork(void)
{
    pthread_mutex_init(&objs_lock, NULL);
    for (size_t i = 0; i < objs.count; i++) /* (their pages go with the registry's) */
        free(VS_AT(objs, sync_obj *, i));
    objs.count = opens.count = 0;
}
