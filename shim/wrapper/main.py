"""podshim-runc-hook: the Python side of podshim-runc (docs/design/runtime-wrapper.md (The runtime wrapper)).

The upstream runtime calls the compiled podshim-runc (native/podshim-runc.c), which execs the
real runtime itself and execs this hook, with the same argv, environment and file descriptors,
only for `create`/`start` of a container that carries podshim's restore annotation (RestorePod,
a container checkpoint archive) and for any call it cannot judge. This hook decides again from
scratch: every invocation is an exec of the real runtime (runc or crun), except those
`create`/`start`, which become a CRIU restore. It imports as little as possible.
"""

from __future__ import annotations

import os
import sys

# Global flags of runc/crun that take a value (everything else before the command is a switch).
_VALUE_FLAGS = frozenset({"--root", "--log", "--log-format", "--criu", "--rootless", "--cgroup-manager"})


def split_global(argv: list[str]) -> tuple[dict[str, str], str | None, list[str]]:
    """Split `[global flags] COMMAND [args]` into (global flags, command, command args)."""
    flags: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("-"):
            return flags, arg, argv[i + 1 :]
        if "=" in arg:
            key, _, value = arg.partition("=")
            flags[key] = value
        elif arg in _VALUE_FLAGS and i + 1 < len(argv):
            flags[arg] = argv[i + 1]
            i += 1
        else:
            flags[arg] = ""
        i += 1
    return flags, None, []


def real_runtime(flags: dict[str, str]) -> str:
    """The real runtime binary for this invocation, told apart by the --root the shim passes."""
    from shim import config

    try:
        cfg = config.load(check_files=False)  # a key file's mode must not fail every runtime call
    except config.ConfigError as e:
        sys.stderr.write(f"podshim-runc: {e}\n")
        raise SystemExit(2) from None
    root = flags.get("--root")
    return (cfg.runtime_for_root(root) if root else cfg.runtime).binary


def main() -> None:
    argv = sys.argv[1:]
    flags, command, rest = split_global(argv)
    if command in ("create", "start"):
        from shim.wrapper import restore as restore_hook

        if command == "start" and restore_hook.already_restored(flags, rest):
            raise SystemExit(0)  # `create` restored it and it runs; no config needed to know
        binary = real_runtime(flags)
        if command == "create":
            restore_hook.maybe_restore(binary, argv, flags, rest)  # returns if not ours
    else:
        binary = real_runtime(flags)
    os.execv(binary, [binary, *argv])


if __name__ == "__main__":
    main()
