"""Queue rings: a bounded queue's items put and taken in shared memory, the broker off the path.

Note [queue ring]
~~~~~~~~~~~~~~~~~
Through the broker every item of a queue costs a put and a get, each a trip through the
broker's Python: on the 2-core VM a stream of 4 KiB items ran at 4-5k items/s, and a
ping-pong handoff took 150-210 us, against multiprocessing.Queue's 30k items/s and 50-80 us.
So a bounded ordinary queue has a ring in shared memory, and its producers and consumers go
through it with atomics alone (a prototype: 300k items/s, 13 us a handoff):

    segment (the broker's, one per queue, journaled; clients map it read-write):
      header (HEADER bytes): magic; bell (u32 futex: consumers sleep on it); tail; head;
        pbell (u32 futex at 32: producers sleep on it); csleep, psleep (sleepers); slots;
        data (bytes of one slot's data); entries; from 1024 and 1280, each owner's
        consumers and producers asleep (a byte per owner)
      entry e (ENTRY bytes, 2 x slots of them): word; pos << 20 | the slot its item is in
        (or SKIP)
      slot i (META bytes): word; flags | taillen << 8; its position; tail[taillen] from 32
      data of slot i (`data` bytes, page aligned)

    entry word: pos << 10 | owner << 2 | FREE/WRITING/READY/TAKEN: entry pos % entries is
      FREE(pos) when position pos may be claimed in it. An item's version (its place in
      the stream) is its position + 1.
    slot word: owner << 2 | FREE/WRITING/QUEUED/HELD (QUEUED keeps its producer, HELD its
      consumer). `maxsize` slots: the items in flight.
    tail word: pos << 2 | CLOSED | REMOVED: the next position to claim, and the end.

    producer: take a FREE slot (CAS -> WRITING(me)); copy the item into its data and write
              its tail (as a mailbox body's, common/mailbox.py); claim the position at the
              tail t (CAS its entry FREE(t) -> WRITING(t, me), then CAS tail t -> t + 1;
              anyone who sees the claim helps move the tail); name the slot in the entry;
              slot QUEUED, entry READY(t): published. No free slot: the queue is full, sleep
              on pbell.
    consumer: at head h, CAS READY(h) -> TAKEN(h, me); slot HELD(me); build the item;
              then commit: entry FREE(h + entries), CAS head h -> h + 1 (helped once the
              entry is free). Its Tensors read the slot's data (zero copy); letting go of
              them frees the slot. Not READY(h): empty, or TAKEN(h): being taken, sleep on
              bell; head at a closed tail: QueueClosed. A get that does not return (a
              signal, Note [shielded steps] in client/shield.py, or its process killed: the
              broker does it) gives the item back: slot QUEUED, entry READY(h), the head
              never having passed it, so it keeps its place.

A CAS on the entry decides who claims and who takes each position, so each item goes to one
consumer, in the order of the positions, and a producer's items keep their order (it claims
them in turn). An item held keeps its slot only, never a position: a consumer that keeps an
item while it waits for the next one holds up nothing but that item's share of `maxsize`.
At most `maxsize` items are untaken, so the entry of a position `entries` back was taken
already (at worst it is being freed: the producer waits for that as for a slot). A sleeper
counts itself in csleep/psleep, reads again, then sleeps on the bell it read before; a waker
stores, fences, and rings a bell only if someone sleeps: no system call while both sides
keep up.

Owners are the broker's numbers for the clients of the queue (1..MEMBERS-1; 0: nobody).
When a client dies the broker finds what it had: a slot it was writing is freed (and its
claimed entry published as SKIP: consumers pass over it), what it had taken or held is let
go. An item the ring cannot describe (on a GPU, larger than a slot's data, a bundle whose
tail does not fit, one written with `create`) is put through the broker as before, naming
the position its producer claimed (its slot, flagged ASK, holds its share of `maxsize`);
the broker publishes it once its journal has it, and the consumer that takes it asks the
broker for it, committing the take once it has the item (a get that fails first gives it
back: the broker takes back its lease). Its slot is freed with the item.

A ring's queue is closed by setting CLOSED in the tail word: no claim gets past it, and
consumers drain to it. The segment outlives a broker that dies: with --state-dir the next
one maps it again, with its owners, and clients go on; items put meanwhile stay.
"""

