/*
 * podshim-runc: the OCI runtime binary the upstream's runc handler calls (BinaryName).
 *
 * docs/design/runtime-wrapper.md (The runtime wrapper): every call is an execv of the real runtime (runc or
 * crun) with the same argv, environment and file descriptors, except
 *   - `create` of a container whose bundle config.json carries podshim's restore annotation,
 * which asks the running podshim first (its restore broker, shim/ops/restore_broker.py): a
 * SOCK_SEQPACKET connection to <[server] state_dir>/restore.sock, named through an O_PATH
 * descriptor of the dir (/proc/self/fd/N/..., paths longer than sun_path), its peer's uid checked
 * equal to ours. `prepare` (cwd, the runtime chosen, PODSHIM_FAILPOINTS, argv[1..]); podshim
 * prepares the restore and answers `exec` (env, argv), `fail` (reported, exit 1) or `hook`. On
 * `exec` this program forks the runtime's restore itself, so the restored init stays in the
 * shim's process tree (its subreaper): the child setsid()s and waits on a pipe until podshim has
 * its pid (`started`), then `exited` <code>, and podshim's verdict (`ok`: exit 0, `fail`: exit 1)
 * after its page check; podshim holds the watchdog role through the connection. No answer before
 * the fork (no socket, another owner, an error, `hook`): the Python restore hook
 * `podshim-runc-hook` (shim/wrapper/main.py) next to this binary's real path, with the same argv,
 * redoes the whole restore. The connection lost after the fork: the child's group is killed and
 * the hook runs with PODSHIM_RUNC_ABORT=<why>, undoes what the restore left and fails the create.
 * The hook also takes every call this program cannot judge safely (a config or config.json it
 * does not fully understand, an odd container id, an I/O error) and decides exactly as the
 * Python wrapper always did. The restore's preparation, CRIU config, page check and marker live
 * in Python (podshim or the hook), never here. `start` of a container that create restored
 * (marker <--root>/<id>/podshim-restored) is a no-op: this program exits 0 itself, as the hook
 * would (its Python start-up cost every restore ~0.1 s).
 *
 * The real runtime is chosen like shim/config.py: the TOML file $PODSHIM_CONFIG (else
 * /etc/podshim/config.toml if it exists), sections [runtime] and [runtimes.NAME] (binary, root),
 * PODSHIM_RUNTIME_BINARY / PODSHIM_RUNTIME_ROOT overriding [runtime], and the `--root` the shim
 * passes picks the runtime whose root (or its parent) it is (Config.runtime_for_root); the
 * broker's dir is [server] state_dir (PODSHIM_SERVER_STATE_DIR over it, default /var/lib/podshim),
 * a value other than a string goes to the hook. The TOML reader knows a strict subset (bare
 * keys, one-line strings without escapes, numbers, booleans, arrays of strings, the known section
 * names); anything else goes to the hook.
 *
 * Build: make -C native (static, -O2); the set-up installs it as .venv/bin/podshim-runc.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#define HOOK_NAME "podshim-runc-hook"
#define RESTORE_ANNOTATION "podshim.restore.checkpoint-dir"
#define RESTORED_MARKER "podshim-restored"
#define CONFIG_ENV "PODSHIM_CONFIG"
#define DEFAULT_CONFIG "/etc/podshim/config.toml"
#define DEFAULT_BINARY "/usr/sbin/runc"
#define DEFAULT_ROOT "/run/containerd/runc/k8s.io"
#define DEFAULT_STATE_DIR "/var/lib/podshim"
#define BROKER_SOCKET "restore.sock" /* in server.state_dir */
#define ABORT_ENV "PODSHIM_RUNC_ABORT"
#define BROKER_MAX_PACKET (256 * 1024)
#define MAX_RUNTIMES 32
#define MAX_KEYS 256
#define MAX_JSON_DEPTH 256

static char **g_argv;          /* our argv: argv[1..] go unchanged to the runtime or the hook */
static const char *g_log = ""; /* the --log file (runc's JSON log): where errors are reported */

/* ------------------------------------------------------------------------------ reporting */

