"""One podshim per socket and per state dir (docs/design/proxy.md (The proxy)): a dead run's
socket is taken over, a live one is not; at the stop a socket is removed only when nobody serves
it; the state dir's lock keeps a second podshim from replaying the journal of a running one."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from shim.server import sockets
from shim.server.app import StartupError, lock_state_dir


def _listening(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen(1)
    return s


def test_a_dead_runs_socket_is_removed(tmp_path: Path) -> None:
    path = tmp_path / "run" / "podshim.sock"
    path.parent.mkdir()
    _listening(path).close()  # the file stays, nobody listens: a run that died
    assert path.exists()
    sockets.remove_stale(str(path))
    assert not path.exists()


def test_a_missing_socket_gets_its_directory(tmp_path: Path) -> None:
    path = tmp_path / "new" / "dir" / "podshim.sock"
    sockets.remove_stale(str(path))
    assert path.parent.is_dir() and not path.exists()


def test_a_live_socket_is_not_taken(tmp_path: Path) -> None:
    path = tmp_path / "podshim.sock"
    with _listening(path):
        with pytest.raises(sockets.SocketInUse, match="another process serves"):
            sockets.remove_stale(str(path))
        assert path.exists()


def test_a_file_that_is_not_a_socket_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "podshim.sock"
    path.write_text("not a socket")
    with pytest.raises(OSError, match="not a socket"):
        sockets.remove_stale(str(path))
    assert path.read_text() == "not a socket"


def test_the_stop_removes_a_dead_socket_and_leaves_a_served_one(tmp_path: Path) -> None:
    path = tmp_path / "podshim.sock"
    with _listening(path):  # a podshim started after ours bound the path anew
        sockets.remove_unserved(str(path))
        assert path.exists(), "removed the next run's socket"
    sockets.remove_unserved(str(path))  # nobody serves it now
    assert not path.exists()
    sockets.remove_unserved(str(path))  # gone already: nothing to do


def test_the_state_dir_is_held_by_one_podshim(tmp_path: Path) -> None:
    fd = lock_state_dir(str(tmp_path))
    try:
        with pytest.raises(StartupError, match=f"another podshim \\(pid {os.getpid()}\\)"):
            lock_state_dir(str(tmp_path))  # a second open file description: flock refuses it
    finally:
        os.close(fd)
    os.close(lock_state_dir(str(tmp_path)))  # released with the descriptor, as at the process's end
