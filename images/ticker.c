/*
 * ticker: a periodic-timer workload of podshim's tests (in the counter image as /ticker).
 *
 *   ticker [--interval-ms MS]
 *
 * Arms, all periodic:
 *   - a timerfd (CLOCK_MONOTONIC) every MS milliseconds (default 5),
 *   - a second timerfd every 100 ms,
 *   - a POSIX timer (timer_create, SIGRTMIN) every MS milliseconds,
 *   - an interval timer (setitimer ITIMER_REAL, SIGALRM) every MS milliseconds,
 * and waits on them with poll() (the signals through a signalfd). Every 100 ms (a poll timeout,
 * so a line is printed even when every timer stopped) it prints and flushes
 *   ticks tfd=<n> tfd100=<n> posix=<n> itimer=<n> ts=<unix seconds>.<ms>
 * with the expirations counted so far. A timer that stops firing (e.g. after a restore that
 * disarmed it) shows as a count that no longer grows.
 *
 * Built static: `gcc -O2 -static -o ticker ticker.c`.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/time.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

static void die(const char *what)
{
	perror(what);
	exit(2);
}

static int periodic_timerfd(long ms)
{
	struct itimerspec its;
	int fd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
	if (fd < 0)
		die("ticker: timerfd_create");
	memset(&its, 0, sizeof(its));
	its.it_interval.tv_sec = ms / 1000;
	its.it_interval.tv_nsec = (ms % 1000) * 1000000L;
	its.it_value = its.it_interval;
	if (timerfd_settime(fd, 0, &its, NULL) < 0)
		die("ticker: timerfd_settime");
	return fd;
}

static uint64_t drain_timerfd(int fd)
{
	uint64_t n = 0;
	if (read(fd, &n, sizeof(n)) != sizeof(n))
		return 0; /* EAGAIN: nothing expired */
	return n;
}

static double mono_now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
	long ms = 5;
	static const struct option longopts[] = {
		{ "interval-ms", required_argument, NULL, 'i' },
		{ NULL, 0, NULL, 0 },
	};
	int c;
	while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
		if (c == 'i')
			ms = strtol(optarg, NULL, 10);
		else
			return 2;
	}
	if (ms <= 0 || ms > 60000) {
		fprintf(stderr, "ticker: --interval-ms must be 1..60000\n");
		return 2;
	}

	sigset_t set;
	sigemptyset(&set);
	sigaddset(&set, SIGRTMIN);
	sigaddset(&set, SIGALRM);
	if (sigprocmask(SIG_BLOCK, &set, NULL) < 0)
		die("ticker: sigprocmask");
	int sfd = signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC);
	if (sfd < 0)
		die("ticker: signalfd");

	int tfd = periodic_timerfd(ms);
	int tfd100 = periodic_timerfd(100);

	struct sigevent sev;
	timer_t ptimer;
	memset(&sev, 0, sizeof(sev));
	sev.sigev_notify = SIGEV_SIGNAL;
	sev.sigev_signo = SIGRTMIN;
	if (timer_create(CLOCK_MONOTONIC, &sev, &ptimer) < 0)
		die("ticker: timer_create");
	struct itimerspec its;
	memset(&its, 0, sizeof(its));
	its.it_interval.tv_sec = ms / 1000;
	its.it_interval.tv_nsec = (ms % 1000) * 1000000L;
	its.it_value = its.it_interval;
	if (timer_settime(ptimer, 0, &its, NULL) < 0)
		die("ticker: timer_settime");

	struct itimerval itv;
	memset(&itv, 0, sizeof(itv));
	itv.it_interval.tv_sec = ms / 1000;
	itv.it_interval.tv_usec = (ms % 1000) * 1000L;
	itv.it_value = itv.it_interval;
	if (setitimer(ITIMER_REAL, &itv, NULL) < 0)
		die("ticker: setitimer");

	uint64_t n_tfd = 0, n_tfd100 = 0, n_posix = 0, n_itimer = 0;
	double last = mono_now();
	printf("ready interval_ms=%ld\n", ms);
	fflush(stdout);
	for (;;) {
		struct pollfd fds[3] = {
			{ .fd = tfd, .events = POLLIN },
			{ .fd = tfd100, .events = POLLIN },
			{ .fd = sfd, .events = POLLIN },
		};
		if (poll(fds, 3, 100) < 0 && errno != EINTR)
			die("ticker: poll");
		if (fds[0].revents & POLLIN)
			n_tfd += drain_timerfd(tfd);
		if (fds[1].revents & POLLIN)
			n_tfd100 += drain_timerfd(tfd100);
		if (fds[2].revents & POLLIN) {
			struct signalfd_siginfo si;
			while (read(sfd, &si, sizeof(si)) == sizeof(si)) {
				if ((int)si.ssi_signo == SIGRTMIN)
					n_posix += 1 + si.ssi_overrun;
				else if (si.ssi_signo == SIGALRM)
					n_itimer++;
			}
		}
		double now = mono_now();
		if (now - last >= 0.1) {
			struct timespec wall;
			clock_gettime(CLOCK_REALTIME, &wall);
			printf("ticks tfd=%llu tfd100=%llu posix=%llu itimer=%llu ts=%ld.%03ld\n",
			       (unsigned long long)n_tfd, (unsigned long long)n_tfd100,
			       (unsigned long long)n_posix, (unsigned long long)n_itimer, (long)wall.tv_sec,
			       wall.tv_nsec / 1000000L);
			fflush(stdout);
			last = now;
		}
	}
}