from __future__ import annotations

import ctypes

from . import _shm
from .qring_sleep import Sleeping

MAGIC = 0x33474E4952515400  # "TQRING3"
HEADER = 4096
ENTRY = 16
META = 256
META_TAIL = META - 32  # the longest tail a slot holds
PAGE = 4096
MEMBERS = 256  # owners 1..255

# header words (a bell word is at its address + 8: _shm.bell, bell_wait, ring_wake); the
# sleepers' words are qring_sleep.py's
Q_MAGIC, Q_TAIL, Q_HEAD, Q_SLOTS, Q_DATA, Q_ENTRIES = 0, 16, 24, 56, 64, 72
FREE, WRITING, READY, TAKEN = 0, 1, 2, 3  # an entry's
QUEUED, HELD = 2, 3  # a slot's (FREE, WRITING as an entry's)
INLINE, ASK = 1, 2  # a slot's flags
SKIP = 1 << 16  # in an entry's second word (position << 20 | slot): pass over it
NAMED = (1 << 20) - 1  # that word's slot and SKIP
CLOSED, REMOVED = 1, 2  # the tail word's low bits
FULL = -3  # no slot (or entry) free


def state(pos: int, owner: int, st: int) -> int:
    return pos << 10 | owner << 2 | st


def metas_offset(slots: int) -> int:
    return HEADER + 2 * slots * ENTRY


