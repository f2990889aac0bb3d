"""Live migration of a pod between nodes (docs/design/migration.md (Live migration)): post-copy,
CRIU's lazy pages served from the source node's dumps through podshim's mutually authenticated
TLS link to the destination's lazy-pages daemons.

credentials.py: the node credentials and the TLS contexts; wire.py: the control channel and its
listener; protocol.py: the messages, the offer; source.py: CheckpointPod with `lazy-migration`;
lazy_dumps.py: its lazy dumps and the pod's cgroups in threads; source_recovery.py: its recovery;
destination.py: RestorePod with `lazy-migration-from`; guard.py: the destination's watchdog of a
podshim that dies.
"""
