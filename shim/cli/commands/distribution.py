"""`podshim push DIR REF`, `podshim pull REF DIR` and the pull of `podshim restorepod --from REF`
(shim/distribution; docs/registries.md).

Credentials: $PODSHIM_REGISTRY_AUTH=USER:PASSWORD, else the docker config file named by
--registry-config, else $DOCKER_CONFIG/config.json, else ~/.docker/config.json; never a
command-line value. The pull target must lie inside one of podshim's `checkpoint.allowed_roots`,
read from podshim's config (--podshim-config, else $PODSHIM_CONFIG, else /etc/podshim/config.toml).
Errors: one line `podshim <command>: <gRPC code name>: <message>`, exit code 1.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import IO, Any

from shim.cli import base, output

REF_HELP = "HOST[:PORT]/REPOSITORY[:TAG]; plain HTTP only for a loopback host unless --insecure"


class TransferProgress:
    """`label: 312.0 MiB / 1.0 GiB (30%), 250.1 MiB/s` on stderr, about 4 times a second, only
    when stderr is a terminal."""

    def __init__(self, label: str, stream: IO[str] | None = None) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        try:
            self.enabled = self.stream.isatty()
        except (AttributeError, ValueError):
            self.enabled = False
        self.start = time.monotonic()
        self.last = 0.0
        self.width = 0

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.last < 0.25 and done < total:
            return
        self.last = now
        rate = done / max(now - self.start, 1e-6)
        pct = f" ({min(100, done * 100 // total)}%)" if total else ""
        line = (
            f"{self.label}: {output.human_bytes(min(done, total or done))} / {output.human_bytes(total)}"
            f"{pct}, {output.human_bytes(int(rate))}/s"
        )
        self.stream.write("\r" + line + " " * max(0, self.width - len(line)))
        self.stream.flush()
        self.width = len(line)

    def clear(self) -> None:
        if self.enabled and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0


def _shim_errors(fn: Any) -> Any:
    """podshim's typed errors as client errors: `CODE: message`, exit code 1."""

    def run(*a: Any, **kw: Any) -> Any:
        from shim.errors import ShimError

        try:
            return fn(*a, **kw)
        except ShimError as e:
            raise base.CliError(f"{e.code_name}: {e}") from None

    return run


def allowed_roots(args: argparse.Namespace) -> list[str]:
    from shim import config

    try:
        cfg = config.load(getattr(args, "podshim_config", None), check_files=False)
    except config.ConfigError as e:
        raise base.UsageError(f"podshim config: {e}") from None
    return list(cfg.allowed_roots)


@_shim_errors
def do_pull(args: argparse.Namespace, ref: str, dest: Path, label: str) -> Any:
    from shim.distribution import pull

    progress = TransferProgress(label)
    try:
        return pull.pull(
            ref,
            dest,
            allowed_roots=allowed_roots(args),
            insecure=args.insecure,
            registry_config=args.registry_config,
            progress=progress,
        )
    finally:
        progress.clear()


@base.guarded("push")
def cmd_push(args: argparse.Namespace) -> int:
    from shim.distribution import push

    progress = TransferProgress(f"push {os.path.basename(os.path.abspath(args.path))}")
    try:
        result = _shim_errors(push.push)(
            args.path,
            args.ref,
            compression=args.compression,
            insecure=args.insecure,
            registry_config=args.registry_config,
            progress=progress,
        )
    finally:
        progress.clear()
    data = {
        "ref": result.ref,
        "digest": result.digest,
        "bytes": result.archive_bytes,
        "storedBytes": result.stored_bytes,
        "seconds": round(result.seconds, 3),
        "layers": [
            {"title": x.title, "digest": x.digest, "size": x.size, "archiveBytes": x.archive_bytes}
            for x in result.layers
        ],
    }
    output.render(data, base.output_of(args), lambda r: f"{r['ref']}@{r['digest']}")
    return base.EXIT_OK


@base.guarded("pull")
def cmd_pull(args: argparse.Namespace) -> int:
    dest = Path(os.path.abspath(args.path))
    created = base.make_output_dir(dest)
    ok = False
    try:
        result = do_pull(args, args.ref, dest, f"pull {args.ref}")
        ok = True
    finally:
        if not ok:
            base.remove_created(created)
    data = {
        "ref": result.ref,
        "digest": result.digest,
        "path": result.path,
        "bytes": result.bytes_fetched,
        "seconds": round(result.seconds, 3),
    }
    output.render(data, base.output_of(args), lambda r: r["path"])
    return base.EXIT_OK


def pull_for_restore(args: argparse.Namespace) -> tuple[Path, bool]:
    """`restorepod --from REF`: pull REF into --pull-dir, else a new directory in the first allowed
    root; returns it and whether this call created it (removed again when the restore fails)."""
    if args.pull_dir:
        dest = Path(os.path.abspath(args.pull_dir))
        created = base.make_output_dir(dest)
    else:
        roots = allowed_roots(args)
        if not roots:
            raise base.UsageError("podshim config has no checkpoint.allowed_roots to pull into")
        repo = args.from_ref.rsplit("/", 1)[-1].replace(":", "-").replace("@", "-")
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in repo)[:80]
        import secrets

        dest = Path(roots[0]) / f"pulled-{safe}-{secrets.token_hex(3)}"
        created = base.make_output_dir(dest)
    try:
        do_pull(args, args.from_ref, dest, f"pull {args.from_ref}")
    except BaseException:
        base.remove_created(created)
        raise
    return dest, bool(created)


def remove_pulled(path: Path) -> None:
    import shutil

    with contextlib.suppress(OSError):
        shutil.rmtree(path)


def add_registry_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--registry-config",
        metavar="FILE",
        help="docker config file with the registry's credentials (default $DOCKER_CONFIG/config.json, "
        "else ~/.docker/config.json; $PODSHIM_REGISTRY_AUTH=USER:PASSWORD overrides it)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="plain HTTP to a registry that is not on loopback (loopback registries always get HTTP)",
    )


def add_pull_options(p: argparse.ArgumentParser) -> None:
    add_registry_options(p)
    p.add_argument(
        "--podshim-config",
        metavar="FILE",
        help="podshim's config, for checkpoint.allowed_roots (default $PODSHIM_CONFIG, else "
        "/etc/podshim/config.toml)",
    )


def register(sub: Any) -> None:
    p = base.client_parser(
        sub,
        "push",
        help="push a pod checkpoint directory to an OCI registry",
        description="Push the complete pod checkpoint at PATH as one OCI artifact: a config blob "
        "with podshim's manifest.json, a layer per container and one for the sandbox, annotations "
        "for schedulers. Encrypted checkpoints stay encrypted.",
    )
    p.add_argument("path", metavar="PATH", help="pod checkpoint directory (written by checkpointpod)")
    p.add_argument("ref", metavar="REF", help=REF_HELP)
    p.add_argument("--compression", choices=("none", "zstd"), default="none", help="layer compression")
    add_registry_options(p)
    p.set_defaults(func=cmd_push)

    p = base.client_parser(
        sub,
        "pull",
        help="pull a pod checkpoint from an OCI registry into a directory",
        description="Pull the pod checkpoint artifact REF into PATH (created 0700 if missing; it must "
        "be empty and inside one of podshim's checkpoint.allowed_roots). Everything is verified as "
        "it arrives; a failed pull leaves PATH empty.",
    )
    p.add_argument("ref", metavar="REF", help=REF_HELP)
    p.add_argument("path", metavar="PATH", help="target directory")
    add_pull_options(p)
    p.set_defaults(func=cmd_pull)
