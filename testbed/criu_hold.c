/*
 * criu_hold.so: preloaded into CRIU by the tests (never by podshim) to hold a dump, by
 * construction, at the instant where ending CRIU is most harmful: while the task it dumps runs a
 * system call CRIU injected into it. compel (CRIU's infection library) swaps a `syscall; int3`
 * into the task's first executable page, sets the task's registers to the call, PTRACE_CONTs it
 * and, once the task trapped, puts registers and code back. CRIU killed in between: the task,
 * no longer traced, runs into the int3 and dies of SIGTRAP (docs/architecture.md §16 (Crash
 * safety)).
 *
 * PODSHIM_CRIU_HOLD=<dir>: when <dir>/hold exists and holds "<nr> <pid> [<pid>...]", CRIU stops
 * itself (SIGSTOP) right after its PTRACE_CONT of the first injected system call number <nr>
 * (-1: any) into one of the pids, once per CRIU process, after writing "<nr> <pid>" to
 * <dir>/held-<CRIU's pid>. Nothing else changes; without the file it does nothing.
 *
 * Built by testbed/criu_hold.py: cc -shared -fPIC -O2 -o criu_hold.so criu_hold.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/uio.h>
#include <sys/user.h>
#include <unistd.h>

typedef long (*ptrace_fn)(enum __ptrace_request, pid_t, void *, void *);

static int held;            /* this CRIU held once already */
static pid_t regs_pid = -1; /* the task whose registers were last set, and the call in them */
static long regs_nr = -2;

/* Whether <dir>/hold names call `nr` into task `pid`. */
static int wanted(const char *dir, long nr, pid_t pid)
{
	char path[4096], buf[4096];
	snprintf(path, sizeof(path), "%s/hold", dir);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return 0;
	ssize_t n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return 0;
	buf[n] = '\0';
	char *end;
	long want = strtol(buf, &end, 10);
	if (end == buf || (want != -1 && want != nr))
		return 0;
	for (char *p = end;;) {
		long target = strtol(p, &end, 10);
		if (end == p)
			return 0;
		if (target == pid)
			return 1;
		p = end;
	}
}

static void hold(const char *dir, long nr, pid_t pid)
{
	char path[4096], line[64];
	snprintf(path, sizeof(path), "%s/held-%d", dir, (int)getpid());
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	if (fd >= 0) {
		int len = snprintf(line, sizeof(line), "%ld %d\n", nr, (int)pid);
		if (write(fd, line, len) != len)
			perror("criu_hold: write");
		close(fd);
	}
	raise(SIGSTOP); /* until someone sends SIGCONT (or SIGKILL) */
}

long ptrace(enum __ptrace_request request, ...)
{
	static ptrace_fn real;
	va_list ap;
	va_start(ap, request);
	pid_t pid = va_arg(ap, pid_t);
	void *addr = va_arg(ap, void *);
	void *data = va_arg(ap, void *);
	va_end(ap);
	if (!real)
		real = (ptrace_fn)dlsym(RTLD_NEXT, "ptrace");
	long ret = real(request, pid, addr, data);
	const char *dir = getenv("PODSHIM_CRIU_HOLD");
	if (ret < 0 || !dir || held)
		return ret;
	if (request == PTRACE_SETREGSET && (long)addr == NT_PRSTATUS) {
		struct iovec *iov = data;
		regs_pid = pid;
		regs_nr = iov->iov_len == sizeof(struct user_regs_struct)
				  ? (long)((struct user_regs_struct *)iov->iov_base)->rax
				  : -2;
	} else if (request == PTRACE_CONT && pid == regs_pid) {
		long nr = regs_nr;
		regs_pid = -1;
		if (wanted(dir, nr, pid)) {
			held = 1;
			hold(dir, nr, pid);
		}
	}
	return ret;
}
