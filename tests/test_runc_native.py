"""The compiled podshim-runc (native/podshim-runc.c, docs/design/runtime-wrapper.md (The runtime wrapper)):
which calls it execs the real runtime with, which it hands to the Python hook, and its side of
podshim's restore broker (a FakeBroker speaking the protocol, not shim/ops/restore_broker.py).

The wrapper is built from the current source into a temporary directory, next to a fake hook;
the "runtimes" are a small recorder program that writes down its pid, argv, environment and what
it reads from an inherited fd (3, or $REC_FD) and stdin. No root, no containerd: the end-to-end restore tests
(tests/test_restore_pod.py, tests/test_checkpoint_container.py) run through the installed one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import struct
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from shim import config as configmod
from testbed.bed import TestBed

REPO = Path(__file__).resolve().parents[1]
NATIVE = REPO / "native"
VENV_BIN = REPO / ".venv" / "bin"
ANNOTATION = "podshim.restore.checkpoint-dir"

RECORDER_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
extern char **environ;
static void put(FILE *f, const char *s) { fwrite(s, 1, strlen(s) + 1, f); }
int main(int argc, char **argv) {
    const char *dir = getenv("REC_DIR");
    char path[4096];
    snprintf(path, sizeof path, "%s/record", dir ? dir : ".");
    FILE *f = fopen(path, "w");
    if (!f) return 99;
    char pid[32];
    snprintf(pid, sizeof pid, "%d", (int)getpid());
    put(f, pid);
    char n[32];
    snprintf(n, sizeof n, "%d", argc);
    put(f, n);
    for (int i = 0; i < argc; i++) put(f, argv[i]);
    int envc = 0;
    for (char **e = environ; *e; e++) envc++;
    snprintf(n, sizeof n, "%d", envc);
    put(f, n);
    for (char **e = environ; *e; e++) put(f, *e);
    char buf[256] = "";
    const char *fd = getenv("REC_FD");
    ssize_t r = read(fd ? atoi(fd) : 3, buf, sizeof buf - 1);
    buf[r > 0 ? r : 0] = 0;
    put(f, r >= 0 ? buf : "<fd closed>");
    fclose(f);
    while ((r = read(0, buf, sizeof buf)) > 0) if (write(1, buf, (size_t)r) != r) return 98;
    const char *code = getenv("REC_EXIT");
    return code ? atoi(code) : 0;
}
"""


