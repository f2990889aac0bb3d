"""`podshim doctor`: checks a node end to end, one line per check with what to do, and passes only
when a restore will work (docs/design/install.md (Installing a node)).

FAIL lines are what stops a checkpoint or restore; warn lines are worth knowing (lazy restore
unavailable, no kubelet running yet, a root podshim will create). It asks the real things: CRIU
checks the kernel and dumps and restores a process holding a TCP socket, containerd reports the
wiring it runs with (the check of shim/checks/wiring.py, which podshim itself runs before each restore),
podshim and the kubelet are found running.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from shim.checks import rlimits
from shim.config import Config, RuntimeConfig
from shim.deadlines import DOCTOR_CRIU_TIMEOUT, DOCTOR_RPC_TIMEOUT
from shim.node import kubelet
from shim.node.setup import wants_criu_path

FAIL_FREE_BYTES = 512 << 20  # below this, a checkpoint of any real pod will not fit
WARN_FREE_BYTES = 4 << 30
CRIU_MIN = (4, 1)
# A string each of podshim's shared CRIU patches (scripts/patches/criu/*.patch) adds to CRIU's
# binary (a log message), so a CRIU can be told to carry it (None: the patch adds no string of its
# own, and is not checked); tests/test_doctor.py keeps this table and the patches in step. A patch
# of one series only (<major.minor>/) is proven by the round trip instead (4.1/0001: a TCP socket
# cannot be dumped without it on Linux >= 6.16).
CRIU_PATCH_MARKERS: dict[str, bytes | None] = {
    "0002-uts-keep-joined-namespace-hostname.patch": b"Keeping the hostname and domain name of the joined",
    "0003-timerfd-rearm-expired-periodic-timer.patch": b"expired periodic timer, re-armed to expire now",
    "0004-page-pipe-tee-pipe-within-pipe-max-size.patch": b"Cannot set the size of the pipe for reading",
    "0005-uffd-keep-userfaultfds-when-the-page-server-fails.patch": b"the userfaultfds stay open and the",
    "0006-restorer-fail-on-short-pages-image.patch": b"the pages image ends at",
    "0007-uffd-several-background-page-requests-in-flight.patch": None,
    "0008-page-server-reads-lazy-pages-from-the-task.patch": b"cannot be read: the task is gone",
    "0009-uffd-wait-for-answers-instead-of-spinning.patch": None,
    "0010-page-server-tcp-congestion-control.patch": b"Unable to set TCP congestion control",
    "0011-tls-log-the-negotiated-session.patch": b"TLS handshake completed: ",
    "0012-mount-clean-copy-by-open-tree.patch": b"by open_tree",
    "0013-page-xfer-close-a-corked-connection-uncorked.patch": b"Uncorking the page server connection",
    "0014-uffd-log-where-the-lazy-pages-daemon-time-goes.patch": b"page transfer time split: ",
    "0015-uffd-copy-background-pages-on-copier-threads.patch": b"Background pages are copied by %d copier",
    rlimits.PATCH: rlimits.MARKER,
}
# What the round trip dumps: a process listening on a TCP socket (the socket options CRIU reads
# of it fail on Linux >= 6.16 without the 4.1 patch), its stdio closed once it reports ready.
_ROUND_TRIP_PROCESS = (
    "import os, socket, sys, time\n"
    "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
    "print('ready', flush=True)\n"
    "null = os.open(os.devnull, os.O_RDWR)\n"
    "for fd in (0, 1, 2): os.dup2(null, fd)\n"
    "while True: time.sleep(1)\n"
)


class Status(enum.Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "FAIL"


@dataclass(frozen=True)
class Result:
    check: str
    status: Status
    detail: str

    def line(self) -> str:
        return f"{self.status.value:<4} {self.check}: {self.detail}"


def ok(check: str, detail: str) -> Result:
    return Result(check, Status.OK, detail)


def warn(check: str, detail: str) -> Result:
    return Result(check, Status.WARN, detail)


def fail(check: str, detail: str) -> Result:
    return Result(check, Status.FAIL, detail)


def _run(argv: list[str], timeout: float = DOCTOR_CRIU_TIMEOUT) -> tuple[int, str]:
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return -1, str(e)
    return res.returncode, (res.stdout + res.stderr).strip()


def _version_tuple(text: str) -> tuple[int, ...]:
    import re

    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    return tuple(int(x) for x in m.groups() if x is not None) if m else ()


def _last_line(text: str) -> str:
    lines = [x for x in text.splitlines() if x.strip()]
    return lines[-1].strip() if lines else "(no output)"


# ---------------------------------------------------------------------------- CRIU


def criu_binaries(cfg: Config) -> list[str]:
    return list(dict.fromkeys(rt.criu for rt in (cfg.runtime, *cfg.runtimes.values())))


def check_criu_binary(criu: str) -> list[Result]:
    name = f"criu {criu}"
    path = shutil.which(criu) if "/" not in criu else criu
    if not path or not os.access(path, os.X_OK):
        return [
            fail(
                name, "not found or not executable: set [runtime] criu to podshim's (/opt/podshim/sbin/criu)"
            )
        ]
    rc, out = _run([path, "--version"])
    version = _version_tuple(out)
    if rc != 0 or not version:
        return [fail(name, f"`criu --version` failed: {_last_line(out)}")]
    shown = ".".join(map(str, version))
    if version[:2] < CRIU_MIN:
        return [fail(name, f"version {shown} < 4.1: use podshim's CRIU (/opt/podshim/sbin/criu)")]
    if os.path.basename(path) != "criu" or not os.path.isabs(criu):
        return [
            fail(
                name,
                f"version {shown}, but runc >= 1.2, crun and containerd 2.x run the `criu` on PATH, and "
                "podshim can put only an absolute path to a file named `criu` first there: rename it",
            )
        ]
    return [ok(name, f"version {shown}")]


def check_criu_kernel(criu: str) -> list[Result]:
    rc, out = _run([criu, "check"])
    if rc == 0 and "Looks good" in out:
        return [ok("criu check", "Looks good (the kernel has what CRIU needs)")]
    return [
        fail("criu check", f"{_last_line(out)}: a kernel feature CRIU needs is missing (see `{criu} check`)")
    ]


def check_criu_patches(criu: str) -> list[Result]:
    try:
        data = Path(criu).read_bytes()
    except OSError as e:
        return [fail("criu patches", f"cannot read {criu}: {e.strerror}")]
    markers = {name: m for name, m in CRIU_PATCH_MARKERS.items() if m is not None}
    missing = [name for name, marker in markers.items() if marker not in data]
    if missing:
        return [
            fail(
                "criu patches",
                f"{criu} lacks podshim's patches {', '.join(missing)} (scripts/patches/criu: a restored pod "
                "renamed after the old one, periodic timers stopped, lazy migrations failing...): use "
                "podshim's CRIU (/opt/podshim/sbin/criu)",
            )
        ]
    return [ok("criu patches", f"{criu} carries podshim's {len(markers)} patches that leave a mark")]


def check_criu_uffd(criu: str, lazy_default: bool) -> list[Result]:
    rc, out = _run([criu, "check", "--feature", "uffd-noncoop"])
    if rc == 0:
        return [ok("userfaultfd", "supported (lazy restores can run)")]
    detail = f"not usable ({_last_line(out)}): lazy restores (lazy-pages=true) fail"
    return (
        [fail("userfaultfd", detail + ", and [restore] lazy_pages is true")]
        if lazy_default
        else [warn("userfaultfd", detail)]
    )


def check_criu_round_trip(criu: str) -> list[Result]:
    """Dump and restore a process holding a listening TCP socket with this CRIU, as runc would."""
    name = "criu dump/restore"
    with tempfile.TemporaryDirectory(prefix="podshim-doctor-") as tmp:
        images = Path(tmp)
        proc = subprocess.Popen(
            [sys.executable, "-c", _ROUND_TRIP_PROCESS],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        restored = 0
        try:
            if proc.stdout is None or proc.stdout.readline() != b"ready\n":
                return [fail(name, "the test process did not start")]
            proc.stdout.close()
            rc, out = _run([criu, "dump", "-t", str(proc.pid), "-D", tmp, "-o", "dump.log", "-v4"])
            if rc != 0:
                return [
                    fail(
                        name,
                        "dump of a process with a TCP socket failed: "
                        + _criu_error(images / "dump.log", out),
                    )
                ]
            proc.wait(timeout=DOCTOR_CRIU_TIMEOUT)
            pidfile = images / "restored.pid"
            argv = [criu, "restore", "-D", tmp, "-o", "restore.log", "-v4", "--restore-detached"]
            rc, out = _run([*argv, "--pidfile", str(pidfile)])
            with contextlib.suppress(OSError, ValueError):
                restored = int(pidfile.read_text())
            if rc != 0 or not restored:
                return [fail(name, f"restore failed: {_criu_error(images / 'restore.log', out)}")]
            return [ok(name, "a process with a TCP socket dumped and restored")]
        finally:
            for pid in (proc.pid, restored):
                with contextlib.suppress(OSError):
                    if pid:
                        os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)


def _criu_error(log: Path, out: str) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return _last_line(out)
    errors = [x.strip() for x in lines if "Error" in x and "RLIMIT_NOFILE" not in x]
    return "; ".join(errors[-2:]) or _last_line(out)


# ---------------------------------------------------------------------------- cgroups, runtimes


def check_cgroups(cfg: Config, root: Path = Path("/sys/fs/cgroup")) -> list[Result]:
    try:
        fstype = _fstype(root)
    except OSError as e:
        return [fail("cgroups", f"cannot read {root}: {e.strerror}")]
    if fstype == "cgroup2":
        return [ok("cgroups", "v2 (cgroup.freeze freezes a pod)")]
    if not (root / "freezer").is_dir():
        return [
            fail(
                "cgroups",
                f"v1 without a freezer hierarchy at {root}/freezer: mount it (the pod cut needs it)",
            )
        ]
    unified = root / "unified"
    offered = _read(unified / "cgroup.controllers").split()
    crun = [n for n, rt in cfg.runtimes.items() if "crun" in os.path.basename(rt.binary)]
    if offered and crun:
        return [
            fail(
                "cgroups",
                f"hybrid, and the cgroup2 mount {unified} still offers {' '.join(offered)}: crun refuses "
                f"this layout (handler {', '.join(crun)}); mount those controllers as v1 hierarchies",
            )
        ]
    return [ok("cgroups", "v1" + (" (hybrid)" if unified.is_dir() else "") + ", freezer mounted")]


def _fstype(path: Path) -> str:
    best, fstype = "", ""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        if (
            len(parts) > 2
            and (str(path) + "/").startswith(parts[1].rstrip("/") + "/")
            and len(parts[1]) > len(best)
        ):
            best, fstype = parts[1], parts[2]
    return fstype


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def check_runtime(name: str, rt: RuntimeConfig) -> list[Result]:
    check = f"runtime {name}"
    if not os.access(rt.binary, os.X_OK):
        return [fail(check, f"{rt.binary} not found or not executable: set binary in podshim's config")]
    rc, out = _run([rt.binary, "--version"])
    first = out.splitlines()[0] if out else ""
    if rc != 0:
        return [fail(check, f"`{rt.binary} --version` failed: {_last_line(out)}")]
    if "crun" in os.path.basename(rt.binary):
        if "+CRIU" not in out:
            return [
                fail(check, f"{first}, built without CRIU: build crun with libcriu (it cannot checkpoint)")
            ]
        return [ok(check, f"{first} (+CRIU)")]
    rc, out = _run([rt.binary, "checkpoint", "--help"])
    if rc != 0:
        return [fail(check, f"{first}: `checkpoint --help` fails: {_last_line(out)}")]
    return [ok(check, f"{first}, checkpoint/restore available")]


# ---------------------------------------------------------------------------- containerd, podshim


def _stub(endpoint: str) -> object:
    from shim import rpc_client  # grpc only for the checks that call

    return rpc_client.runtime_stub(endpoint)


def check_wiring(cfg: Config) -> list[Result]:
    """containerd's report of its runtime handlers, judged as podshim judges it before a restore."""
    from api.runtime.v1 import api_pb2 as cri
    from shim import rpc_client
    from shim.checks.wiring import Verdict, config_section, judge, major_version

    stub = _stub(cfg.upstream_endpoint)
    try:
        version = stub.Version(cri.VersionRequest(), timeout=DOCTOR_RPC_TIMEOUT)  # type: ignore[attr-defined]
        status = stub.Status(cri.StatusRequest(verbose=True), timeout=DOCTOR_RPC_TIMEOUT)  # type: ignore[attr-defined]
    except rpc_client.RpcError as e:
        return [
            fail("containerd", f"{rpc_client.rpc_error_message(e, cfg.upstream_endpoint)}: start containerd")
        ]
    major = major_version(version.runtime_version)
    results = [
        ok("containerd", f"{version.runtime_name} {version.runtime_version} at {cfg.upstream_endpoint}")
    ]
    try:
        runtimes = json.loads(status.info.get("config") or "{}").get("containerd", {}).get("runtimes", {})
    except (ValueError, AttributeError):
        runtimes = {}
    handlers = ["", *cfg.runtimes]
    for h in handlers:
        w = judge(status.info, h, major)
        check = f"wiring {w.handler}"
        if w.verdict is Verdict.WRONG:
            results.append(fail(check, w.problem + " (`podshim node setup` writes it)"))
            continue
        if w.verdict is Verdict.UNKNOWN:
            results.append(warn(check, w.problem))
            continue
        rt = cfg.runtime_for_handler(h) or cfg.runtime
        options = (runtimes.get(w.handler) or {}).get("options") or {}
        results += _wiring_details(check, w.binary, rt, options, config_section(w.handler, major), h)
    return results


