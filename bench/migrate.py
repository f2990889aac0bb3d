"""bench/migrate: live migration of a pod between two nodes (docs/design/migration.md (Live
migration)).

Two test nodes (testbed/nodes.py: two beds whose podshims run in network namespaces of their own,
joined by a veth pair) and, for the registry path, Debian's docker-registry on a loopback port.
Per size (`--sizes`, MiB; default 256 1024 4096), a counter of that resident memory printing
every 10 ms runs on node A and migrates to B (RestorePod with `lazy-migration-from` on B,
CheckpointPod with `lazy-migration` on A, both at once):

* downtime: the counter's last line on A to its first line on B (the `ts=` both print, one clock);
* total: the CheckpointPod call to its answer (every page on B and A's pod removed);
* the wire floor: the same bytes (the counter's memory) through the same link with a plain TCP
  socket (a sender in A's namespace, a receiver in B's, `sendall` / `recv_into` of 1 MiB buffers);
* the TLS floor: the same in mutual TLS 1.3 with the nodes' credentials and the cipher suite CRIU's
  gnutls negotiated for the migration's pages (read from the dumps' CRIU logs: "TLS handshake
  completed: ...", CRIU patch 0011; gnutls' default AES-256-GCM when a CRIU does not say);
* the cipher floor: that suite's AEAD alone (AES-GCM of `cryptography`, 16 KiB records as TLS's),
  every byte encrypted in one process and decrypted in another, both at once, as A's page server
  and B's daemon must: the lower bound of any encrypted transfer of those bytes on this machine;
* the memory floor: the first write of as many bytes of fresh anonymous memory in one process, in
  4 KiB pages (as B's lazy-pages daemon maps each page with UFFDIO_COPY): on this VM the kernel hands
  every freed page back to the host at once (free page reporting, `min_free_ms` 0), so each page a
  process first touches costs a fault in the host, and B must so materialise the pod's memory; the
  other floors reuse one buffer and never pay it;
* the page connection and both floors use one congestion control (`--tcp-congestion`, default
  podshim's `[migration] tcp_congestion`, cubic; "" for the host's: BBR here, whose pacing without
  the fq qdisc slows both);
* the registry path (bench/distribution.py's migrate: CheckpointPod, push, pull, RestorePod +
  StartContainer, the first line on B; `--skip-registry` leaves it out);
* where B's lazy-pages daemon spent the page phase (B runs → every page): its receiving thread's
  wait in epoll, receipt (TLS read and decryption; the socket reads alone), own copies (a fault's
  answer), CPU and time runnable without a CPU, and its copier threads' copies (sums over the
  threads), idle, CPU and runnable time: the line CRIU logs at its end (patches 0014, 0015), which
  B's podshim logs with "lazy restore complete"; and what the machine's cores did meanwhile
  (/proc/stat: busy, idle, steal).

Ends with `RESULT migrate_downtime_4g_s=… downtime_slope_s_per_gib=… total_vs_wire_floor=…
total_vs_tls_floor=… total_vs_cipher_floor=… total_vs_memory_floor=…` (the largest size's downtime
and total/floors; the slope of downtime over GiB, least squares).
Targets (reported, not enforced): downtime at 4 GiB ≤ 1 s, slope ≤ 0.05 s/GiB, total ≤ 1.3 × floor.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from api.runtime.v1 import api_pb2 as cri
from bench.common import (
    COUNT_RE,
    CpuTimes,
    CriLog,
    counter_config,
    cpu_line,
    machine_summary,
    remove_pod,
    remove_tree,
    result_line,
    runtime_stub,
    say,
    start_counter_pod,
    table,
)
from shim.config import Config
from testbed.nodes import Nodes, node_pair

INTERVAL_MS = 10
TIMEOUT = 1800.0

# The receiver and sender of the floors, each run in its node's namespace (nsenter): argv host,
# port, bytes, the congestion control ("": the namespace's default) and, for the TLS floor, the
# node's certificate, key and CA (mutual TLS 1.3, as the page connection). The sender prints its
# start (after the handshake) and the cipher; the receiver the bytes and when the last came.
_FLOOR_SETUP = textwrap.dedent(
    """
    import os, socket, ssl, sys, time
    host, port, total, cc, *pki = sys.argv[1:]
    def congestion(s):
        if cc:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc.encode())
    def tls(purpose):
        ctx = ssl.SSLContext(purpose)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_cert_chain(pki[0], pki[1])
        ctx.load_verify_locations(cafile=pki[2])
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx
    """
)
_RECEIVER = _FLOOR_SETUP + textwrap.dedent(
    """
    s = socket.socket()
    congestion(s)
    s.bind((host, 0))
    s.listen()
    print(s.getsockname()[1], flush=True)
    c, _ = s.accept()
    congestion(c)
    if pki:
        c = tls(ssl.PROTOCOL_TLS_SERVER).wrap_socket(c, server_side=True)
    buf = bytearray(1 << 20)
    got = 0
    while True:
        n = c.recv_into(buf)
        if not n:
            break
        got += n
    print(got, time.time(), flush=True)
    """
)
_SENDER = _FLOOR_SETUP + textwrap.dedent(
    """
    chunk = os.urandom(1 << 20)
    c = socket.socket()
    congestion(c)
    c.connect((host, int(port)))
    cipher = "none"
    if pki:
        c = tls(ssl.PROTOCOL_TLS_CLIENT).wrap_socket(c, server_hostname=host)
        cipher = c.version() + "/" + c.cipher()[0]
    start = time.time()
    print(start, cipher, flush=True)
    sent = 0
    while sent < int(total):
        c.sendall(chunk)
        sent += len(chunk)
    # FIN, then wait for the receiver's close: a close with unread data (TLS 1.3's session tickets)
    # would reset the connection and drop what the receiver had not read yet
    c.shutdown(socket.SHUT_WR)
    while c.recv(1 << 16):
        pass
    c.close()
    """
)
# The TLS 1.3 suites of the AEADs CRIU's gnutls may negotiate, by gnutls' name of the cipher (the
# last part of the session's description CRIU logs at the handshake, patch 0011), with the key bits.
TLS_SUITES = {"AES-128-GCM": ("TLS_AES_128_GCM_SHA256", 128), "AES-256-GCM": ("TLS_AES_256_GCM_SHA384", 256)}
# What gnutls' default priority (NORMAL) negotiates between two CRIUs: a CRIU without patch 0011
# logs no suite.
DEFAULT_CRIU_CIPHER = "AES-256-GCM"
HANDSHAKE_RE = re.compile(rb"TLS handshake completed: \S*\((AES-\d+-GCM)\)")


def negotiated_cipher(archive: Path) -> str:
    """The AEAD of the pages' TLS, from the dumps' CRIU logs in the source's archive (every dump
    must agree; a suite the floors do not know is an error: they would measure another), with
    where it was found."""
    found: set[str] = set()
    for log in archive.rglob("migration-dump.log"):
        found.update(m.decode() for m in HANDSHAKE_RE.findall(log.read_bytes()))
    if not found:
        return f"{DEFAULT_CRIU_CIPHER} (gnutls' default: CRIU's log names none)"
    if len(found) > 1 or not found <= TLS_SUITES.keys():
        raise RuntimeError(f"the pages negotiated {sorted(found)}; the floors know {sorted(TLS_SUITES)}")
    return f"{found.pop()} (CRIU's log)"


def floor(n: Nodes, nbytes: int, congestion: str, cipher: str | None = None) -> float:
    """Seconds to move `nbytes` from A's namespace to B's through the veth with a plain socket (the
    wire floor) or, given the pages' `cipher`, in TLS 1.3 with that suite as CRIU's page connection
    (the TLS floor), with congestion control `congestion` ("": the namespaces' default, the host's)."""
    tls = cipher is not None

    def ns(i: int) -> list[str]:
        return ["nsenter", f"--net={n.link.netns(i)}", sys.executable, "-c"]

    def pki(i: int) -> list[str]:
        name = n.link.names[i]
        return (
            [str(n.pki / f"{name}.pem"), str(n.pki / f"{name}-key.pem"), str(n.pki / "ca.pem")] if tls else []
        )

    address = n.link.address(1)
    with tempfile.TemporaryDirectory() as tmp:
        # Python's ssl sets no TLS 1.3 suites before 3.13: OpenSSL's configuration does, both ends
        env = dict(os.environ)
        if cipher is not None:
            conf = Path(tmp) / "openssl.cnf"
            conf.write_text(_OPENSSL_CONF.format(suite=TLS_SUITES[cipher][0]))
            env["OPENSSL_CONF"] = str(conf)
        recv = subprocess.Popen(
            [*ns(1), _RECEIVER, address, "0", str(nbytes), congestion, *pki(1)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert recv.stdout is not None
        port = recv.stdout.readline().strip()
        send = subprocess.run(
            [*ns(0), _SENDER, address, port, str(nbytes), congestion, *pki(0)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            env=env,
        )
        got, ended = recv.stdout.readline().split()
        recv.wait(timeout=60)
    if send.returncode or int(got) < nbytes:
        raise RuntimeError(f"the floor moved {got} of {nbytes} bytes: {send.stderr}")
    start, suite = send.stdout.split()[:2]
    if cipher is not None and suite != "TLSv1.3/" + TLS_SUITES[cipher][0]:
        raise RuntimeError(f"the TLS floor negotiated {suite}, not CRIU's TLSv1.3/{TLS_SUITES[cipher][0]}")
    return float(ended) - float(start)


_OPENSSL_CONF = """openssl_conf = floor
[floor]
ssl_conf = floor_ssl
[floor_ssl]
system_default = floor_tls
[floor_tls]
Ciphersuites = {suite}
"""

# One side of the cipher floor: argv role (encrypt / decrypt), key bits, bytes. It prepares its
# records, prints "ready", waits for a line on stdin, then runs and prints its start and end. The
# decrypting side decrypts records the encrypting one would make (one 1 MiB chunk's, over again).
_CIPHER_SIDE = textwrap.dedent(
    """
    import os, sys, time
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    role, bits, total = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    record = 16 << 10
    aead = AESGCM(AESGCM.generate_key(bits))
    chunk = memoryview(os.urandom(1 << 20))
    nonces = [i.to_bytes(12, "big") for i in range(len(chunk) // record)]
    records = [chunk[i * record : (i + 1) * record] for i in range(len(nonces))]
    if role == "decrypt":
        records = [aead.encrypt(nonce, r, None) for nonce, r in zip(nonces, records)]
    op = aead.decrypt if role == "decrypt" else aead.encrypt
    print("ready", flush=True)
    sys.stdin.readline()
    start = time.time()
    done = 0
    while done < total:
        for nonce, r in zip(nonces, records):
            op(nonce, r, None)
        done += len(chunk)
    print(start, time.time(), flush=True)
    """
)


# The memory floor's process: argv bytes; prints the seconds its first write of them took.
_TOUCH = textwrap.dedent(
    """
    import ctypes, mmap, sys, time
    n = int(sys.argv[1])
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_NOHUGEPAGE)
    start = time.perf_counter()
    ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(m)), 1, n)
    print(time.perf_counter() - start, flush=True)
    """
)


def memory_floor(nbytes: int) -> float:
    """Seconds to write `nbytes` of fresh anonymous memory once, in 4 KiB pages (a process of its own)."""
    out = subprocess.run(
        [sys.executable, "-c", _TOUCH, str(nbytes)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=True,
    )
    return float(out.stdout)


def cipher_floor(nbytes: int, cipher: str) -> float:
    """Seconds to encrypt `nbytes` in one process and decrypt them in another, both at once (the
    page server's and the daemon's share of the pages' TLS), with the pages' AEAD: from the
    earlier start to the later end."""
    bits = TLS_SUITES[cipher][1]
    sides = [
        subprocess.Popen(
            [sys.executable, "-c", _CIPHER_SIDE, role, str(bits), str(nbytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for role in ("encrypt", "decrypt")
    ]
    try:
        for p in sides:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a side of the cipher floor did not start")
        for p in sides:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        times = [tuple(map(float, p.communicate(timeout=TIMEOUT)[0].split())) for p in sides]
    finally:
        for p in sides:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in sides):
        raise RuntimeError("a side of the cipher floor failed")
    return max(t[1] for t in times) - min(t[0] for t in times)


def entries(path: Path) -> list[tuple[int, float]]:
    try:
        return [(int(c), float(t)) for c, t in COUNT_RE.findall(path.read_bytes())]
    except FileNotFoundError:
        return []


def live_migrate(n: Nodes, mib: int, tag: str) -> tuple[dict[str, float], str]:
    """One migration of a fresh counter of `mib` MiB: downtime, total, and the phases A logged;
    and the AEAD its pages' TLS negotiated."""
    rt_a, rt_b = runtime_stub(n.a.podshim_socket), runtime_stub(n.b.podshim_socket)
    cc = counter_config("counter", mib, interval_ms=INTERVAL_MS)
    pod = start_counter_pod(rt_a, n.a, f"live-{tag}", {"counter": cc}, timeout=TIMEOUT)
    CriLog(pod.log_path("counter")).wait(COUNT_RE, 60)
    out = Path(n.a.checkpoint_root) / f"live-{tag}"
    into = Path(n.b.checkpoint_root) / f"live-{tag}"
    out.mkdir(mode=0o700)
    into.mkdir(mode=0o700)
    from testbed import pods

    config = pods.pod_config(f"live-{tag}", n.b.pod_logs_dir)
    answers: dict[str, Any] = {}

    def restore() -> None:
        try:
            answers["b"] = rt_b.RestorePod(
                cri.RestorePodRequest(
                    checkpoint_path=str(into),
                    config=config,
                    container_configs=[counter_config("counter", mib, interval_ms=INTERVAL_MS)],
                    options={"lazy-migration-from": n.link.names[0]},
                ),
                timeout=TIMEOUT,
            )
        except grpc.RpcError as e:
            answers["b"] = e

    b_log_at = Path(n.b.podshim_log).stat().st_size
    # its running containers, listed before the clock starts (the released API takes no empty list)
    ids = pods.running_ids(rt_a, pod.id)
    t = threading.Thread(target=restore)
    t.start()
    start = time.time()
    with CpuTimes() as cores:
        rt_a.CheckpointPod(
            cri.CheckpointPodRequest(
                pod_sandbox_id=pod.id,
                output_path=str(out),
                container_ids=ids,
                options={"lazy-migration": n.link.listen(1)},
            ),
            timeout=TIMEOUT,
        )
        answered = time.monotonic()
    total = time.time() - start
    t.join(TIMEOUT)
    if isinstance(answers.get("b"), grpc.RpcError):
        raise RuntimeError(f"RestorePod on B failed: {answers['b']}")
    b_log = Path(config.log_directory) / "counter" / "0.log"
    CriLog(b_log).wait(COUNT_RE, 60)
    a_last, b_first = entries(pod.log_path("counter"))[-1], entries(b_log)[0]
    phases = {}
    for line in reversed(Path(n.a.podshim_log).read_text().splitlines()):
        if '"migration complete"' in line:
            phases = {k: v for k, v in json.loads(line).items() if isinstance(v, float)}
            break
    cipher = negotiated_cipher(out)
    # the page phase (B runs → every page) on this clock: A's phases count from its freeze, and its
    # answer came just after its last ("total")
    nan = float("nan")
    since_freeze = answered - phases.get("total", nan)
    pages_cores = cores.window(
        since_freeze + phases.get("destination_running", nan), since_freeze + phases.get("pages", nan)
    )
    remove_pod(rt_b, answers["b"].pod_sandbox_id)
    remove_pod(rt_a, pod.id)
    remove_tree(out)
    remove_tree(into)
    return {
        "downtime": b_first[1] - a_last[1],
        "counts_lost": b_first[0] - a_last[0] - 1,
        "total": total,
        **{f"phase_{k}": v for k, v in phases.items()},
        **{f"daemon_{k}": v for k, v in daemon_split(Path(n.b.podshim_log), b_log_at).items()},
        **{f"cores_{k}": v for k, v in pages_cores.items()},
    }, cipher


def daemon_split(log: Path, since: int) -> dict[str, float]:
    """Where B's lazy-pages daemon spent the page phase (CRIU patches 0014, 0015): the `transfer`
    of B's "lazy restore complete" line past byte `since` of its podshim's `log` (one container,
    one daemon); {} when its CRIU logs none."""
    for line in log.read_bytes()[since:].splitlines():
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            if rec.get("event") == "lazy restore complete" and rec.get("transfer"):
                return {k: float(v) for k, v in rec["transfer"].items()}
    return {}


# The daemon's time split's columns: header, key of its `transfer` (CRIU 0014/0015's names)
SPLIT_COLUMNS = [
    ("daemon s", "wall"),
    ("wait s", "wait"),
    ("recv s", "recv"),
    ("socket s", "sock"),
    ("copy s", "copy"),
    ("other s", "other"),
    ("cpu s", "cpu"),
    ("runnable s", "runnable"),
    ("copier copy s", "copier_copy"),
    ("copier idle s", "copier_idle"),
    ("copier cpu s", "copier_cpu"),
    ("copier runnable s", "copier_runnable"),
]
SPLIT_HEADERS = [
    "size",
    "B runs→pages s",
    *(h for h, _ in SPLIT_COLUMNS),
    "cores busy s",
    "idle s",
    "steal s",
]


def prefixed(live: dict[str, float], prefix: str) -> dict[str, float]:
    """The figures of `live` whose names start with `prefix`, without it."""
    return {k.removeprefix(prefix): v for k, v in live.items() if k.startswith(prefix)}


def split_row(mib: int, live: dict[str, float]) -> list[Any]:
    """One row of the daemon's time split (daemon_split) and what the cores did meanwhile."""
    nan = float("nan")
    d, c = prefixed(live, "daemon_"), prefixed(live, "cores_")
    busy = sum(c.get(k, nan) for k in ("user", "nice", "system", "irq", "softirq"))
    pages = live.get("phase_pages", nan) - live.get("phase_destination_running", nan)
    return [
        f"{mib} MiB",
        pages,
        *(d.get(k, nan) for _, k in SPLIT_COLUMNS),
        busy,
        c.get("idle", nan),
        c.get("steal", nan),
    ]


def registry_path(n: Nodes, mib: int, tag: str) -> float:
    """bench/distribution's migration (checkpoint, push, pull, restore, first line on B)."""
    from bench import distribution
    from testbed.registry import Registry

    rt_a, rt_b = runtime_stub(n.a.podshim_socket), runtime_stub(n.b.podshim_socket)
    with Registry(Path(n.a.base_dir)) as reg:
        os.environ.update(reg.auth_env())
        pod = start_counter_pod(
            rt_a, n.a, f"reg-{tag}", {"counter": counter_config("counter", mib)}, timeout=TIMEOUT
        )
        try:
            return distribution.migrate(rt_a, rt_b, n.a, n.b, reg, pod, mib, tag)["total"]
        finally:
            remove_pod(rt_a, pod.id)


def slope(xs: list[float], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096], help="MiB")
    ap.add_argument("--skip-registry", action="store_true", help="leave out the registry path")
    ap.add_argument(
        "--tcp-congestion",
        default=Config().migration_tcp_congestion,
        help="the pages' and the floors' congestion control ([migration] tcp_congestion; '': the host's)",
    )
    args = ap.parse_args(argv)
    cc = args.tcp_congestion
    print(machine_summary())
    rows = []
    split_rows = []
    downtimes: list[float] = []
    nan = float("nan")
    ratio_last = tls_ratio_last = cipher_ratio_last = memory_ratio_last = nan
    with contextlib.ExitStack() as stack:
        say("starting nodes A and B (two beds in network namespaces, a veth between them)")
        n = stack.enter_context(node_pair(migration={"tcp_congestion": cc}))
        say(f"A {n.link.address(0)}, B {n.link.address(1)}, congestion control {cc or 'the host default'}")
        for mib in args.sizes:
            tag = f"{mib}-{secrets.token_hex(2)}"
            say(f"{mib} MiB: live migration")
            live, negotiated = live_migrate(n, mib, tag)
            cipher = negotiated.split()[0]
            wire = floor(n, mib << 20, cc)
            tls = floor(n, mib << 20, cc, cipher)
            aead = cipher_floor(mib << 20, cipher)
            memory = memory_floor(mib << 20)
            reg = float("nan") if args.skip_registry else registry_path(n, mib, tag)
            say(
                f"{mib} MiB: downtime {live['downtime']:.3f}s, total {live['total']:.2f}s, "
                f"wire floor {wire:.2f}s, TLS floor {tls:.2f}s, cipher floor {aead:.2f}s ({negotiated}), "
                f"memory floor {memory:.2f}s, "
                f"registry path {reg:.1f}s; phases {live}"
            )
            say(f"{mib} MiB: the page phase's cores: {cpu_line(prefixed(live, 'cores_'))}")
            downtimes.append(live["downtime"])
            split_rows.append(split_row(mib, live))
            ratio_last, tls_ratio_last = live["total"] / wire, live["total"] / tls
            cipher_ratio_last, memory_ratio_last = live["total"] / aead, live["total"] / memory
            rows.append(
                [
                    f"{mib} MiB",
                    live["downtime"],
                    live["counts_lost"],
                    live.get("phase_go", float("nan")),
                    live.get("phase_destination_running", float("nan")),
                    live["total"],
                    live.get("phase_pages", nan) - live.get("phase_destination_running", nan),
                    wire,
                    ratio_last,
                    tls,
                    tls_ratio_last,
                    aead,
                    cipher_ratio_last,
                    memory,
                    memory_ratio_last,
                    reg,
                ]
            )
    print()
    print(
        table(
            [
                "size",
                "downtime s",
                "counts lost",
                "freeze→go s",
                "freeze→B runs s",
                "total s",
                "B runs→pages s",
                "wire floor s",
                "total/floor",
                "TLS floor s",
                "total/TLS floor",
                "cipher floor s",
                "total/cipher floor",
                "memory floor s",
                "total/memory floor",
                "registry path s",
            ],
            rows,
        )
    )
    print()
    print("where B's lazy-pages daemon spent the page phase (its log, CRIU 0014/0015), and the cores")
    print(table(SPLIT_HEADERS, split_rows))
    gib = [m / 1024 for m in args.sizes]
    print(
        result_line(
            migrate_downtime_4g_s=downtimes[-1],
            downtime_slope_s_per_gib=slope(gib, downtimes) if len(gib) > 1 else float("nan"),
            total_vs_wire_floor=ratio_last,
            total_vs_tls_floor=tls_ratio_last,
            total_vs_cipher_floor=cipher_ratio_last,
            total_vs_memory_floor=memory_ratio_last,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
