"""Every deadline, timeout, grace period and retry interval of podshim, in seconds, in one place
(docs/design/crash-safety.md (Cancellation), docs/design/crash-safety.md (Crash safety)). The
modules that use one import it from here; this module imports nothing, so the CLI and the runtime
wrapper may use it too."""

from __future__ import annotations

# ---------------------------------------------------------------------- a caller's deadline
DEFAULT_DEADLINE = 600.0  # the CRI says the caller sets one; this bounds a caller that did not
CHECK_MARGIN = 0.1  # kept from it to answer when the checks themselves run out of time
# kept from it to thaw and clean up (CheckpointPod, CheckpointContainer, CreateContainer from a
# tar), so that podshim's own DEADLINE_EXCEEDED reaches the caller
CLEANUP_MARGIN = 0.5
RESTORE_CLEANUP_MARGIN = 1.0  # RestorePod's: removing the new sandbox takes longer
# kept from it when a call is passed to the upstream (or by the front to the daemon), so that the
# upstream's DEADLINE_EXCEEDED reaches the caller as a status before podshim's own server resets
# the stream at the deadline (which a client whose timer runs late reports as CANCELLED)
PASSTHROUGH_DEADLINE_MARGIN = 0.1

# ---------------------------------------------------------------------- freeze, runc and CRIU
FREEZE_TIMEOUT = 5.0  # to confirm a cgroup froze or thawed
# for the dumps started before the cut to reach their gates (runc and CRIU start-up: 0.1-0.3 s)
DUMPS_READY_WAIT = 3.0
# How long a dump started before the cut waits at its gate for podshim's word (DumpGate): the
# cut follows within DUMPS_READY_WAIT + FREEZE_TIMEOUT; this bounds a CRIU whose podshim hangs.
GATE_WAIT = 30.0
# How often a gate looks whether podshim is still there: a podshim killed with dumps at their
# gates leaves orphans that end within this (nothing seized), so its restart's recovery, which
# waits for the runc and CRIU processes of an interrupted checkpoint, is not held up.
GATE_LOOK = 0.1
KILL_WAIT = 10.0  # for SIGKILLed runc/CRIU processes to disappear
# A dump podshim gives up on (the caller's deadline, another container's failure, a service stop,
# runc gone) is never killed while its CRIU holds the container's processes (ptrace): CRIU is let
# finish, and then detaches them, for at most DUMP_FINISH_WAIT; past it, it is taken for hung and
# killed. DUMP_STOP_CONFIRM: for the dump's processes to stop (SIGSTOP) before podshim looks
# whether CRIU's code runs in any task; DUMP_LOOK_INTERVAL: between two such looks while it is let
# go on (docs/design/crash-safety.md (Cancellation)).
DUMP_FINISH_WAIT = 60.0
DUMP_STOP_CONFIRM = 2.0
DUMP_LOOK_INTERVAL = 0.25
VERSION_TIMEOUT = 10.0  # for `runc/crun/criu --version` (and `restore --help`)
CPUINFO_TIMEOUT = 20.0  # for `criu cpuinfo dump/check`
NETLOCK_TIMEOUT = 10.0  # for one iptables-restore of the pod's netns lock (tcp-established)
# exec sessions in a container (the kubelet's exec probes) are waited for this long before a
# checkpoint refuses them, looking again every EXEC_SESSION_POLL
EXEC_SESSION_WAIT = 3.0
EXEC_SESSION_POLL = 0.02

# ------------------------------------------------- lazy restore (docs/design/restore-pod.md (Lazy restore))
LAZY_READY_TIMEOUT = 30.0  # for a lazy-pages daemon to listen (it reads the images' metadata first)
LAZY_POLL = 0.02  # between two looks for new userfaultfds in the daemon
LAZY_CONTAINER_CHECK = 2.0  # between two looks at the container (gone: the daemon goes too)
GUARD_EXIT_WAIT = 5.0  # for a released userfaultfd guard to exit (shim/criu/uffd_guard.py)
# between two looks at a container whose page images failed their checksum, until it has started
# (a stop of a created container is a no-op: it is killed once it runs)
LAZY_STARTED_POLL = 0.05
# the longest the page images' background checksum pass waits, from its start, for the container
# to be restored (it takes the CPU the restore path needs on a small node; docs/design/restore-pod.md
# (Lazy restore))
LAZY_CHECK_PAUSE_SECONDS = 10.0

# ---------------------------------------------- live migration (docs/design/migration.md (Live migration))
MIGRATION_CONNECT = 30.0  # the source retries reaching the destination's listener this long
MIGRATION_STEP = 30.0  # one exchange of the handshake (offer, archive, page connections)
# a connection to the destination's listener completes its TLS handshake and greeting within this,
# or is dropped: handshakes run side by side, so a silent stranger delays nobody
MIGRATION_PEER_HANDSHAKE = 2.0
MIGRATION_HEARTBEAT = 0.5  # each node sends a ping this often while the link is idle
# the lease: the destination kills its containers when it has heard nothing from the source this
# long (after `go`, until `ack`); the source, after losing the link, waits the lease and the
# margin before it thaws, so the two never run at once
MIGRATION_LEASE = 3.0
MIGRATION_FENCE_MARGIN = 1.0
# the destination's kill of its copy keeps emptying the containers' cgroups this long at most (a
# fork racing the first SIGKILLs); the kill itself takes milliseconds, well within the margin
MIGRATION_KILL_WAIT = 5.0