def _wiring_details(
    check: str, binary: str, rt: RuntimeConfig, options: dict[str, object], section: str, handler: str
) -> list[Result]:
    real = os.path.realpath(shutil.which(binary) or binary)
    hook = os.path.join(os.path.dirname(real), "podshim-runc-hook")
    if not os.access(hook, os.X_OK):
        return [
            fail(check, f"BinaryName {binary} has no podshim-runc-hook next to {real}: reinstall podshim")
        ]
    criu_path = str(options.get("CriuPath") or "")
    if criu_path and not wants_criu_path(rt.binary):
        name = os.path.basename(rt.binary)
        if "crun" in name:
            return [
                fail(
                    check,
                    f"CriuPath is set; crun refuses the --criu it becomes: remove it ([{section}.options])",
                )
            ]
        return [
            warn(
                check,
                f"CriuPath is set, which {name} >= 1.2 ignores with a warning in every container's log "
                f"(podshim names its CRIU on PATH): remove it from [{section}.options]",
            )
        ]
    if criu_path and os.path.realpath(criu_path) != os.path.realpath(rt.criu):
        return [
            fail(
                check,
                f"CriuPath = {criu_path!r} but podshim's CRIU is {rt.criu!r}: runc < 1.2 restores with "
                f"CriuPath's; set [{section}.options] CriuPath = {rt.criu!r} (or remove it)",
            )
        ]
    root = os.path.join(str(options.get("Root") or "/run/containerd/runc"), "k8s.io")
    if os.path.normpath(root) != os.path.normpath(rt.root):
        where = "[runtime]" if not handler else f"[runtimes.{handler}]"
        return [
            warn(
                check,
                f"podshim-runc, podshim.* passed; but containerd keeps these containers in {root}: "
                f"set {where} root = {root!r}",
            )
        ]
    return [ok(check, f"runs {binary}, passes podshim.* annotations")]


