"""The OCI runtime driver (runc, crun): checkpoint/restore argv, CRIU options, logs and stats."""
