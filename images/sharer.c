/*
 * sharer: holds state shared between two containers of a pod (podshim's tests of what a pod
 * checkpoint refuses; in the counter image as /sharer).
 *
 *   sharer sysv KEY          create (or attach) a SysV shared memory segment with KEY (hex)
 *                            in the pod's IPC namespace and keep it attached
 *   sharer posix NAME        shm_open(NAME) in /dev/shm (create or open), map it, keep it
 *   sharer listen NAME       listen on the abstract unix stream socket @NAME (the pod's network
 *                            namespace), accept one connection and keep it
 *   sharer connect NAME      connect to @NAME (retrying until it listens) and keep the connection
 *   sharer watch PATH        an inotify watch on PATH (creating it): prints `event <mask> PATH`
 *                            for each write (IN_CLOSE_WRITE | IN_MODIFY)
 *   sharer shmcount NAME     shm_open(NAME) in /dev/shm (create or open), map it, and every 100 ms
 *                            take the next number of the counter it holds (an atomic add, so
 *                            two containers mapping it share one sequence) and print
 *                            `shm <n> <unix seconds>`; a file of the pod's /dev/shm checkpointed
 *                            with the pod resumes the sequence, still shared
 *
 * Prints `ready <mode>` (flushed) once the state is held, then sleeps until killed (watch:
 * reads and prints its events).
 * Built static: `gcc -O2 -static -o sharer sharer.c`.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/mman.h>
#include <sys/shm.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

static void die(const char *what)
{
	perror(what);
	exit(2);
}

static socklen_t abstract_addr(struct sockaddr_un *sa, const char *name)
{
	memset(sa, 0, sizeof(*sa));
	sa->sun_family = AF_UNIX;
	size_t n = strlen(name);
	if (n + 1 > sizeof(sa->sun_path))
		n = sizeof(sa->sun_path) - 1;
	memcpy(sa->sun_path + 1, name, n); /* sun_path[0] == 0: abstract */
	return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

/* shm_open(name) in /dev/shm (create or open), sized and mapped shared; the descriptor kept open
 * (the segment held open and mapped) or closed (mapped only). */
static void *map_posix(const char *name, size_t size, int keep_fd)
{
	int fd = shm_open(name, O_CREAT | O_RDWR, 0600);
	if (fd < 0)
		die("sharer: shm_open");
	if (ftruncate(fd, (off_t)size) < 0)
		die("sharer: ftruncate");
	void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED)
		die("sharer: mmap");
	if (!keep_fd)
		close(fd);
	return p;
}

int main(int argc, char **argv)
{
	if (argc != 3) {
		fprintf(stderr, "usage: sharer sysv KEY | posix NAME | listen NAME | connect NAME | watch PATH | shmcount NAME\n");
		return 2;
	}
	const char *mode = argv[1], *arg = argv[2];
	if (!strcmp(mode, "sysv")) {
		key_t key = (key_t)strtol(arg, NULL, 16);
		int id = shmget(key, 65536, IPC_CREAT | 0600);
		if (id < 0)
			die("sharer: shmget");
		char *p = shmat(id, NULL, 0);
		if (p == (void *)-1)
			die("sharer: shmat");
		p[0] = 'x';
	} else if (!strcmp(mode, "posix")) {
		char *p = map_posix(arg, 65536, 1);
		p[0] = 'x';
	} else if (!strcmp(mode, "shmcount")) {
		unsigned long *n = map_posix(arg, 4096, 0);
		printf("ready %s\n", mode);
		fflush(stdout);
		for (;;) {
			unsigned long v = __atomic_fetch_add(n, 1, __ATOMIC_SEQ_CST);
			struct timespec ts;
			clock_gettime(CLOCK_REALTIME, &ts);
			printf("shm %lu %ld.%03ld\n", v, (long)ts.tv_sec, ts.tv_nsec / 1000000);
			fflush(stdout);
			usleep(100000);
		}
	} else if (!strcmp(mode, "listen") || !strcmp(mode, "connect")) {
		struct sockaddr_un sa;
		socklen_t len = abstract_addr(&sa, arg);
		int s = socket(AF_UNIX, SOCK_STREAM, 0);
		if (s < 0)
			die("sharer: socket");
		if (!strcmp(mode, "listen")) {
			if (bind(s, (struct sockaddr *)&sa, len) < 0 || listen(s, 1) < 0)
				die("sharer: bind/listen");
			printf("listening %s\n", arg);
			fflush(stdout);
			if (accept(s, NULL, NULL) < 0)
				die("sharer: accept");
		} else {
			while (connect(s, (struct sockaddr *)&sa, len) < 0)
				usleep(50000);
		}
	} else if (!strcmp(mode, "watch")) {
		int f = open(arg, O_CREAT | O_WRONLY, 0644);
		if (f < 0)
			die("sharer: open");
		close(f);
		int in = inotify_init1(IN_CLOEXEC);
		if (in < 0 || inotify_add_watch(in, arg, IN_CLOSE_WRITE | IN_MODIFY) < 0)
			die("sharer: inotify");
		printf("ready %s\n", mode);
		fflush(stdout);
		for (;;) {
			char buf[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
			ssize_t n = read(in, buf, sizeof(buf));
			if (n <= 0)
				continue; /* EINTR (a restore, a signal) */
			for (char *p = buf; p < buf + n;) {
				struct inotify_event *ev = (struct inotify_event *)p;
				printf("event %#x %s\n", ev->mask, arg);
				fflush(stdout);
				p += sizeof(*ev) + ev->len;
			}
		}
	} else {
		fprintf(stderr, "sharer: unknown mode %s\n", mode);
		return 2;
	}
	printf("ready %s\n", mode);
	fflush(stdout);
	for (;;)
		pause();
}