def check_podshim(cfg: Config) -> list[Result]:
    from api.runtime.v1 import api_pb2 as cri
    from shim import rpc_client

    endpoint = "unix://" + cfg.socket
    try:
        v = _stub(endpoint).Version(cri.VersionRequest(), timeout=DOCTOR_RPC_TIMEOUT)  # type: ignore[attr-defined]
    except rpc_client.RpcError as e:
        return [
            fail("podshim", f"{rpc_client.rpc_error_message(e, endpoint)}: `systemctl enable --now podshim`")
        ]
    return [ok("podshim", f"serving {v.runtime_name} {v.runtime_version} at {endpoint}")]


def check_kubelets(cfg: Config, pids: list[int] | None) -> list[Result]:
    from shim.archive.paths import is_inside

    want = "unix://" + cfg.socket
    found = kubelet.running(pids)
    if not found:
        return [
            warn(
                "kubelet",
                f"no kubelet running on this node: start it with --container-runtime-endpoint={want}",
            )
        ]
    results = []
    roots = [Path(os.path.realpath(r)) for r in cfg.allowed_roots]
    for k in found:
        if k.endpoint != want:
            results.append(
                fail(
                    f"kubelet {k.pid}",
                    f"uses {k.endpoint} ({k.source}): set --container-runtime-endpoint={want}",
                )
            )
            continue
        results.append(ok(f"kubelet {k.pid}", f"uses {want} ({k.source})"))
        ckpt = Path(os.path.realpath(os.path.join(k.root_dir, kubelet.CHECKPOINTS)))
        if not any(ckpt == r or is_inside(ckpt, r) for r in roots):
            results.append(
                warn(
                    f"kubelet {k.pid}",
                    f"its container checkpoints ({ckpt}) are outside [checkpoint] allowed_roots: add it, or "
                    "CheckpointContainer through the kubelet is refused where podshim checkpoints itself",
                )
            )
    return results