@dataclass
class Record:
    pid: int
    argv: list[str]
    env: dict[str, str]
    fd3: str


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the wrapper built from native/ as the set-up builds it, the recorder program)."""
    if shutil.which("make") is None or shutil.which("cc") is None:
        pytest.fail("make and cc are needed (the set-up installs build-essential)")
    out = tmp_path_factory.mktemp("native")
    subprocess.run(["make", "-s", "-C", str(NATIVE), f"BUILD={out}"], check=True)
    src = out / "recorder.c"
    src.write_text(RECORDER_C)
    subprocess.run(["cc", "-O2", "-o", str(out / "recorder"), str(src)], check=True)
    return out / "podshim-runc", out / "recorder"


def _place(program: Path, at: Path) -> None:
    """`program` at `at`, as a hard link: a copy is written through a descriptor that a process
    forked meanwhile by another thread holds until it execs, and exec of the copy then fails with
    ETXTBSY."""
    try:
        os.link(program, at)
    except OSError:  # another file system
        shutil.copy2(program, at)


class Node:
    """A wrapper in <tmp>/bin with a fake hook beside it, fake runc/crun, a podshim config."""

    def __init__(self, tmp: Path, wrapper: Path, recorder: Path) -> None:
        self.tmp = tmp
        self.bin = tmp / "bin"
        self.bin.mkdir()
        self.wrapper = self.bin / "podshim-runc"
        _place(wrapper, self.wrapper)
        self.hook = self.bin / "podshim-runc-hook"
        self.runc = tmp / "runc"
        self.crun = tmp / "crun"
        for p in (self.hook, self.runc, self.crun):
            _place(recorder, p)
        self.rec_dir = tmp / "rec"
        self.rec_dir.mkdir()
        self.config = tmp / "podshim.toml"
        self.root = tmp / "state" / "runc" / "k8s.io"
        self.crun_root = tmp / "state" / "crun" / "k8s.io"
        # where podshim's restore broker would listen: none unless a test starts a FakeBroker
        self.state_dir = tmp / "podshim-state"
        self.write_config(
            f'[runtime]\nbinary = "{self.runc}"\nroot = "{self.root}"\ncriu = "/usr/local/sbin/criu"\n\n'
            f'[runtimes.crun]\nbinary = "{self.crun}"\nroot = "{self.crun_root}"\n\n'
            f'[server]\nstate_dir = "{self.state_dir}"\n'
        )
        self.bundle = tmp / "bundle"
        self.bundle.mkdir()

    def write_config(self, text: str) -> None:
        self.config.write_text(text)

    def env(self, **extra: str) -> dict[str, str]:
        env = {"PATH": "/usr/bin:/bin", "PODSHIM_CONFIG": str(self.config), "REC_DIR": str(self.rec_dir)}
        env.update(extra)
        return env

    def run(
        self, *args: str, env: dict[str, str] | None = None, exe: Path | None = None, **kw: object
    ) -> tuple[subprocess.CompletedProcess[bytes], Record | None]:
        record = self.rec_dir / "record"
        record.unlink(missing_ok=True)
        proc = subprocess.run(
            [str(exe or self.wrapper), *args],
            env=env if env is not None else self.env(),
            capture_output=True,
            timeout=30,
            **kw,  # type: ignore[arg-type]
        )
        if not record.exists():
            return proc, None
        fields = record.read_bytes().split(b"\0")
        pid = int(fields[0])
        argc = int(fields[1])
        argv = [f.decode() for f in fields[2 : 2 + argc]]
        envc = int(fields[2 + argc])
        env_items = [f.decode() for f in fields[3 + argc : 3 + argc + envc]]
        fd3 = fields[3 + argc + envc].decode()
        return proc, Record(pid, argv, dict(e.split("=", 1) for e in env_items), fd3)

    def who(self, *args: str, env: dict[str, str] | None = None) -> str:
        """Which program ran: "runc", "crun", "hook" (or "none")."""
        proc, rec = self.run(*args, env=env)
        if rec is None:
            return f"none (exit {proc.returncode}: {proc.stderr.decode().strip()})"
        names = {str(self.runc): "runc", str(self.crun): "crun", str(self.hook): "hook"}
        assert rec.argv[1:] == list(args)
        return names.get(rec.argv[0], rec.argv[0])

    def spec(self, text: str) -> Path:
        (self.bundle / "config.json").write_text(text)
        return self.bundle


@pytest.fixture
def node(tmp_path: Path, built: tuple[Path, Path]) -> Node:
    return Node(tmp_path, *built)


# ---------------------------------------------------------------------------- the common path


@pytest.mark.parametrize(
    "args",
    [
        ["--root", "ROOT", "--log", "LOG", "--log-format", "json", "state", "abc"],
        ["--root=ROOT", "--systemd-cgroup", "kill", "abc", "9"],
        ["--root", "ROOT", "exec", "--process", "/tmp/p.json", "--detach", "--pid-file", "/p", "abc"],
        ["--root", "ROOT", "delete", "--force", "abc"],
        ["--version"],
        ["--root", "ROOT", "events", "--stats", "", "a b", "new\nline", "ünï", "--", "-x"],
    ],
)
def test_every_other_call_is_an_exec_of_the_runtime_unchanged(node: Node, args: list[str]) -> None:
    """Same process (exec, not a child), argv, environment, stdin/stdout, inherited fds, exit code."""
    args = [a.replace("ROOT", str(node.root)).replace("LOG", str(node.tmp / "log.json")) for a in args]
    r, w = os.pipe()
    os.write(w, b"through an inherited fd")
    os.close(w)
    # The pipe keeps its number in the child (no preexec_fn: that makes subprocess fork() rather
    # than vfork(), and grpc's fork handlers, loaded by other tests, then run in the child).
    env = node.env(SOME_VAR="kept as is", REC_EXIT="7", REC_FD=str(r))
    proc = subprocess.Popen(
        [str(node.wrapper), *args],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=(r,),
    )
    out, err = proc.communicate(b"stdin data", timeout=30)
    os.close(r)
    assert proc.returncode == 7, err
    fields = (node.rec_dir / "record").read_bytes().split(b"\0")
    assert out == b"stdin data"
    assert int(fields[0]) == proc.pid  # exec'd in place: the upstream's pid is the runtime's
    argc = int(fields[1])
    assert [f.decode() for f in fields[2 : 2 + argc]] == [str(node.runc), *args]
    envc = int(fields[2 + argc])
    got_env = dict(f.decode().split("=", 1) for f in fields[3 + argc : 3 + argc + envc])
    assert got_env == env
    assert fields[3 + argc + envc] == b"through an inherited fd"
    assert not (node.tmp / "log.json").exists()  # nothing written on the way


def test_create_of_an_ordinary_container_goes_to_the_runtime(node: Node) -> None:
    bundle = node.spec(
        json.dumps(
            {
                "ociVersion": "1.0.2",
                "process": {"args": ["sh", "-c", "a && b <c>"], "env": [f"{ANNOTATION}=/x"]},
                "annotations": {"io.kubernetes.cri.container-type": "container", f"{ANNOTATION}x": "/y"},
                "linux": {"annotations": {ANNOTATION: "/nested/is/not/ours"}},
            }
        )
    )
    args = ("--root", str(node.root), "create", "--bundle", str(bundle), "--pid-file", "/p", "c1")
    assert node.who(*args) == "runc"


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"annotations": {ANNOTATION: "/ckpt/c"}}, "hook"),
        ({"annotations": {"a": "b", ANNOTATION: "/ckpt/c"}, "process": {}}, "hook"),
        ({"annotations": {ANNOTATION: ""}}, "runc"),  # empty: not a restore (like the hook)
        ({"annotations": {}}, "runc"),
        ({}, "runc"),
        ({"annotations": {ANNOTATION: None}}, "hook"),  # odd values: the hook judges them
        ({"annotations": ["x"]}, "hook"),
    ],
)
def test_create_with_the_restore_annotation_goes_to_the_hook(node: Node, spec: dict, expected: str) -> None:
    bundle = node.spec(json.dumps(spec))
    assert node.who("--root", str(node.root), "create", "--bundle", str(bundle), "c1") == expected


@pytest.mark.parametrize(
    "text",
    [
        '{"annotations": {"podshim\\u002erestore.checkpoint-dir": "/c"}}',  # escaped key
        '{"annotations": {"x": "\\"}", "podshim.restore.checkpoint-dir": "/c"}}',
        '{"annotations": {}, "annotations": {"podshim.restore.checkpoint-dir": "/c"}}',
        '{"annotations": {"podshim.restore.checkpoint-dir": "/c"}, "annotations": {}}',
    ],
)
def test_the_annotation_is_found_however_the_json_spells_it(node: Node, text: str) -> None:
    bundle = node.spec(text)
    assert node.who("--root", str(node.root), "create", "--bundle", str(bundle), "c1") == "hook"


@pytest.mark.parametrize(
    "text",
    ["", "{", "[]", '{"annotations": {}} x', '{"a": NaN}', '{"a": "\x01"}', '{"a": 01}', "\0{}"],
)
def test_a_config_json_it_cannot_parse_goes_to_the_hook(node: Node, text: str) -> None:
    bundle = node.spec(text)
    assert node.who("--root", str(node.root), "create", "--bundle", str(bundle), "c1") == "hook"


def test_bundle_flag_forms_and_the_working_directory(node: Node) -> None:
    bundle = node.spec(json.dumps({"annotations": {ANNOTATION: "/c"}}))
    assert node.who("create", f"--bundle={bundle}", "c1") == "hook"
    assert node.who("create", "-b", str(bundle), "c1") == "hook"
    assert node.who("create", "--bundle", str(node.tmp / "missing"), "c1") == "hook"  # cannot read
    proc, rec = node.run("create", "c1", cwd=bundle)  # no --bundle: the working directory
    assert rec is not None and rec.argv[0] == str(node.hook)
    node.spec("{}")
    proc, rec = node.run("create", "c1", cwd=bundle)
    assert rec is not None and rec.argv[0] == str(node.runc)


def test_start_of_a_restored_container_is_a_no_op(node: Node) -> None:
    """`create` restored it and it runs: the wrapper answers `start` itself (exit 0, as the hook's
    already_restored), running neither the hook nor the runtime."""
    (node.root / "c1").mkdir(parents=True)
    (node.root / "c1" / "podshim-restored").write_text("/ckpt")
    (node.root / "c2").mkdir(parents=True)
    proc, rec = node.run("--root", str(node.root), "start", "c1")
    assert proc.returncode == 0 and rec is None, (proc.returncode, rec)
    assert node.who("--root", str(node.root), "start", "c2") == "runc"
    assert node.who("--root", str(node.root), "start", "c3") == "runc"
    assert node.who("start", "c1") == "runc"  # no --root: no marker to look for (as the hook)
    assert node.who("--root", str(node.root), "start", "../k8s.io/c1") == "hook"  # odd id: the hook
    assert node.who("--root", str(node.root), "state", "c1") == "runc"  # only start


# ---------------------------------------------------------------------------- choosing the runtime


def test_the_root_picks_the_runtime(node: Node) -> None:
    """The runc shim passes --root <handler's Root>/<namespace>: crun's root goes to crun."""
    assert node.who("--root", str(node.crun_root), "state", "x") == "crun"
    assert node.who("--root", str(node.crun_root.parent), "state", "x") == "crun"  # the Root option
    assert node.who("--root", f"{node.crun_root}/", "state", "x") == "crun"
    assert node.who("--root", f"{node.tmp}/state/./runc/../crun//k8s.io", "state", "x") == "crun"
    assert node.who("--root", str(node.root), "state", "x") == "runc"
    assert node.who("--root", "/elsewhere", "state", "x") == "runc"  # unknown root: [runtime]
    assert node.who("state", "x") == "runc"
    env = node.env(PODSHIM_RUNTIME_BINARY=str(node.crun))  # env overrides [runtime] binary
    assert node.who("--root", "/elsewhere", "state", "x", env=env) == "crun"


def test_without_a_config_file_the_defaults_apply(node: Node) -> None:
    env = node.env(PODSHIM_RUNTIME_BINARY=str(node.crun))
    del env["PODSHIM_CONFIG"]  # /etc/podshim/config.toml, if any: its runtime binary is overridden
    if Path(configmod.DEFAULT_CONFIG_PATH).exists():
        pytest.skip(f"{configmod.DEFAULT_CONFIG_PATH} exists on this machine")
    assert node.who("--root", "/run/containerd/runc/k8s.io", "state", "x", env=env) == "crun"


GOOD_CONFIGS = [
    "",
    "# only a comment\n",
    '[runtime]\nbinary = "{runc}"\n',
    "[runtime]\nbinary = '{runc}'   # literal string\n",
    '[server]\nsocket = "/a.sock"\nmetrics_address = ""\n[upstream]\ntimeout_seconds = 1.5e2\n'
    '[checkpoint]\nallowed_roots = [\n  "/a", # one\n  \'/b\',\n]\n[log]\nlevel = "debug"\n'
    '[runtime]\nbinary="{runc}"\nroot="{root}"\n[runtimes.crun]\nbinary = "{crun}"\nroot = "{crun_root}"\n',
    '[runtimes.crun]\nbinary = "{crun}"\nroot = "{crun_root}"\n\n[runtime]\nbinary = "{runc}"\r\n',
    # two runtimes with one root: the first in the file wins
    '[runtimes.kata]\nbinary = "{runc}"\nroot = "{crun_root}"\n'
    '[runtimes.crun]\nbinary = "{crun}"\nroot = "{crun_root}"\n',
    '[upstream]\ntimeout_seconds = 1_000\n[runtime]\nbinary = "{crun}"\n',
]
BAD_RUNTIME_CONFIGS = [
    "[runtime]\nbinary = 3\n",
    '[runtime]\nbinry = "{runc}"\n',
    '[runtime]\nbinary = "{runc}"\nbinary = "{crun}"\n',
    '[runtime]\nbinary = "{runc}"\n[runtime]\nroot = "/x"\n',
    '[runtime]\nbinary = "{runc}" x\n',
    "[runtime]\nbinary = \"{runc}\nroot = '/x'\n",
    "not toml at all",
]
UNSUPPORTED_BUT_VALID = [  # valid TOML the wrapper leaves to the hook (slow path, same result)
    '[runtime]\nbinary = "{runc}\\u0020"\n',
    '[runtime]\nbinary = """{runc}"""\n',
    '[ runtime ]\nbinary = "{runc}"\n',
    '[runtime]\n"binary" = "{runc}"\n',
    'runtime.binary = "{runc}"\n',
    '[runtimes.crun]\nbinary = "{crun}"\n[runtimes.crun.x]\n',
    '[runtimes]\ncrun = {{ binary = "{crun}" }}\n',
    'runtime = {{ binary = "{crun}" }}\n',
]


def _fill(node: Node, text: str) -> str:
    return text.format(runc=node.runc, crun=node.crun, root=node.root, crun_root=node.crun_root)


def _python_choice(node: Node, root: str, env: dict[str, str]) -> str:
    """What the Python wrapper (shim/wrapper/main.real_runtime) would exec."""
    cfg = configmod.load(None, env=env, check_files=False)
    binary = (cfg.runtime_for_root(root) if root else cfg.runtime).binary
    return {str(node.runc): "runc", str(node.crun): "crun"}.get(binary, binary)


@pytest.mark.parametrize("text", GOOD_CONFIGS)
def test_chooses_the_runtime_the_python_wrapper_chooses(node: Node, text: str) -> None:
    node.write_config(_fill(node, text))
    env = node.env()
    if "[runtime]" not in text:  # the default binary is the real runc: not run here
        env["PODSHIM_RUNTIME_BINARY"] = str(node.runc)
    default_root = configmod.RuntimeConfig.root
    roots = ("", str(node.root), str(node.crun_root), str(node.crun_root.parent), default_root)
    for root in roots:
        args = ("--root", root, "state", "x") if root else ("state", "x")
        assert node.who(*args, env=env) == _python_choice(node, root, env), (text, root)


@pytest.mark.parametrize("text", BAD_RUNTIME_CONFIGS)
def test_a_config_the_python_wrapper_refuses_goes_to_the_hook(node: Node, text: str) -> None:
    node.write_config(_fill(node, text))
    with pytest.raises(configmod.ConfigError):
        configmod.load(str(node.config), env={}, check_files=False)
    assert node.who("--root", str(node.root), "state", "x") == "hook"


@pytest.mark.parametrize("text", UNSUPPORTED_BUT_VALID)
def test_toml_outside_the_subset_goes_to_the_hook(node: Node, text: str) -> None:
    node.write_config(_fill(node, text))
    assert node.who("--root", str(node.root), "state", "x") == "hook"


def test_a_named_config_that_is_missing_goes_to_the_hook(node: Node) -> None:
    env = node.env(PODSHIM_CONFIG=str(node.tmp / "missing.toml"))
    assert node.who("state", "x", env=env) == "hook"


def test_the_example_config_takes_the_fast_path(node: Node) -> None:
    """systemd/config.toml, as a node installs it, is read by the wrapper itself: no Python."""
    env = node.env(
        PODSHIM_CONFIG=str(REPO / "systemd" / "config.toml"), PODSHIM_RUNTIME_BINARY=str(node.runc)
    )
    assert node.who("--root", "/run/containerd/runc/k8s.io", "state", "x", env=env) == "runc"


def test_every_runtime_key_is_known_to_the_wrapper(node: Node) -> None:
    """A key added to RuntimeConfig must be added to the C reader too, else every config using
    it would silently take the Python path."""
    for f in dataclasses.fields(configmod.RuntimeConfig):
        if f.name in ("binary", "root"):
            continue
        node.write_config(f'[runtime]\nbinary = "{node.runc}"\n{f.name} = "/x"\n')
        assert node.who("state", "x") == "runc", f.name


@pytest.mark.e2e
def test_the_test_beds_config_takes_the_fast_path(node: Node, bed: TestBed) -> None:
    """The bed's podshim.toml (what the e2e tests and bench/node.py run with) too: else every
    runtime call of the suite would silently go through Python."""
    env = node.env(PODSHIM_CONFIG=str(bed.podshim_config), PODSHIM_RUNTIME_BINARY=str(node.runc))
    assert node.who("--root", str(bed.runc_root), "state", "x", env=env) == "runc"


# ---------------------------------------------------------------------------- the hook and errors


def test_the_hook_is_found_next_to_the_real_path_of_a_symlinked_wrapper(node: Node) -> None:
    """A symlinked wrapper (/usr/local/bin/podshim-runc to the venv's): its hook is the venv's."""
    elsewhere = node.tmp / "usr-local-bin"
    elsewhere.mkdir()
    (elsewhere / "podshim-runc").symlink_to(node.wrapper)
    node.write_config("[runtime]\nbinary = 3\n")
    proc, rec = node.run("state", "x", exe=elsewhere / "podshim-runc")
    assert rec is not None and rec.argv == [str(node.hook), "state", "x"], proc.stderr


def test_a_missing_hook_is_a_clear_error_in_the_runtime_log(node: Node) -> None:
    node.hook.unlink()
    node.write_config("[runtime]\nbinary = 3\n")
    log = node.tmp / "log.json"
    proc, rec = node.run("--log", str(log), "--log-format", "json", "state", "x")
    assert rec is None and proc.returncode == 1
    assert f"cannot run the restore hook {node.hook}" in proc.stderr.decode()
    entry = json.loads(log.read_text().splitlines()[-1])
    assert entry["level"] == "error" and entry["msg"].startswith("podshim-runc: cannot run the restore hook")


def test_a_missing_runtime_is_a_clear_error(node: Node) -> None:
    node.runc.unlink()
    log = node.tmp / "log.json"
    proc, _ = node.run("--log", str(log), "state", "x")
    assert proc.returncode == 1
    assert f"cannot execute the runtime {node.runc}: No such file or directory" in proc.stderr.decode()
    assert "cannot execute the runtime" in json.loads(log.read_text())["msg"]


# ---------------------------------------------------------------------------- podshim's restore broker


def _packet(*fields: str) -> bytes:
    return b"".join(f.encode() + b"\0" for f in fields)


class FakeBroker:
    """podshim's restore broker as the wrapper sees it (the protocol of shim/ops/restore_broker.py,
    not its code): a SOCK_SEQPACKET listener at <state_dir>/restore.sock, one connection, answered
    by `script(broker, conn)`. Every packet received is kept in `got` (its fields; None: EOF)."""

    def __init__(self, state_dir: Path, script: Callable[[FakeBroker, socket.socket], None]) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self.got: list[list[str] | None] = []
        self.error: BaseException | None = None
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fd = os.open(state_dir, os.O_PATH | os.O_DIRECTORY)
        try:  # through the descriptor, as podshim: the path may exceed sun_path
            self.sock.bind(f"/proc/self/fd/{fd}/restore.sock")
        finally:
            os.close(fd)
        self.sock.listen(1)
        self.sock.settimeout(30)
        self.thread = threading.Thread(target=self._serve, args=(script,), daemon=True)
        self.thread.start()

    def _serve(self, script: Callable[[FakeBroker, socket.socket], None]) -> None:
        try:
            conn, _ = self.sock.accept()
            conn.settimeout(30)
            with conn:
                script(self, conn)
        except BaseException as e:  # noqa: BLE001 - re-raised by done()
            self.error = e

    def recv(self, conn: socket.socket) -> list[str] | None:
        pkt = conn.recv(1 << 20)
        assert not pkt or pkt.endswith(b"\0"), pkt
        self.got.append(pkt[:-1].decode().split("\0") if pkt else None)
        return self.got[-1]

    def done(self) -> list[list[str] | None]:
        self.thread.join(30)
        self.sock.close()
        if self.error is not None:
            raise self.error
        return self.got


def _restore_args(node: Node) -> list[str]:
    bundle = node.spec(json.dumps({"annotations": {ANNOTATION: "/ckpt/c"}}))
    log = node.tmp / "log.json"
    return [
        "--root",
        str(node.root),
        "--log",
        str(log),
        "create",
        "--bundle",
        str(bundle),
        "--pid-file",
        "/p",
        "c1",
    ]


def test_a_restore_is_run_by_podshims_broker(node: Node) -> None:
    """`prepare` to podshim ([server] state_dir), which answers `exec`: the wrapper forks it
    (podshim's env on top of its own, its own session, started only once podshim has its pid),
    reports how it exited and exits as podshim's verdict says."""
    args = _restore_args(node)
    seen: dict[str, object] = {}

    def script(b: FakeBroker, conn: socket.socket) -> None:
        b.recv(conn)
        seen["wrapper"] = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        conn.send(_packet("exec", "FROM_PODSHIM=a b=c", "REC_EXIT=3", "", str(node.runc), "restore", "c1"))
        pid = int(b.recv(conn)[1])  # type: ignore[index]
        seen["record_before_go"] = (node.rec_dir / "record").exists()
        b.recv(conn)
        seen["sid"] = os.getsid(pid)  # not reaped before the verdict: a zombie still
        conn.send(_packet("ok"))

    broker = FakeBroker(node.state_dir, script)
    proc, rec = node.run(*args, env=node.env(PODSHIM_FAILPOINTS="runc-wrapper.x=sleep:1"), cwd=node.tmp)
    prepare, started, exited = broker.done()
    assert proc.returncode == 0, proc.stderr
    assert prepare == ["prepare", str(node.tmp), str(node.runc), "runc-wrapper.x=sleep:1", *args]
    assert rec is not None and rec.argv == [str(node.runc), "restore", "c1"]
    assert started == ["started", str(rec.pid)]
    assert seen == {"wrapper": seen["wrapper"], "record_before_go": False, "sid": rec.pid}
    assert seen["wrapper"] != rec.pid  # a child, not an exec
    assert exited == ["exited", "3"]
    assert rec.env == {
        **node.env(PODSHIM_FAILPOINTS="runc-wrapper.x=sleep:1"),
        "FROM_PODSHIM": "a b=c",
        "REC_EXIT": "3",
    }


def test_podshims_fail_is_the_creates_error(node: Node) -> None:
    """`fail` instead of `exec` (the preparation failed), or as the verdict once the restore ran:
    the message on stderr and in the runtime's --log, exit 1, no hook."""
    args = _restore_args(node)
    for after_the_fork in (False, True):

        def script(b: FakeBroker, conn: socket.socket, after_the_fork: bool = after_the_fork) -> None:
            b.recv(conn)
            if after_the_fork:
                conn.send(_packet("exec", "", "/bin/sh", "-c", "kill -9 $$"))
                b.recv(conn)
                b.recv(conn)
            conn.send(_packet("fail", 'checkpoint /ckpt/c: "pages" differ'))

        broker = FakeBroker(node.state_dir, script)
        (node.tmp / "log.json").unlink(missing_ok=True)
        proc, rec = node.run(*args)
        got = broker.done()
        assert proc.returncode == 1 and rec is None, proc.stderr
        assert proc.stderr.decode() == 'podshim-runc: checkpoint /ckpt/c: "pages" differ\n'
        entry = json.loads((node.tmp / "log.json").read_text())
        assert entry == {"level": "error", "msg": 'podshim-runc: checkpoint /ckpt/c: "pages" differ'}
        assert got[2:] == ([["exited", "-9"]] if after_the_fork else [])  # Python's returncode
        (node.state_dir / "restore.sock").unlink()


@pytest.mark.parametrize(
    "answer",
    [None, b"", b"hook\0", b"exec\0A\0\0/bin/true\0", b"exec\0A=1\0", b"exec\0\0\0", b"fail\0a", b"what\0"],
)
def test_without_an_answer_podshim_would_stand_by_the_hook_restores(node: Node, answer: bytes | None) -> None:
    """No broker (None), EOF, `hook`, or an answer the wrapper does not understand, all before it
    forked anything: the hook redoes the whole restore, as before the broker existed."""
    broker = None
    if answer is not None:

        def script(b: FakeBroker, conn: socket.socket) -> None:
            b.recv(conn)
            if answer:
                conn.send(answer)
            else:
                conn.shutdown(socket.SHUT_RDWR)
            b.recv(conn)

        broker = FakeBroker(node.state_dir, script)
    args = _restore_args(node)
    proc, rec = node.run(*args)
    assert rec is not None and rec.argv == [str(node.hook), *args], proc.stderr
    assert "PODSHIM_RUNC_ABORT" not in rec.env
    if broker is not None:
        assert broker.done()[1:] == [None]  # nothing started


def test_podshim_lost_while_the_restore_runs_aborts_it_through_the_hook(node: Node) -> None:
    """The connection closed after `started`: the wrapper kills the restore's process group at
    once and hands the create to the hook with PODSHIM_RUNC_ABORT (the hook undoes what is left
    and fails the create)."""
    pids = node.tmp / "pids"

    def script(b: FakeBroker, conn: socket.socket) -> None:
        b.recv(conn)
        conn.send(
            _packet(
                "exec", "", "/bin/sh", "-c", f"sleep 60 & echo $$ $! > {pids}.tmp; mv {pids}.tmp {pids}; wait"
            )
        )
        b.recv(conn)
        for _ in range(1000):
            if pids.exists():
                break
            threading.Event().wait(0.01)

    broker = FakeBroker(node.state_dir, script)
    args = _restore_args(node)
    proc, rec = node.run(*args)
    broker.done()
    assert rec is not None and rec.argv == [str(node.hook), *args], proc.stderr
    assert rec.env["PODSHIM_RUNC_ABORT"] == (
        "podshim's restore broker connection was lost after the restore started (poll: connection closed)"
    )
    for pid in map(int, pids.read_text().split()):  # the shell (reaped) and its sleep (the group)
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", pid


def test_the_brokers_state_dir(node: Node) -> None:
    """[server] state_dir, PODSHIM_SERVER_STATE_DIR over it (as shim/config.py), a path longer
    than sun_path; a state_dir that is not a string is the hook's to report."""
    text = node.config.read_text().replace(str(node.state_dir), "{dir}")
    long_dir = node.tmp / "/".join(["d" * 50] * 3)
    args = _restore_args(node)
    for config_dir, env_dir, used in [
        (long_dir, None, long_dir),
        (node.tmp / "unused", str(node.state_dir), node.state_dir),
    ]:
        node.write_config(text.format(dir=config_dir))

        def script(b: FakeBroker, conn: socket.socket) -> None:
            b.recv(conn)
            conn.send(_packet("fail", "asked"))

        broker = FakeBroker(used, script)
        env = node.env(**({"PODSHIM_SERVER_STATE_DIR": env_dir} if env_dir else {}))
        proc, rec = node.run(*args, env=env)
        broker.done()
        assert proc.returncode == 1 and proc.stderr == b"podshim-runc: asked\n", proc.stderr
    node.write_config(text.replace('"{dir}"', "3"))
    assert node.who("--root", str(node.root), "state", "x") == "hook"


# ---------------------------------------------------------------------------- the installed one


def test_the_installed_wrapper_is_the_compiled_one_with_its_hook(tmp_path: Path) -> None:
    """The set-up installs native/ as .venv/bin/podshim-runc next to the Python hook; a call the
    wrapper cannot judge reaches the real hook, which reports the config error (exit code 2)."""
    wrapper, hook = VENV_BIN / "podshim-runc", VENV_BIN / "podshim-runc-hook"
    assert wrapper.read_bytes()[:4] == b"\x7fELF", "run the set-up (make setup)"
    assert hook.read_text().startswith("#!") and "shim.wrapper.main" in hook.read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text("[runtime]\nbinary = 3\n")
    proc = subprocess.run(
        [str(wrapper), "state", "x"], env={"PODSHIM_CONFIG": str(bad)}, capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"podshim-runc: config file {bad}: runtime.binary: expected str, got 3"