/* Report like runc (and the hook) do: a line on stderr and a JSON line in the --log file. */
static void report(const char *msg) {
    dprintf(2, "podshim-runc: %s\n", msg);
    if (!*g_log)
        return;
    int fd = open(g_log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
        return;
    char buf[8192];
    size_t n = 0;
    const char *head = "{\"level\":\"error\",\"msg\":\"podshim-runc: ";
    for (const char *s = head; *s && n < sizeof buf; s++)
        buf[n++] = *s;
    for (const unsigned char *s = (const unsigned char *)msg; *s && n + 8 < sizeof buf; s++) {
        if (*s == '"' || *s == '\\') {
            buf[n++] = '\\';
            buf[n++] = (char)*s;
        } else if (*s < 0x20) {
            n += (size_t)snprintf(buf + n, sizeof buf - n, "\\u%04x", *s);
        } else {
            buf[n++] = (char)*s;
        }
    }
    if (n + 3 < sizeof buf) {
        memcpy(buf + n, "\"}\n", 3);
        n += 3;
        if (write(fd, buf, n) < 0) { /* nothing more to do: stderr has it */
        }
    }
    close(fd);
}

/* ------------------------------------------------------------------------------ exec */

/* Hand the call to the Python hook next to this binary's real path (symlinks resolved). */
static void __attribute__((noreturn)) to_hook(void) {
    static char path[PATH_MAX + sizeof(HOOK_NAME) + 1];
    char msg[PATH_MAX + 256];
    ssize_t n = readlink("/proc/self/exe", path, PATH_MAX);
    if (n <= 0 || n >= PATH_MAX) {
        report("cannot find its own path (/proc/self/exe) to run " HOOK_NAME);
        exit(1);
    }
    path[n] = '\0';
    char *slash = strrchr(path, '/');
    if (!slash) {
        report("cannot find its own directory to run " HOOK_NAME);
        exit(1);
    }
    strcpy(slash + 1, HOOK_NAME);
    g_argv[0] = path;
    execv(path, g_argv);
    snprintf(msg, sizeof msg, "cannot run the restore hook %s: %s", path, strerror(errno));
    report(msg);
    exit(1);
}

static void __attribute__((noreturn)) to_runtime(const char *binary) {
    char msg[PATH_MAX + 256];
    g_argv[0] = (char *)binary;
    execv(binary, g_argv);
    snprintf(msg, sizeof msg, "cannot execute the runtime %s: %s", binary, strerror(errno));
    report(msg);
    exit(1);
}

/* ------------------------------------------------------------------------------ files */

/* The whole file, NUL-terminated (0), or -errno. */
static int read_file(const char *path, char **out, size_t *len) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    size_t cap = 65536, n = 0;
    char *buf = malloc(cap + 1);
    if (!buf) {
        close(fd);
        return -ENOMEM;
    }
    for (;;) {
        if (n == cap) {
            if (cap > (64u << 20)) { /* 64 MiB: not a config file */
                free(buf);
                close(fd);
                return -EFBIG;
            }
            cap *= 2;
            char *bigger = realloc(buf, cap + 1);
            if (!bigger) {
                free(buf);
                close(fd);
                return -ENOMEM;
            }
            buf = bigger;
        }
        ssize_t r = read(fd, buf + n, cap - n);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            int e = errno;
            free(buf);
            close(fd);
            return -e;
        }
        if (r == 0)
            break;
        n += (size_t)r;
    }
    close(fd);
    buf[n] = '\0';
    *out = buf;
    *len = n;
    return 0;
}

static int valid_utf8(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned char c = s[i];
        size_t k;
        unsigned int cp;
        if (c < 0x80) {
            i++;
            continue;
        } else if ((c & 0xE0) == 0xC0) {
            k = 1;
            cp = c & 0x1F;
        } else if ((c & 0xF0) == 0xE0) {
            k = 2;
            cp = c & 0x0F;
        } else if ((c & 0xF8) == 0xF0) {
            k = 3;
            cp = c & 0x07;
        } else {
            return 0;
        }
        if (i + k >= n)
            return 0;
        for (size_t j = 1; j <= k; j++) {
            if ((s[i + j] & 0xC0) != 0x80)
                return 0;
            cp = (cp << 6) | (s[i + j] & 0x3F);
        }
        if ((k == 1 && cp < 0x80) || (k == 2 && cp < 0x800) || (k == 3 && cp < 0x10000) || cp > 0x10FFFF ||
            (cp >= 0xD800 && cp <= 0xDFFF))
            return 0;
        i += k + 1;
    }
    return 1;
}

/* ------------------------------------------------------------------------------ config (TOML subset) */

struct runtime {
    const char *name; /* "" for [runtime] */
    const char *binary;
    const char *root;
};

struct config {
    struct runtime runtime;
    struct runtime runtimes[MAX_RUNTIMES];
    int n_runtimes;
    const char *state_dir; /* [server] state_dir: where podshim's restore broker listens */
};

enum { SEC_NONE, SEC_OTHER, SEC_RUNTIME, SEC_RUNTIMES };

static int is_bare(char c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
}

static char *skip_ws(char *p) {
    while (*p == ' ' || *p == '\t')
        p++;
    return p;
}

/* After a value or header: blanks, an optional comment, then the end of the line (or file).
 * Returns the start of the next line, or NULL. */
static char *end_of_line(char *p) {
    p = skip_ws(p);
    if (*p == '#') {
        for (p++; *p && *p != '\n'; p++) {
            unsigned char c = (unsigned char)*p;
            if ((c < 0x20 && c != '\t' && !(c == '\r' && p[1] == '\n')) || c == 0x7f)
                return NULL;
        }
    }
    if (*p == '\r' && p[1] == '\n')
        p++;
    if (*p == '\n')
        return p + 1;
    return *p ? NULL : p;
}

/* A one-line basic ("...", no escapes) or literal ('...') string at p; NUL-terminates it in place
 * and returns the char after the closing quote, or NULL. */
static char *toml_string(char *p, const char **value) {
    char q = *p;
    if (q != '"' && q != '\'')
        return NULL;
    if (p[1] == q && p[2] == q)
        return NULL; /* multi-line string */
    char *s = p + 1, *e = s;
    for (; *e != q; e++) {
        unsigned char c = (unsigned char)*e;
        if (!c || c == '\n' || c == '\\' || (c < 0x20 && c != '\t') || c == 0x7f)
            return NULL; /* end of file, newline, escape (not needed, not handled), control */
    }
    *e = '\0';
    *value = s;
    return e + 1;
}

