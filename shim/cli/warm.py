"""The CLI's warm helper (docs/checkpoint-restore.md (The podshim CLI)): the read-only commands
(`WARM_COMMANDS`) without the 0.2 s Python spends importing grpc and protobuf at every call.

A background process of the caller's user loads those and the commands once. A command line of a
read-only command hands it the command line, working directory, environment, umask and standard
descriptors (SCM_RIGHTS) over its socket; a forked child takes them on and runs the command as the
caller would have (`shim.cli.parser.run`); the caller waits for its exit code, passing SIGINT,
SIGTERM and SIGHUP on. No helper serving: the command runs in the caller, which starts one. The
helper exits after CLI_WARM_IDLE without a call, or once a file of a module it loaded changes (a
child never runs other code than the files hold). One helper per interpreter and module search
path, in a directory only its user enters, answering only that user (SO_PEERCRED)."""

from __future__ import annotations

import array
import contextlib
import json
import os
import signal
import socket
import stat
import struct
import sys
import zlib
from types import FrameType
from typing import Any

from shim.cli.argv import command_of
from shim.deadlines import CLI_WARM_HANDOFF, CLI_WARM_IDLE

WARM_COMMANDS = frozenset({"pods", "ps", "inspect", "inspectp"})
ENABLE_ENV = "PODSHIM_CLI_WARM"  # "0": every command runs in the calling process
DIR_ENV = "PODSHIM_CLI_WARM_DIR"  # where the helper's socket is; else $XDG_RUNTIME_DIR or /tmp
UNIX_PATH_MAX = 107
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STDIO = (0, 1, 2)
EXIT_LOST = 1  # the child ended without saying its exit code (killed)

# ---------------------------------------------------------------------------- the caller's side


def run(argv: list[str]) -> int | None:
    """The exit code of `argv` run by the warm helper's child; None when it is to run in this
    process (not a read-only command, no helper serving, or turned off)."""
    if os.environ.get(ENABLE_ENV) == "0" or command_of(argv) not in WARM_COMMANDS:
        return None
    path = socket_path()
    if path is None:
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(CLI_WARM_HANDOFF)
        try:
            conn.connect(path)
        except OSError:
            start_helper(path)  # for the next call; this one runs here
            return None
        return _handed_off(conn, argv, path)
    finally:
        conn.close()


