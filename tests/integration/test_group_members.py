"""serve --group: what members can do to each other (issue 31, Note [members] in
server/store/members.py). Each user's lease slots and mailboxes are in segments only that user
and the broker can open: another member's open fails with EACCES, its hello with a session
token of another user is refused, and queue items between two users go through the broker.
The tests run as root, and make a group and two member users of their own."""

from __future__ import annotations

import grp
import multiprocessing as mp
import os
import secrets
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest
import zmq

import tensorbroker as tb
from tensorbroker.common import host
from tensorbroker.common.protocol import PROTOCOL_VERSION, decode, encode

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="makes users: needs root")

FORKSERVER = mp.get_context("forkserver")
SHM = "/dev/shm"


def hello(address: str, token: str | None = None) -> dict[str, Any]:
    """Say hello on a raw DEALER as this process (the session lives until it exits)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        pid = os.getpid()
        sock.send(encode({
            "op": "hello", "id": 1, "version": PROTOCOL_VERSION,
            "session": token or secrets.token_hex(16),
            "pid": pid, "boot_id": host.boot_id(), "start_time": host.start_time(pid),
        }))  # fmt: skip
        assert sock.poll(10_000), "no answer to hello"
        reply: dict[str, Any] = decode(sock.recv())
        return reply
    finally:
        sock.close(linger=0)
        ctx.term()


def opens(path: str) -> dict[str, str]:
    """How opening `path` read-write and read-only goes: "ok" or the error's name."""
    out = {}
    for how, flags in (("rw", os.O_RDWR), ("ro", os.O_RDONLY)):
        try:
            os.close(os.open(path, flags))
            out[how] = "ok"
        except OSError as exc:
            out[how] = type(exc).__name__
    return out


def _as_user(uid: int, gid: int, address: str, job: Callable[..., Any], args: tuple[Any, ...],
             conn: Connection) -> None:  # fmt: skip
    """Run `job(address, conn, *args)` as user `uid` (group `gid`) and send what it returns.
    It drops root only after one connection as root, which loads every module it needs."""
    with tb.connect(address) as c:
        c.exists("-")
    os.setgroups([gid])
    os.setgid(gid)
    os.setuid(uid)
    try:
        conn.send(("ok", job(address, conn, *args)))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def start_as(uid: int, gid: int, address: str, job: Callable[..., Any], *args: Any,
             ) -> tuple[Any, Connection]:  # fmt: skip
    parent, child = FORKSERVER.Pipe()
    p = FORKSERVER.Process(target=_as_user, args=(uid, gid, address, job, args, child))
    p.start()
    return p, parent


def result(p: Any, conn: Connection) -> Any:
    try:
        assert conn.poll(60), "the client process said nothing"
        state, said = conn.recv()
    finally:
        p.join(30)
    assert p.exitcode == 0
    assert state == "ok", said
    return said


# -- the jobs, each run as a member ----------------------------------------------------------


def holder(address: str, conn: Connection, token: str) -> None:
    """Say hello as session `token`, tell the parent what was given and how opening its
    segments goes, and keep the session (this process) until told."""
    reply = hello(address, token)
    own = {k: opens(os.path.join(SHM, reply[k][0])) for k in ("slots", "mailboxes") if k in reply}
    conn.send((reply, own))
    conn.recv()  # "done"


def intruder(address: str, conn: Connection, other: dict[str, Any], token: str) -> Any:
    """Try to open another member's slots and mailboxes, and to say hello as its session."""
    mine = hello(address)
    return {
        "theirs": {k: opens(os.path.join(SHM, other[k][0])) for k in ("slots", "mailboxes")},
        "mine": {k: mine[k][0] for k in ("slots", "mailboxes")},
        "as them": hello(address, token),
    }


def reader(address: str, conn: Connection) -> list[int]:
    """Get a key (read through its own lease slots) and take two queue items."""
    with tb.connect(address, timeout=5.0) as c:
        got = [int(c.get("root's").numpy()[0])]
        q = c.queue("to members")
        got += [int(q.get(timeout=30).numpy()[0]) for _ in range(2)]
        return got


