"""serve --group (issue 14): the members of a group connect and map the memory, each session
attributed to the kernel's uid of its process; a user outside the group is refused with a
clear error. The tests run as root, and make a group and two users of their own."""

from __future__ import annotations

import grp
import multiprocessing as mp
import os
import secrets
import stat
import subprocess
from collections.abc import Iterator
from multiprocessing.connection import Connection

import numpy as np
import pytest

import tensorbroker as tb

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="makes users: needs root")

FORKSERVER = mp.get_context("forkserver")


def _client_as(uid: int, gid: int | None, address: str, conn: Connection) -> None:
    """A client of `address` running as user `uid` (and group `gid`): it reads root's array,
    puts one of its own, and sends what happened. It drops root only after one connection as
    root, which loads every module it needs (the interpreter's own files may not be readable
    by that user)."""
    with tb.connect(address) as c:
        c.exists("root's")
    os.setgroups([gid] if gid is not None else [])
    os.setgid(gid if gid is not None else 65534)
    os.setuid(uid)
    try:
        with tb.connect(address, timeout=2.0) as c:
            mine = c.get("root's").numpy().copy()
            c.put("member's", mine * 2)
            conn.send(("ok", c.stats()["clients_by_uid"]))
    except tb.BrokerUnavailable as exc:
        conn.send(("refused", str(exc)))


def run_as(uid: int, gid: int | None, address: str) -> tuple[str, object]:
    parent, child = FORKSERVER.Pipe()
    p = FORKSERVER.Process(target=_client_as, args=(uid, gid, address, child))
    p.start()
    try:
        assert parent.poll(60), "the client process said nothing"
        result: tuple[str, object] = parent.recv()
    finally:
        p.join(30)
    assert p.exitcode == 0
    return result


@pytest.fixture(scope="module")
def users() -> Iterator[tuple[str, int, int]]:
    """A group of our own, a user in it and one outside it: (group, member, outsider)."""
    tag = secrets.token_hex(3)
    group, member, outsider = f"tbg{tag}", f"tbm{tag}", f"tbo{tag}"
    subprocess.run(["groupadd", group], check=True)
    try:
        for name, extra in ((member, ["-G", group]), (outsider, [])):
            subprocess.run(["useradd", "-M", "-N", "-s", "/usr/sbin/nologin", *extra, name],
                           check=True)  # fmt: skip
        yield group, _uid(member), _uid(outsider)
    finally:
        for name in (member, outsider):
            subprocess.run(["userdel", name], capture_output=True)
        subprocess.run(["groupdel", group], capture_output=True)


def _uid(name: str) -> int:
    import pwd

    return pwd.getpwnam(name).pw_uid


def _gid(path: str) -> int | None:
    """The group of `path`; None if it went meanwhile (another worker's segment, unlinked
    between the listing and this look)."""
    try:
        return os.stat(path).st_gid
    except FileNotFoundError:
        return None


def test_a_group_member_connects_and_maps_the_memory_and_others_are_refused(
    users: tuple[str, int, int], group_address: str
) -> None:
    group, member, outsider = users
    gid = grp.getgrnam(group).gr_gid
    with (
        tb.start_broker("16MiB", address=group_address, options=["--group", group]) as b,
        tb.connect(b.address) as c,
    ):
        c.put("root's", np.arange(4, dtype=np.int64))
        path = b.address[len("ipc://") :]
        for shared_path, mode in (
            (os.path.dirname(path), 0o750),
            (path, 0o660),
            (path + ".lane", 0o660),
        ):
            info = os.stat(shared_path)
            assert info.st_gid == gid and stat.S_IMODE(info.st_mode) == mode, shared_path
        segments = [f for f in os.listdir("/dev/shm") if _gid(f"/dev/shm/{f}") == gid]
        assert segments, "no segment was given to the group"

        state, said = run_as(member, gid, b.address)
        assert state == "ok" and said == {"0": 1, str(member): 1}, said  # the kernel's uids
        assert (c.get("member's").numpy() == np.arange(4) * 2).all()

        state, said = run_as(outsider, None, b.address)
        assert state == "refused" and "not open to this user" in str(said), said
        assert "--group" in str(said)
