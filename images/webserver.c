/*
 * webserver: the stand-in for the web servers critest runs (nginx, httpd, hostnet-nginx).
 *
 *   webserver [--port N] [--name NAME] [--pidfile PATH] [--title TITLE]
 *
 * Prints `NAME: listening on port N` (critest looks for the name in the container's log), writes
 * its pid to PATH (critest's hostPID tests read /var/run/nginx.pid), then answers every HTTP
 * request on 0.0.0.0:N with 200 and a short page until SIGTERM. With --title it first executes
 * itself again with TITLE as argv[0], so that /proc/<pid>/cmdline reads like nginx's ("nginx:
 * master process ..."; critest greps for it) while its name stays the file's. Built static by
 * images/build.py.
 */
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static const char page[] = "<html><body>podshim test web server</body></html>\n";

int main(int argc, char **argv) {
    int port = 80;
    const char *name = "webserver", *pidfile = NULL, *title = NULL;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--port")) port = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--name")) name = argv[i + 1];
        else if (!strcmp(argv[i], "--pidfile")) pidfile = argv[i + 1];
        else if (!strcmp(argv[i], "--title")) title = argv[i + 1];
        else { fprintf(stderr, "webserver: unknown option %s\n", argv[i]); return 2; }
    }
    if (title && strcmp(argv[0], title)) {
        const char *path = argv[0];
        argv[0] = (char *)title;
        execv(path, argv);
        perror("execv");
        return 1;
    }
    signal(SIGPIPE, SIG_IGN);
    int s = socket(AF_INET6, SOCK_STREAM, 0), off = 0, on = 1;
    if (s < 0) { perror("socket"); return 1; }
    setsockopt(s, IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof off);
    setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
    struct sockaddr_in6 addr = {.sin6_family = AF_INET6, .sin6_port = htons(port), .sin6_addr = in6addr_any};
    if (bind(s, (struct sockaddr *)&addr, sizeof addr) < 0 || listen(s, 64) < 0) { perror("bind/listen"); return 1; }
    if (pidfile) {
        FILE *f = fopen(pidfile, "w");
        if (!f) { perror(pidfile); return 1; }
        fprintf(f, "%d\n", getpid());
        fclose(f);
    }
    printf("%s: listening on port %d\n", name, port);
    fflush(stdout);
    char buf[4096], head[256];
    for (;;) {
        int c = accept(s, NULL, NULL);
        if (c < 0) continue;
        (void)!read(c, buf, sizeof buf);
        int n = snprintf(head, sizeof head,
                         "HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n",
                         sizeof page - 1);
        (void)!write(c, head, n);
        (void)!write(c, page, sizeof page - 1);
        close(c);
    }
}
