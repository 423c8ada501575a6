"""What the clients of one user write and no other user may: lease slots and mailboxes, a
table of each per user under serve --group.

Note [members]
~~~~~~~~~~~~~~
A broker that serves a group opens its sockets, its arena and its broadcast rings to the
group's members read-write (their bytes are written and read in place), so the members trust
each other as one user there: any member can overwrite any object, a put under way or one
another member reads. Two things are per user, because a member who could write another's
would reach past the data into its leases and its calls:

    lease slots   cleared, they let the broker free (and hand on) memory under the arrays
                  of the slots' client; filled, they pin memory
    mailboxes     a forged body answers another client's get with any bytes; an offer
                  names the consumer's session token

So under --group each user that connects gets a slot table and a mailbox table of its own,
created by the broker with mode 0600 and a POSIX ACL entry that lets that one user read and
write it (`share_with_user` in segments.py): the kernel refuses any other member's open with
EACCES. Clients of one user share them (a user can always reach its own processes). A
direct handoff (Note [direct handoff] in common/mailbox.py) goes only between two clients
of one user; between users an item goes through the broker. Without --group every client
is the broker's user: one table of each, as before. Where /dev/shm has no ACLs, a user
other than the broker's gets neither: its gets and queue items go through the broker.

An index across the tables (a session's region, its mailbox) is the table's ordinal times
the entries of a table, plus the index in it. The slot tables are journaled in meta "slots"
(a lone name: one table for everyone) with their users, so a broker that adopts the state
keeps each session's region where its client writes it; mailboxes are new with each broker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from ...common import _shm
from ...common.directory import REGIONS, SLOTS
from ...common.mailbox import IDLE, MAILBOX, word
from ..durability.journal import Journal
from .directory import Mapped, SlotTable

log = logging.getLogger(__name__)

MAILBOXES = 1024  # clients with a mailbox at once (512 KiB); more go through the broker


class MailboxTable(Mapped):
    """The mailboxes, and which are free. A new segment for each broker: a seal sent again to
    one that restarted says itself where its item went."""

    def __init__(
        self, shm_dir: str, prefix: str, journal: Journal, count: int = MAILBOXES,
        group: int | None = None, user: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__(
            shm_dir, prefix, count * MAILBOX, journal, "mailboxes", None, group, user=user
        )
        self._free = list(range(count - 1, -1, -1))

    def at(self, index: int) -> int:
        return self.addr + index * MAILBOX

    def assign(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, index: int) -> None:
        """Its client is gone and no grant on it is out: empty it for the next one."""
        _shm.store(self.at(index), word(0, IDLE))
        _shm.offer_write(self.at(index), 0, 0, 0, 0, 0, 0, 0, b"")
        self._free.append(index)


T = TypeVar("T", SlotTable, MailboxTable)
Key = int | None  # the uid whose table it is; None: everyone's (no --group)


class _PerUser(Generic[T]):
    """Tables of one kind: one per user (`per_user`), else one for everyone. `make(key)`
    creates a table; `per` is how many entries each has."""

    def __init__(self, per_user: bool, per: int, make: Callable[[Key], T]) -> None:
        self.per_user, self.per = per_user, per
        self._make: Callable[[Key], T] = make
        self.tables: list[T] = []
        self.keys: list[Key] = []
        self._ordinal: dict[Key, int] = {}
        self._refused: set[Key] = set()  # users whose table could not be made

    def _add(self, key: Key, table: T) -> int:
        self._ordinal[key] = len(self.tables)
        self.tables.append(table)
        self.keys.append(key)
        self._added()
        return len(self.tables) - 1

    def _added(self) -> None: ...

    def _table_of(self, uid: int | None) -> int | None:
        """The ordinal of the table for a client of `uid` (made now if need be); None if it
        has none (the kernel named no user, or its table could not be made)."""
        if not self.per_user:
            return self._ordinal.get(None)
        if uid is None or uid in self._refused:
            return None
        found = self._ordinal.get(uid)
        if found is not None:
            return found
        try:
            table = self._make(uid)
        except OSError as exc:
            self._refused.add(uid)
            log.warning(
                "cannot make uid %s a shared-memory table of its own (%s): its clients ask "
                "the broker for every get (does the tmpfs support ACLs?)", uid, exc,
            )  # fmt: skip
            return None
        return self._add(uid, table)

    def assign(self, uid: int | None) -> int | None:
        """A free entry (a slot region, all zero; a mailbox) for a client of `uid`, as an
        index across the tables; None if it gets none."""
        i = self._table_of(uid)
        if i is None:
            return None
        local = self.tables[i].assign()
        return None if local is None else i * self.per + local

    def split(self, index: int) -> tuple[T, int]:
        """The table of `index` across the tables, and its index in it."""
        return self.tables[index // self.per], index % self.per

    def together(self, a: int, b: int) -> bool:
        """Whether `a` and `b` are in one table (of one user, or no --group)."""
        return a // self.per == b // self.per

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tables]

    def close(self, unlink: bool = True) -> None:
        for table in self.tables:
            table.close(unlink)


class SlotTables(_PerUser[SlotTable]):
    """The lease-slot tables (server/store/directory.py's SlotTable), as one: a region is an index
    across them. `existing`: meta "slots" of a state adopted (a name, or [uid, name] pairs)."""

    def __init__(
        self, shm_dir: str, prefix: str = "tb-0-", journal: Journal | None = None, *,
        per_user: bool = False, existing: str | list[Any] | None = None,
        regions: int = REGIONS, slots: int = SLOTS,
    ) -> None:  # fmt: skip
        self._journal = journal if journal is not None else Journal()

        def make(key: Key, name: str | None = None) -> SlotTable:
            return SlotTable(shm_dir, prefix, self._journal, regions, slots, name, user=key)

        super().__init__(per_user, regions, make)
        self.slots, self.region_bytes = slots, slots * 8
        found: list[Any] = [[None, existing]] if isinstance(existing, str) else existing or []
        try:
            for key, name in found:
                self._add(key, make(key, str(name)))
            if not per_user and None not in self._ordinal:
                self._add(None, make(None))
        except BaseException:
            self.close(unlink=False)
            raise

    def _added(self) -> None:
        if self.keys == [None]:  # as a broker without --group always wrote it
            self._journal.meta("slots", self.tables[0].name)
        else:
            pairs = zip(self.keys, self.tables, strict=True)
            self._journal.meta("slots", [[key, table.name] for key, table in pairs])

    def release(self, region: int) -> None:
        table, local = self.split(region)
        table.release(local)

    def keep(self, region: int) -> None:
        table, local = self.split(region)
        table.keep(local)

    def clear_free(self) -> None:
        for table in self.tables:
            table.clear_free()

    def where(self, region: int) -> list[Any]:
        """What a client is told of its region: the segment, the offset, the slots."""
        table, local = self.split(region)
        return [table.name, local * table.region_bytes, table.slots]

    def used(self, region: int | None = None) -> set[int]:
        """SlotTable.used, of one region or of every assigned one."""
        if region is not None:
            table, local = self.split(region)
            return table.used(local)
        out: set[int] = set()
        for table in self.tables:
            out |= table.used()
        return out

    def held(self, region: int | None = None) -> dict[int, int]:
        """SlotTable.held, of one region or of every assigned one."""
        if region is not None:
            table, local = self.split(region)
            return table.held(local)
        if len(self.tables) == 1:
            return self.tables[0].held()
        out: dict[int, int] = {}
        for table in self.tables:
            for oid, n in table.held().items():
                out[oid] = out.get(oid, 0) + n
        return out


class MailboxTables(_PerUser[MailboxTable]):
    """The mailbox tables (MailboxTable above), as one: a mailbox is an index
    across them."""

    def __init__(
        self, shm_dir: str, prefix: str, journal: Journal, *, per_user: bool = False,
        count: int = MAILBOXES,
    ) -> None:  # fmt: skip
        def make(key: Key) -> MailboxTable:
            return MailboxTable(shm_dir, prefix, journal, count, user=key)

        super().__init__(per_user, count, make)
        if not per_user:
            self._add(None, make(None))

    def at(self, index: int) -> int:
        table, local = self.split(index)
        return table.at(local)

    def local(self, index: int) -> int:
        """Its index in its table: what an offer names (the producer maps that table)."""
        return index % self.per

    def release(self, index: int) -> None:
        table, local = self.split(index)
        table.release(local)

    def where(self, index: int) -> list[Any]:
        """What a client is told of its mailbox: the segment, its size, the index in it."""
        table, local = self.split(index)
        return [table.name, table.size, local]
