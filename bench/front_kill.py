"""bench/front_kill: what a SIGKILLed podshim-front costs a gRPC client of podshim's socket.

Clients call Version (through the front to the daemon) in a loop, each on its own channel, one
per kind: ``plain`` (the default call options: fails fast) and ``ready`` (``wait_for_ready=True``:
waits for a connection instead of failing when there is none), each call with a 5 s deadline. The
front is SIGKILLed ``--kills`` times, ``--period`` seconds apart; the daemon starts it again.
Per kill and client kind:

* ``unavailable``: how many calls failed UNAVAILABLE, split by cause: ``connect`` (the
  connection could not be made: no socket, refused) or ``dropped`` (the call was on the
  connection the killed front held);
* ``span``: from the start of the first failed call to the end of the last one (0 when none
  failed): how long the client saw UNAVAILABLE;
* ``gap``: from the kill to the first answer (OK) to a call started after it: how long the
  client went without an answer, failed calls and waiting ones alike.

Also whether the socket file stayed the same (its inode) across every kill. Ends with ``RESULT
plain_span_p50_s=… plain_span_max_s=… plain_gap_p50_s=… plain_gap_max_s=… ready_span_max_s=…
ready_gap_p50_s=… ready_gap_max_s=… plain_unavailable=… ready_unavailable=… socket_replaced=…``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from api.runtime.v1 import api_pb2 as cri
from bench.common import bench_bed, machine_summary, median, result_line, say, table
from testbed import _sys

SERVICE = "/runtime.v1.RuntimeService/"
KINDS = ("plain", "ready")
CALL_TIMEOUT = 5.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.front_kill", description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=8, help="front kills (default 8)")
    p.add_argument("--period", type=float, default=2.0, help="seconds between kills (default 2)")
    p.add_argument("--socket", help="an existing podshim socket (default: a bed of its own)")
    return p.parse_args(argv)


@dataclass
class Call:
    start: float
    end: float
    code: str
    details: str


@dataclass
class Client:
    kind: str
    socket: str
    timeout: float = CALL_TIMEOUT  # each call's deadline
    calls: list[Call] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with grpc.insecure_channel(f"unix://{self.socket}") as ch:
            fn: grpc.UnaryUnaryMultiCallable[bytes, bytes] = ch.unary_unary(SERVICE + "Version")
            request = cri.VersionRequest(version="v1").SerializeToString()
            clock = time.monotonic
            while not self.stop.is_set():
                t0 = clock()
                try:
                    fn(request, timeout=self.timeout, wait_for_ready=self.kind == "ready")
                    code, details = "OK", ""
                except grpc.RpcError as e:
                    code, details = e.code().name, e.details() or ""
                with self.cond:
                    self.calls.append(Call(t0, clock(), code, details))
                    self.cond.notify_all()

    def answered_after(self, when: float, timeout: float, count: int = 1) -> bool:
        """Wait for OK answers to `count` calls started after `when`."""

        def answered() -> bool:
            n = 0
            for c in reversed(self.calls):  # in the order they started: the newest first
                if c.start <= when:
                    return False
                n += c.code == "OK"
                if n >= count:
                    return True
            return False

        with self.cond:
            return self.cond.wait_for(answered, timeout)


def cause(call: Call) -> str:
    """connect: no connection could be made; dropped: the call's connection went away under it;
    other: not UNAVAILABLE (a deadline, say)."""
    if call.code != "UNAVAILABLE":
        return "other"
    d = call.details.lower()
    connect = ("failed to connect", "connection refused", "no such file", "connect:")
    return "connect" if any(w in d for w in connect) else "dropped"


def fronts_of(socket: str) -> list[int]:
    return [
        pid
        for pid in _sys.all_pids()
        if (argv := _sys.read_cmdline(pid))
        and Path(argv[0]).name == "podshim-front"
        and f"--listen={socket}" in argv
    ]


def measure(socket: str, args: argparse.Namespace) -> int:
    clients = [Client(kind, socket) for kind in KINDS]
    threads = [threading.Thread(target=c.run, daemon=True) for c in clients]
    for t in threads:
        t.start()
    kills: list[float] = []
    replaced = 0  # kills after which the socket was another file (a new inode or creation time)
    first = os.stat(socket)
    identity = (first.st_ino, first.st_ctime_ns)
    try:
        for c in clients:
            if not c.answered_after(time.monotonic(), 30):
                raise RuntimeError(f"{c.kind} client: no answer from {socket}")
        for k in range(args.kills):
            time.sleep(args.period)  # steady calls before each kill
            (front,) = fronts_of(socket)
            killed = time.monotonic()
            os.kill(front, signal.SIGKILL)
            kills.append(killed)
            for c in clients:
                if not c.answered_after(killed, 30):
                    raise RuntimeError(f"kill {k + 1}: the {c.kind} client got no answer within 30 s")
            st = os.stat(socket)
            replaced += (st.st_ino, st.st_ctime_ns) != identity
            identity = (st.st_ino, st.st_ctime_ns)
            say(f"kill {k + 1}/{args.kills}: front {front} killed; both clients answered again")
        time.sleep(args.period)
    finally:
        for c in clients:
            c.stop.set()
        for t in threads:
            t.join(CALL_TIMEOUT + 5)

    figures: dict[str, dict[str, list[float]]] = {c.kind: {"span": [], "gap": []} for c in clients}
    counts: dict[str, dict[str, int]] = {c.kind: {"connect": 0, "dropped": 0, "other": 0} for c in clients}
    rows = []
    for i, killed in enumerate(kills):
        until = kills[i + 1] if i + 1 < len(kills) else float("inf")
        row: list[object] = [i + 1]
        for c in clients:
            window = [x for x in c.calls if killed <= x.end < until]  # the calls that ended after this kill
            failed = [x for x in window if x.code != "OK"]
            by = {k: 0 for k in counts[c.kind]}
            for x in failed:
                by[cause(x)] += 1
                counts[c.kind][cause(x)] += 1
            span = max(x.end for x in failed) - min(x.start for x in failed) if failed else 0.0
            gap = min(x.end for x in window if x.code == "OK" and x.start > killed) - killed
            figures[c.kind]["span"].append(span)
            figures[c.kind]["gap"].append(gap)
            row += [f"{by['connect']}/{by['dropped']}/{by['other']}", span, gap]
        rows.append(row)
    heads = ["kill"] + [h for k in KINDS for h in (f"{k} failed c/d/o", f"{k} span s", f"{k} gap s")]
    print()
    print("Per kill: failed calls (connect / dropped / other), UNAVAILABLE span, gap to the first answer")
    print(table(heads, rows))
    examples = {cause(x): x.details for c in clients for x in c.calls if x.code != "OK"}
    for what, said in examples.items():
        print(f"  a {what} failure: {said[:200]}")
    print(f"socket file replaced {replaced} time(s) over {len(kills)} kills")
    print(
        result_line(
            plain_span_p50_s=median(figures["plain"]["span"]),
            plain_span_max_s=max(figures["plain"]["span"]),
            plain_gap_p50_s=median(figures["plain"]["gap"]),
            plain_gap_max_s=max(figures["plain"]["gap"]),
            ready_span_max_s=max(figures["ready"]["span"]),
            ready_gap_p50_s=median(figures["ready"]["gap"]),
            ready_gap_max_s=max(figures["ready"]["gap"]),
            plain_unavailable=counts["plain"]["connect"] + counts["plain"]["dropped"],
            ready_unavailable=counts["ready"]["connect"] + counts["ready"]["dropped"],
            socket_replaced=replaced,
        ),
        flush=True,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print("bench/front_kill: a client's outage when podshim-front is SIGKILLed", flush=True)
    print(machine_summary(), flush=True)
    if args.socket:
        return measure(args.socket, args)
    with bench_bed() as bed:
        return measure(str(bed.podshim_socket), args)


if __name__ == "__main__":
    sys.exit(main())
