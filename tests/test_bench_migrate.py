"""Unit tests of bench/migrate.py's floors that need no nodes: the suite read from the dumps' CRIU
logs (patch 0011), the cipher floor's two sides, the memory floor. No timings asserted."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import migrate as bm

HANDSHAKE = "(00.1) TLS handshake completed: (TLS1.3-X.509)-(ECDHE-SECP256R1)-(RSA-PSS-RSAE-SHA256)-({})\n"


def dump_log(archive: Path, container: str, text: str) -> None:
    log = archive / "containers" / container / "migration-dump.log"
    log.parent.mkdir(parents=True)
    log.write_text(text)


def test_the_suite_is_read_from_the_dumps_logs(tmp_path: Path) -> None:
    dump_log(tmp_path, "a", "(00.1) Dumping\n" + HANDSHAKE.format("AES-128-GCM"))
    dump_log(tmp_path, "b", HANDSHAKE.format("AES-128-GCM"))
    assert bm.negotiated_cipher(tmp_path) == "AES-128-GCM (CRIU's log)"


def test_a_criu_that_names_no_suite_is_taken_for_gnutls_default(tmp_path: Path) -> None:
    dump_log(tmp_path, "a", "(00.123456) TLS handshake completed\n")
    assert bm.negotiated_cipher(tmp_path).split()[0] == bm.DEFAULT_CRIU_CIPHER == "AES-256-GCM"


@pytest.mark.parametrize("suites", [["AES-128-GCM", "AES-256-GCM"], ["AES-512-GCM"]])
def test_suites_the_floors_cannot_match_are_an_error(tmp_path: Path, suites: list[str]) -> None:
    for i, suite in enumerate(suites):
        dump_log(tmp_path, f"c{i}", HANDSHAKE.format(suite))
    with pytest.raises(RuntimeError, match="the pages negotiated"):
        bm.negotiated_cipher(tmp_path)


@pytest.mark.parametrize("cipher", sorted(bm.TLS_SUITES))
def test_the_cipher_floor_runs_both_sides(cipher: str) -> None:
    # the decrypting side fails (InvalidTag) unless it was given the encrypting side's records
    assert bm.cipher_floor(4 << 20, cipher) > 0


def test_the_memory_floor_writes_fresh_memory() -> None:
    assert bm.memory_floor(16 << 20) > 0
