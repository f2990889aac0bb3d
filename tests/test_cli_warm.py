"""The CLI's warm helper (shim/cli/warm.py): a read-only command's first call runs in the calling
process and starts the helper; the next calls run in the helper's child, with the caller's
descriptors, directory and environment, and give the same output, stderr and exit code as the
command run alone, without grpc ever loading in the calling process. The CRI server here is a
real gRPC server of the CRI's generated stubs; the end-to-end CLI tests (tests/test_cli.py) run
their read-only commands through the helper too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from shim.cli import warm

REPO = Path(__file__).resolve().parents[1]
# the command line's entry, run as the console script runs it; says whether grpc loaded here
ENTRY = """
import sys
from shim.cli import main
try:
    sys.exit(main(sys.argv[1:]))
finally:
    print("grpc" in sys.modules, file=sys.stderr)
"""


class Pods(api_pb2_grpc.RuntimeServiceServicer):
    def ListPodSandbox(
        self, request: cri.ListPodSandboxRequest, context: grpc.ServicerContext
    ) -> cri.ListPodSandboxResponse:
        pod = cri.PodSandbox(
            id="abcdef0123456789",
            metadata=cri.PodSandboxMetadata(name="web", namespace="shop", uid="u1"),
            state=cri.SANDBOX_READY,
            created_at=1_700_000_000_000_000_000,
        )
        return cri.ListPodSandboxResponse(items=[pod])


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[Path]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    api_pb2_grpc.add_RuntimeServiceServicer_to_server(Pods(), server)
    sock = tmp_path / "cri.sock"
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    yield sock
    server.stop(0)


def podshim(
    helpers: Path, *args: str, warm_on: bool = True, cwd: Path = REPO
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, warm.DIR_ENV: str(helpers), warm.ENABLE_ENV: "1" if warm_on else "0"}
    return subprocess.run(
        [sys.executable, "-c", ENTRY, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )


def _helper_pid(helpers: Path) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for f in helpers.glob("*.sock.pid"):
            text = f.read_text().strip()
            if text and Path(str(f).removesuffix(".pid")).exists():
                return int(text)
        time.sleep(0.05)
    raise AssertionError(f"no warm helper started in {helpers}")


def test_read_only_commands_run_in_the_helpers_child_as_they_would_alone(
    runtime: Path, tmp_path: Path
) -> None:
    helpers = tmp_path / "helpers"
    helpers.mkdir(mode=0o700)
    ep = ["-r", str(runtime)]
    alone = podshim(helpers, *ep, "pods", "-o", "json", warm_on=False)
    assert alone.returncode == 0, alone.stderr
    assert not list(helpers.iterdir()), "turned off, no helper starts"
    first = podshim(helpers, *ep, "pods", "-o", "json")
    assert (first.returncode, first.stdout) == (0, alone.stdout), first.stderr
    assert first.stderr.strip() == "True", "the first call runs in the calling process"
    pid = _helper_pid(helpers)
    try:
        for args, code in [
            (["pods", "-o", "json"], 0),
            (["pods", "-q"], 0),
            (["pods", "--bogus"], 2),  # argparse's usage error, on the caller's stderr
            (["-r", str(tmp_path / "absent.sock"), "pods"], 1),  # the runtime not there
        ]:
            argv = args if args[0] == "-r" else [*ep, *args]
            there = podshim(helpers, *argv, cwd=tmp_path)
            here = podshim(helpers, *argv, warm_on=False, cwd=tmp_path)
            assert (there.returncode, there.stdout) == (code, here.stdout), (args, there.stderr)
            *said, loaded = there.stderr.splitlines()
            assert loaded == "False", f"{args}: grpc loaded in the caller: the helper did not run it"
            assert said == here.stderr.splitlines()[:-1], (said, here.stderr)
        assert (
            json.loads(podshim(helpers, *ep, "pods", "-o", "json").stdout)["items"][0]["id"]
            == "abcdef0123456789"
        )
        # a command that is not read-only never goes there
        other = podshim(helpers, *ep, "checkpointpod", "nosuchpod", "/nowhere")
        assert other.stderr.splitlines()[-1] == "True", other.stderr
    finally:
        assert warm.stop_helpers(str(helpers)) == [pid]  # SIGTERM, by its pid file
    deadline = time.monotonic() + 10
    while any(helpers.glob("*.sock")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not list(helpers.glob("*.sock")) and not list(helpers.glob("*.pid")), "SIGTERM: its files go"


def test_a_directory_open_to_others_is_not_used(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    os.environ[warm.DIR_ENV], saved = str(open_dir), os.environ.get(warm.DIR_ENV, "")
    try:
        assert warm.socket_path() is None
        os.chmod(open_dir, 0o700)
        path = warm.socket_path()
        assert path is not None and path.startswith(str(open_dir) + "/warm-")
    finally:
        os.environ[warm.DIR_ENV] = saved
