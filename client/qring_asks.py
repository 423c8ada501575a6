"""Items a queue ring cannot hold (Note [queue ring] in common/qring.py): on a GPU, larger
than a slot, a bundle whose tail does not fit, one written with `create`. Each is put
through the broker at a position its producer claimed in the ring (its slot flagged ASK),
and its consumer, having taken that position, asks the broker for it. Whatever
interrupts (Note [shielded steps]), a claimed position is published, passed over or
given back, and an item taken is the caller's or first in the queue again.

Note [ring failures]
~~~~~~~~~~~~~~~~~~~~
What each failure of a put or get through the broker leaves (issue 48; each case has a
test in test_queue_rings.py, test_queue_ring_interrupts.py or test_recovery.py):

- A put refused (BrokerError): the producer passes its position over and frees its slot.
- A put given up (Ctrl-C) and answered anyway (`late`): aborted; the broker passes its
  position over. Given up with no answer (cancelled, or a cancel never confirmed): the
  producer asks (`qunclaim`); a put the broker had granted is aborted there, else the
  broker refuses any put for that position from then on and the producer passes it over
  itself. Either way one side only frees the slot, so a slot the producer has taken again
  since is never freed under it (the ABA case).
- A put for which the broker has no room does not wait (CapacityError at once on the
  host; a device put waits at most DEVICE_WAIT, for memory already freed whose GPU reads
  are finishing): no later item waits behind its position for memory that consumers hold.
- A put carried over a broker restart is matched at adoption to the position its producer
  claimed (`QueueRingRoom.adopted`), so that its abort passes the position over.
- A seal interrupted before it was sent aborts its put; after, the put went in unless the
  broker refuses it, and the exception says which (`Writes._interrupted`).
- A get that fails or is interrupted after its take gives the item back (`unask`): the
  broker takes back the lease it handed over (a GPU item's it cannot: that item goes).
  A consumer that dies there: the broker does it (`QueueRingRoom._left`).
- A consumer's take that races the queue's removal: its ask is told the queue "was
  removed", and the broker, which unmaps the ring only after the batch, never reads it
  unmapped.
- Positions passed over behind an item use entries (two per slot) until a consumer passes
  them: with no consumer taking, a put may wait as on a full queue while a slot is free.
  It goes on once a consumer takes; nothing is lost or wedged (bounded, not closed).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ..common.errors import BrokerError, BrokerUnavailable
from ..common.protocol import Op
from ..common.qring import ASK, QueueRingView
from .cancel import given_up
from .shield import shielded
from .tensor import Tensor

if TYPE_CHECKING:
    from .reads import Item
    from .transfer import Transfer


class QueueRing(Protocol):
    """What these functions use of a queue ring (client/qring.py's QueueRing, which calls
    them: named here, not imported, so that neither module imports the other)."""

    transfer: Transfer
    view: QueueRingView
    owner: int
    queue_id: int
    name: str
    asking: tuple[int, int] | None

    def wait_for(
        self, attempt: Callable[[int], int], deadline: float | None, timeout: float | None
    ) -> int: ...


log = logging.getLogger(__name__)

BACK_WAIT = 2.0  # seconds a get that failed waits for the broker to take its item back


def put(
    ring: QueueRing, plan: Any, claim: float | None, until: float | None, block: bool
) -> int | None:
    """`QueueRing.put` of an item through the broker, at a position reserved first, waiting
    up to `claim` seconds for a slot. Its version; None if not `block`. It went in only if
    this returned."""
    answered: list[dict[str, Any]] = []
    claimed: list[int] = []
    try:
        reserve(ring, claim, claimed)
        plan.fields["ring"] = claimed[1]
        epoch = ring.transfer.conn.leases.epoch  # (Leases.hold_put)
        reply = ring.transfer.ask_memory(Op.QPUT, until, answered.append, **plan.request)
    except BaseException as exc:
        not_put(ring, claimed, answered, exc)
        raise
    return ring.transfer.fill(plan, reply, block, epoch)  # (a failed fill is aborted: the broker's)


def reserve(ring: QueueRing, timeout: float | None, claimed: list[int]) -> None:
    """A slot, then a position after it named for an item put through the broker (ASK),
    waiting up to `timeout` seconds for each; each is added to `claimed` in the step
    that takes it (Note [shielded steps]), so that whatever interrupts, `not_put`
    knows what to give back."""
    view, owner = ring.view, ring.owner
    deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)

    def take_slot(_owner: int) -> int:
        with shielded():
            got = view.alloc(owner)
            if got >= 0:
                claimed.append(got)
            return got

    def take_position(_owner: int) -> int:
        with shielded():
            got = view.claim(owner)
            if got >= 0:
                view.name(got, claimed[0], ASK, b"")
                claimed.append(got)
            return got

    ring.wait_for(take_slot, deadline, timeout)
    ring.wait_for(take_position, deadline, timeout)


def not_put(
    ring: QueueRing, claimed: list[int], answered: list[dict[str, Any]], exc: BaseException
) -> None:
    """A put through the broker that raised `exc` with `claimed` (its slot, and position):
    aborted if the broker granted it (it then passes the position over); passed over here
    if the broker refused it; given up with no answer, the broker is asked whether it had
    it (`unclaim`: one side only frees the slot); left to the broker if it exited (one back
    with the state goes on with it)."""
    view, owner = ring.view, ring.owner
    conn = ring.transfer.conn
    with shielded():
        if len(claimed) == 1:
            view.unalloc(claimed[0], owner)
            return
        if answered:  # given up, but granted: aborted, the broker passes it over
            with contextlib.suppress(BrokerError):
                conn.call(Op.ABORT, put=answered[0]["put"])
            return
        if not claimed or isinstance(exc, BrokerUnavailable):
            return
        if given_up(exc):  # (cancelled, or maybe not: the broker may have granted it)
            try:
                reply = conn.call(Op.QUNCLAIM, wait=BACK_WAIT, queue=ring.queue_id, ring=claimed[1])
                if reply["aborted"]:
                    return
            except BrokerError as err:
                log.warning("queue %r: a put given up holds position %d until this client "
                            "ends (%s)", ring.name, claimed[1], err)  # fmt: skip
                return
        view.skip(claimed[1], owner)
        view.unalloc(claimed[0], owner)


@contextlib.contextmanager
def create(
    ring: QueueRing, shape: Sequence[int], dtype: Any, device: Any, timeout: float | None,
    until: float | None,
) -> Iterator[Tensor]:  # fmt: skip
    """`Queue.create`: the item is written in place through the broker, at a position
    reserved first (passed over if the broker never had the put, aborted if it did)."""
    answered: list[dict[str, Any]] = []
    claimed: list[int] = []
    made = False
    try:
        reserve(ring, timeout, claimed)
        with ring.transfer.create(
            ring.name, shape, dtype, device, Op.QPUT, until, late=answered.append,
            queue=ring.queue_id, name=ring.name, timeout=timeout, ring=claimed[1],
        ) as buffer:  # fmt: skip
            made = True
            yield buffer
    except BaseException as exc:
        if not made:  # (once made, aborted by transfer.create)
            not_put(ring, claimed, answered, exc)
        raise


def ask(ring: QueueRing, pos: int, slot: int) -> Item | None:
    """The item taken at `pos` (in `slot`) that was put through the broker, asked for:
    committed once it is built and no signal came meanwhile; else given back first in
    the queue (`unask`) and the signal's handler run (None if it returns)."""
    conn, answered = ring.transfer.conn, list[dict[str, Any]]()
    try:
        reply = conn.call(
            Op.QGET, late=answered.append, queue=ring.queue_id, name=ring.name, ring=pos
        )  # fmt: skip
    except BaseException:
        with shielded():
            unask(ring, pos, slot, answered[0]["lease"] if answered else None)
        raise
    with shielded() as step:
        try:
            item, lease = ring.transfer.reads.build(reply)
        except BaseException:
            unask(ring, pos, slot, reply["lease"])
            raise
        if not step.pending:
            ring.view.commit(pos)
            ring.asking = None
            if step.noting:  # a signal from now on comes again once the get returned
                step.deferring = True
            return item
        lease.disarm()  # interrupted: the item stays in the queue
        unask(ring, pos, slot, reply["lease"])
    return None


def unask(ring: QueueRing, pos: int, slot: int, lease: int | None) -> None:
    """Give back the item taken at `pos` (in `slot`; its entry still TAKEN) that this
    consumer asked the broker for, on `lease` if the broker answered (None: it did not,
    or not yet). Taken back by the broker, it is first in the queue again; else (an item
    on a device, or a broker gone) the entry is committed and the item goes with its
    lease (this client's, as a get that returned and was dropped)."""
    conn, view = ring.transfer.conn, ring.view
    ring.asking = None
    try:
        back = conn.call(Op.QBACK, wait=BACK_WAIT, queue=ring.queue_id, ring=pos)["back"]
    except BrokerError as exc:
        log.warning("queue %r: the item at %d taken by a get that failed is dropped, "
                    "the broker did not take it back (%s)", ring.name, pos, exc)  # fmt: skip
        back = False
    if back:
        if lease is not None:
            conn.leases.forget(lease)
        view.back(pos, slot, ring.owner)
        return
    view.commit(pos)
    if lease is not None:
        conn.leases.releases.put(lease)