def _handed_off(conn: socket.socket, argv: list[str], path: str) -> int | None:
    request = json.dumps(
        {"argv": argv, "argv0": sys.argv[0], "cwd": _cwd(), "env": dict(os.environ), "umask": _umask()}
    ).encode()
    try:
        conn.sendmsg(
            [struct.pack("!I", len(request)), request],
            [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", STDIO))],
        )
        reader = conn.makefile("rb")
        first = reader.readline().split()
    except OSError:
        return None  # a helper that stopped meanwhile: nothing ran
    if first[:1] != [b"pid"]:
        if first == [b"stale"]:
            start_helper(path)  # the code changed under the helper, which is going: a new one
        return None
    pid = int(first[1])
    forwarded: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        forwarded.append(signum)
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        conn.settimeout(None)  # the command's own --timeout bounds it
        last = reader.readline().split()
    except OSError:
        last = []
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if last[:1] == [b"exit"]:
        return int(last[1])
    if forwarded:
        return 128 + forwarded[0]
    print("podshim: the command's process ended without an exit code", file=sys.stderr)
    return EXIT_LOST


def _cwd() -> str:
    try:
        return os.getcwd()
    except OSError:  # removed under the caller
        return "/"


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def socket_path() -> str | None:
    """The socket of the helper of this interpreter and module search path, in a directory of the
    caller's user (made 0700; None when it is anyone else's or open to others)."""
    uid = os.getuid()
    base = os.environ.get(DIR_ENV) or os.path.join(
        os.environ.get("XDG_RUNTIME_DIR") or "/tmp", f"podshim-cli-{uid}"
    )
    try:
        os.makedirs(base, 0o700, exist_ok=True)
        st = os.lstat(base)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
        return None
    key = zlib.crc32("\0".join([sys.executable, *sys.path]).encode())
    path = os.path.join(base, f"warm-{key:08x}.sock")
    return path if len(path.encode()) <= UNIX_PATH_MAX else None


def start_helper(path: str) -> None:
    """A helper serving `path`, started in a session of its own (it outlives this process); a
    second one started meanwhile finds the first holding the lock and exits."""
    pid = os.fork()
    if pid == 0:  # the intermediate: the helper is its child, reparented once it exits
        code = 0
        try:
            if os.fork() == 0:
                code = 127
                os.setsid()
                null = os.open(os.devnull, os.O_RDWR)
                for fd in STDIO:
                    os.dup2(null, fd)
                os.closerange(3, 65536)
                os.chdir("/")
                os.execv(sys.executable, [sys.executable, "-m", "shim.cli.warm", path])
        finally:
            os._exit(code)
    os.waitpid(pid, 0)


def stop_helpers(directory: str) -> list[int]:
    """SIGTERM the helpers serving in `directory` (a DIR_ENV), by their pid files: the pids."""
    stopped = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(directory):
            if not (name.startswith("warm-") and name.endswith(".sock.pid")):
                continue
            try:
                with open(os.path.join(directory, name)) as f:
                    pid = int(f.read())
                os.kill(pid, signal.SIGTERM)
            except (OSError, ValueError):
                continue
            stopped.append(pid)
    return stopped


# ---------------------------------------------------------------------------- the helper


def serve(path: str) -> None:
    """Serve `path` until CLI_WARM_IDLE passes without a call, SIGTERM, or a change to the files
    of the modules loaded here."""
    import fcntl

    lock = open(path + ".lock", "a")  # noqa: SIM115 - held for the helper's life
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return  # another helper serves it
    _preload()
    loaded = _loaded_files()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.unlink(path)  # a helper's that died: nobody serves it (the lock says so)
    except FileNotFoundError:
        pass
    old_mask = os.umask(0o177)
    try:
        listener.bind(path)
    finally:
        os.umask(old_mask)
    listener.listen(64)
    listener.settimeout(CLI_WARM_IDLE)
    bound = os.stat(path).st_ino
    with open(path + ".pid", "w") as f:
        f.write(f"{os.getpid()}\n")
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the children are reaped by the kernel
    signal.signal(signal.SIGTERM, _stop)
    try:
        while True:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                return
            with conn:
                if not _serve_one(conn, listener, lock, loaded):
                    return
    except SystemExit:
        return
    finally:
        listener.close()
        # a helper started after this one went stale may have bound the path and written its pid
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == bound:
                os.unlink(path)
        with contextlib.suppress(FileNotFoundError, ValueError):
            with open(path + ".pid") as f:
                mine = int(f.read()) == os.getpid()
            if mine:
                os.unlink(path + ".pid")


def _stop(_signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(0)


def _preload() -> None:
    """What the read-only commands need, loaded once: grpc (no channel: nothing runs in this
    process that a fork could not copy), protobuf, the CRI modules and the commands."""
    from google.protobuf import json_format  # noqa: F401

    from shim import rpc_client
    from shim.cli import parser

    rpc_client.preload()

    for name in WARM_COMMANDS:
        parser.build_parser([name])
    try:
        import yaml  # noqa: F401  (-o yaml)
    except ImportError:
        pass


def _loaded_files() -> dict[str, int]:
    """The files of the modules loaded here from the directory podshim's package is in (the
    source tree, or site-packages with the libraries beside it), with their mtimes."""
    import shim

    root = os.path.dirname(os.path.dirname(os.path.abspath(shim.__file__ or ""))) + os.sep
    files = {}
    for module in list(sys.modules.values()):
        f = getattr(module, "__file__", None)
        if f and os.path.abspath(f).startswith(root):
            files[f] = os.stat(f).st_mtime_ns
    return files


def _changed(files: dict[str, int]) -> bool:
    for f, mtime in files.items():
        try:
            if os.stat(f).st_mtime_ns != mtime:
                return True
        except OSError:
            return True
    return False


def _serve_one(conn: socket.socket, listener: socket.socket, lock: Any, loaded: dict[str, int]) -> bool:
    """One caller: its command run by a child; False when this helper is to stop (stale)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    if uid != os.getuid():
        return True
    conn.settimeout(CLI_WARM_HANDOFF)
    fds: list[int] = []
    try:
        request, fds = _receive(conn)
        if _changed(loaded):
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_UN)  # before the caller starts the next helper
            conn.sendall(b"stale\n")
            return False
        if len(fds) != len(STDIO):
            return True
        if os.fork() == 0:
            listener.close()
            lock.close()
            _child(conn, request, fds)
    except (OSError, ValueError):
        return True
    finally:
        for fd in fds:
            os.close(fd)
    return True


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    fds = array.array("i")
    head, ancdata, _flags, _addr = conn.recvmsg(4, socket.CMSG_SPACE(len(STDIO) * fds.itemsize))
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    if len(head) != 4:
        raise ValueError("short request")
    (size,) = struct.unpack("!I", head)
    body = conn.recv(size, socket.MSG_WAITALL)
    if len(body) != size:
        raise ValueError("short request")
    return json.loads(body), list(fds)


def _child(conn: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    """Become the caller's command: its descriptors, directory, environment and umask, then run it.
    Never returns."""
    import io
    import time

    code = EXIT_LOST
    try:
        for target, fd in zip(STDIO, fds, strict=True):
            os.dup2(fd, target)
        try:
            os.chdir(request["cwd"])
        except OSError:
            os.chdir("/")
        os.environ.clear()
        os.environ.update(request["env"])
        time.tzset()
        os.umask(int(request["umask"]))
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
        sys.stdout = io.TextIOWrapper(
            io.FileIO(1, "w", closefd=False), encoding="utf-8", line_buffering=os.isatty(1)
        )
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True
        )
        argv = [str(a) for a in request["argv"]]
        sys.argv = [str(request.get("argv0") or "podshim"), *argv]
        conn.settimeout(None)
        conn.sendall(f"pid {os.getpid()}\n".encode())
        from shim.cli import parser

        try:
            code = parser.run(argv)
        except SystemExit as e:  # argparse's usage errors and --help
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except OSError:
                pass
        conn.sendall(f"exit {code}\n".encode())
    except BaseException:  # noqa: BLE001 - the caller says the command ended without its code
        pass
    finally:
        os._exit(0)


if __name__ == "__main__":
    serve(sys.argv[1])
