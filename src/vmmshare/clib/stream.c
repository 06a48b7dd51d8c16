/*
 * Streams' work: each stream runs what is queued on it in order, on a worker thread of its own (started with its
 * first queued task; work queued on an idle stream runs at once in the caller's thread). A failure is kept for the
 * next synchronize, and what is queued behind it does not run until then, but records (an event's, a notify's),
 * which other processes wait for. As vmmshare.runtime.streams has it.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "vs.h"

vs_stream *vs_stream_new(uint64_t handle, uint64_t context, int device)
{
    vs_stream *s = calloc(1, sizeof *s);
    if (s == NULL)
        return NULL;
    s->handle = handle;
    s->context = context;
    s->device = device;
    pthread_mutex_init(&s->m, NULL);
    pthread_cond_init(&s->cv, NULL);
    return s;
}

static void record_failure(vs_stream *s, aclError rc, const char *what, const vs_err *err)
{
    if (rc && !s->failed) {
        s->failed = rc;
        snprintf(s->message, sizeof s->message, "%s on stream %#llx failed: %.400s", what,
                 (unsigned long long)s->handle, err->message);
    }
}

static void *worker(void *arg)
{
    vs_stream *s = arg;
    pthread_mutex_lock(&s->m);
    for (;;) {
        while (s->head == NULL && !s->closed)
            pthread_cond_wait(&s->cv, &s->m);
        vs_task *t = s->head;
        if (t == NULL)
            break;
        s->head = t->next;
        if (s->head == NULL)
            s->tail = NULL;
        s->running = true;
        bool skip = s->failed && !t->always;
        pthread_mutex_unlock(&s->m);
        vs_err err;
        aclError rc = skip ? 0 : t->run(t->arg, &err);
        if (t->drop != NULL)
            t->drop(t->arg);
        pthread_mutex_lock(&s->m);
        s->running = false;
        record_failure(s, rc, t->what, &err);
        s->skipped += skip;
        free(t);
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->m);
    return NULL;
}

aclError vs_stream_submit(vs_err *err, vs_stream *s, const char *what, aclError (*run)(void *, vs_err *),
                          void (*drop)(void *), void *arg, bool always)
{
    vs_task *t = calloc(1, sizeof *t);
    if (t == NULL) {
        if (drop != NULL)
            drop(arg);
        return vs_set(err, ACL_ERROR_RT_MEMORY_ALLOCATION, "out of memory");
    }
    t->run = run;
    t->drop = drop;
    t->arg = arg;
    t->what = what;
    t->always = always;
    pthread_mutex_lock(&s->m);
    if (!s->has_thread) {
        if (pthread_create(&s->thread, NULL, worker, s) != 0) {
            pthread_mutex_unlock(&s->m);
            free(t);
            if (drop != NULL)
                drop(arg);
            return vs_set(err, ACL_ERROR_RT_RESOURCE_ALLOC_FAIL, "cannot start the stream's worker thread");
        }
        s->has_thread = true;
    }
    if (s->tail != NULL)
        s->tail->next = t;
    else
        s->head = t;
    s->tail = t;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->m);
    return ACL_SUCCESS;
}

aclError vs_stream_run_or_submit(vs_err *err, vs_stream *s, const char *what, aclError (*run)(void *, vs_err *),
                                 void (*drop)(void *), void *arg)
{
    pthread_mutex_lock(&s->m);
    if (s->head == NULL && !s->running) { /* the stream is here: nothing queued later can pass it */
        vs_err ran;
        aclError rc = run(arg, &ran);
        if (drop != NULL)
            drop(arg);
        record_failure(s, rc, what, &ran);
        pthread_mutex_unlock(&s->m);
        return ACL_SUCCESS;
    }
    pthread_mutex_unlock(&s->m);
    return vs_stream_submit(err, s, what, run, drop, arg, true);
}

aclError vs_stream_do(vs_err *err, vs_stream *s, const char *what, aclError (*run)(void *, vs_err *),
                      void (*drop)(void *), void *arg)
{
    pthread_mutex_lock(&s->m);
    if (s->head == NULL && !s->running) { /* nothing ahead of it: it runs now, in the caller's thread */
        if (s->failed) {
            s->skipped++;
        } else {
            vs_err ran;
            record_failure(s, run(arg, &ran), what, &ran);
        }
        if (drop != NULL)
            drop(arg);
        pthread_mutex_unlock(&s->m);
        return ACL_SUCCESS;
    }
    pthread_mutex_unlock(&s->m);
    return vs_stream_submit(err, s, what, run, drop, arg, false);
}

bool vs_stream_idle(vs_stream *s)
{
    pthread_mutex_lock(&s->m);
    bool idle = s->head == NULL && !s->running;
    pthread_mutex_unlock(&s->m);
    return idle;
}

/* Stop a stream no table names any more (called without the runtime's lock: its tasks may take it). */
void vs_stream_close(vs_stream *s, bool force)
{
    if (s == NULL)
        return;
    pthread_mutex_lock(&s->m);
    if (force) {
        s->aborted = true;
        while (s->head != NULL) {
            vs_task *t = s->head;
            s->head = t->next;
            if (t->drop != NULL)
                t->drop(t->arg);
            free(t);
        }
        s->tail = NULL;
    }
    s->closed = true;
    pthread_cond_broadcast(&s->cv);
    if (force && s->waiting != NULL) /* a task blocked in a wait gives up, so the thread ends (kicked under the */
        vs_sync_kick(s->waiting);    /* stream's lock: the wait clears `waiting` under it before its page can go) */
    bool joined = s->has_thread;
    pthread_mutex_unlock(&s->m);
    if (joined && !pthread_equal(s->thread, pthread_self()))
        pthread_join(s->thread, NULL);
    pthread_mutex_destroy(&s->m);
    pthread_cond_destroy(&s->cv);
    free(s);
}

/* Wait until the stream's queued work has run (at most `timeout_ms`, -1: no limit), then report (and clear) the
 * first failure since the last synchronize. Called without the runtime's lock (the work may need it). */
aclError vs_stream_report(vs_stream *s, int32_t timeout_ms, const char *call)
{
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    if (timeout_ms > 0) {
        deadline.tv_sec += timeout_ms / 1000;
        deadline.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
        if (deadline.tv_nsec >= 1000000000L) {
            deadline.tv_sec++;
            deadline.tv_nsec -= 1000000000L;
        }
    }
    pthread_mutex_lock(&s->m);
    while (s->head != NULL || s->running) {
        if (timeout_ms > 0) {
            if (pthread_cond_timedwait(&s->cv, &s->m, &deadline) == ETIMEDOUT && (s->head != NULL || s->running)) {
                int left = s->running;
                for (vs_task *t = s->head; t != NULL; t = t->next)
                    left++;
                pthread_mutex_unlock(&s->m);
                return vs_fail(ACL_ERROR_RT_STREAM_SYNC_TIMEOUT, call, "stream %#llx still has %d task(s) after "
                               "%d ms", (unsigned long long)s->handle, left, timeout_ms);
            }
        } else {
            pthread_cond_wait(&s->cv, &s->m);
        }
    }
    aclError code = s->failed;
    int skipped = s->skipped;
    char message[512];
    snprintf(message, sizeof message, "%s", s->message);
    s->failed = 0;
    s->skipped = 0;
    pthread_mutex_unlock(&s->m);
    if (!code)
        return ACL_SUCCESS;
    if (skipped)
        return vs_fail(code, call, "%s; %d task(s) queued after it did not run", message, skipped);
    return vs_fail(code, call, "%s", message);
}

