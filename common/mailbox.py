"""Mailboxes: a queue item handed from its producer straight to a parked consumer.

Note [direct handoff]
~~~~~~~~~~~~~~~~~~~~~
Through the broker a small queue handoff wakes two processes in turn (the broker, then the
consumer), with Python in each: on this 2-core VM a traced 4 KiB handoff took 376 us, about
100 of them in the two wake-ups, where multiprocessing.Queue takes about 180. So when a
consumer parks on an empty queue, the broker offers that queue's last producer a *direct
grant*: "your next item may go straight into this consumer's mailbox". The producer then
wakes only the consumer; the broker learns of the item from the seal that follows, off the
consumer's path.

    mailbox segment (the broker's, new with each broker): one MAILBOX of 512 B per client,
    at its lease-slot region's index (common/_shm.c has the layout)
    ┌ state: token << 8 | IDLE/OPEN/CLAIMED/FILLED ┬ bell (futex) ┬ body ┬ offer (seqlock) ┐

    consumer: qget(mailbox) ─> broker: queue empty: park; state = OPEN(t) in the consumer's
              mailbox; the grant (queue, t, where, lease, version) in the producer's offer
    producer q.put: copy into a granted block; offer for this queue? CAS OPEN(t) ->
                    CLAIMED(t); write the body (the consumer's reply); CAS CLAIMED(t) ->
                    FILLED(t); ring the bell;  then the seal goes, with t
    consumer: wakes on the bell, reads FILLED(t)'s body: the item, with the lease the
              broker set aside for it
    broker:   any other way the wait could end (another item sealed, its timeout, the queue
              closed, either client gone) first takes the grant back: CAS OPEN(t) -> IDLE.
              If that fails the producer claimed it: the item is the consumer's answer.

One CAS decides between the producer and the broker, so each item goes to one consumer. A
producer uses a grant only with no seal of its own still unanswered: then every item it put
before is in the queue already (or answered the consumer's wait, which took the grant
back), and its items keep their order. The broker reserves the item's place in the stream
and the consumer's lease id when it offers the grant; a mailbox is offered again only once
the item claimed from it is known to the broker (by its seal, or by its producer's death,
when the body in the mailbox says what was handed over). A producer that dies between
claim and fill leaves CLAIMED(t): the broker takes it back and the consumer asks again.

The bell also says "a reply is on your socket": the broker rings it after answering a get
that waits on it, so the consumer sleeps on one futex for either. Offers live in shared
memory, not in messages, so that a put does not read its socket to find one. The broker that
restarts makes a new segment: a seal sent again with an old grant says who the item went to.
"""

from __future__ import annotations

from . import _shm
from .directory import map_segment

IDLE, OPEN, CLAIMED, FILLED = 0, 1, 2, 3
MAILBOX = _shm.MAILBOX  # bytes per client: its mailbox, and the offer made to it
MAILBOX_BODY = _shm.MAILBOX_BODY  # the longest body: a bigger item goes through the broker


def word(token: int, state: int) -> int:
    """A mailbox's state word."""
    return token << 8 | state


class Mailboxes:
    """A client's read-write view of the broker's mailbox segment. Never unmapped: a thread
    may sleep on a bell in it at any time, and it is 64 KiB (once per broker a client saw)."""

    def __init__(self, path: str, size: int) -> None:
        self.size = size
        self.addr = map_segment(path, size, writable=True)

    def at(self, index: int) -> int:
        """The address of mailbox `index` (ValueError if out of the segment)."""
        if not 0 <= index < self.size // MAILBOX:
            raise ValueError(f"mailbox {index} is out of the segment")
        return self.addr + index * MAILBOX
