"""The OCI runtime wrapper's Python side (docs/design/runtime-wrapper.md (The runtime wrapper)): main.py is
`podshim-runc-hook` (argv parsing, exec of the real runtime), restore.py the restore at `create`.
The daemon never imports this package; the names both share live in shim/contract.py."""
