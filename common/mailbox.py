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

    mailbox segment (the broker's, new with each broker; one per user under --group, Note
    [members] in server/store/members.py): MAILBOX bytes per client, one each, assigned at
    hello (common/_shm.c has the layout)
    ┌ state: token << 8 | IDLE/OPEN/CLAIMED/FILLED ┬ bell (futex) ┬ body ┬ offer (seqlock) ┐

    consumer: qget(mailbox) ─> broker: queue empty: park; state = OPEN(t) in the consumer's
              mailbox; in the producer's offer: (queue, t, mailbox, lease, version, get id,
              applied: the id of the producer's last seal the broker had applied)
    producer q.put: copy into a granted block; then, under its seal lock, in one C call
              (_shm.hand_over): if the offer is for this queue and `applied` is its last
              seal sent, CAS OPEN(t) -> CLAIMED(t); write the body (the get's reply: a
              head of the item's own numbers, then a tail its producer packed once for
              the layout, `body_tail`); CAS CLAIMED(t) -> FILLED(t); ring the bell. Its
              seal then goes, saying "direct t"; a put that waits returns then, with the
              version the offer named (Note [writes]).
    consumer: wakes on the bell, reads FILLED(t)'s body, addressed to its get: the item,
              with the lease the broker set aside for it
    broker:   any other way the wait can end (another item sealed, its timeout, the queue
              closed, the get cancelled, either client gone) first takes the grant back:
              CAS OPEN(t) -> IDLE. If that fails the producer claimed it: the item answers
              the get, takes its place in the stream and counts in flight from then.

One CAS decides between the producer and the broker, so each item goes to one consumer, and
one producer's items keep their order: it claims only if the broker had applied all its
earlier seals when it made the offer (its earlier items are in the queue, or answered this
get, which took the grant back; a seal applied later would have taken it back too), and no
seal of its other threads goes between its claim and its seal. The broker rewrites the
offer as each seal of the producer's is applied, and the producer reads no socket first.
A mailbox has one grant out at a time, and a client's mailbox is given to another only once
none is out on it (a producer that claimed it may still be writing). A body names the get it
answers: a get given up (Ctrl-C) leaves what is handed to it where it is, never answering a
later get.

When it goes wrong: a producer that dies after filling leaves the body, from which the
broker seals the item. One that dies between claim and fill leaves CLAIMED(t): the broker
takes it back and handles the get again. A claim whose fill fails (its consumer died and
the mailbox was emptied) goes through the queue, its seal saying "undone t". A consumer
whose broker dies takes what was handed to it, or takes the grant back itself, before it
asks the broker that comes back; the producer's seal, sent again, says where its item went.

The bell also says "a reply is on your socket": the broker rings it after answering a get
that waits on it, so the consumer sleeps on one futex for either. Offers live in shared
memory, not in messages, so that a put does not read its socket to find one.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from . import _shm
from .directory import map_segment

IDLE, OPEN, CLAIMED, FILLED = 0, 1, 2, 3
MAILBOX = _shm.MAILBOX  # bytes per client: its mailbox, and the offer made to it
MAILBOX_BODY = _shm.MAILBOX_BODY  # the longest body: a bigger item goes through the broker
BODY_HEAD = struct.Struct("<6Q")  # a body's head: the get it answers, lease, version, oid,
assert BODY_HEAD.size == _shm.BODY_HEAD  # put, base (the offset of the item's block)

Template = list[tuple[str, str, list[int], list[int], int]]  # name, dtype, shape, strides,
# and offset from the block, of each tensor


def body_tail(name: str, bundle: bool, segment: str, template: Template) -> bytes:
    """A body's tail: what the items of one layout in one segment share, so that a
    producer packs it once (the head, written in C, holds what each item has of its own)."""
    packed: bytes = msgpack.packb([name, bundle, segment, template])
    return packed


def item_reply(
    request: int, lease: int, version: int, oid: int, put: int, base: int, tail: Any
) -> dict[str, Any]:
    """The reply to get `request` that a body says (`tail` unpacked): the item, as the
    broker would have answered it, on the lease the broker set aside for it."""
    name, bundle, segment, template = tail
    tensors = [[n, dt, shape, strides, segment, base + off, "cpu"]
               for n, dt, shape, strides, off in template]  # fmt: skip
    return {"id": request, "ok": True, "key": name, "version": version, "bundle": bundle,
            "tensors": tensors, "lease": lease, "oid": oid, "put": put}  # fmt: skip


def read_body(body: bytes) -> dict[str, Any]:
    """A whole body, as `item_reply` (ValueError if it is not one)."""
    if len(body) < BODY_HEAD.size:
        raise ValueError(f"a mailbox body of {len(body)} bytes")
    request, lease, version, oid, put, base = BODY_HEAD.unpack_from(body)
    try:
        tail = msgpack.unpackb(body[BODY_HEAD.size :], raw=False, strict_map_key=True)
        return item_reply(request, lease, version, oid, put, base, tail)
    except (TypeError, msgpack.UnpackException) as exc:
        raise ValueError(f"a mailbox body that does not say an item: {exc}") from None


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