# ---------------------------------------------------------------------- recovery
# how long recovery lets a crashed run's runc/CRIU finish (CRIU then cures and unseizes the pod's
# processes) before it kills them
RECOVERY_WAIT = 120.0
# a recovery that failed is retried while podshim runs: first after RETRY_FIRST, then doubling up
# to RETRY_MAX
RETRY_FIRST = 0.5
RETRY_MAX = 30.0
# after a RunPodSandbox left without an answer (or, after a crash, after the restore's last
# journal write), recovery keeps looking this long for the sandbox it may still create
SANDBOX_SETTLE = 30.0
STALE_IMPORT_SECONDS = 900.0  # an import dir without a container after this long was interrupted
STALE_DECRYPTED_SECONDS = 900.0  # a decrypted dir without a container after this long likewise

# ---------------------------------------------------------------------- the service (SIGTERM)
# calls in flight get STOP_GRACE to finish, then cancelled operations STOP_CLEANUP to undo their
# work, a dump in flight let finish (DUMP_FINISH_WAIT) included; together within the unit's
# TimeoutStopSec (90 s), after which systemd SIGKILLs
STOP_GRACE = 15.0
STOP_CLEANUP = DUMP_FINISH_WAIT + 10.0
PASSTHROUGH_STOP_GRACE = 1.0  # passed-through calls and streams are cancelled within this

# ----------------------------------------------------------- podshim-front (docs/design/proxy.md (The proxy))
FRONT_READY_TIMEOUT = 10.0  # for the front to say it listens
SOCKET_PROBE_TIMEOUT = 1.0  # a live server on podshim's socket path accepts at once, a dead one refuses
FRONT_EXIT_MARGIN = 2.0  # after its grace, the front is killed if it has not exited
# a front that died is started again after FRONT_RESTART_FIRST, doubling up to FRONT_RESTART_MAX
# (each jittered by FRONT_RESTART_JITTER) while it keeps dying; one that ran FRONT_STEADY is started
# again after FRONT_RESTART_FIRST. The node's CRI is down while the front is: the bound is short
FRONT_RESTART_FIRST = 0.05
FRONT_RESTART_MAX = 0.25
FRONT_RESTART_JITTER = 0.2
FRONT_STEADY = 60.0
# a front whose daemon's socket has been unreachable this long stops (no daemon came back to adopt it)
FRONT_ORPHAN_TIMEOUT = 60.0
FRONT_METRICS_TIMEOUT = 2.0  # reading the front's metrics at a scrape of podshim's /metrics

# ---------------------------------------------------------------------- the upstream
WIRING_CACHE_SECONDS = 5.0  # one verbose Status answers the wiring check of every handler this long
WIRING_RETRY_SECONDS = 2.0  # the upstream is not up yet at start-up: ask again this often
WIRING_STATUS_TIMEOUT = 30.0  # the verbose Status call at most (the upstream's own limit if lower)

# ---------------------------------------------------------------------- a registry (push, pull)
REGISTRY_CONNECT_TIMEOUT = 10.0  # to reach the registry
REGISTRY_READ_TIMEOUT = 60.0  # without a byte from it

# ---------------------------------------------------------------------- the CLI's calls
CLI_LONG_TIMEOUT = 120.0  # checkpointpod, restorepod, checkpoint
CLI_SHORT_TIMEOUT = 10.0  # everything else
CLI_WARM_IDLE = 300.0  # the CLI's warm helper (shim/cli/warm.py) exits after this long without a call
CLI_WARM_HANDOFF = 2.0  # the helper reached and its child started, at most; else the command runs alone

# `podshim doctor` (shim/node/doctor.py)
DOCTOR_CRIU_TIMEOUT = 30.0  # each CRIU run of its checks (criu check, the dump and restore)
DOCTOR_RPC_TIMEOUT = 5.0  # each call to containerd or podshim

# The cluster API (shim/kube/): each request to the API server (a watch is re-opened by the
# controller's loop); how often PodCheckpoints are listed again while one waits on its source pod
# (a pod becoming ready or scheduled sends no event on them), and otherwise (a list catches what a
# watch missed; each node lists every object, so rarely); a PodCheckpoint's deadline when
# spec.timeoutSeconds is nil or 0
KUBE_REQUEST_TIMEOUT = 10.0
KUBE_RESYNC = 5.0
KUBE_RESYNC_IDLE = 300.0
KUBE_CHECKPOINT_DEFAULT_TIMEOUT = 600.0
# `kubectl podshim ... --wait`: how long it waits by default, and beyond a checkpoint's own
# timeoutSeconds (the node must first see the object)
PLUGIN_WAIT = 600.0
PLUGIN_PICKUP_MARGIN = 60.0