# -- the tests ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def members() -> Iterator[tuple[int, int, int]]:
    """A group of our own and two users in it: (gid, member a, member b)."""
    import pwd

    tag = secrets.token_hex(3)
    group, names = f"tbg{tag}", [f"tba{tag}", f"tbb{tag}"]
    subprocess.run(["groupadd", group], check=True)
    try:
        for name in names:
            subprocess.run(["useradd", "-M", "-N", "-s", "/usr/sbin/nologin", "-G", group, name],
                           check=True)  # fmt: skip
        a, b = (pwd.getpwnam(n).pw_uid for n in names)
        yield grp.getgrnam(group).gr_gid, a, b
    finally:
        for name in names:
            subprocess.run(["userdel", name], capture_output=True)
        subprocess.run(["groupdel", group], capture_output=True)


def test_a_member_cannot_open_another_members_lease_slots_or_mailboxes(
    members: tuple[int, int, int], group_address: str
) -> None:
    gid, a, b = members
    token = secrets.token_hex(16)
    with tb.start_broker("16MiB", address=group_address, options=["--group", str(gid)]) as broker:
        proc, conn = start_as(a, gid, broker.address, holder, token)
        try:
            assert conn.poll(60), "member a said nothing"
            theirs, own = conn.recv()
            assert theirs["ok"], theirs
            assert own == {"slots": {"rw": "ok", "ro": "ok"},
                           "mailboxes": {"rw": "ok", "ro": "ok"}}  # fmt: skip
            for k in ("slots", "mailboxes"):  # the broker's, with one ACL entry: a's
                path = os.path.join(SHM, theirs[k][0])
                assert os.stat(path).st_uid == 0 and os.stat(path).st_gid != gid, k
                acl = os.getxattr(path, "system.posix_acl_access")
                assert a.to_bytes(4, "little") in acl and b.to_bytes(4, "little") not in acl
            # Member b, while a's session lives: a's segments are closed to it (EACCES), its
            # own are others, and a's session token is refused from it.
            b_proc, b_conn = start_as(b, gid, broker.address, intruder, theirs, token)
            tried = result(b_proc, b_conn)
        finally:
            conn.send("done")
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(30)
        assert proc.exitcode == 0
        denied = {"rw": "PermissionError", "ro": "PermissionError"}
        assert tried["theirs"] == {"slots": denied, "mailboxes": denied}, tried
        assert tried["mine"]["slots"] != theirs["slots"][0]
        assert tried["mine"]["mailboxes"] != theirs["mailboxes"][0]
        refused = tried["as them"]
        assert not refused["ok"] and "belongs to uid" in refused["error"], refused

        # The broker's own user has a table of its own: 0600, no member's.
        mine = hello(broker.address)
        path = os.path.join(SHM, mine["slots"][0])
        assert mine["slots"][0] not in (theirs["slots"][0], tried["mine"]["slots"])
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_members_read_directly_and_queue_items_cross_users_through_the_broker(
    members: tuple[int, int, int], group_address: str
) -> None:
    gid, a, _ = members
    with (
        tb.start_broker("16MiB", address=group_address, options=["--group", str(gid)]) as broker,
        tb.connect(broker.address) as c,
    ):
        c.put("root's", np.array([7], dtype=np.int64))
        q = c.queue("to members")
        q.put(np.array([1], dtype=np.int64))  # this client is the queue's last producer
        proc, conn = start_as(a, gid, broker.address, reader)
        try:
            # The member takes item 1 and waits for item 2: no grant is offered to this
            # producer of another user (neither maps the other's mailboxes), so the item goes
            # through the broker.
            deadline = time.monotonic() + 30
            while not (len(q) == 0 and c.stats()["waiters"] == 1):
                assert time.monotonic() < deadline, "the member's get never waited"
                time.sleep(0.01)
            assert c.stats()["direct_offered"] == 0
            q.put(np.array([2], dtype=np.int64))
            assert result(proc, conn) == [7, 1, 2]
            assert c.stats()["direct_handoffs"] == 0
        finally:
            if proc.is_alive():  # a failure above: the member's user can only go without it
                proc.kill()
                proc.join(30)
