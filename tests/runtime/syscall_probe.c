/* Tries the syscalls named on the command line and prints "NAME ok" or "NAME errno N"
   for each: the seccomp tests run it inside a sandbox (built static, so any base runs it). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/perf_event.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/personality.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

static void *nothing(void *arg) { return arg; }

#if defined(__x86_64__)
/* the 32-bit entry point: a filter must cover it too (keyctl is 288 there) */
static long int80(long nr, long a, long b, long c) {
    long ret;
    __asm__ volatile("int $0x80" : "=a"(ret) : "a"(nr), "b"(a), "c"(b), "d"(c) : "memory");
    if (ret < 0 && ret > -4096) { errno = (int)-ret; return -1; }
    return ret;
}
#endif

static long try_one(const char *name) {
    if (!strcmp(name, "keyctl")) return syscall(SYS_keyctl, 0 /* GET_KEYRING_ID */, -3 /* session */, 1);
#if defined(__x86_64__)
    if (!strcmp(name, "keyctl_int80")) return int80(288, 0, -3, 1);
#endif
    if (!strcmp(name, "add_key")) return syscall(SYS_add_key, "user", "aospec", "x", 1, -2 /* process */);
    if (!strcmp(name, "request_key")) return syscall(SYS_request_key, "user", "aospec-none", NULL, 0);
    if (!strcmp(name, "perf_event_open")) {
        struct perf_event_attr a;
        memset(&a, 0, sizeof a);
        a.type = PERF_TYPE_SOFTWARE;
        a.size = sizeof a;
        a.config = PERF_COUNT_SW_TASK_CLOCK;
        a.exclude_kernel = 1;
        a.exclude_hv = 1;
        return syscall(SYS_perf_event_open, &a, 0, -1, -1, 0);
    }
    if (!strcmp(name, "userfaultfd")) return syscall(SYS_userfaultfd, O_CLOEXEC | 1 /* USER_MODE_ONLY */);
    if (!strcmp(name, "io_uring_setup")) {
        char params[120];
        memset(params, 0, sizeof params);
        return syscall(SYS_io_uring_setup, 1, params);
    }
    if (!strcmp(name, "bpf")) {
        char attr[128];
        memset(attr, 0, sizeof attr);
        return syscall(SYS_bpf, 0 /* MAP_CREATE */, attr, sizeof attr);
    }
    if (!strcmp(name, "unshare")) return unshare(0);
    if (!strcmp(name, "setns")) return setns(-1, 0);
    if (!strcmp(name, "mount")) return mount("none", "/tmp", "tmpfs", 0, NULL);
    if (!strcmp(name, "name_to_handle_at")) {
        struct { unsigned int bytes; int type; unsigned char h[128]; } fh = {128, 0, {0}};
        int id;
        return syscall(SYS_name_to_handle_at, AT_FDCWD, "/", &fh, &id, 0);
    }
    if (!strcmp(name, "get_mempolicy")) return syscall(SYS_get_mempolicy, NULL, NULL, 0, NULL, 0);
    if (!strcmp(name, "personality_query")) return personality(0xffffffff) == -1 ? -1 : 0;
    if (!strcmp(name, "personality_linux")) return personality(PER_LINUX) == -1 ? -1 : 0;
    if (!strcmp(name, "personality_norandom")) return personality(ADDR_NO_RANDOMIZE) == -1 ? -1 : 0;
    if (!strcmp(name, "clone3")) return syscall(SYS_clone3, NULL, 0);
    if (!strcmp(name, "clone_newns")) {
        long pid = syscall(SYS_clone, CLONE_NEWNS | SIGCHLD, 0, 0, 0, 0);
        if (pid == 0) _exit(0);
        if (pid > 0) waitpid((pid_t)pid, NULL, 0);
        return pid < 0 ? -1 : 0;
    }
    if (!strcmp(name, "fork")) {
        pid_t pid = fork();
        if (pid == 0) _exit(0);
        if (pid > 0) waitpid(pid, NULL, 0);
        return pid < 0 ? -1 : 0;
    }
    if (!strcmp(name, "thread")) {
        pthread_t t;
        int rc = pthread_create(&t, NULL, nothing, NULL);
        if (rc) { errno = rc; return -1; }
        return pthread_join(t, NULL) ? -1 : 0;
    }
    errno = EINVAL;
    return -2;
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        errno = 0;
        long rc = try_one(argv[i]);
        if (rc == -2) printf("%s unknown\n", argv[i]);
        else if (rc < 0) printf("%s errno %d\n", argv[i], errno);
        else printf("%s ok\n", argv[i]);
    }
    return 0;
}
