"""The lease-slot and mailbox tables per user (Note [members] in server/store/members.py): indices
across the tables, what the journal is told, adoption, and a user whose table cannot be
made. Opening as another user is tested with real users in test_group_members.py."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tensorbroker.common import _shm
from tensorbroker.server.durability.journal import Journal
from tensorbroker.server.store import segments
from tensorbroker.server.store.members import MailboxTables, SlotTables


class Meta(Journal):
    def __init__(self) -> None:
        self.meta_said: dict[str, Any] = {}

    def meta(self, name: str, value: Any) -> None:
        self.meta_said[name] = value


@pytest.fixture
def shm_dir(tmp_path: Path) -> str:
    return str(tmp_path)


@pytest.fixture
def made() -> Iterator[list[Any]]:
    tables: list[Any] = []
    yield tables
    for t in tables:
        t.close()


OTHER = os.geteuid() + 4242  # a user that is not this one (nothing needs to exist)


def test_without_group_there_is_one_table_named_as_before(shm_dir: str, made: list[Any]) -> None:
    journal = Meta()
    slots = SlotTables(shm_dir, "tb-t-", journal, regions=4, slots=16)
    made.append(slots)
    assert len(slots.names) == 1 and journal.meta_said["slots"] == slots.names[0]
    regions = [slots.assign(uid) for uid in (None, OTHER, 0)]  # any user: the one table
    assert regions == [0, 1, 2]
    assert slots.where(2) == [slots.names[0], 2 * 16 * 8, 16]
    assert os.stat(os.path.join(shm_dir, slots.names[0])).st_mode & 0o777 == 0o600


def test_each_user_has_a_table_of_its_own(shm_dir: str, made: list[Any]) -> None:
    journal = Meta()
    slots = SlotTables(shm_dir, "tb-t-", journal, per_user=True, regions=4, slots=16)
    mailboxes = MailboxTables(shm_dir, "tb-t-", journal, per_user=True, count=8)
    made += [slots, mailboxes]
    assert slots.names == [] and mailboxes.names == []  # made at a user's first hello
    me, other, mine_too = (
        slots.assign(os.geteuid()),
        slots.assign(OTHER),
        slots.assign(os.geteuid()),
    )
    assert (me, other, mine_too) == (0, 4, 1)
    assert slots.assign(None) is None  # a client the kernel named no user for: none
    mine, theirs = slots.where(me)[0], slots.where(other)[0]
    assert mine != theirs and slots.where(mine_too)[0] == mine
    assert journal.meta_said["slots"] == [[os.geteuid(), mine], [OTHER, theirs]]
    assert os.stat(os.path.join(shm_dir, mine)).st_mode & 0o777 == 0o600  # no ACL: ours
    acl = os.getxattr(os.path.join(shm_dir, theirs), "system.posix_acl_access")
    assert OTHER.to_bytes(4, "little") in acl

    a, b, c = (
        mailboxes.assign(os.geteuid()),
        mailboxes.assign(OTHER),
        mailboxes.assign(os.geteuid()),
    )
    assert (a, b, c) == (0, 8, 1)
    assert a is not None and b is not None and c is not None
    assert mailboxes.together(a, c) and not mailboxes.together(a, b)
    assert mailboxes.local(b) == 0 and mailboxes.where(b)[2] == 0
    assert mailboxes.at(b) == mailboxes.tables[1].addr


def test_an_adopted_state_keeps_each_users_regions(shm_dir: str) -> None:
    journal = Meta()
    slots = SlotTables(shm_dir, "tb-t-", journal, per_user=True, regions=4, slots=16)
    me, other = slots.assign(os.geteuid()), slots.assign(OTHER)
    assert me is not None and other is not None
    _shm.slot_publish(slots.tables[1].addr, 77)  # the other user's client reads object 77
    slots.close(unlink=False)  # the broker dies

    found = journal.meta_said["slots"]
    again = SlotTables(shm_dir, "tb-t-", Meta(), per_user=True, existing=found, regions=4, slots=16)
    try:
        assert again.names == slots.names
        again.keep(me)
        again.keep(other)
        again.clear_free()
        assert again.held(other) == {77: 1} and again.held() == {77: 1}
        assert again.assign(OTHER) == 5  # the next region of that user's table
    finally:
        again.close()

    # A state of a broker without --group (meta "slots": a name) adopted by one with it.
    single = Meta()
    first = SlotTables(shm_dir, "tb-u-", single, regions=4, slots=16)
    assert first.assign(None) == 0
    first.close(unlink=False)
    found = single.meta_said["slots"]
    grouped = SlotTables(
        shm_dir, "tb-u-", Meta(), per_user=True, existing=found, regions=4, slots=16
    )
    try:
        grouped.keep(0)
        assert grouped.assign(OTHER) == 4  # a table of its own, after the adopted one
    finally:
        grouped.close()


def test_a_user_whose_table_cannot_be_made_reads_through_the_broker(
    shm_dir: str, made: list[Any], monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    def no_acls(fd: int, uid: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(segments, "share_with_user", no_acls)
    slots = SlotTables(shm_dir, "tb-t-", Meta(), per_user=True, regions=4, slots=16)
    made.append(slots)
    assert slots.assign(OTHER) is None and slots.assign(OTHER) is None
    assert len([r for r in caplog.records if "cannot make uid" in r.message]) == 1
    assert slots.assign(os.geteuid()) == 0  # the broker's own user needs no ACL
    assert os.listdir(shm_dir) == slots.names  # nothing half made is left
