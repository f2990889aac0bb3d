"""What every client command of `podshim` shares (pip's base_command): the exit codes and the
errors that choose them, the argument types, the global options, id resolution, and `guarded`,
which turns any failure into one line on stderr. The commands are in shim/cli/commands/, one
module each; their gRPC goes through shim/cli/transport.py.

Conventions (crictl's): `-r/--runtime-endpoint` (default $CONTAINER_RUNTIME_ENDPOINT, else
podshim's socket), `--timeout` seconds, `-o json|yaml|table`. Exit codes: 0 success, 1 the
runtime (or the node) failed — the gRPC code name and message go to stderr —, 2 bad usage.
Errors never print a traceback. Long operations show elapsed time and bytes written on a
terminal (stderr) and stay quiet when stderr is not one.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from shim.cli import output, transport
from shim.deadlines import CLI_LONG_TIMEOUT, CLI_SHORT_TIMEOUT

if TYPE_CHECKING:  # pathlib and json load when used: every command's start-up passes here
    from pathlib import Path

DEFAULT_ENDPOINT = "unix:///run/podshim/podshim.sock"
ENDPOINT_ENV = "CONTAINER_RUNTIME_ENDPOINT"
# shim/config.py's names for --config's help, repeated: the parser loads no config code
# (tests/test_cli_startup.py holds them equal)
CONFIG_ENV = "PODSHIM_CONFIG"
DEFAULT_CONFIG_PATH = "/etc/podshim/config.toml"

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """Bad arguments or input files: exit code 2."""


class CliError(Exception):
    """A failure on this side of the socket (archive unreadable, ambiguous id): exit code 1."""


# ---------------------------------------------------------------------------- argument types


def duration(value: str) -> float:
    """Seconds: `30`, `30s`, `1.5m`, `1h` (crictl writes durations with a unit)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*", value)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid duration {value!r} (e.g. 30, 30s, 2m)")
    scale = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m.group(2) or "s"]
    seconds = float(m.group(1)) * scale
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"invalid duration {value!r}: must be positive")
    return seconds


def key_value(value: str) -> tuple[str, str]:
    """`k=v` of --option (the value may be empty, the key may not)."""
    key, sep, val = value.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {value!r}")
    return key.strip(), val


def name_file(value: str) -> tuple[str, str]:
    """`NAME=FILE` of --container-config."""
    name, sep, path = value.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=FILE, got {value!r}")
    return name.strip(), path.strip()


# ---------------------------------------------------------------------------- options


def add_global_options(parser: argparse.ArgumentParser, *, suppress: bool = False) -> None:
    """-r/--runtime-endpoint, --timeout, -o. On the main parser (defaults) and, with
    `suppress`, on each client subcommand so they work before or after the command name."""
    default: Any = argparse.SUPPRESS if suppress else None
    parser.add_argument(
        "-r",
        "--runtime-endpoint",
        metavar="ENDPOINT",
        default=default,
        help=f"CRI endpoint (default ${ENDPOINT_ENV}, else {DEFAULT_ENDPOINT})",
    )
    parser.add_argument(
        "--timeout",
        type=duration,
        metavar="SECONDS",
        default=default,
        help=f"deadline of the call (default {CLI_LONG_TIMEOUT:g}s for checkpointpod, restorepod and "
        f"checkpoint, {CLI_SHORT_TIMEOUT:g}s for the others)",
    )
    parser.add_argument(
        "-o",
        "--output",
        choices=output.FORMATS,
        default=default,
        help="output format (default: table for lists and operations, json for inspect*)",
    )


def endpoint(args: argparse.Namespace) -> str:
    return getattr(args, "runtime_endpoint", None) or os.environ.get(ENDPOINT_ENV) or DEFAULT_ENDPOINT


def timeout_of(args: argparse.Namespace, long: bool = False) -> float:
    t = getattr(args, "timeout", None)
    return float(t) if t else (CLI_LONG_TIMEOUT if long else CLI_SHORT_TIMEOUT)


def output_of(args: argparse.Namespace, default: str = "table") -> str:
    return getattr(args, "output", None) or default