def data_offset(slots: int) -> int:
    return -(-(metas_offset(slots) + slots * META) // PAGE) * PAGE


def ring_bytes(slots: int, data: int) -> int:
    """Bytes of a ring of `slots` slots of `data` bytes each."""
    return data_offset(slots) + slots * data


def slot_data(maxsize: int, budget: int, largest: int) -> int:
    """Bytes of data per slot for a queue of `maxsize`: `largest` at most, down to a page so
    that the ring stays within `budget`."""
    per = max(PAGE, min(largest, budget // max(maxsize, 1)))
    return per // PAGE * PAGE


class QueueRingView(Sleeping):
    """A mapped queue ring (`addr`): the atomics of Note [queue ring], for clients and the
    broker alike."""

    __slots__ = ("addr", "slots", "data", "entries", "metas", "first")

    def __init__(self, addr: int) -> None:
        if _shm.load(addr + Q_MAGIC) != MAGIC:
            raise ValueError("not a tensorbroker queue ring")
        self.addr = addr
        self.slots = int(_shm.load(addr + Q_SLOTS))
        self.data = int(_shm.load(addr + Q_DATA))
        self.entries = 2 * self.slots
        self.metas = addr + metas_offset(self.slots)
        self.first = data_offset(self.slots)

    @staticmethod
    def format(addr: int, slots: int, data: int) -> None:
        """Lay out a new ring (zeroed memory): every entry free for its first position."""
        for e in range(2 * slots):
            _shm.store(addr + HEADER + e * ENTRY, state(e, 0, FREE))
        _shm.store(addr + Q_SLOTS, slots)
        _shm.store(addr + Q_DATA, data)
        _shm.store(addr + Q_MAGIC, MAGIC)

    def entry(self, pos: int) -> int:
        return self.addr + HEADER + (pos % self.entries) * ENTRY

    def meta(self, slot: int) -> int:
        return self.metas + slot * META

    def offset(self, slot: int) -> int:
        """The offset in the segment of slot `slot`'s data."""
        return self.first + slot * self.data

    # -- producers --------------------------------------------------------------------------

    def alloc(self, owner: int) -> int:
        """A free slot, now WRITING by `owner`; FULL if none is; -CLOSED / -REMOVED."""
        load, cas, metas, mine = _shm.load, _shm.cas, self.metas, owner << 2 | WRITING
        t = load(self.addr + Q_TAIL)
        if t & 3:
            return -(t & 3)
        for slot in range(self.slots):
            at = metas + slot * META
            if load(at) == FREE and cas(at, FREE, mine):
                return slot
        return FULL

    def unalloc(self, slot: int, owner: int) -> None:
        """A slot `owner` took for a put that did not happen."""
        if _shm.cas(self.meta(slot), owner << 2 | WRITING, FREE):
            self.wake_producers()

    def claim(self, owner: int) -> int:
        """The position at the tail for `owner` (its entry WRITING), FULL (its entry is
        still being freed), or -CLOSED / -REMOVED."""
        addr, load, cas = self.addr, _shm.load, _shm.cas
        while True:
            t = load(addr + Q_TAIL)
            if t & 3:
                return -(t & 3)
            pos = t >> 2
            entry = self.entry(pos)
            w = load(entry)
            if w == state(pos, 0, FREE):
                if not cas(entry, w, state(pos, owner, WRITING)):
                    continue
                if cas(addr + Q_TAIL, t, t + 4):
                    return pos
                t = load(addr + Q_TAIL)
                if t >> 2 != pos:
                    return pos  # another claimant moved the tail on for this claim
                _shm.store(entry, w)  # the queue ended at this position: not claimed
                self.wake_consumers()
                return -(t & 3)
            if w >> 10 == pos:  # claimed, the tail not moved on yet
                cas(addr + Q_TAIL, t, t + 4)
                continue
            if w >> 10 > pos:  # position pos was taken already: the tail is behind
                cas(addr + Q_TAIL, t, t + 4)
                continue
            return FULL  # the position a lap back is being taken

    def name(self, pos: int, slot: int, flags: int, tail: bytes) -> None:
        """Say what position `pos` (claimed) holds: slot `slot`, with `flags` and `tail`."""
        meta = self.meta(slot)
        _shm.store(meta + 8, flags | len(tail) << 8)
        _shm.store(meta + 16, pos)
        if tail:
            _shm.copy_in(meta + 32, tail)
        _shm.store(self.entry(pos) + 8, pos << 20 | slot)

    def publish(self, pos: int, slot: int, owner: int) -> None:
        """Position `pos`, named by `owner`, is written: consumers may take it."""
        _shm.store(self.meta(slot), owner << 2 | QUEUED)
        _shm.store(self.entry(pos), state(pos, 0, READY))
        self.wake_consumers()

    # -- consumers ---------------------------------------------------------------------------

    def take(self, owner: int) -> tuple[int, int, int, bytes] | int | None:
        """The item at the head, taken by `owner`: (position, slot, flags, tail), its entry
        TAKEN and its slot HELD until the taker `commit`s it (the head moves on) or gives it
        `back`: no other consumer passes it meanwhile, so an item whose get did not return
        keeps its place. None if there is none yet (or another consumer is taking the
        head); -CLOSED once the head is at a closed end, -REMOVED once removed."""
        addr, load, cas, entries = self.addr, _shm.load, _shm.cas, self.entries
        while True:
            if load(addr + Q_TAIL) & REMOVED:
                return -REMOVED
            h = load(addr + Q_HEAD)
            entry = self.entry(h)
            w = load(entry)
            if w == state(h, 0, READY):
                if not cas(entry, w, state(h, owner, TAKEN)):
                    continue
                slot = load(entry + 8) & NAMED
                if slot & SKIP:  # passed over
                    self._taken(entry, h)
                    continue
                meta = self.meta(slot)
                _shm.store(meta, owner << 2 | HELD)
                word = load(meta + 8)
                return h, slot, word & 0xFF, ctypes.string_at(meta + 32, word >> 8)
            pos = w >> 10
            if pos >= h + entries:  # taken and committed: move the head on
                cas(addr + Q_HEAD, h, h + 1)
                continue
            if pos > h:  # the head read is behind already
                continue
            t = load(addr + Q_TAIL)
            if t & REMOVED:
                return -REMOVED
            if t & CLOSED and t >> 2 == h:
                return -CLOSED
            return None  # empty, or being taken

    def head(self) -> int:
        """The position of the next item to take."""
        return int(_shm.load(self.addr + Q_HEAD))

    def commit(self, pos: int) -> None:
        """The item taken at `pos` is its taker's: the head moves on."""
        self._taken(self.entry(pos), pos)

    def back(self, pos: int, slot: int, owner: int) -> None:
        """The item `owner` took at `pos` (in `slot`) goes back, first in the queue again."""
        _shm.cas(self.meta(slot), owner << 2 | HELD, QUEUED)
        _shm.store(self.entry(pos), state(pos, 0, READY))
        self.wake_consumers()

    def _taken(self, entry: int, pos: int) -> None:
        """The entry of `pos` is read: free for the position a lap on."""
        _shm.store(entry, state(pos + self.entries, 0, FREE))
        _shm.cas(self.addr + Q_HEAD, pos, pos + 1)
        self.wake_producers()
        self.wake_consumers()  # (those that found the head being taken)

    def release(self, slot: int, owner: int) -> bool:
        """`owner` lets go of the item in `slot`: the slot is free."""
        if not _shm.cas(self.meta(slot), owner << 2 | HELD, FREE):
            return False
        self.wake_producers()
        return True

    def ready(self, producer: bool) -> bool:
        """Whether a put (`producer`) or a take might not wait now (or the queue ended)."""
        t = _shm.load(self.addr + Q_TAIL)
        if t & REMOVED or (t & CLOSED and (producer or _shm.load(self.addr + Q_HEAD) >= t >> 2)):
            return True
        if producer:
            pos = t >> 2
            free = any(_shm.load(self.meta(i)) == FREE for i in range(self.slots))
            return free and _shm.load(self.entry(pos)) >> 10 >= pos
        h = _shm.load(self.addr + Q_HEAD)
        w = _shm.load(self.entry(h))
        return bool((w >> 10 == h and w & 3 == READY) or w >> 10 >= h + self.entries)

    # -- what the slots and entries hold ----------------------------------------------------

    def entry_word(self, pos: int) -> tuple[int, int, int, int]:
        """The entry of `pos`: (position, owner, state, slot), the slot its claimant named for
        that position (with SKIP), or NAMED if none is named yet."""
        entry = self.entry(pos)
        w, named = _shm.load(entry), _shm.load(entry + 8)
        slot = named & NAMED if named >> 20 == w >> 10 else NAMED
        return w >> 10, (w >> 2) & 0xFF, w & 3, slot

    def slot_word(self, slot: int) -> tuple[int, int, int, int]:
        """Slot `slot`: (owner, state, flags, position named)."""
        meta = self.meta(slot)
        w = _shm.load(meta)
        return (w >> 2) & 0xFF, w & 3, _shm.load(meta + 8) & 0xFF, _shm.load(meta + 16)

    def entry_words(self) -> list[tuple[int, int, int, int]]:
        return [self.entry_word(e) for e in range(self.entries)]

    def slot_words(self) -> list[tuple[int, int, int, int]]:
        return [self.slot_word(i) for i in range(self.slots)]

    def counts(self) -> tuple[int, int]:
        """(items waiting to be taken, items in flight)."""
        ready = sum(
            st == READY and not slot & SKIP for _pos, _o, st, slot in self.entry_words()
        )  # fmt: skip
        busy = sum(st != FREE for _o, st, _f, _p in self.slot_words())
        return ready, busy

    def skip(self, pos: int, owner: int | None) -> bool:
        """Publish the entry `owner` (None: whoever) claimed, and gave up or died, as one to
        pass over; at the head, it is passed over at once."""
        entry = self.entry(pos)
        w = _shm.load(entry)
        if w >> 10 != pos or w & 3 != WRITING or owner not in (None, (w >> 2) & 0xFF):
            return False
        while True:  # its claimant may have died before it moved the tail on
            t = _shm.load(self.addr + Q_TAIL)
            if t >> 2 != pos or _shm.cas(self.addr + Q_TAIL, t, t + 4 if not t & 3 else t):
                break
        if t >> 2 == pos and t & 3:  # the queue ended at this position: it was never claimed
            _shm.store(entry, state(pos, 0, FREE))
            self.wake_consumers()
            return True
        _shm.store(entry + 8, pos << 20 | SKIP)
        _shm.store(entry, state(pos, 0, READY))
        if _shm.load(self.addr + Q_HEAD) == pos and _shm.cas(
            entry, state(pos, 0, READY), state(pos, 0, TAKEN)
        ):  # taken by no one: passed over as a consumer would
            self._taken(entry, pos)
        self.wake_consumers()
        return True
