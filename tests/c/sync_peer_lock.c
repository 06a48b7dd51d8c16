/*
 * A process that imported a notify holds its page's record lock (as any importer can, for as long as it likes): a
 * record of the notify blocks, and only that: the exporter's other threads go on allocating, creating streams and
 * events. The child takes the lock; the parent waits until /proc/locks shows its record blocked on it, makes its
 * other calls, then lets the child go and joins the record. Prints each step's codes.
 */
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "acl/acl.h"

static aclrtNotify notify;
static atomic_int recorded = -1; /* the record's code once it returns */

static void *record(void *unused)
{
    (void)unused;
    aclrtSetDevice(0);
    atomic_store(&recorded, (int)aclrtRecordNotify(notify, NULL));
    return NULL;
}

/* Whether /proc/locks lists a blocked request of process `pid`. */
static bool blocked(pid_t pid)
{
    FILE *f = fopen("/proc/locks", "r");
    char line[256], who[32];
    bool found = false;
    snprintf(who, sizeof who, " %d ", (int)pid);
    while (f != NULL && !found && fgets(line, sizeof line, f) != NULL)
        found = strstr(line, "->") != NULL && strstr(line, who) != NULL;
    if (f != NULL)
        fclose(f);
    return found;
}

static int child(int in, int out)
{
    char key[65];
    if (read(in, key, sizeof key) != (ssize_t)sizeof key || aclrtSetDevice(0) != ACL_SUCCESS)
        return 2;
    aclrtNotify mine;
    if (aclrtNotifyImportByKey(&mine, key, 0) != ACL_SUCCESS)
        return 3;
    int fd = -1;
    DIR *d = opendir("/proc/self/fd");
    for (struct dirent *e; d != NULL && (e = readdir(d)) != NULL;) {
        char path[300], target[300] = {0};
        snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
        if (readlink(path, target, sizeof target - 1) > 0 && strstr(target, "vmmshare:sync") != NULL)
            fd = atoi(e->d_name);
    }
    if (d != NULL)
        closedir(d);
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
    if (fd < 0 || fcntl(fd, F_SETLK, &fl) != 0)
        return 4;
    char c = 'x';
    if (write(out, &c, 1) != 1 || read(in, &c, 1) != 1) /* held until the parent says so */
        return 5;
    return 0; /* the lock goes with the process */
}

int main(void)
{
    setvbuf(stdout, NULL, _IONBF, 0);
    alarm(60); /* a hang is a failure, not a stuck test */
    int down[2], up[2];
    if (pipe(down) != 0 || pipe(up) != 0)
        return 1;
    pid_t pid = fork();
    if (pid == 0)
        _exit(child(down[0], up[1]));
    aclrtSetDevice(0);
    char key[65] = {0};
    printf("create %d\n", aclrtCreateNotify(&notify, 0));
    printf("key %d\n", aclrtNotifyGetExportKey(notify, key, sizeof key, ACL_RT_NOTIFY_EXPORT_FLAG_DISABLE_PID_VALIDATION));
    char c;
    if (write(down[1], key, sizeof key) != (ssize_t)sizeof key || read(up[0], &c, 1) != 1)
        return 1;
    pthread_t t;
    pthread_create(&t, NULL, record, NULL);
    while (!blocked(getpid()))
        sched_yield();
    aclrtStream s;
    aclrtEvent e;
    void *p;
    int made = aclrtCreateStream(&s), host = aclrtMallocHost(&p, 4096), event = aclrtCreateEvent(&e);
    int gone = aclrtDestroyEvent(e) | aclrtFreeHost(p) | aclrtDestroyStream(s);
    printf("others %d %d %d %d while the record waits %d\n", made, host, event, gone, atomic_load(&recorded) == -1);
    if (write(down[1], &c, 1) != 1)
        return 1;
    pthread_join(t, NULL);
    int status;
    waitpid(pid, &status, 0);
    printf("record %d child %d\n", atomic_load(&recorded), WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    printf("destroy %d\n", aclrtDestroyNotify(notify));
    return 0;
}
