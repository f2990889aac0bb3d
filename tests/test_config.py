"""Configuration precedence and errors, and podshim-runc's argv handling (unit tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shim import config
from shim.wrapper.main import split_global


def write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "podshim.toml"
    p.write_text(text)
    return str(p)


def test_defaults_without_a_file() -> None:
    cfg = config.load(None, env={})
    assert cfg.socket == "/run/podshim/podshim.sock"
    # the kubelet's checkpoint API writes into <root-dir>/checkpoints: allowed without a config
    assert cfg.allowed_roots == ("/var/lib/kubelet/pod-checkpoints", "/var/lib/kubelet/checkpoints")
    assert cfg.runtime_name == "upstream"
    assert cfg.log_format == "json"


def test_file_env_flags_precedence(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '[server]\nsocket = "/a.sock"\n[upstream]\nendpoint = "unix:///file.sock"\n'
        '[checkpoint]\nallowed_roots = ["/r1", "/r2"]\n[runtime]\nbinary = "/usr/bin/crun"\n'
        '[runtimes.kata]\nbinary = "/k"\nroot = "/run/k"\n',
    )
    cfg = config.load(
        path, env={"PODSHIM_UPSTREAM_ENDPOINT": "unix:///env.sock"}, overrides={"socket": "/flag.sock"}
    )
    assert cfg.socket == "/flag.sock"
    assert cfg.upstream_endpoint == "unix:///env.sock"
    assert cfg.allowed_roots == ("/r1", "/r2")
    assert cfg.runtime.binary == "/usr/bin/crun"
    assert cfg.runtime_for_handler("kata") == config.RuntimeConfig(binary="/k", root="/run/k", criu="criu")
    assert cfg.runtime_for_handler("unknown") is None
    assert cfg.runtime_for_root("/run/k").binary == "/k"


def test_config_env_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[log]\nformat = "console"\n')
    assert config.load(None, env={"PODSHIM_CONFIG": path}).log_format == "console"


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[server]\nsockt = "/x"\n', "server.sockt"),
        ('[srv]\nsocket = "/x"\n', "srv"),
        ("[server]\nsocket = 3\n", "server.socket"),
        ('[server]\nsocket = "relative.sock"\n', "server.socket"),
        ('[log]\nlevel = "loud"\n', "log.level"),
        ('[server]\nruntime_name = "kubelet"\n', "server.runtime_name"),
        ('[checkpoint]\nghost_limit = "lots"\n', "checkpoint.ghost_limit"),
        ('[checkpoint]\nghost_limit_max = "auto"\n', "checkpoint.ghost_limit_max"),
        ('[checkpoint]\nrootfs_compression = "zstd"\n', "checkpoint.rootfs_compression"),
        ('[checkpoint]\nirmap_scan_paths = ["data"]\n', "checkpoint.irmap_scan_paths"),
        ("[checkpoint]\nfile_locks = 1\n", "checkpoint.file_locks"),
        ('[upstream]\nendpoint = "tcp://1.2.3.4:1"\n', "upstream.endpoint"),
        ('[checkpoint]\nallowed_roots = "/one"\n', "checkpoint.allowed_roots"),
        ('[checkpoint]\nallowed_roots = ["rel"]\n', "checkpoint.allowed_roots"),
        ('[checkpoint]\nwriteback_ahead = "sometimes"\n', "checkpoint.writeback_ahead"),
        ('[runtime]\nbinry = "/x"\n', "runtime.binry"),
        ("[server\n", "not valid TOML"),
    ],
)
def test_bad_config_names_the_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(config.ConfigError) as err:
        config.load(write(tmp_path, text), env={})
    msg = str(err.value)
    assert key in msg and "\n" not in msg


def test_missing_explicit_file_is_an_error() -> None:
    with pytest.raises(config.ConfigError, match="not found"):
        config.load("/nonexistent/podshim.toml", env={})


def test_split_global_flags_of_containerd_calls() -> None:
    argv = [
        "--root",
        "/run/r/k8s.io",
        "--log",
        "/b/log.json",
        "--log-format",
        "json",
        "--criu",
        "/c",
        "create",
        "--bundle",
        "/b",
        "--pid-file",
        "/b/pid",
        "abc",
    ]
    flags, command, rest = split_global(argv)
    assert flags == {
        "--root": "/run/r/k8s.io",
        "--log": "/b/log.json",
        "--log-format": "json",
        "--criu": "/c",
    }
    assert command == "create"
    assert rest == ["--bundle", "/b", "--pid-file", "/b/pid", "abc"]
    assert split_global(["--systemd-cgroup", "--root=/x", "start", "id"]) == (
        {"--systemd-cgroup": "", "--root": "/x"},
        "start",
        ["id"],
    )
    assert split_global(["--version"]) == ({"--version": ""}, None, [])


async def test_upstream_timeout_bounds_podshims_own_calls(tmp_path: Path) -> None:
    """`[upstream] timeout_seconds` reaches the calls podshim makes by itself (here the pod view
    a CheckpointPod builds), through the Upstream the server creates from the config."""
    from shim.sandbox import build_pod_view
    from shim.server.app import Server

    cfg = config.load(write(tmp_path, "[upstream]\ntimeout_seconds = 7.5\n"), env={})
    server = Server(cfg, engine=None)  # type: ignore[arg-type]
    seen: list[float] = []

    class Runtime:
        async def PodSandboxStatus(self, request: object, timeout: float) -> object:  # noqa: N802
            seen.append(timeout)
            raise RuntimeError("enough")

    server.upstream.runtime = Runtime()  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="enough"):
        await build_pod_view(server.upstream, "pod-1")
    assert server.upstream.timeout == 7.5 and seen == [7.5]
    await server.upstream.close()


def test_checkpoint_option_defaults() -> None:
    """Every CheckpointPod option has a node default ([checkpoint]), in the options' vocabulary,
    overridable from the file and the environment; a request's own keys win (CheckpointOptions)."""
    from shim.ops.checkpoint_checks import CheckpointOptions

    assert config.load(None, env={}).option_defaults() == {
        "file-locks": "true",
        "tcp-established": "false",
        "ext-unix-sk": "false",
        "shell-job": "false",
        "rootfs-compression": "none",
        "ghost-limit": "auto",
        "irmap-scan-paths": "",
    }
    assert set(config.Config().option_defaults()) == set(CheckpointOptions.KEYS)
    cfg = config.load(
        None,
        env={
            "PODSHIM_CHECKPOINT_TCP_ESTABLISHED": "true",
            "PODSHIM_CHECKPOINT_GHOST_LIMIT": "8M",
            "PODSHIM_CHECKPOINT_IRMAP_SCAN_PATHS": "/etc/app,/data",
        },
    )
    opts = CheckpointOptions.parse({}, cfg.option_defaults(), config.parse_size(cfg.ghost_limit_max))
    assert opts.criu.tcp_established and opts.criu.ghost_limit == 8 << 20 and opts.ghost_auto_max == 0
    assert opts.criu.irmap_scan_paths == ("/etc/app", "/data")
    mine = CheckpointOptions.parse(
        {"tcp-established": "false", "ghost-limit": "auto"}, cfg.option_defaults(), 64
    )
    assert not mine.criu.tcp_established and mine.ghost_auto_max == 64 and mine.criu.ghost_limit == 0
    default = CheckpointOptions.parse({}, config.Config().option_defaults(), 64 << 20)
    assert default.ghost_auto_max == 64 << 20 and default.criu.file_locks and not default.compress