/* A TOML number in the subset: [+-]digits[.digits][e[+-]digits], '_' between digits. */
static char *toml_number(char *p) {
    if (*p == '+' || *p == '-')
        p++;
    int digits = 0;
    while ((*p >= '0' && *p <= '9') || (*p == '_' && digits)) {
        digits += *p != '_';
        p++;
    }
    if (!digits)
        return NULL;
    if (*p == '.') {
        p++;
        if (!(*p >= '0' && *p <= '9'))
            return NULL;
        while ((*p >= '0' && *p <= '9') || *p == '_')
            p++;
    }
    if (*p == 'e' || *p == 'E') {
        p++;
        if (*p == '+' || *p == '-')
            p++;
        if (!(*p >= '0' && *p <= '9'))
            return NULL;
        while ((*p >= '0' && *p <= '9') || *p == '_')
            p++;
    }
    if (p[-1] == '_')
        return NULL;
    return p;
}

/* Skip blanks, newlines and comments inside an array. */
static char *skip_array_ws(char *p) {
    for (;;) {
        p = skip_ws(p);
        if (*p == '#' || *p == '\n' || (*p == '\r' && p[1] == '\n')) {
            char *next = end_of_line(p);
            if (!next || next == p)
                return p;
            p = next;
            continue;
        }
        return p;
    }
}

/* Parse the config file text (modified in place: strings are NUL-terminated). 0: understood. */
static int parse_config(char *text, size_t len, struct config *cfg) {
    if (!valid_utf8((const unsigned char *)text, len) || strlen(text) != len)
        return -1;
    static char sections[MAX_KEYS][128];
    int n_sections = 0;
    static struct {
        int section;
        char key[64];
    } keys[MAX_KEYS];
    int n_keys = 0;
    int section = SEC_NONE, section_idx = -1, server = 0;
    struct runtime *rt = NULL;
    char *p = text;
    while (*p) {
        p = skip_ws(p);
        if (*p == '#' || *p == '\n' || *p == '\r' || !*p) {
            char *next = end_of_line(p);
            if (!next)
                return -1;
            p = next;
            continue;
        }
        if (*p == '[') {
            char *s = p + 1, *e = s;
            while (is_bare(*e) || *e == '.')
                e++;
            if (*e != ']' || e == s || (size_t)(e - s) >= sizeof sections[0])
                return -1;
            char *next = end_of_line(e + 1);
            if (!next)
                return -1;
            *e = '\0';
            for (int i = 0; i < n_sections; i++)
                if (!strcmp(sections[i], s))
                    return -1; /* a table defined twice */
            if (n_sections == MAX_KEYS)
                return -1;
            strcpy(sections[n_sections], s);
            section_idx = n_sections++;
            server = !strcmp(s, "server");
            if (!strcmp(s, "runtime")) {
                section = SEC_RUNTIME;
                rt = &cfg->runtime;
            } else if (!strncmp(s, "runtimes.", 9) && s[9] && !strchr(s + 9, '.')) {
                if (cfg->n_runtimes == MAX_RUNTIMES)
                    return -1;
                section = SEC_RUNTIMES;
                rt = &cfg->runtimes[cfg->n_runtimes++];
                rt->name = s + 9;
                rt->binary = DEFAULT_BINARY;
                rt->root = DEFAULT_ROOT;
            } else if (!strchr(s, '.') && strcmp(s, "runtimes")) {
                /* another section ([server], [log], ...): podshim serve checks its keys and
                 * values; parsed here only to find the runtime sections and server.state_dir */
                section = SEC_OTHER;
                rt = NULL;
            } else {
                return -1; /* [runtimes] itself, deeper tables */
            }
            p = next;
            continue;
        }
        /* key = value */
        if (section == SEC_NONE)
            return -1; /* top-level keys are not podshim's */
        char *ks = p, *ke = p;
        while (is_bare(*ke))
            ke++;
        if (ke == ks || (size_t)(ke - ks) >= sizeof keys[0].key)
            return -1; /* quoted or dotted keys */
        char *q = skip_ws(ke);
        if (*q != '=')
            return -1;
        *ke = '\0';
        for (int i = 0; i < n_keys; i++)
            if (keys[i].section == section_idx && !strcmp(keys[i].key, ks))
                return -1; /* a key defined twice */
        if (n_keys == MAX_KEYS)
            return -1;
        keys[n_keys].section = section_idx;
        strcpy(keys[n_keys++].key, ks);
        q = skip_ws(q + 1);
        const char *value = NULL;
        char *after;
        if (*q == '"' || *q == '\'') {
            after = toml_string(q, &value);
        } else if (rt) {
            return -1; /* runtime keys are strings */
        } else if (*q == '[') {
            after = skip_array_ws(q + 1);
            while (after && *after != ']') {
                const char *item;
                after = toml_string(after, &item);
                if (!after)
                    return -1;
                after = skip_array_ws(after);
                if (*after == ',')
                    after = skip_array_ws(after + 1);
                else if (*after != ']')
                    return -1;
            }
            if (after)
                after++;
        } else if (!strncmp(q, "true", 4) || !strncmp(q, "false", 5)) {
            after = q + (*q == 't' ? 4 : 5);
        } else {
            after = toml_number(q);
        }
        if (!after)
            return -1;
        char *next = end_of_line(after);
        if (!next)
            return -1;
        if (rt) {
            if (!strcmp(ks, "binary"))
                rt->binary = value;
            else if (!strcmp(ks, "root"))
                rt->root = value;
            else if (strcmp(ks, "criu"))
                return -1; /* unknown runtime key */
        } else if (server && !strcmp(ks, "state_dir")) {
            if (!value)
                return -1; /* not a string: podshim serve refuses it, the hook reports it */
            cfg->state_dir = value;
        }
        p = next;
    }
    return 0;
}

