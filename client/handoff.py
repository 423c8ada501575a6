"""The client's side of Note [direct handoff] (common/mailbox.py): a consumer waiting on its
bell, and a producer handing an item to a consumer's mailbox."""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import msgpack

from ..common import _shm
from ..common.descriptors import ObjectDesc
from ..common.mailbox import CLAIMED, FILLED, MAILBOX_BODY, OPEN, Mailboxes, word


class DirectGrant(NamedTuple):
    """A grant offered by the broker: this client's next item of a queue may go to the
    consumer whose mailbox is `region`, as `version`, on lease `lease`."""

    token: int
    region: int
    lease: int
    version: int
    consumer: str  # its session token


class Bell:
    """This client's own mailbox, waited on by one get at a time (`lock`), as named by the
    broker of `generation` (Connection.generation)."""

    def __init__(self, address: int, generation: int) -> None:
        self.address, self.generation = address, generation
        self.lock = threading.Lock()
        self._last = 0  # the token of the last item taken: a FILLED mailbox stays so

    def count(self) -> int:
        """Read before looking for what it rings for: a ring after that ends `wait` at once."""
        return _shm.bell(self.address)

    def wait(self, seen: int, timeout: float) -> None:
        _shm.bell_wait(self.address, seen, timeout)

    def take(self, request_id: int) -> dict[str, Any] | None:
        """The item a producer handed over, as the reply to `request_id`; None if none."""
        state, body = _shm.mailbox_read(self.address)
        if body is None or state & 0xFF != FILLED or state >> 8 == self._last:
            return None
        self._last = state >> 8
        reply: dict[str, Any] = msgpack.unpackb(body, raw=False)
        reply["id"], reply["ok"] = request_id, True
        return reply


def hand_over(
    mailboxes: Mailboxes, grant: DirectGrant, name: str, bundle: bool, wires: list[Any],
    oid: int, put: int,
) -> list[Any] | None:  # fmt: skip
    """Hand an item written at `wires` (the block of put `put`, object `oid`) to the consumer
    of `grant`; the seal's `direct` field, or None if the grant was taken back (or the item
    does not fit a mailbox): then it goes through the broker."""
    body = ObjectDesc.wire(name, grant.version, bundle, wires, grant.lease)
    body["oid"], body["put"] = oid, put
    packed = msgpack.packb(body)
    if len(packed) > MAILBOX_BODY:
        return None
    try:
        address = mailboxes.at(grant.region)
    except ValueError:
        return None
    if not _shm.cas(address, word(grant.token, OPEN), word(grant.token, CLAIMED)):
        return None
    if not _shm.mailbox_fill(address, grant.token, packed):
        return None
    return [grant.token, grant.consumer, grant.lease, grant.version]
