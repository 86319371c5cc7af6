/* What the writable-bind tests run, built static (any base runs it):
     setid_probe whoami              setuid(0), setgid(0), then prints "euid=N egid=N"
     setid_probe plant METHOD DST    copies itself to DST with mode 04755 (06755 for
                                     "sgid") by METHOD: chmod fchmod fchmodat fchmodat2
                                     creat open openat mknod openat2 sgid
     setid_probe mknod_dev DST       a character device 1,3 (what /dev/null is) at DST
     setid_probe vsock               socket(AF_VSOCK, SOCK_STREAM, 0)
     setid_probe reach PID...        for each PID: "ptrace-PID" (PTRACE_ATTACH, then
                                     detach), "mem-PID" (open /proc/PID/mem for writing)
                                     and "signal-PID" (kill with signal 0)
   Each prints "NAME ok" or "NAME errno N". */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#ifndef SYS_openat2
#define SYS_openat2 437
#endif
#ifndef SYS_fchmodat2
#define SYS_fchmodat2 452
#endif

struct open_how_ { unsigned long long flags, mode, resolve; };

static int copy_self(int out) {
    char buf[65536];
    int in = open("/proc/self/exe", O_RDONLY);
    if (in < 0) return -1;
    ssize_t n;
    while ((n = read(in, buf, sizeof buf)) > 0)
        if (write(out, buf, (size_t)n) != n) { close(in); return -1; }
    close(in);
    return n < 0 ? -1 : 0;
}

static int plain(const char *dst) {
    int fd = open(dst, O_WRONLY | O_CREAT | O_TRUNC, 0755);
    if (fd < 0 || copy_self(fd) < 0) return -1;
    return fd;
}

static long plant(const char *how, const char *dst) {
    const mode_t mode = 04755;
    int fd;
    if (!strcmp(how, "chmod") || !strcmp(how, "sgid")) {
        if ((fd = plain(dst)) < 0) return -1;
        close(fd);
        return chmod(dst, !strcmp(how, "sgid") ? 02755 : mode);
    }
    if (!strcmp(how, "fchmod")) {
        if ((fd = plain(dst)) < 0) return -1;
        long rc = fchmod(fd, mode);
        close(fd);
        return rc;
    }
    if (!strcmp(how, "fchmodat")) {
        if ((fd = plain(dst)) < 0) return -1;
        close(fd);
        return fchmodat(AT_FDCWD, dst, mode, 0);
    }
    if (!strcmp(how, "fchmodat2")) {
        if ((fd = plain(dst)) < 0) return -1;
        close(fd);
        return syscall(SYS_fchmodat2, AT_FDCWD, dst, mode, 0);
    }
    if (!strcmp(how, "creat")) fd = (int)syscall(SYS_creat, dst, mode);
    else if (!strcmp(how, "open")) fd = (int)syscall(SYS_open, dst, O_WRONLY | O_CREAT | O_TRUNC, mode);
    else if (!strcmp(how, "openat")) fd = (int)syscall(SYS_openat, AT_FDCWD, dst, O_WRONLY | O_CREAT | O_TRUNC, mode);
    else if (!strcmp(how, "openat2")) {
        struct open_how_ h = {O_WRONLY | O_CREAT | O_TRUNC, mode, 0};
        fd = (int)syscall(SYS_openat2, AT_FDCWD, dst, &h, sizeof h);
    } else if (!strcmp(how, "mknod")) {
        if (syscall(SYS_mknodat, AT_FDCWD, dst, S_IFREG | mode, 0) < 0) return -1;
        fd = open(dst, O_WRONLY);
    } else {
        errno = EINVAL;
        return -1;
    }
    if (fd < 0) return -1;
    long rc = copy_self(fd);
    close(fd);
    return rc;
}

static void report(const char *name, long rc) {
    if (rc < 0) printf("%s errno %d\n", name, errno);
    else printf("%s ok\n", name);
}

int main(int argc, char **argv) {
    if (argc >= 2 && !strcmp(argv[1], "whoami")) {
        if (setuid(0) < 0 || setgid(0) < 0) { /* what an unprivileged caller gets */ }
        printf("euid=%d egid=%d\n", (int)geteuid(), (int)getegid());
        return 0;
    }
    if (argc == 4 && !strcmp(argv[1], "plant")) {
        errno = 0;
        report(argv[2], plant(argv[2], argv[3]));
        return 0;
    }
    if (argc == 3 && !strcmp(argv[1], "mknod_dev")) {
        report("mknod_dev", mknod(argv[2], S_IFCHR | 0666, makedev(1, 3)));
        return 0;
    }
    if (argc == 2 && !strcmp(argv[1], "vsock")) {
        int fd = socket(40 /* AF_VSOCK */, SOCK_STREAM, 0);
        report("vsock", fd);
        return 0;
    }
    if (argc >= 3 && !strcmp(argv[1], "reach")) {
        char name[64], path[64];
        for (int i = 2; i < argc; i++) {
            pid_t pid = (pid_t)atoi(argv[i]);
            snprintf(name, sizeof name, "ptrace-%d", (int)pid);
            errno = 0;
            long rc = ptrace(PTRACE_ATTACH, pid, NULL, NULL);
            if (rc == 0) {
                waitpid(pid, NULL, __WALL);
                ptrace(PTRACE_DETACH, pid, NULL, NULL);
            }
            report(name, rc);
            snprintf(name, sizeof name, "mem-%d", (int)pid);
            snprintf(path, sizeof path, "/proc/%d/mem", (int)pid);
            int fd = open(path, O_RDWR);
            report(name, fd);
            if (fd >= 0) close(fd);
            snprintf(name, sizeof name, "signal-%d", (int)pid);
            report(name, kill(pid, 0));
        }
        return 0;
    }
    fprintf(stderr, "usage: setid_probe whoami | plant METHOD DST | mknod_dev DST | vsock | reach PID...\n");
    return 2;
}
