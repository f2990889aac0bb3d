"""Stock PostgreSQL 15 (Debian's own packages, images/debian.py) checkpointed and restored as a
pod, end to end, with runc and crun: run as its own non-root user, with its default
`dynamic_shared_memory_type = posix` (its segments live in the pod's /dev/shm) and 256 MB of
shared buffers, CheckpointPod with empty options as the kubelet sends it, RestorePod into a new
pod: every row, the sequence and the index come back intact (amcheck), and the server resumes in
place, with no crash recovery and no second start-up in its log.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from testbed import pods
from testbed.bed import TestBed

pytestmark = pytest.mark.e2e

Stub = api_pb2_grpc.RuntimeServiceStub
RPC_TIMEOUT = 180
PG_UID = 999
READY = b"database system is ready to accept connections"
RECOVERY = (b"database system was interrupted", b"redo starts", b"was not properly shut down")
SERVER = (
    "initdb -D /tmp/pg -U postgres --auth=trust --no-sync >/tmp/initdb.log 2>&1 || "
    "{ cat /tmp/initdb.log; exit 1; }; "
    "exec postgres -D /tmp/pg -c listen_addresses= -c unix_socket_directories=/tmp "
    "-c shared_buffers=256MB -c jit=off -c max_parallel_workers_per_gather=2"
)
LOAD = """
create extension amcheck;
create sequence ids;
create table t (id bigint primary key default nextval('ids'), v text not null);
insert into t (v) select md5(g::text) from generate_series(1, 100000) g;
create index t_v on t (v);
"""
SUMMARY = "select count(*), md5(string_agg(v, ',' order by id)) from t"


@pytest.fixture(scope="module")
def postgres_image(bed: TestBed) -> str:
    """The image, built from the set-up's cached packages and imported into the bed's containerd."""
    return bed.import_debian_image("postgres")


def server(image: str) -> cri.ContainerConfig:
    cc = pods.container_config("pg", image=image, command=["sh", "-c", SERVER], args=[])
    sc = cc.linux.security_context
    sc.run_as_user.CopyFrom(cri.Int64Value(value=PG_UID))
    sc.run_as_group.CopyFrom(cri.Int64Value(value=PG_UID))
    return cc


def psql(rt: Stub, cid: str, sql: str) -> str:
    r = rt.ExecSync(
        cri.ExecSyncRequest(
            container_id=cid,
            cmd=["psql", "-h", "/tmp", "-U", "postgres", "-At", "-v", "ON_ERROR_STOP=1", "-c", sql],
            timeout=60,
        ),
        timeout=90,
    )
    assert r.exit_code == 0, (sql, r.stderr.decode(errors="replace"))
    return r.stdout.decode().strip()


def test_stock_postgres_checkpoints_and_restores_with_every_row(
    rt: Stub,
    bed: TestBed,
    log_root: Path,
    pod_cleanup: list[str],
    runtime_handler: str,
    archives: list[Path],
    postgres_image: str,
) -> None:
    tag = f"pg-{runtime_handler or 'runc'}-{secrets.token_hex(2)}"
    src = pods.run_pod(rt, tag, log_root, {"pg": server(postgres_image)}, runtime_handler=runtime_handler)
    pod_cleanup.append(src.id)
    log = src.log_path("pg")
    pods.wait_for(lambda: READY in _read(log), timeout=60, what="postgres ready")
    cid = src.containers["pg"]
    psql(rt, cid, LOAD)
    assert psql(rt, cid, "show dynamic_shared_memory_type") == "posix"
    want = psql(rt, cid, SUMMARY)
    next_id = int(psql(rt, cid, "select last_value from ids")) + 1
    shm = [
        p for p in Path(f"/proc/{_pid(rt, cid)}/root/dev/shm").iterdir() if p.name.startswith("PostgreSQL.")
    ]
    assert shm, "postgres keeps no segment in the pod's /dev/shm: the test would prove nothing"

    out = Path(bed.checkpoint_root) / tag
    out.mkdir(mode=0o700)
    archives.append(out)
    rt.CheckpointPod(pods.checkpoint_request(rt, src.id, out), timeout=RPC_TIMEOUT)  # empty options
    assert (out / "sandbox" / "dev-shm.tar").is_file()
    pods.remove_pod(rt, src.id)

    config = pods.pod_config(f"{tag}-new", log_root)
    resp = rt.RestorePod(
        cri.RestorePodRequest(
            checkpoint_path=str(out),
            config=config,
            container_configs=[server(postgres_image)],
            runtime_handler=runtime_handler,
        ),
        timeout=RPC_TIMEOUT,
    )
    pod_cleanup.append(resp.pod_sandbox_id)
    new = resp.restored_containers[0].container_id
    rt.StartContainer(cri.StartContainerRequest(container_id=new), timeout=RPC_TIMEOUT)
    assert psql(rt, new, SUMMARY) == want
    assert int(psql(rt, new, "select nextval('ids')")) == next_id
    psql(rt, new, "select bt_index_check('t_v', true), bt_index_check('t_pkey', true)")
    # a query with parallel workers: new dynamic shared memory segments beside the restored ones
    parallel = "set parallel_setup_cost = 0; set min_parallel_table_scan_size = 0; "
    assert psql(rt, new, parallel + SUMMARY).splitlines()[-1] == want
    new_log = Path(config.log_directory) / "pg" / "0.log"
    text = _read(new_log)
    assert READY not in text, "postgres started again: not restored"
    assert not [r for r in RECOVERY if r in text], text[-2000:]


def _read(path: Path) -> bytes:
    return path.read_bytes() if path.exists() else b""


def _pid(rt: Stub, cid: str) -> int:
    from testbed.checks import verbose_info

    return int(verbose_info(rt, cid)["pid"])
