"""`podshim` starts light: building the parser and printing the help of every command loads
neither grpc, protobuf nor the generated CRI modules, nor the daemon's code. They load inside
the functions that send a call or do the work (shim/cli/transport.py), so `podshim pods --help`
costs little more than Python itself. What is loaded is checked, never how long it takes."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from api.runtime.v1 import api_pb2 as cri
from shim import config as configmod
from shim.cli import base, commands
from shim.cli.argv import command_of
from shim.cli.parser import build_parser

REPO = Path(__file__).resolve().parents[1]

# Run in a fresh interpreter (this one has grpc loaded): every command's parser and its --help,
# subcommands' too, then the modules that got loaded.
CHILD = """
import argparse, contextlib, io, json, sys
from shim.cli.parser import build_parser, run

def commands(parser, prefix):
    yield prefix
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, [*prefix, name])

helps = {}
for argv in commands(build_parser(), []):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            run([*argv, "--help"])  # here, never the warm helper: its help is captured
        except SystemExit as e:
            helps[" ".join(argv) or "(podshim)"] = (e.code, len(out.getvalue()))
print(json.dumps({"helps": helps, "modules": sorted(sys.modules)}))
"""

# What only a call or the daemon needs.
RPC = ("grpc", "google")
DAEMON = ("asyncio", "structlog", "shim.config", "shim.archive", "shim.server", "shim.engine", "shim.logs")


def _child() -> dict[str, object]:
    res = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    data = json.loads(res.stdout)
    assert isinstance(data, dict)
    return data


def _under(modules: object, roots: tuple[str, ...]) -> list[str]:
    assert isinstance(modules, list)
    return sorted(m for m in modules if any(m == r or m.startswith(r + ".") for r in roots))


def test_help_of_every_command_loads_no_grpc_protobuf_nor_daemon_code() -> None:
    data = _child()
    helps = data["helps"]
    assert isinstance(helps, dict)
    # every command printed its help and exited 0 (so the check below covers them all)
    assert {"(podshim)", "pods", "ps", "checkpointpod", "restorepod", "serve", "node setup"} <= set(helps)
    assert all(code == 0 and size > 0 for code, size in helps.values()), helps
    modules = data["modules"]
    assert isinstance(modules, list)
    rpc = _under(modules, RPC) + [m for m in modules if "api_pb2" in m or "cri_pb2" in m]
    assert rpc == [], f"the parser and --help load what only a call needs: {rpc}"
    daemon = _under(modules, DAEMON)
    assert daemon == [], f"the parser and --help load the daemon's code: {daemon}"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("no subcommands")


def _subparser(name: str) -> argparse.ArgumentParser:
    return _subparsers(build_parser())[name]


def test_a_command_line_builds_and_imports_only_its_command() -> None:
    """`podshim pods …` adds the pods parser alone, importing no other command's module."""
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from shim.cli.parser import build_parser; build_parser(['pods', '-q']);"
            "print(sorted(m for m in sys.modules if m.startswith('shim.cli.commands.')))",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert res.stdout.strip() == "['shim.cli.commands.pods']"
    assert sorted(_subparsers(build_parser(["-r", "/x.sock", "pods", "-q"]))) == ["pods"]


def test_every_command_has_its_module_in_the_table() -> None:
    """commands.MODULES names each command the whole parser has, in its order: each command alone
    gets the same parser."""
    full = _subparsers(build_parser())
    assert list(full) == [c for names in commands.MODULES.values() for c in names]
    for name, parser in full.items():
        alone = _subparsers(build_parser([name]))
        assert name in alone and alone[name].format_help() == parser.format_help(), name


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["pods", "-q"], "pods"),
        (["-r", "pods", "ps"], "ps"),  # -r's value is no command
        (["--runtime-endpoint", "/x", "-o", "json", "--timeout", "5", "inspectp", "a"], "inspectp"),
        (["--runtime-endpoint=/x", "-ojson", "ps"], "ps"),
        (["--time", "5", "ps"], None),  # an abbreviation of --timeout: left to argparse, all commands
        (["-h", "ps"], None),  # `podshim -h` lists every command
        (["--he"], None),
        (["--", "ps"], None),
        (["-o", "json"], None),
        ([], None),
    ],
)
def test_the_command_a_line_names(argv: list[str], command: str | None) -> None:
    assert command_of(argv) == command


def _state_choices(command: str) -> list[str]:
    for action in _subparser(command)._actions:
        if "--state" in action.option_strings:
            assert action.choices is not None
            return [str(c) for c in action.choices]
    raise AssertionError(f"{command} has no --state")


def test_state_choices_name_cri_states() -> None:
    """--state's names are resolved on use (SANDBOX_<NAME>, CONTAINER_<NAME>): each names a state."""
    pod = {c: cri.PodSandboxStateValue(state=f"SANDBOX_{c.upper()}").state for c in _state_choices("pods")}
    assert pod == {"notready": cri.SANDBOX_NOTREADY, "ready": cri.SANDBOX_READY}
    ctr = {c: cri.ContainerStateValue(state=f"CONTAINER_{c.upper()}").state for c in _state_choices("ps")}
    assert sorted(ctr.values()) == sorted(cri.ContainerState.values())


def test_config_names_in_the_help_are_the_configs() -> None:
    assert base.CONFIG_ENV == configmod.CONFIG_ENV
    assert base.DEFAULT_CONFIG_PATH == configmod.DEFAULT_CONFIG_PATH
