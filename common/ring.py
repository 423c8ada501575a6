"""Broadcast rings: a broadcast queue's items, read by its subscribers without the broker.

Note [broadcast ring]
~~~~~~~~~~~~~~~~~~~~~
Through messages, each item of a broadcast queue costs the broker one get and one answer per
subscriber: with 4 subscribers, 4 wake-ups and about 40 us of broker CPU each, on the path of
a stream that waits for its slowest reader. So a bounded broadcast queue has a ring in shared
memory, one slot per item in flight (twice maxsize), and each subscription that can map it
has a bit (at most RING_BITS; more read through messages, as do unbounded queues):

    broker, at a seal (once the journal has it): slot[version % slots] = the item (its
            head and tail, as a mailbox body's), `unread` = the bits of the subscriptions;
            seq = version, stored last; bump the bell and wake every subscriber (one call)
    subscriber, at its cursor (the next version): seq == cursor? set its bit in `held`,
            clear it in `unread`: the item is its own until its Tensor goes (`RingLease`),
            which clears `held`. Else sleep on the bell.
    whoever finds both sets empty after clearing its bit tells the broker ("done", a
    one-way message at its next get, or from its release thread): the broker checks the
    slot, empties it and frees the item.

An item in a slot is retired and held by the ring (one lease), so the queue's slot
accounting (Note [queue slots]) and the memory bound are as for any item. An item the ring
cannot describe (a device item, or a tail over RING_TAIL bytes) goes in its slot as
RING_ASK: the subscriber takes the slot, then asks the broker for the item as a message-path
subscriber does. A subscription that ends has its bit cleared from `unread` everywhere (and
from `held` too if its process is gone); its bit is given again only once no slot has it.
The header's `end` says where a closed or removed stream ends, and `members` which bits are
still served, so that a subscriber never sleeps on a stream that is over. A subscription's
end waits for the journal's commit as the slot writes do, and comes after its stream's end
when both are in one batch (a removed queue's): a subscriber reads `members` before `end`,
so it is told the queue was removed, not that its subscription ended.

Recovery: the ring's segment is journaled, and so are the subscriptions' bits and first
versions. A broker that comes back maps the same ring and writes `members` as the journal
has them: subscribers go on at their cursors, and the broker takes back every slot still
held (its item held by the ring again) and frees the rest. Items the journal has that were
never written to the ring (the broker died between its commit and the slot writes: the
header's `top` is the last version written) are posted again, each to the subscriptions that
started before it. A "done" lost with the broker is found then, and by the broker's scan of
the rings producers wait on (`QueueRings.scan`).
"""

from __future__ import annotations

from . import _shm

MAGIC = 0x31474E49_52425400  # "TBRING1"
HEADER = _shm.RING_HEADER
SLOT = _shm.RING_SLOT
TAIL = _shm.RING_TAIL  # the longest tail a slot holds: a bigger item is asked for
ASK = _shm.RING_ASK
BITS = 64  # subscriptions served through one ring; more read through messages

# header words
R_MAGIC, R_BELL, R_SLOTS, R_MEMBERS, R_END, R_WHY, R_TOP = 0, 8, 16, 24, 32, 40, 48
CLOSED, REMOVED = 1, 2


def ring_size(slots: int) -> int:
    """Bytes of a ring of `slots` slots."""
    return HEADER + slots * SLOT


def slot_seq(ring: int, index: int) -> int:
    """The address of slot `index`'s seq word."""
    return ring + HEADER + index * SLOT