# ---------------------------------------------------------------------------- directories


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_allowed_roots(cfg: Config) -> list[Result]:
    results = []
    for r in cfg.allowed_roots:
        check = f"allowed root {r}"
        try:
            st = os.stat(r)
        except FileNotFoundError:
            # (the first checkpoint into it creates it: `podshim checkpointpod` does, the kubelet does)
            results.append(warn(check, f"does not exist yet: mkdir -m 0700 -p {r}"))
            continue
        if not stat.S_ISDIR(st.st_mode):
            results.append(fail(check, "is not a directory"))
        elif st.st_uid != 0 or st.st_mode & 0o022:
            results.append(
                fail(
                    check, f"owner uid {st.st_uid}, mode {st.st_mode & 0o7777:04o}: chown root and chmod go-w"
                )
            )
        else:
            results.append(ok(check, f"root-owned, mode {st.st_mode & 0o7777:04o}"))
    return results


def check_free_space(cfg: Config) -> list[Result]:
    results = []
    for d in dict.fromkeys([*cfg.allowed_roots, cfg.state_dir]):
        where = _existing(Path(d))
        try:
            st = os.statvfs(where)
        except OSError as e:
            results.append(fail(f"free space {d}", f"cannot statvfs {where}: {e.strerror}"))
            continue
        free = st.f_bavail * st.f_frsize
        shown = f"{free / 2**30:.1f} GiB free"
        if free < FAIL_FREE_BYTES:
            results.append(
                fail(f"free space {d}", f"{shown}: a checkpoint needs about the pod's memory; free space")
            )
        elif free < WARN_FREE_BYTES:
            results.append(warn(f"free space {d}", f"{shown}: enough for small pods only"))
        else:
            results.append(ok(f"free space {d}", shown))
    return results


