"""The service's Unix socket: taken only from nobody, given back only if still ours.

* A path where a server still accepts connections is refused (probed by connecting),
  so a second ``edge serve --uds S`` cannot take over a live socket; a socket file
  nobody listens on any more (a killed server's) is replaced.
* On exit the file is removed only if it is the one this process bound (same device
  and inode), so stopping one server never deletes another's socket.
* Probe, removal and bind happen under a lock on the directory, so two servers
  starting at once cannot both decide the path is free.
* The socket is created owner-only, then given ``group`` and ``mode``.
"""

from __future__ import annotations

import grp
import logging
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from edge.dirlock import locked_directory

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 1.0


class SocketUnavailable(RuntimeError):
    """The Unix socket path cannot be used: another server owns it, or it is not a socket."""


def group_id(group: str) -> int:
    """A group name or number as a gid; ValueError for an unknown group."""
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ValueError(f"unknown group {group!r}") from None


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _remove_if_stale(path: Path) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketUnavailable(f"{path} exists and is not a socket; remove it or choose another --uds path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(PROBE_TIMEOUT_S)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:  # nobody listens: a dead server's leftover
        os.unlink(path)
        log.info("removed stale socket %s", path)
        return
    except FileNotFoundError:
        return
    except TimeoutError:  # bound and listening, but its backlog is full: alive
        pass
    except OSError as exc:
        raise SocketUnavailable(f"cannot probe socket {path}: {exc.strerror or exc}") from None
    finally:
        probe.close()
    raise SocketUnavailable(f"another server is listening on {path}; stop it or choose another --uds path")


@dataclass
class UnixListener:
    """A listening Unix socket and the identity of the file it was bound to."""

    path: Path
    sock: socket.socket
    identity: tuple[int, int]

    @classmethod
    def bind(cls, path: str | os.PathLike[str], mode: int = 0o660, group: str | None = None,
             backlog: int = 128) -> UnixListener:
        p = Path(path)
        gid = group_id(group) if group else None
        p.parent.mkdir(parents=True, exist_ok=True)
        with locked_directory(p.parent):
            _remove_if_stale(p)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old = os.umask(0o177)  # owner-only until group and mode are set below
            try:
                sock.bind(str(p))
            except OSError as exc:
                sock.close()
                raise SocketUnavailable(f"cannot bind {p}: {exc.strerror or exc}") from None
            finally:
                os.umask(old)
            identity = _identity(p)
            assert identity is not None
            listener = cls(p, sock, identity)
            try:
                if gid is not None:
                    os.chown(p, -1, gid)
                os.chmod(p, mode)
            except OSError as exc:
                listener._close_locked()
                raise SocketUnavailable(f"cannot set group {group!r} / mode {mode:o} on {p}: "
                                        f"{exc.strerror or exc}") from None
        sock.listen(backlog)
        sock.set_inheritable(True)
        return listener

    def close(self) -> None:
        """Close the socket; remove its file only if it is still the one we bound."""
        with locked_directory(self.path.parent):
            self._close_locked()

    def _close_locked(self) -> None:
        self.sock.close()
        current = _identity(self.path)
        if current == self.identity:
            os.unlink(self.path)
        elif current is not None:
            log.warning("not removing %s: it is no longer the socket this server created", self.path)
