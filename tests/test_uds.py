"""The Unix socket is never taken from a live server and never removed from under another."""

from __future__ import annotations

import grp
import os
import socket
import stat
from pathlib import Path

import pytest

from edge.serving.uds import SocketUnavailable, UnixListener


def connects(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
            return True
        except OSError:
            return False


def test_a_live_socket_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "edge.sock"
    first = UnixListener.bind(path)
    try:
        with pytest.raises(SocketUnavailable, match="another server is listening"):
            UnixListener.bind(path)
        assert connects(path)  # the first server is still reachable
    finally:
        first.close()
    assert not path.exists()


def test_a_stale_socket_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "edge.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))  # a killed server's leftover: the file stays, nobody listens
    dead.close()
    assert path.is_socket() and not connects(path)
    listener = UnixListener.bind(path)
    try:
        assert connects(path)
    finally:
        listener.close()


def test_exit_removes_only_the_socket_this_process_bound(tmp_path: Path) -> None:
    path = tmp_path / "edge.sock"
    ours = UnixListener.bind(path)
    path.unlink()  # someone else took the path over meanwhile
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(str(path))
    other.listen(1)
    try:
        ours.close()
        assert path.is_socket() and connects(path)
    finally:
        other.close()


def test_a_regular_file_is_not_replaced(tmp_path: Path) -> None:
    path = tmp_path / "edge.sock"
    path.write_text("precious")
    with pytest.raises(SocketUnavailable, match="not a socket"):
        UnixListener.bind(path)
    assert path.read_text() == "precious"


def test_mode_and_group(tmp_path: Path) -> None:
    path = tmp_path / "edge.sock"
    group = grp.getgrgid(os.getgid()).gr_name
    listener = UnixListener.bind(path, mode=0o600, group=group)
    try:
        st = path.stat()
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_gid == os.getgid()
    finally:
        listener.close()
    with pytest.raises(ValueError, match="unknown group"):
        UnixListener.bind(path, group="no-such-group-edge")