def test_tcp_congestion_must_be_one_the_kernel_has(tmp_path: Path) -> None:
    """[migration] tcp_congestion (CRIU patch 0010): cubic by default, "" for the host's default,
    a name the kernel has not loaded refused at start-up with the ones it has."""
    assert config.load(write(tmp_path, ""), env={}).migration_tcp_congestion == "cubic"
    assert (
        config.load(write(tmp_path, '[migration]\ntcp_congestion = ""\n'), env={}).migration_tcp_congestion
        == ""
    )
    with pytest.raises(
        config.ConfigError, match=r"migration.tcp_congestion: 'no-such-cc' is not a congestion"
    ):
        config.load(write(tmp_path, '[migration]\ntcp_congestion = "no-such-cc"\n'), env={})
    # podshim-runc never checks it
    cfg = config.load(
        write(tmp_path, '[migration]\ntcp_congestion = "no-such-cc"\n'), env={}, check_files=False
    )
    assert cfg.migration_tcp_congestion == "no-such-cc"
    available = tmp_path / "available"
    available.write_text("reno bbr\n")
    problem = config.tcp_congestion_problem("cubic", str(available))
    assert problem is not None and "reno bbr" in problem
    assert config.tcp_congestion_problem("bbr", str(available)) is None
    assert "cannot be checked" in (config.tcp_congestion_problem("cubic", str(tmp_path / "none")) or "")
