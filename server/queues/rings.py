"""The broker's side of Note [broadcast ring] (common/ring.py): a broadcast queue's ring, the
bits of the subscriptions it serves, and the items its slots hold."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from ...common import _shm
from ...common.mailbox import body_tail
from ...common.ring import (
    ASK,
    BITS,
    MAGIC,
    R_END,
    R_MAGIC,
    R_MEMBERS,
    R_SLOTS,
    R_TOP,
    R_WHY,
    TAIL,
    ring_size,
    slot_seq,
)
from ..durability.journal import Journal
from ..store.directory import Mapped

MAX_SLOTS = 4096  # a queue bounded higher reads through messages (a ring of 2 MiB at most)


@dataclass(eq=False, slots=True)
class Posted:
    """An item for a slot: its version, the subscriptions to take it (a bit each), and the
    item itself, held by the ring (None for an ASK slot: asked for through the broker)."""

    version: int
    unread: int
    item: Any
    tail: bytes
    index: int = -1  # its slot
    written: bool = False  # in its slot (after the journal's commit)


@dataclass(slots=True)
class End:
    """No item after `version` will come: the stream was closed or removed (`why`)."""

    why: int
    version: int


@dataclass(slots=True)
class Leave:
    """A subscription ended: its bit leaves `members` and the slots' unread sets (and their
    held sets too, `held`, if its process is gone)."""

    unread: int
    held: int


class Ring(Mapped):
    """A broadcast queue's ring. Slot writes wait for the journal's commit (`flush`): a
    subscriber must never take an item that a broker coming back would not know."""

    def __init__(
        self, shm_dir: str, prefix: str, journal: Journal, slots: int,
        group: int | None = None, existing: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__(shm_dir, prefix, ring_size(slots), journal, "ring", existing, group)
        if existing is None:
            _shm.store(self.addr + R_SLOTS, slots)
            _shm.store(self.addr + R_MAGIC, MAGIC)
        elif _shm.load(self.addr + R_MAGIC) != MAGIC:
            raise ValueError(f"{existing} is not a tensorbroker ring")
        self.slots = _shm.load(self.addr + R_SLOTS)
        self.bits: dict[int, int] = {}  # subscription -> its bit
        self.starts: dict[int, int] = {}  # subscription -> the first version it takes
        self.parted: dict[int, Any] = {}  # bit -> the session of an ended subscription whose
        # items it still holds (cleared once its process is gone)
        self.posted: dict[int, Posted] = {}  # slot -> what is in it (or is to be, `staged`)
        self.where: dict[int, int] = {}  # version -> its slot
        self.waiting: deque[Posted] = deque()  # for slots not free yet, in order
        self.staged: list[Posted | End | Leave] = []  # writes that wait for the commit
        self._leaving = 0  # bits of subscriptions ended, listed in `members` until the commit
        self._next_bit = 0
        self.queue_id = 0  # its queue's

    @property
    def members(self) -> int:
        mask = 0
        for bit in self.bits.values():
            mask |= 1 << bit
        return mask

    # -- subscriptions ---------------------------------------------------------------------

    def join(self, sub: int, start: int) -> int | None:
        """A bit for subscription `sub`; None if none is free (it reads through messages).
        A bit is given again only once no slot has it, round robin, and not while the
        process of a subscription that had it lives (a thread of its may still be taking a
        slot with it: `parted`, until `session_gone`)."""
        taken = self.members | self._leaving | self.marked()
        for i in range(BITS):
            bit = (self._next_bit + i) % BITS
            if not taken >> bit & 1 and bit not in self.parted:
                self._next_bit = bit + 1
                self.bits[sub], self.starts[sub] = bit, start
                self._list_members()  # before the reply that names the bit
                return bit
        return None

    def leave(self, sub: int, session: Any, gone: bool) -> None:
        """Subscription `sub` ended: its bit leaves every slot it had not taken yet (and the
        ones it holds too if its process is `gone`, else they stay until it is). Like the
        slot writes, this waits for the journal's commit (`flush`, which finds the slots it
        left idle): a broker that dies before it comes back with the subscription as the
        journal has it, its bit still set everywhere; and the end of a removed queue,
        staged before its subscriptions leave, is written before them."""
        bit = self.bits.pop(sub)
        self.starts.pop(sub, None)
        if not gone:
            self.parted[bit] = session
        mask = 1 << bit
        for p in self.waiting:  # not written yet: no subscriber can see these
            p.unread &= ~mask
        for p in self.posted.values():
            if not p.written:
                p.unread &= ~mask
        self._leaving |= mask
        self.staged.append(Leave(mask, mask if gone else 0))

    def _list_members(self) -> None:
        """`members` in the header: the subscriptions served, and those whose end is not
        written yet."""
        _shm.store(self.addr + R_MEMBERS, self.members | self._leaving)

    def session_gone(self, session: Any) -> list[int]:
        """The process of `session` is gone: what its ended subscriptions held is let go."""
        mask = 0
        for bit in [b for b, s in self.parted.items() if s is session]:
            del self.parted[bit]
            mask |= 1 << bit
        return self._clear(0, mask) if mask else []

    def forget(self, bits: int) -> list[int]:
        """Subscriptions that did not come back with their clients after a restart: their
        bits leave every slot. The versions of the slots left idle (or idle already)."""
        self._clear(bits, bits)
        return self.idle()

    def _clear(self, unread: int, held: int) -> list[int]:
        idle = []
        for index, p in self.posted.items():
            if not p.written:
                p.unread &= ~unread
            elif _shm.ring_release(self.addr, index, p.version, unread, held):
                idle.append(p.version)
        for p in self.waiting:
            p.unread &= ~unread
        return idle

    def marked(self, held: bool = False) -> int:
        """The bits set in any slot (`held`: as held only)."""
        mask = 0
        for index, p in self.posted.items():
            if p.written:
                seq = slot_seq(self.addr, index)
                mask |= _shm.load(seq + 16) | (0 if held else _shm.load(seq + 8))
            elif not held:
                mask |= p.unread
        for p in [] if held else self.waiting:
            mask |= p.unread
        return mask

    # -- items -----------------------------------------------------------------------------

    def held_items(self, mask: int) -> list[int]:
        """The oids of the items held in slots by any of the bits of `mask`."""
        out = []
        for index, p in self.posted.items():
            if p.written and p.item is not None:
                if _shm.load(slot_seq(self.addr, index) + 16) & mask:
                    out.append(p.item.oid)
        return out

    def tail(self, obj: Any) -> bytes | None:
        """The slot tail that describes item `obj`; None if a slot cannot (ask for it)."""
        if obj.device != "cpu" or not obj.wire:
            return None
        base, segment = obj.block.offset, obj.block.segment
        template = [(w[0], w[1], w[2], w[3], w[5] - base) for w in obj.wire]
        tail = body_tail(obj.key, obj.bundle, segment, template)
        return tail if len(tail) <= TAIL else None

    def post(self, version: int, unread: int, item: Any, tail: bytes) -> None:
        """Put an item in a free slot once the journal has it (or once a slot is free: an
        item kept long by a subscriber keeps its slot, not the stream)."""
        p = Posted(version, unread, item, tail)
        if self.waiting or not self._place(p):
            self.waiting.append(p)

    def _place(self, p: Posted) -> bool:
        index = p.version % self.slots  # where a subscriber looks first
        if index in self.posted:
            free = [i for i in range(self.slots) if i not in self.posted]
            if not free:
                return False
            index = free[0]
        p.index = index
        self.posted[index] = p
        self.where[p.version] = index
        self.staged.append(p)
        return True

    def end(self, why: int, version: int) -> None:
        """No item after `version` will come (`why`: CLOSED or REMOVED)."""
        self.staged.append(End(why, version))

    def flush(self) -> list[int]:
        """Write what waited for the commit, then wake every subscriber once. The versions
        written with no subscription left to take them (idle at once)."""
        staged, self.staged = self.staged, []
        idle = []
        for p in staged:
            if isinstance(p, End):
                _shm.store(self.addr + R_WHY, p.why)
                _shm.store(self.addr + R_END, p.version + 1)
                continue
            if isinstance(p, Leave):  # `members` first: its get waiting ends (the wake below)
                self._leaving &= ~p.unread
                self._list_members()
                idle += [v for v in self._clear(p.unread, p.held) if v not in idle]
                continue
            item = p.item
            flags, oid, base = (ASK, 0, 0) if item is None else (0, item.oid, item.block.offset)
            _shm.ring_publish(
                self.addr, p.index, p.version, p.unread, flags, oid, 0, base, p.tail
            )  # fmt: skip
            _shm.store(self.addr + R_TOP, p.version)
            p.written = True
            if not p.unread and p.version not in idle:
                idle.append(p.version)
        if staged:
            _shm.ring_wake(self.addr)
        return idle

    def done(self, version: int) -> Posted | None:
        """A subscriber found the slot of `version` idle: empty it. What it held (None if
        it is not idle, or holds another version by now)."""
        index = self.where.get(version)
        p = None if index is None else self.posted[index]
        if p is None or not p.written or not _shm.ring_idle(self.addr, p.index):
            return None
        _shm.store(slot_seq(self.addr, p.index), 0)
        del self.posted[p.index], self.where[version]
        while self.waiting and self._place(self.waiting[0]):
            self.waiting.popleft()
        return p

    def idle(self) -> list[int]:
        """The versions whose slots are idle (their "done" not come yet, or lost)."""
        return [
            p.version for index, p in self.posted.items()
            if p.written and _shm.ring_idle(self.addr, index)
        ]  # fmt: skip

    def mask_for(self, version: int) -> int:
        """The bits of the subscriptions that take item `version`."""
        mask = 0
        for sub, bit in self.bits.items():
            if self.starts.get(sub, 0) <= version:
                mask |= 1 << bit
        return mask

    @property
    def top(self) -> int:
        """The last version written to a slot."""
        return _shm.load(self.addr + R_TOP)

    def adopt(self, items: dict[int, Any]) -> list[Posted]:
        """The slots a broker that died left: those still taken or held are posted again
        (their items, `items` by oid, held by the ring again); idle ones are emptied. The
        ones kept. `top` becomes the last version found written (it is stored after the
        slot: a broker may have died between the two)."""
        kept = []
        top = self.top
        for index in range(self.slots):
            seq = slot_seq(self.addr, index)
            version = _shm.load(seq)
            if not version:
                continue
            top = max(top, version)
            if _shm.ring_idle(self.addr, index):
                _shm.store(seq, 0)
                continue
            flags = _shm.load(seq + 24) & 0xFFFFFFFF
            item = None if flags & ASK else items.get(_shm.load(seq + 32))
            if item is None and not flags & ASK:  # freed: nothing of it is left to read
                _shm.store(seq, 0)
                continue
            self.posted[index] = p = Posted(version, 0, item, b"", index, written=True)
            self.where[version] = index
            kept.append(p)
        _shm.store(self.addr + R_TOP, top)
        self._list_members()  # as the journal has them (not a join it never got)
        return kept

    def unlisted(self) -> list[int]:
        """Adopted subscriptions whose bits `members` does not list: the broker that died
        wrote their leaves and died before its commit (a broker before leaves waited for
        the commit), so some slots may have lost their bits too: they ended."""
        shown = _shm.load(self.addr + R_MEMBERS)
        return [sub for sub, bit in self.bits.items() if not shown >> bit & 1]

    def describe(self) -> list[Any]:
        """What a subscriber needs to map it: [segment, bytes, slots]."""
        return [self.name, self.size, self.slots]
