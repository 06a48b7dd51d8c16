/*
 * A child forked while another thread of its parent makes a GPU's context (its first use, which takes a while on a
 * GPU: the stand-in's FAKECUDA_RETAIN_DELAY_MS) must not hang in its own calls on a lock that thread held at the
 * fork: the child's GPU calls answer (on a real driver, with an error: CUDA is not usable across fork), never
 * block. tests/test_attacks_c_cuda.py builds it with the library's sources and the sanitizers.
 */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "acl/acl.h"

#include "checks.h"

/* Device 1's first GPU call: its context is made (slowly) under the backend's lock of contexts. */
static void *first_use_of_device_1(void *arg)
{
    (void)arg;
    size_t f = 0, t = 0;
    aclrtSetDevice(1);
    aclrtGetMemInfo(ACL_HBM_MEM, &f, &t);
    return NULL;
}

int main(void)
{
    (void)fd_count;
    size_t f = 0, t = 0;
    EXPECT(aclrtSetDevice(0), 0);
    EXPECT(aclrtGetMemInfo(ACL_HBM_MEM, &f, &t), 0); /* device 0's context made, before any thread */
    pthread_t th;
    TRUE(pthread_create(&th, NULL, first_use_of_device_1, NULL) == 0);
    usleep(300 * 1000); /* the thread is inside the retain of device 1's context */
    pid_t child = fork();
    if (child == 0) {
        alarm(5); /* a hang is the failure */
        aclrtSetDevice(0);
        aclrtGetMemInfo(ACL_HBM_MEM, &f, &t); /* device 0's context is known: whatever it answers, it answers */
        _exit(0);
    }
    int status = 0;
    TRUE(child > 0 && waitpid(child, &status, 0) == child);
    TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    if (WIFSIGNALED(status))
        printf("FAIL the child hung in aclrtGetMemInfo (killed by signal %d)\n", WTERMSIG(status));
    pthread_join(th, NULL);
    EXPECT(aclrtResetDevice(0), 0);
    EXPECT(aclrtResetDevice(1), 0);
    if (failures == 0)
        printf("ok (%d checks)\n", checks);
    return failures != 0;
}
