/*
 * counter: the test workload of podshim.
 *
 *   counter [--mem-mib N] [--interval-ms MS] [--init-seconds S] [--state-file PATH]
 *
 * 1. Spends S seconds (default 0) "initialising" (busy CPU work), so that a
 *    restore can be shown to skip a slow start.
 * 2. Allocates N MiB (default 0) of anonymous memory and fills every 64-bit
 *    word with pattern(offset) = splitmix64(offset ^ SEED): every page is
 *    written (so resident) and every word depends on its offset, so a restore
 *    that loses, zeroes, duplicates or shifts a page is detected.
 * 3. Prints `ready mem_mib=N`, then `count=<n> ts=<unix seconds>.<ms>` right
 *    away and every MS milliseconds (default 1000), n counting from 0.  Every
 *    line is flushed.  With --state-file it also rewrites PATH (write to
 *    PATH.tmp + rename) with `<n>\n` on each tick.
 * 4. SIGUSR1: checks the whole pattern and prints `verify ok mem_mib=N` or
 *    `verify FAILED offset=<byte offset> expected=0x.. got=0x.. bad_words=<k>`.
 * 5. SIGTERM / SIGINT: prints `stopping count=<last n>` and exits 0.
 *
 * Built static: `gcc -O2 -static -o counter counter.c`.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define SEED 0x706f647368696d21ULL /* "podshim!" */

static volatile sig_atomic_t got_term;
static volatile sig_atomic_t got_usr1;

static uint64_t *mem;
static size_t mem_words;
static long mem_mib;

static inline uint64_t pattern(uint64_t offset)
{
	uint64_t z = offset ^ SEED;
	z += 0x9e3779b97f4a7c15ULL;
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
	return z ^ (z >> 31);
}

static void on_term(int sig)
{
	(void)sig;
	got_term = 1;
}

static void on_usr1(int sig)
{
	(void)sig;
	got_usr1 = 1;
}

static void install(int sig, void (*handler)(int))
{
	struct sigaction sa;
	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = handler; /* no SA_RESTART: wake nanosleep() */
	sigemptyset(&sa.sa_mask);
	if (sigaction(sig, &sa, NULL) < 0) {
		perror("counter: sigaction");
		exit(2);
	}
}

static double mono_now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static long parse_long(const char *opt, const char *value)
{
	char *end;
	errno = 0;
	long v = strtol(value, &end, 10);
	if (errno || *end || end == value || v < 0) {
		fprintf(stderr, "counter: bad value for %s: %s\n", opt, value);
		exit(2);
	}
	return v;
}

static void busy_init(long seconds)
{
	if (seconds <= 0)
		return;
	volatile uint64_t sink = 0;
	double end = mono_now() + (double)seconds;
	uint64_t i = 0;
	while (mono_now() < end && !got_term) {
		for (int k = 0; k < 100000; k++)
			sink += pattern(i++);
	}
}

static void fill_memory(void)
{
	if (mem_mib <= 0)
		return;
	size_t bytes = (size_t)mem_mib << 20;
	mem = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (mem == MAP_FAILED) {
		fprintf(stderr, "counter: mmap %ld MiB: %s\n", mem_mib, strerror(errno));
		exit(3);
	}
	mem_words = bytes / sizeof(uint64_t);
	for (size_t i = 0; i < mem_words; i++)
		mem[i] = pattern((uint64_t)i * sizeof(uint64_t));
}

static void verify_memory(void)
{
	size_t bad = 0, first = 0;
	uint64_t want = 0, got = 0;
	for (size_t i = 0; i < mem_words; i++) {
		uint64_t p = pattern((uint64_t)i * sizeof(uint64_t));
		if (mem[i] != p) {
			if (bad == 0) {
				first = i;
				want = p;
				got = mem[i];
			}
			bad++;
		}
	}
	if (bad == 0)
		printf("verify ok mem_mib=%ld\n", mem_mib);
	else
		printf("verify FAILED offset=%zu expected=0x%016" PRIx64 " got=0x%016" PRIx64
		       " bad_words=%zu\n",
		       first * sizeof(uint64_t), want, got, bad);
	fflush(stdout);
}

static void write_state(const char *path, uint64_t count)
{
	static int warned;
	char tmp[4096];
	if (snprintf(tmp, sizeof(tmp), "%s.tmp", path) >= (int)sizeof(tmp))
		return;
	FILE *f = fopen(tmp, "w");
	if (f) {
		fprintf(f, "%" PRIu64 "\n", count);
		if (fclose(f) == 0 && rename(tmp, path) == 0)
			return;
	}
	if (!warned) {
		fprintf(stderr, "counter: cannot write state file %s: %s\n", path, strerror(errno));
		warned = 1;
	}
}

/* Sleep `ms` milliseconds, serving SIGUSR1 meanwhile; returns early on SIGTERM. */
static void sleep_serving(long ms)
{
	struct timespec req = {ms / 1000, (ms % 1000) * 1000000L}, rem;
	for (;;) {
		if (got_term)
			return;
		if (got_usr1) {
			got_usr1 = 0;
			verify_memory();
		}
		if (nanosleep(&req, &rem) == 0)
			return;
		if (errno != EINTR)
			return;
		req = rem;
	}
}

int main(int argc, char **argv)
{
	long interval_ms = 1000, init_seconds = 0;
	const char *state_file = NULL;
	static const struct option opts[] = {
		{"mem-mib", required_argument, NULL, 'm'},
		{"interval-ms", required_argument, NULL, 'i'},
		{"init-seconds", required_argument, NULL, 's'},
		{"state-file", required_argument, NULL, 'f'},
		{"help", no_argument, NULL, 'h'},
		{NULL, 0, NULL, 0},
	};
	int c;
	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (c) {
		case 'm':
			mem_mib = parse_long("--mem-mib", optarg);
			break;
		case 'i':
			interval_ms = parse_long("--interval-ms", optarg);
			break;
		case 's':
			init_seconds = parse_long("--init-seconds", optarg);
			break;
		case 'f':
			state_file = optarg;
			break;
		case 'h':
			printf("usage: counter [--mem-mib N] [--interval-ms MS] [--init-seconds S] "
			       "[--state-file PATH]\n");
			return 0;
		default:
			return 2;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "counter: unexpected argument: %s\n", argv[optind]);
		return 2;
	}
	if (interval_ms <= 0)
		interval_ms = 1;

	install(SIGTERM, on_term);
	install(SIGINT, on_term);
	install(SIGUSR1, on_usr1);

	busy_init(init_seconds);
	fill_memory();
	printf("ready mem_mib=%ld\n", mem_mib);
	fflush(stdout);

	uint64_t count = 0;
	for (;;) {
		if (got_term)
			break;
		struct timespec now;
		clock_gettime(CLOCK_REALTIME, &now);
		printf("count=%" PRIu64 " ts=%lld.%03ld\n", count, (long long)now.tv_sec,
		       now.tv_nsec / 1000000L);
		fflush(stdout);
		if (state_file)
			write_state(state_file, count);
		sleep_serving(interval_ms);
		if (got_term)
			break;
		count++;
	}
	printf("stopping count=%" PRIu64 "\n", count);
	fflush(stdout);
	return 0;
}