def runtime_stub(args: argparse.Namespace) -> transport.RuntimeStub:
    """The RuntimeService stub of the endpoint `args` name."""
    return transport.runtime_stub(endpoint(args))


# ---------------------------------------------------------------------------- error handling


Command = Callable[[argparse.Namespace], int]


def guarded(name: str) -> Callable[[Command], Command]:
    """Turn every failure of a client command into one line on stderr and its exit code."""

    def wrap(fn: Command) -> Command:
        @functools.wraps(fn)
        def run(args: argparse.Namespace) -> int:
            try:
                return fn(args)
            except UsageError as e:
                report(name, str(e))
                return EXIT_USAGE
            except CliError as e:
                report(name, str(e))
                return EXIT_RUNTIME
            except KeyboardInterrupt:
                report(name, "interrupted (the call was cancelled)")
                return EXIT_INTERRUPTED
            except BrokenPipeError:
                with contextlib.suppress(OSError):
                    sys.stdout = open(os.devnull, "w")  # silence the flush at exit
                return EXIT_OK
            except Exception as e:
                if transport.is_rpc_error(e):  # tested here, not in an except clause: grpc loads lazily
                    report(name, transport.rpc_error_message(e, endpoint(args)))
                    return EXIT_RUNTIME
                # a bug: one line, never a traceback
                report(name, f"unexpected error: {type(e).__name__}: {e}")
                return EXIT_RUNTIME

        return run

    return wrap


def report(name: str, message: str) -> None:
    """One line on stderr: `podshim NAME: MESSAGE`."""
    print(f"podshim {name}: {message}", file=sys.stderr)


# ---------------------------------------------------------------------------- id resolution


def resolve_pod(stub: transport.RuntimeStub, pod_id: str, timeout: float) -> str:
    """A unique prefix of a pod id (crictl style) → the full id; unknown ids go through as given
    so the runtime answers NOT_FOUND."""
    if len(pod_id) >= 64 or not pod_id:
        return pod_id
    from api.runtime.v1 import api_pb2 as cri

    items = stub.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=timeout).items
    return _unique(pod_id, [p.id for p in items], "pod")


def resolve_container(stub: transport.RuntimeStub, cid: str, timeout: float) -> str:
    if len(cid) >= 64 or not cid:
        return cid
    from api.runtime.v1 import api_pb2 as cri

    items = stub.ListContainers(cri.ListContainersRequest(), timeout=timeout).containers
    return _unique(cid, [c.id for c in items], "container")


def _unique(prefix: str, ids: Iterable[str], kind: str) -> str:
    matches = sorted({i for i in ids if i.startswith(prefix)})
    if len(matches) > 1:
        shown = ", ".join(output.short_id(m) for m in matches[:5])
        raise CliError(f"{kind} id prefix {prefix!r} is ambiguous ({shown}): give more characters")
    return matches[0] if matches else prefix


# ---------------------------------------------------------------------------- shared by the commands


def verbose_info(info: Any) -> dict[str, Any]:
    """The verbose `info` map with its JSON values decoded (crictl's inspect output)."""
    import json

    out: dict[str, Any] = {}
    for k, v in sorted(info.items()):
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    return out


def render_many(objs: list[dict[str, Any]], fmt: str, as_table: Callable[[dict[str, Any]], str]) -> None:
    if fmt == "table":
        print("\n\n".join(as_table(o) for o in objs))
    else:
        output.render(objs[0] if len(objs) == 1 else objs, fmt)


def make_output_dir(path: Path) -> list[Path]:
    """Create the output directory (0700) when missing; return what was created, deepest last."""
    if path.exists() or path.is_symlink():
        return []
    missing = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    try:
        path.mkdir(mode=0o700, parents=True)
    except OSError as e:
        raise CliError(f"cannot create {path}: {e.strerror}") from None
    return list(reversed(missing))


def remove_created(created: list[Path]) -> None:
    for p in reversed(created):
        with contextlib.suppress(OSError):
            p.rmdir()  # only when empty: never removes what the runtime left


def client_parser(sub: Any, name: str, **kw: Any) -> argparse.ArgumentParser:
    """A client command's parser; the global options also work after the command name."""
    p = sub.add_parser(name, **kw)
    add_global_options(p, suppress=True)
    return p