def check_private_dir(
    check: str, path: str, created_by: str, readable: int = 0, note: str = ""
) -> list[Result]:
    """A root-owned directory nobody else writes to; read access beyond `readable` (bits of 0o044)
    is a warning."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return [warn(check, f"{path} does not exist yet ({created_by} creates it)")]
    mode = st.st_mode & 0o7777
    if st.st_uid != 0 or mode & 0o022:
        return [
            fail(
                check,
                f"{path}: owner uid {st.st_uid}, mode {mode:04o}: chown root {path} && chmod 0700 {path}",
            )
        ]
    if mode & 0o044 & ~readable:
        return [warn(check, f"{path}: mode {mode:04o}, readable by others{note}")]
    return [ok(check, f"{path}: root-owned, mode {mode:04o}")]


# ---------------------------------------------------------------------------- all of it


def check_cluster(cfg: Config) -> list[Result]:
    """The cluster API (docs/cluster.md): reachable, served, the node's rights."""
    from shim.kube import doctor as kube_doctor  # lightkube only when doctor runs

    made = {"ok": ok, "warn": warn, "fail": fail}
    return [made[status](check, detail) for status, check, detail in kube_doctor.check_cluster(cfg)]


def checks(cfg: Config, kubelet_pids: list[int] | None = None) -> Iterator[Callable[[], list[Result]]]:
    """Every check of the node, in the order they print."""
    for criu in criu_binaries(cfg):
        yield functools.partial(check_criu_binary, criu)
    criu = cfg.runtime.criu
    yield lambda: check_criu_kernel(criu)
    yield lambda: check_criu_patches(criu)
    yield lambda: check_criu_round_trip(criu)
    yield lambda: check_criu_uffd(criu, cfg.lazy_pages)
    yield lambda: check_cgroups(cfg)
    for name, rt in (("runc", cfg.runtime), *cfg.runtimes.items()):
        yield functools.partial(check_runtime, name, rt)
    yield lambda: check_wiring(cfg)
    yield lambda: check_podshim(cfg)
    yield lambda: check_kubelets(cfg, kubelet_pids)
    yield lambda: check_cluster(cfg)
    yield lambda: check_allowed_roots(cfg)
    yield lambda: check_free_space(cfg)
    note = " (podshim narrows it to 0700 at start)"
    yield lambda: check_private_dir("state dir", cfg.state_dir, "podshim", note=note)
    # the unit's RuntimeDirectoryMode=0750: a group may reach the socket
    yield lambda: check_private_dir("socket dir", os.path.dirname(cfg.socket), "the unit", readable=0o040)


def run(cfg: Config, kubelet_pids: list[int] | None = None, out: Callable[[str], None] = print) -> bool:
    """Run every check, printing each line as it comes; True when nothing failed."""
    failed = False
    start = time.monotonic()
    for check in checks(cfg, kubelet_pids):
        for r in _guarded(check):
            out(r.line())
            failed = failed or r.status is Status.FAIL
    out(f"{'FAILED' if failed else 'passed'} in {time.monotonic() - start:.1f}s")
    return not failed


def _guarded(check: Callable[[], list[Result]]) -> list[Result]:
    try:
        return check()
    except Exception as e:  # noqa: BLE001 - one check's bug must not hide the others
        return [fail("doctor", f"a check crashed: {type(e).__name__}: {e}")]
