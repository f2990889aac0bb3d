/*
 * pause: the sandbox ("infra") process of a pod.
 *
 * Sleeps forever in pause(2), reaps any child it inherits (it is PID 1 of the
 * pod's PID namespace when that namespace is shared) and exits 0 on SIGINT or
 * SIGTERM.  Built static: `gcc -O2 -static -o pause pause.c`.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_down(int sig)
{
	(void)sig;
	_exit(0);
}

static void on_child(int sig)
{
	int saved = errno;
	(void)sig;
	while (waitpid(-1, NULL, WNOHANG) > 0)
		;
	errno = saved;
}

static void install(int sig, void (*handler)(int), int flags)
{
	struct sigaction sa;
	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = handler;
	sa.sa_flags = flags;
	sigemptyset(&sa.sa_mask);
	if (sigaction(sig, &sa, NULL) < 0) {
		perror("pause: sigaction");
		exit(1);
	}
}

int main(int argc, char **argv)
{
	if (argc > 1 && (strcmp(argv[1], "-v") == 0 || strcmp(argv[1], "--version") == 0)) {
		printf("podshim-pause 1\n");
		return 0;
	}
	if (getpid() != 1)
		fprintf(stderr, "pause: warning: not running as PID 1\n");
	install(SIGINT, on_down, 0);
	install(SIGTERM, on_down, 0);
	install(SIGCHLD, on_child, SA_NOCLDSTOP | SA_RESTART);
	for (;;)
		pause();
	return 1; /* not reached */
}