/* 0: cfg holds the effective runtimes; -1: not understood (the hook decides). */
static int load_config(struct config *cfg) {
    cfg->runtime.name = "";
    cfg->runtime.binary = DEFAULT_BINARY;
    cfg->runtime.root = DEFAULT_ROOT;
    cfg->n_runtimes = 0;
    cfg->state_dir = DEFAULT_STATE_DIR;
    const char *env = getenv(CONFIG_ENV);
    const char *path = env && *env ? env : DEFAULT_CONFIG;
    char *text;
    size_t len;
    int r = read_file(path, &text, &len);
    if (r == -ENOENT && !env) {
        /* no file: the defaults */
    } else if (r < 0) {
        return -1; /* named but missing, unreadable: the hook reports it */
    } else if (parse_config(text, len, cfg) < 0) {
        return -1;
    }
    const char *b = getenv("PODSHIM_RUNTIME_BINARY"), *rr = getenv("PODSHIM_RUNTIME_ROOT");
    if (b)
        cfg->runtime.binary = b;
    if (rr)
        cfg->runtime.root = rr;
    const char *sd = getenv("PODSHIM_SERVER_STATE_DIR"); /* as shim/config.py _from_env */
    if (sd)
        cfg->state_dir = sd;
    return 0;
}

/* posixpath.normpath into out (PATH_MAX); -1 when too long. */
static int normpath(const char *path, char *out) {
    size_t len = strlen(path);
    if (len >= PATH_MAX)
        return -1;
    if (!len) {
        strcpy(out, ".");
        return 0;
    }
    int slashes = path[0] == '/' ? (path[1] == '/' && path[2] != '/' ? 2 : 1) : 0;
    const char *comps[PATH_MAX / 2 + 1];
    size_t lens[PATH_MAX / 2 + 1];
    int n = 0;
    const char *p = path;
    while (*p) {
        while (*p == '/')
            p++;
        if (!*p)
            break;
        const char *s = p;
        while (*p && *p != '/')
            p++;
        size_t l = (size_t)(p - s);
        if (l == 1 && s[0] == '.')
            continue;
        if (l == 2 && s[0] == '.' && s[1] == '.') {
            if (n && !(lens[n - 1] == 2 && comps[n - 1][0] == '.' && comps[n - 1][1] == '.')) {
                n--;
                continue;
            }
            if (slashes)
                continue; /* '..' at the root */
        }
        comps[n] = s;
        lens[n++] = l;
    }
    size_t o = 0;
    for (int i = 0; i < slashes; i++)
        out[o++] = '/';
    for (int i = 0; i < n; i++) {
        if (i)
            out[o++] = '/';
        memcpy(out + o, comps[i], lens[i]);
        o += lens[i];
    }
    if (!o)
        out[o++] = '.';
    out[o] = '\0';
    return 0;
}

/* posixpath.dirname, in place. */
static void dirname_inplace(char *p) {
    char *slash = strrchr(p, '/');
    if (!slash) {
        p[0] = '\0';
        return;
    }
    slash[1] = '\0';
    size_t n = (size_t)(slash + 1 - p);
    size_t i = 0;
    while (i < n && p[i] == '/')
        i++;
    if (i == n)
        return; /* all slashes: kept as they are */
    while (n > 0 && p[n - 1] == '/')
        p[--n] = '\0';
}

/* Config.runtime_for_root. NULL when a path is too long (the hook decides). */
static const char *runtime_for_root(const struct config *cfg, const char *root) {
    char want[PATH_MAX], have[PATH_MAX];
    if (normpath(root, want) < 0)
        return NULL;
    for (int i = -1; i < cfg->n_runtimes; i++) {
        const struct runtime *rt = i < 0 ? &cfg->runtime : &cfg->runtimes[i];
        if (normpath(rt->root, have) < 0)
            return NULL;
        if (!strcmp(have, want))
            return rt->binary;
        dirname_inplace(have);
        if (!strcmp(have, want))
            return rt->binary;
    }
    return cfg->runtime.binary;
}

/* ------------------------------------------------------------------------------ config.json (JSON) */

enum { JSON_NO = 0, JSON_RESTORE = 1, JSON_UNSURE = 2 };

struct json {
    const char *p;
    int verdict; /* JSON_NO until the annotation or something odd is seen */
};

