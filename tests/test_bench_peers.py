"""Unit tests of the peers bench's pure parts (bench/peers.py): the pause from printed timestamps,
the rotation of the peers' order, the medians and the RESULT ratios. No bed, no timings asserted."""

from __future__ import annotations

import math

import pytest

from bench import peers


def test_rotation_puts_each_peer_first_in_turn() -> None:
    order = [peers.rotation(peers.PEERS, r) for r in range(4)]
    assert order[0] == ["podshim", "podman", "containerd"]
    assert order[1] == ["podman", "containerd", "podshim"]
    assert order[2] == ["containerd", "podshim", "podman"]
    assert order[3] == order[0]
    assert [o[0] for o in order[:3]] == list(peers.PEERS)
    assert all(sorted(o) == sorted(peers.PEERS) for o in order)
    assert peers.rotation([], 2) == []


def test_largest_gap_around_the_call() -> None:
    # printed every 0.01 s; the checkpoint (called at 10.05, back at 10.40) froze it 10.06..10.36
    stamps = [10.0 + i / 100 for i in range(7)] + [10.36 + i / 100 for i in range(6)]
    assert peers.largest_gap(stamps, 10.05, 10.40) == pytest.approx(0.30)
    # a larger gap outside the window is not the checkpoint's
    before = [8.0, 9.5, *stamps]
    assert peers.largest_gap(before, 10.05, 10.40) == pytest.approx(0.30)
    # the order of the lines does not matter
    assert peers.largest_gap(list(reversed(stamps)), 10.05, 10.40) == pytest.approx(0.30)
    # a pause spanning the whole call, from the last stamp before it to the first after
    assert peers.largest_gap([1.0, 1.01, 2.5, 2.51], 1.02, 2.4) == pytest.approx(1.49)
    # no stamp after the call (or none before): no figure
    assert math.isnan(peers.largest_gap([1.0, 1.01], 1.02, 2.0))
    assert math.isnan(peers.largest_gap([3.0, 3.01], 1.0, 2.0))
    assert math.isnan(peers.largest_gap([], 1.0, 2.0))


def cell(pause: float, checkpoint: float, restore: float) -> dict[str, float]:
    return {"pause": pause, "checkpoint": checkpoint, "restore": restore, "archive_mib": 1.0}


def test_summarize_holds_podshim_against_the_best_peer() -> None:
    nan = math.nan
    medians = {
        4: {  # worse than any other size everywhere: a small size's fixed costs are not the verdict
            peers.POD: cell(0.5, 4.0, 3.0),
            peers.POD_LAZY: cell(nan, nan, 2.0),
            peers.CTR: cell(0.6, 5.0, 4.0),
            peers.PODMAN_EXPORT: cell(0.2, 1.0, 1.2),
            peers.PODMAN_IN_PLACE: cell(0.1, 0.8, 0.6),
            peers.CONTAINERD: cell(0.25, 0.5, 0.8),
        },
        1024: {
            peers.POD: cell(1.0, 2.0, 1.5),
            peers.POD_LAZY: cell(nan, nan, 0.3),
            peers.CTR: cell(1.1, 2.2, 3.0),
            peers.PODMAN_EXPORT: cell(2.0, 4.0, 3.0),
            peers.PODMAN_IN_PLACE: cell(nan, 3.0, 2.0),  # a peer's missing figure is left out
            peers.CONTAINERD: cell(0.8, 2.5, 2.5),
        },
        4096: {
            peers.POD: cell(2.0, 9.0, 4.0),
            peers.POD_LAZY: cell(nan, nan, 0.4),
            peers.CTR: cell(2.0, 9.0, 5.0),
            peers.PODMAN_EXPORT: cell(3.0, 10.0, 9.0),
            peers.PODMAN_IN_PLACE: cell(4.0, 6.0, 5.0),
            peers.CONTAINERD: cell(5.0, 12.0, 8.0),
        },
    }
    got = peers.summarize(medians, 0.05, 0.35)
    # the worst of 1 GiB and 4 GiB of podshim / the best peer at that size
    assert got["pause_vs_best_peer"] == pytest.approx(max(1.0 / 0.8, 2.0 / 3.0))
    assert got["checkpoint_vs_best_peer"] == pytest.approx(max(2.0 / 2.5, 9.0 / 6.0))
    assert got["restore_vs_best_peer"] == pytest.approx(max(1.5 / 2.0, 4.0 / 5.0))
    assert got["lazy_restore_vs_best_peer"] == pytest.approx(max(0.3 / 2.0, 0.4 / 5.0))
    assert got["tar_restore_vs_containerd"] == pytest.approx(max(3.0 / 2.5, 5.0 / 8.0))
    assert got["cli_startup_s"] == pytest.approx(0.05)
    assert got["cli_first_call_s"] == pytest.approx(0.35)
    assert list(got) == [
        "pause_vs_best_peer",
        "checkpoint_vs_best_peer",
        "restore_vs_best_peer",
        "lazy_restore_vs_best_peer",
        "tar_restore_vs_containerd",
        "cli_startup_s",
        "cli_first_call_s",
    ]


def test_summarize_without_a_peer_or_lazy_gives_nan() -> None:
    medians = {1024: {peers.POD: cell(0.05, 0.4, 0.3), peers.CTR: cell(0.06, 0.5, 0.4)}}
    got = peers.summarize(medians, math.nan, math.nan)
    assert all(math.isnan(v) for v in got.values()), got


def test_medians_leave_out_missing_figures() -> None:
    res = peers.Results()
    res.add(4, peers.POD, peers.Sample(pause=0.1, checkpoint=1.0, restore=0.5, archive_mib=5.0))
    res.add(4, peers.POD, peers.Sample(pause=0.3, checkpoint=3.0, restore=math.nan, archive_mib=5.0))
    res.add(4, peers.POD, peers.Sample(pause=0.2, checkpoint=2.0, restore=0.7, archive_mib=5.0))
    m = res.medians()[4][peers.POD]
    assert m == {
        "pause": pytest.approx(0.2),
        "checkpoint": 2.0,
        "restore": pytest.approx(0.6),
        "archive_mib": 5.0,
    }
    res.add(4, peers.POD_LAZY, peers.Sample(restore=0.2))
    assert math.isnan(res.medians()[4][peers.POD_LAZY]["pause"])


def test_every_operation_belongs_to_one_peer() -> None:
    ops = [op for peer in peers.PEERS for op in peers.OPS[peer]]
    assert len(ops) == len(set(ops))
    assert set(peers.PEER_OPS) == set(peers.OPS["podman"]) | set(peers.OPS["containerd"])
