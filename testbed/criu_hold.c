/*
 * criu_hold.so: preloaded into CRIU by the tests (never by podshim) to hold a dump, by
 * construction, at the instant where ending CRIU is most harmful: while the task it dumps runs a
 * system call CRIU injected into it. compel (CRIU's infection library) swaps a `syscall; int3`
 * into the task's first executable page, sets the task's registers to the call, PTRACE_CONTs it
 * and, once the task trapped, puts registers and code back. CRIU killed in between: the task,
 * no longer traced, runs into the int3 and dies of SIGTRAP (docs/design/crash-safety.md (Crash
 * safety)). Or in the middle of the task's memory images, where ending CRIU harms nothing: for a
 * test that acts while CRIU still dumps, ending CRIU or not ("pages", below).
 *
 * PODSHIM_CRIU_HOLD=<dir>: when <dir>/hold exists and holds "<nr> <pid> [<pid>...]", CRIU stops
 * itself (SIGSTOP) right after its PTRACE_CONT of the first injected system call number <nr>
 * (-1: any) into one of the pids, once per CRIU process, after writing "<nr> <pid>" to
 * <dir>/held-<CRIU's pid>. Nothing else changes; without the file it does nothing.
 *
 * "pages <bytes>" in <dir>/hold instead: CRIU stops itself once it has written <bytes> in all
 * into its pages-*.img images (splice, from the pipes its parasite filled), after writing
 * "pages <pid>" to <dir>/held-<CRIU's pid>, <pid> being the process whose memory it dumps (the
 * one it last made a ptrace request to). CRIU is then in its own code and the task in CRIU's
 * parasite, waiting for its next command: ending CRIU there leaves the task unharmed (the
 * parasite, its socket closed, returns the task to what it ran), unlike at an injected call.
 * Only in a process whose executable is named criu* (the library is preloaded into everything
 * the held podshim starts).
 *
 * Built by testbed/criu_hold.py: cc -shared -fPIC -O2 -o criu_hold.so criu_hold.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <elf.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/user.h>
#include <unistd.h>

typedef long (*ptrace_fn)(enum __ptrace_request, pid_t, void *, void *);
typedef ssize_t (*splice_fn)(int, loff_t *, int, loff_t *, size_t, unsigned int);

static int held;            /* this CRIU held once already */
static pid_t regs_pid = -1; /* the task whose registers were last set, and the call in them */
static long regs_nr = -2;
static pid_t last_traced = -1; /* the pid of CRIU's last successful ptrace request */
static long long pages_written; /* bytes spliced into pages-*.img images */

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

/* The bytes of pages <dir>/hold asks CRIU to be held after ("pages <bytes>"), or -1. */
static long long pages_wanted(const char *dir)
{
	char path[4096], buf[64];
	snprintf(path, sizeof(path), "%s/hold", dir);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	ssize_t n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return -1;
	buf[n] = '\0';
	if (strncmp(buf, "pages ", 6) != 0)
		return -1;
	char *end;
	long long want = strtoll(buf + 6, &end, 10);
	return end == buf + 6 || want < 0 ? -1 : want;
}

/* Whether this process's executable is named criu* (looked up once). */
static int is_criu(void)
{
	static int known = -1;
	if (known < 0) {
		char exe[4096];
		ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
		exe[n > 0 ? n : 0] = '\0';
		const char *base = strrchr(exe, '/');
		known = strncmp(base ? base + 1 : exe, "criu", 4) == 0;
	}
	return known;
}

/* Whether `fd` is open on a pages-*.img image. */
static int pages_image(int fd)
{
	char link[64], target[4096];
	snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
	ssize_t n = readlink(link, target, sizeof(target) - 1);
	if (n <= 0)
		return 0;
	target[n] = '\0';
	const char *base = strrchr(target, '/');
	base = base ? base + 1 : target;
	size_t len = strlen(base);
	return strncmp(base, "pages-", 6) == 0 && len > 10 && strcmp(base + len - 4, ".img") == 0;
}

/* The process (thread group) of thread `tid`, or `tid` when /proc cannot tell. */
static pid_t tgid_of(pid_t tid)
{
	char path[64], buf[4096];
	snprintf(path, sizeof(path), "/proc/%d/status", (int)tid);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return tid;
	ssize_t n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return tid;
	buf[n] = '\0';
	const char *line = strstr(buf, "\nTgid:");
	return line ? (pid_t)strtol(line + 6, NULL, 10) : tid;
}

static void hold(const char *dir, const char *what, pid_t pid)
{
	char path[4096], line[64];
	snprintf(path, sizeof(path), "%s/held-%d", dir, (int)getpid());
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	if (fd >= 0) {
		int len = snprintf(line, sizeof(line), "%s %d\n", what, (int)pid);
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
	if (ret >= 0 && pid > 0)
		last_traced = pid;
	const char *dir = getenv("PODSHIM_CRIU_HOLD");
	if (ret < 0 || !dir || held)
		return ret;
	if (request == PTRACE_SETREGSET && (long)addr == NT_PRSTATUS) {
		regs_pid = pid;
#ifdef __x86_64__
		struct iovec *iov = data;
		regs_nr = iov->iov_len == sizeof(struct user_regs_struct)
				  ? (long)((struct user_regs_struct *)iov->iov_base)->rax
				  : -2;
#else
		regs_nr = -2; /* the call number is read on x86-64 only: no call hold elsewhere */
#endif
	} else if (request == PTRACE_CONT && pid == regs_pid) {
		long nr = regs_nr;
		regs_pid = -1;
		if (wanted(dir, nr, pid)) {
			char what[32];
			snprintf(what, sizeof(what), "%ld", nr);
			held = 1;
			hold(dir, what, pid);
		}
	}
	return ret;
}

ssize_t splice(int fd_in, loff_t *off_in, int fd_out, loff_t *off_out, size_t len,
	       unsigned int flags)
{
	static splice_fn real;
	if (!real)
		real = (splice_fn)dlsym(RTLD_NEXT, "splice");
	ssize_t ret = real(fd_in, off_in, fd_out, off_out, len, flags);
	const char *dir = getenv("PODSHIM_CRIU_HOLD");
	if (ret <= 0 || !dir || held || !is_criu() || !pages_image(fd_out))
		return ret;
	int saved = errno;
	pages_written += ret;
	long long want = pages_wanted(dir);
	if (want >= 0 && pages_written >= want) {
		held = 1;
		hold(dir, "pages", last_traced > 0 ? tgid_of(last_traced) : -1);
	}
	errno = saved;
	return ret;
}