static void json_ws(struct json *j) {
    while (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r')
        j->p++;
}

static int hex4(const char *s, unsigned int *out) {
    unsigned int v = 0;
    for (int i = 0; i < 4; i++) {
        char c = s[i];
        v <<= 4;
        if (c >= '0' && c <= '9')
            v |= (unsigned int)(c - '0');
        else if (c >= 'a' && c <= 'f')
            v |= (unsigned int)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F')
            v |= (unsigned int)(c - 'A' + 10);
        else
            return -1;
    }
    *out = v;
    return 0;
}

/* A JSON string at j->p. Its ASCII decoding goes to out (cap bytes); *ascii is 0 when it has a
 * non-ASCII character or does not fit (then it equals none of our keys); *empty when "". */
static int json_string(struct json *j, char *out, size_t cap, int *ascii, int *empty) {
    if (*j->p != '"')
        return -1;
    j->p++;
    size_t n = 0;
    *ascii = 1;
    for (;;) {
        unsigned char c = (unsigned char)*j->p;
        unsigned int ch;
        if (!c || c < 0x20)
            return -1;
        if (c == '"') {
            j->p++;
            break;
        }
        if (c == '\\') {
            char e = j->p[1];
            j->p += 2;
            switch (e) {
            case '"': ch = '"'; break;
            case '\\': ch = '\\'; break;
            case '/': ch = '/'; break;
            case 'b': ch = '\b'; break;
            case 'f': ch = '\f'; break;
            case 'n': ch = '\n'; break;
            case 'r': ch = '\r'; break;
            case 't': ch = '\t'; break;
            case 'u':
                if (hex4(j->p, &ch) < 0)
                    return -1;
                j->p += 4;
                break;
            default:
                return -1;
            }
        } else {
            ch = c;
            j->p++;
        }
        if (ch == 0 || ch >= 0x80 || n + 1 >= cap)
            *ascii = 0; /* none of our keys has it (or is that long) */
        else
            out[n++] = (char)ch;
        if (empty)
            *empty = 0;
    }
    if (cap)
        out[n < cap ? n : cap - 1] = '\0';
    return 0;
}

static int json_value(struct json *j, int depth, int where);

enum { IN_OTHER, IN_TOP, IN_ANNOTATIONS };

/* An object at j->p. where: IN_TOP (the spec), IN_ANNOTATIONS (spec.annotations) or IN_OTHER. */
static int json_object(struct json *j, int depth, int where) {
    j->p++; /* '{' */
    json_ws(j);
    if (*j->p == '}') {
        j->p++;
        return 0;
    }
    for (;;) {
        char key[64];
        int ascii, empty = 1;
        json_ws(j);
        if (json_string(j, key, sizeof key, &ascii, NULL) < 0)
            return -1;
        json_ws(j);
        if (*j->p != ':')
            return -1;
        j->p++;
        json_ws(j);
        if (where == IN_TOP && ascii && !strcmp(key, "annotations")) {
            if (*j->p != '{') {
                j->verdict = JSON_UNSURE; /* not a map: the hook's business */
                if (json_value(j, depth + 1, IN_OTHER) < 0)
                    return -1;
            } else if (json_object(j, depth + 1, IN_ANNOTATIONS) < 0) {
                return -1;
            }
        } else if (where == IN_ANNOTATIONS && ascii && !strcmp(key, RESTORE_ANNOTATION)) {
            if (*j->p == '"') {
                char dummy[1];
                int a2;
                if (json_string(j, dummy, sizeof dummy, &a2, &empty) < 0)
                    return -1;
                if (!empty && j->verdict == JSON_NO)
                    j->verdict = JSON_RESTORE;
            } else {
                j->verdict = JSON_UNSURE;
                if (json_value(j, depth + 1, IN_OTHER) < 0)
                    return -1;
            }
        } else if (json_value(j, depth + 1, IN_OTHER) < 0) {
            return -1;
        }
        json_ws(j);
        if (*j->p == ',') {
            j->p++;
            continue;
        }
        if (*j->p == '}') {
            j->p++;
            return 0;
        }
        return -1;
    }
}

static int json_value(struct json *j, int depth, int where) {
    if (depth > MAX_JSON_DEPTH)
        return -1;
    json_ws(j);
    const char *p = j->p;
    if (*p == '{')
        return json_object(j, depth, where);
    if (*p == '[') {
        j->p++;
        json_ws(j);
        if (*j->p == ']') {
            j->p++;
            return 0;
        }
        for (;;) {
            if (json_value(j, depth + 1, IN_OTHER) < 0)
                return -1;
            json_ws(j);
            if (*j->p == ',') {
                j->p++;
                continue;
            }
            if (*j->p == ']') {
                j->p++;
                return 0;
            }
            return -1;
        }
    }
    if (*p == '"') {
        char dummy[1];
        int ascii;
        return json_string(j, dummy, sizeof dummy, &ascii, NULL);
    }
    if (!strncmp(p, "true", 4) || !strncmp(p, "null", 4)) {
        j->p += 4;
        return 0;
    }
    if (!strncmp(p, "false", 5)) {
        j->p += 5;
        return 0;
    }
    /* number: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)? */
    if (*p == '-')
        p++;
    if (*p == '0')
        p++;
    else if (*p >= '1' && *p <= '9')
        while (*p >= '0' && *p <= '9')
            p++;
    else
        return -1; /* also NaN/Infinity, which Python accepts: the hook decides */
    if (*p == '.') {
        p++;
        if (!(*p >= '0' && *p <= '9'))
            return -1;
        while (*p >= '0' && *p <= '9')
            p++;
    }
    if (*p == 'e' || *p == 'E') {
        p++;
        if (*p == '+' || *p == '-')
            p++;
        if (!(*p >= '0' && *p <= '9'))
            return -1;
        while (*p >= '0' && *p <= '9')
            p++;
    }
    j->p = p;
    return 0;
}

/* Whether the bundle's config.json asks for a restore: JSON_NO, JSON_RESTORE or JSON_UNSURE. */
static int bundle_verdict(const char *bundle) {
    char path[PATH_MAX];
    if (bundle && *bundle) {
        if (snprintf(path, sizeof path, "%s/config.json", bundle) >= (int)sizeof path)
            return JSON_UNSURE;
    } else {
        strcpy(path, "config.json"); /* the runtime's default bundle: the working directory */
    }
    char *text;
    size_t len;
    if (read_file(path, &text, &len) < 0 || strlen(text) != len)
        return JSON_UNSURE;
    struct json j = {text, JSON_NO};
    json_ws(&j);
    if (*j.p != '{' || json_object(&j, 0, IN_TOP) < 0)
        return JSON_UNSURE;
    json_ws(&j);
    if (*j.p)
        return JSON_UNSURE; /* trailing garbage */
    free(text);
    return j.verdict;
}

/* ------------------------------------------------------------------------------ restore broker */

/* docs/design/runtime-wrapper.md (The runtime wrapper): podshim prepares the restore, this process runs
 * it (so the restored init stays in the shim's process tree) and podshim settles it. Protocol: one
 * SOCK_SEQPACKET packet per message, every field NUL-terminated, the first one the verb. */

static int g_sock = -1;

/* One packet: 0 or -errno. MSG_NOSIGNAL: a closed peer is EPIPE, not SIGPIPE. */
static int send_packet(const char *buf, size_t n) {
    for (;;) {
        ssize_t r = send(g_sock, buf, n, MSG_NOSIGNAL);
        if (r == (ssize_t)n)
            return 0;
        if (r < 0 && errno == EINTR)
            continue;
        return r < 0 ? -errno : -EMSGSIZE;
    }
}

/* One packet into buf: its length, 0 at EOF (or an empty packet), -errno; -EMSGSIZE if cut. */
static ssize_t recv_packet(char *buf, size_t cap) {
    struct iovec iov = {buf, cap};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    for (;;) {
        ssize_t r = recvmsg(g_sock, &msg, MSG_CMSG_CLOEXEC);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return -errno;
        return (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) ? -EMSGSIZE : r;
    }
}

/* The packet's fields (a NULL-terminated array, malloc'd), or NULL when it does not end with a
 * NUL (malformed); *nf their number. */
static char **split_fields(char *buf, size_t n, int *nf) {
    if (!n || buf[n - 1])
        return NULL;
    size_t count = 0;
    for (size_t i = 0; i < n; i++)
        count += !buf[i];
    char **f = malloc((count + 1) * sizeof *f);
    if (!f)
        return NULL;
    size_t k = 0;
    for (size_t i = 0; i < n; i += strlen(buf + i) + 1)
        f[k++] = buf + i;
    f[k] = NULL;
    *nf = (int)k;
    return f;
}

/* Wait for the child `pid`; its wait status. */
static int reap(pid_t pid) {
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    return status;
}

/* The connection failed after the restore started: kill what it started, and let the hook (in
 * its abort mode, told by ABORT_ENV, in a process of its own) undo what else the restore left
 * and fail the create. */
static void __attribute__((noreturn)) abort_restore(pid_t pid, const char *what, int err) {
    char why[512];
    snprintf(why, sizeof why,
             "podshim's restore broker connection was lost after the restore started (%s: %s)", what,
             err ? strerror(err) : "connection closed");
    kill(-pid, SIGKILL); /* its session: runc and its CRIU */
    kill(pid, SIGKILL);
    reap(pid);
    close(g_sock);
    signal(SIGPIPE, SIG_DFL);
    if (setenv(ABORT_ENV, why, 1) < 0) {
        report(why);
        exit(1);
    }
    /* the undo in a session of its own, waited for: the upstream's SIGKILL of this process (the
     * StartContainer's deadline) must not cut it short, podshim being gone already */
    pid_t undo = fork();
    if (undo == 0) {
        setsid();
        to_hook();
    }
    if (undo < 0)
        to_hook(); /* in this process, then */
    int status = reap(undo);
    exit(WIFEXITED(status) ? WEXITSTATUS(status) : 1);
}

/* Connect and send `prepare`: podshim's answer, split (NULL: fall back to the hook). */
static char **broker_ask(const char *state_dir, const char *binary, int argc, char **argv, int *nf) {
    int dir = open(state_dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (dir < 0)
        return NULL;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    /* through the descriptor: a state dir path may exceed sun_path */
    snprintf(addr.sun_path, sizeof addr.sun_path, "/proc/self/fd/%d/" BROKER_SOCKET, dir);
    g_sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    int r = g_sock < 0 ? -1 : connect(g_sock, (struct sockaddr *)&addr, sizeof addr);
    close(dir);
    struct ucred cred;
    socklen_t cred_len = sizeof cred;
    if (r < 0 || getsockopt(g_sock, SOL_SOCKET, SO_PEERCRED, &cred, &cred_len) < 0 || cred.uid != geteuid())
        return NULL;

    /* prepare\0<cwd>\0<binary>\0<failpoints>\0<argv[1]>\0...<argv[argc-1]>\0 */
    char cwd[PATH_MAX];
    if (!getcwd(cwd, sizeof cwd))
        return NULL;
    const char *failpoints = getenv("PODSHIM_FAILPOINTS");
    const char *head[] = {"prepare", cwd, binary, failpoints ? failpoints : ""};
    size_t len = 0;
    for (int i = -4; i < argc - 1; i++)
        len += strlen(i < 0 ? head[i + 4] : argv[i + 1]) + 1;
    char *out = malloc(len), *o = out;
    if (!out)
        return NULL;
    for (int i = -4; i < argc - 1; i++) {
        const char *s = i < 0 ? head[i + 4] : argv[i + 1];
        size_t l = strlen(s) + 1;
        memcpy(o, s, l);
        o += l;
    }
    r = send_packet(out, len);
    free(out);
    char *in = r < 0 ? NULL : malloc(BROKER_MAX_PACKET);
    if (!in)
        return NULL;
    ssize_t n = recv_packet(in, BROKER_MAX_PACKET);
    return n > 0 ? split_fields(in, (size_t)n, nf) : NULL;
}

/* Until the child exits, watch the connection: podshim gone while the restore runs is an abort
 * then, not when the restore ends (no one would settle it). Without pidfds (Linux < 5.3), only
 * the child is waited for. */
static void watch_child(pid_t pid) {
    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    if (pidfd < 0)
        return;
    struct pollfd fds[2] = {{.fd = pidfd, .events = POLLIN}, {.fd = g_sock, .events = POLLRDHUP}};
    for (;;) {
        if (poll(fds, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        if (fds[1].revents) { /* hang-up or error: podshim has nothing more to say */
            int err = 0;
            socklen_t len = sizeof err;
            getsockopt(g_sock, SOL_SOCKET, SO_ERROR, &err, &len);
            abort_restore(pid, "poll", err);
        }
        if (fds[0].revents)
            break;
    }
    close(pidfd);
}

/* podshim's `exec` (f: its fields): run it, report, take the verdict. Returns only when it
 * cannot start it (the hook then redoes the restore). */
static void broker_run(char **f, int nf) {
    /* exec\0<K=V>\0...<K=V>\0\0<path>\0<arg1>\0...<argN>\0 */
    int e = 1;
    for (; e < nf && *f[e]; e++)
        if (f[e][0] == '=' || !strchr(f[e], '='))
            return;
    if (e + 1 >= nf || !*f[e + 1])
        return; /* no empty field, or no path after it */
    char **env = f + 1, **cmd = f + e + 1;
    f[e] = NULL; /* ends env */

    int gate[2];
    if (pipe2(gate, O_CLOEXEC) < 0)
        return;
    pid_t pid = fork();
    if (pid < 0) {
        close(gate[0]);
        close(gate[1]);
        return;
    }
    if (pid == 0) {
        /* its own session, so that an abort kills runc and its CRIU as one group; stdio and
         * every other inherited descriptor as today (the socket and the gate are close-on-exec) */
        close(gate[1]);
        setsid();
        char go;
        ssize_t g;
        while ((g = read(gate[0], &go, 1)) < 0 && errno == EINTR) {
        }
        if (g != 1)
            _exit(127); /* EOF: the parent died before podshim knew the pid */
        for (char **kv = env; *kv; kv++) {
            char *eq = strchr(*kv, '=');
            *eq = '\0';
            if (setenv(*kv, eq + 1, 1) < 0)
                _exit(127);
        }
        execv(cmd[0], cmd);
        _exit(127);
    }
    close(gate[0]);
    signal(SIGPIPE, SIG_IGN); /* the go byte to a child already killed: EPIPE */
    signal(SIGCHLD, SIG_DFL); /* an inherited SIG_IGN would reap the child behind waitid's back */
    char msg[64];
    int ml = snprintf(msg, sizeof msg, "started%c%d%c", '\0', (int)pid, '\0');
    int r = send_packet(msg, (size_t)ml);
    if (r < 0)
        abort_restore(pid, "send started", -r);
    if (write(gate[1], "g", 1) < 0) { /* the child was killed: its status says so */
    }
    close(gate[1]);
    watch_child(pid);
    /* WNOWAIT: the child stays a zombie, its pid (and group id) not reusable, until the verdict */
    siginfo_t si;
    for (;;) {
        memset(&si, 0, sizeof si);
        if (waitid(P_PID, (id_t)pid, &si, WEXITED | WNOWAIT) == 0)
            break;
        if (errno != EINTR)
            abort_restore(pid, "waitid", errno);
    }
    int code = si.si_code == CLD_EXITED ? si.si_status : -si.si_status; /* Python's returncode */
    ml = snprintf(msg, sizeof msg, "exited%c%d%c", '\0', code, '\0');
    if ((r = send_packet(msg, (size_t)ml)) < 0)
        abort_restore(pid, "send exited", -r);

    /* ok\0  |  fail\0<message>\0 */
    char *in = f[0]; /* the reply's buffer, done with */
    ssize_t n = recv_packet(in, BROKER_MAX_PACKET);
    if (n <= 0)
        abort_restore(pid, "recv", n < 0 ? (int)-n : 0);
    f = split_fields(in, (size_t)n, &nf);
    if (f && !strcmp(f[0], "ok") && nf == 1) {
        reap(pid);
        exit(0);
    }
    if (f && !strcmp(f[0], "fail") && nf == 2) {
        reap(pid);
        report(f[1]);
        exit(1);
    }
    abort_restore(pid, "recv of the verdict", EBADMSG); /* one it does not understand */
}

/* Ask podshim's broker; returns only when it did not take the restore before the fork (no
 * socket, another owner, an error, `hook`): the caller hands the call to the hook. */
static void broker(const char *state_dir, const char *binary, int argc, char **argv) {
    int nf;
    char **f = broker_ask(state_dir, binary, argc, argv, &nf);
    if (f && !strcmp(f[0], "fail") && nf == 2) {
        report(f[1]);
        exit(1);
    }
    if (f && !strcmp(f[0], "exec"))
        broker_run(f, nf);
    if (g_sock >= 0) /* `hook`, not understood, or an error */
        close(g_sock);
    g_sock = -1;
}

/* ------------------------------------------------------------------------------ main */

/* Global flags of runc/crun that take a value (shim/wrapper/main.py _VALUE_FLAGS). */
static int value_flag(const char *a) {
    static const char *const flags[] = {"--root", "--log", "--log-format", "--criu", "--rootless", "--cgroup-manager"};
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++)
        if (!strcmp(a, flags[i]))
            return 1;
    return 0;
}

/* shim/wrapper/restore.py _arg: the first `NAME VALUE` or `NAME=VALUE` of rest, NAME in order. */
static const char *arg_value(char **rest, int n, const char *const *names) {
    for (int i = 0; i < n; i++)
        for (const char *const *name = names; *name; name++) {
            size_t l = strlen(*name);
            if (!strcmp(rest[i], *name) && i + 1 < n)
                return rest[i + 1];
            if (!strncmp(rest[i], *name, l) && rest[i][l] == '=')
                return rest[i] + l + 1;
        }
    return NULL;
}

int main(int argc, char **argv) {
    g_argv = argv;
    const char *root = "", *command = NULL;
    char **rest = NULL;
    int n_rest = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (a[0] != '-') {
            command = a;
            rest = argv + i + 1;
            n_rest = argc - i - 1;
            break;
        }
        const char *eq = strchr(a, '=');
        const char *value = "";
        size_t klen = eq ? (size_t)(eq - a) : strlen(a);
        if (eq)
            value = eq + 1;
        else if (value_flag(a) && i + 1 < argc)
            value = argv[++i];
        if (klen == 6 && !strncmp(a, "--root", 6))
            root = value;
        else if (klen == 5 && !strncmp(a, "--log", 5))
            g_log = value;
    }

    int create = command && !strcmp(command, "create");
    int start = command && !strcmp(command, "start");
    if (start) {
        const char *id = n_rest ? rest[n_rest - 1] : "";
        if (*root && *id) {
            char marker[PATH_MAX];
            struct stat st;
            if (strchr(id, '/') || !strcmp(id, ".") || !strcmp(id, ".."))
                to_hook();
            if (snprintf(marker, sizeof marker, "%s/%s/%s", root, id, RESTORED_MARKER) >= (int)sizeof marker)
                to_hook();
            if (stat(marker, &st) == 0)
                _exit(0); /* create restored it and it runs: start is a no-op, as the hook says
                             (already_restored), without a Python start-up on the restore's path */
            if (errno != ENOENT && errno != ENOTDIR && errno != ELOOP)
                to_hook(); /* cannot tell: the hook answers */
        }
    }

    struct config cfg;
    if (load_config(&cfg) < 0)
        to_hook();
    const char *binary = *root ? runtime_for_root(&cfg, root) : cfg.runtime.binary;
    if (!binary)
        to_hook();

    if (create) {
        static const char *const bundle_flags[] = {"--bundle", "-b", NULL};
        int verdict = bundle_verdict(arg_value(rest, n_rest, bundle_flags));
        /* tests/faults (docs/design/crash-safety.md (Fault injection)): the hook's path, as without podshim */
        const char *points = getenv("PODSHIM_FAILPOINTS");
        int no_broker = points && strstr(points, "runc-wrapper.broker=off");
        if (verdict == JSON_RESTORE && !no_broker)
            broker(cfg.state_dir, binary, argc, argv); /* returns when podshim does not take it */
        if (verdict != JSON_NO)
            to_hook();
    }
    to_runtime(binary);
}
