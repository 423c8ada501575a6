"""The broker's address and descriptors as the operating system sees them: whether another
broker serves the address, the open-files limit, who the peer of a ZeroMQ frame is, and the
sockets a group may use (serve --group)."""

from __future__ import annotations

import logging
import os
import resource
import socket

import zmq

from ...common.config import ipc_path
from ...common.errors import BrokerError
from ...common.protocol import Op, decode, encode
from ..store.records import Peer

log = logging.getLogger(__name__)


class AddressInUse(BrokerError):
    code = "unavailable"


def refuse_if_served(address: str) -> None:
    """AddressInUse if a broker answers at `address`."""
    path = ipc_path(address)
    if path is not None and not _listened(path):  # (no half-second wait for an answer)
        return
    ctx = zmq.Context()
    probe = ctx.socket(zmq.DEALER)
    probe.setsockopt(zmq.LINGER, 0)
    try:
        probe.connect(address)
        probe.send(encode({"op": Op.PING, "id": 1}))
        if probe.poll(500):
            pid = decode(probe.recv()).get("pid")
            raise AddressInUse(
                f"a broker (pid {pid}) already serves {address}; stop it "
                "(kill it, or systemctl stop) or choose another --address"
            )
    finally:
        probe.close()
        ctx.term()


def _listened(path: str) -> bool:
    """Whether a process listens on the Unix socket at `path`: a file a crashed broker left
    refuses the connection at once."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(0.5)  # (a full backlog: a stopped broker's; the PING says)
    try:
        probe.connect(path)
    except (FileNotFoundError, ConnectionRefusedError):
        return False
    except OSError:  # (not ours to judge: the PING says)
        return True
    finally:
        probe.close()
    return True


def raise_fd_limit() -> None:
    """Each client's sockets and pidfd are descriptors of this process: take all the kernel
    allows (the soft limit, often 1024, up to the hard one)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:  # the kernel takes at most fs.nr_open
        hard = 1 << 20
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, hard, exc)


def frame_peer(frame: zmq.Frame) -> Peer | None:
    """The process that sent `frame` over an ipc:// connection, as the kernel gave it to
    ZeroMQ (SO_PEERCRED, which libzmq appends to the peer's address: "...:uid:gid:pid"); no
    pid where the kernel cannot say (a process in another pid namespace: 0)."""
    address = frame.get("Peer-Address")
    ids = address.split(":")[-3:] if isinstance(address, str) else []
    if len(ids) != 3 or not all(part.isdigit() for part in ids):
        return None
    return Peer(int(ids[2]) or None, int(ids[0]))


def share_sockets(gid: int, *paths: str | None) -> None:
    """Let the members of group `gid` connect to the sockets at `paths` (mode 0660), and into
    their folder (0750: in, but not to write there), which must be this user's own."""
    sockets = [p for p in paths if p is not None]
    folder = os.path.dirname(sockets[0])
    if os.lstat(folder).st_uid != os.getuid() or os.path.islink(folder):
        raise BrokerError(
            f"--group: {folder} is not a folder of yours, so the broker will not open it to "
            "the group: serve at an address in a folder of yours"
        )
    try:
        for path, mode in ((folder, 0o750), *((p, 0o660) for p in sockets)):
            os.chown(path, -1, gid)
            os.chmod(path, mode)
    except PermissionError as exc:
        raise BrokerError(
            f"--group: cannot give {exc.filename} to group {gid}: this user must be a member "
            "of the group"
        ) from None
