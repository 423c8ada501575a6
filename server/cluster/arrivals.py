"""Queue items that other nodes of a cluster lent this node (Note [queues across nodes] in
queue_links.py): each read by NIXL into a block of this node's part of its queue, and
sealed there in the order its lender lent them, so that one producer's items keep their
order. An item for a broadcast part that holds `maxsize` items that arrived waits, unread,
until one of those is freed: its lender keeps it pinned meanwhile, and so its producer
waits for the slowest subscriber on any node.

As a pull (Note [offers] in offers.py), an item is read only while its lender surely holds
this node up (`fresh`): else its lender may have let it go, and its memory may hold another
item by now. One whose read ended past the bound is read again once the lender is fresh
(unless a forget fails it meanwhile). An item lent to the incarnation of this node that
this one replaced, or before its lender knew that this node forgot it (`acked`), is given
back unread. `qtaken` and `qback` name the lender's incarnation that lent the item: loan
ids are each incarnation's own.

A `qtaken` may be lost with a link's connection that broke and came back; the two nodes
then forget each other and link again (Note [beats] in beats.py), and the lender would put
the item back in its part: one item in two parts. So the items taken of each lender in the
last TAKEN_FOR down_afters (`taken`: a loss is found at a beat within that, and the hellos
follow) are named again in this node's hello and welcome to it. The lender reads them
before it puts anything back, and frees them (QueueLinks.hello); a lender that forgot this
node first, for a relink, keeps what it lent it until then (QueueLinks.let_go, `hold`).
A lender that took this node for down puts the items back at once: across a death, or a
partition longer than down_after, a queue is at least once.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...common.errors import BrokerError
from ..queues.queue_state import BrokerQueue
from ..queues.queues import Queues
from ..store.records import Session, StoredObject
from .pulls import POLL
from .records import Links
from .transfers import Transfers

log = logging.getLogger(__name__)

TAKEN_FOR = 2.0  # down_afters an item taken is named in the hellos to its lender
TAKEN_KEPT = 65536  # items taken of one lender that a hello names, at most (the newest)


@dataclass(slots=True)
class Arrival:
    """Item `loan` of `node`, for part `q`: read into put `put` (0: not begun, waiting for a
    slot of a full broadcast part, or for its lender to be fresh). `again`: read, but past
    its lender's bound: read again once it is fresh."""

    node: str
    loan: int
    q: BrokerQueue
    message: dict[str, Any]  # the lender's qitem: the item's layout and address
    put: int = 0
    handle: Any = None  # the read under way
    size: int = 0
    failed: bool = False
    again: bool = False

    @property
    def over(self) -> bool:
        """Read (or failed): ready to seal (or give back)."""
        return self.handle is None and (self.failed or (self.put > 0 and not self.again))

    def answer(self, op: str) -> dict[str, Any]:
        return answer(op, self.loan, self.message)


def answer(op: str, loan: int, qitem: dict[str, Any]) -> dict[str, Any]:
    """`qtaken` or `qback` of `loan`, for the lender's incarnation that lent it (`qitem`)."""
    return {"op": op, "loan": loan, "of": qitem.get("from")}


class Arrivals:
    """The items being read into this node's parts, by lender in the order lent. `on_end(a,
    delivered)` is told of each once it is sealed into its part (or failed, and its block
    given back)."""

    def __init__(
        self, queues: Queues, transfers: Transfers, links: Links, session: Session,
        on_end: Callable[[Arrival, bool], None],
    ) -> None:  # fmt: skip
        self.queues, self.registry, self.transfers = queues, queues.registry, transfers
        self.links, self.session, self.on_end = links, session, on_end
        self._by_node: dict[str, deque[Arrival]] = {}
        self.came: set[int] = set()  # the oids of items sealed here from a peer's part
        self._held: dict[int, list[StoredObject]] = {}  # broadcast part id -> items arrived
        # lender -> (when, loan, its incarnation): items taken lately (`taken`)
        self._taken: dict[str, deque[tuple[float, int, Any]]] = {}
        self._warned: dict[str, float] = {}  # lender -> when its window overflowed
        self.bytes_received = 0

    def lenders(self) -> list[str]:
        """The nodes whose items are being read here (their links are in use: Note [beats])."""
        return [node for node, arrivals in self._by_node.items() if arrivals]

    def arrived(self, node: str, m: dict[str, Any]) -> None:
        """`node` lent this node an item of its part of a queue (its `qitem`)."""
        loan, name = int(m["loan"]), str(m["queue"])
        q = self.queues.by_name.get(name)
        kind = q is not None and (q.subs is not None) == bool(m.get("broadcast"))
        if q is None or q.removed or not kind or not self.links.acked(node, m):
            # (not acked: lent to the incarnation this one replaced, or before its lender
            # knew that this node forgot it; it lets it go)
            self.links.after(node, answer("qback", loan, m))
            return
        a = Arrival(node, loan, q, m)
        self._by_node.setdefault(node, deque()).append(a)
        self._begin(a)

    def _begin(self, a: Arrival) -> None:
        """Read `a` into a new block of its part; not yet if it is for a full broadcast part,
        or waits behind one that is (its lender's items keep their order)."""
        q, m = a.q, a.message
        if not self.links.fresh(a.node):  # its lender may have let it go: not read yet
            return
        if q.subs is not None and (self._full(q) or self._ahead(a)):
            return
        try:
            specs, bundle, _ = self.transfers.layout(a.node, m)  # (host items only)
            a.put, obj = self.registry.begin_put(self.session, q.name, specs, bundle, queue=q)
        except (BrokerError, KeyError, TypeError, ValueError):  # no room here, say
            a.failed = True
            return
        q.in_flight += 1
        q.pending += 1
        if q.subs is not None:
            self._held.setdefault(q.id, []).append(obj)
        self._read(a, obj)

    def _read(self, a: Arrival, obj: StoredObject) -> None:
        try:
            a.handle, a.size = self.transfers.take(a.node, a.message, obj)
            a.again = False
        except (OSError, KeyError, TypeError, ValueError):
            a.failed = True

    def _full(self, q: BrokerQueue) -> bool:
        """Whether broadcast part `q` holds `maxsize` items that arrived, not yet freed."""
        held = self._held[q.id] = [o for o in self._held.get(q.id, []) if not o.freed]
        return 0 < q.maxsize <= len(held)

    def _ahead(self, a: Arrival) -> bool:
        """Whether an item of `a`'s lender waits for a slot ahead of `a`."""
        first = next(b for b in self._by_node[a.node] if b.put == 0 and not b.failed)
        return first is not a

    def of(self, q: BrokerQueue, node: str | None = None) -> bool:
        """Whether items for `q` (from `node`, or any) are being read or wait to be."""
        lines = self._by_node.values() if node is None else [self._by_node.get(node, ())]
        return any(a.q is q for line in lines for a in line)

    @property
    def poll_in(self) -> float:
        """Seconds until the items waiting are looked at again (a read that ended wakes the
        loop itself: Transfers.fd)."""
        due = math.inf
        for line in self._by_node.values():
            for a in line:
                if a.handle is None and (a.put == 0 or a.again) and not a.failed:
                    due = min(due, POLL)  # waits for a slot, or for its lender to be fresh
        return due

    def poll(self) -> None:
        """Reads that ended, sealed in each lender's order; items waiting for a slot begun."""
        for node, line in list(self._by_node.items()):
            for a in line:
                if a.handle is not None:
                    try:
                        if self.transfers.done(a.handle):
                            a.handle = None
                            # Its lender may have let it go during the read (or this loop
                            # paused): read again once it surely holds it (a later forget
                            # fails it).
                            a.again = not self.links.fresh(node)
                    except OSError:
                        a.handle, a.failed = None, True
                elif a.again and not a.failed:
                    if self.links.fresh(node):
                        self._read(a, self.registry.pending[a.put])
                elif a.put == 0 and not a.failed:
                    self._begin(a)
            while line and line[0].over:
                self._end(line.popleft())
            if not line:
                del self._by_node[node]

    def _end(self, a: Arrival) -> None:
        if a.failed:
            if a.put:
                self.registry.abort(self.session, a.put, False)
            self.links.after(a.node, a.answer("qback"))
        else:
            self.bytes_received += a.size
            # Not lent on from here (REPASS in queue_links.py), should it stay in the part
            # (it may, also with a consumer waiting: a producer here may hand that one its
            # own item first).
            self.came.add(self.registry.pending[a.put].oid)
            self.queues.deliver(self.session, a.put, a.q)
            self.links.after(a.node, a.answer("qtaken"))
            taken = self._taken.setdefault(a.node, deque(maxlen=TAKEN_KEPT))
            full = len(taken) == TAKEN_KEPT  # (the oldest still in the window: warned once)
            if full and taken[0][0] > self.taken_since() > self._warned.get(a.node, 0.0):
                self._warned[a.node] = time.monotonic()  # (once a window)
                log.warning("cluster: over %d items taken of %r lately: a relink may hand the "
                            "oldest out again", TAKEN_KEPT, a.node)  # fmt: skip
            taken.append((time.monotonic(), a.loan, a.message.get("from")))
        self.on_end(a, not a.failed)

    def taken(self, node: str) -> list[list[Any]]:
        """The items taken of `node` lately, for a hello or welcome: [loan, of] each."""
        self.forget_taken()
        return [[loan, of] for _, loan, of in self._taken.get(node, ())]

    def taken_since(self) -> float:
        """When the window of items named in hellos begins (TAKEN_FOR down_afters ago)."""
        return time.monotonic() - TAKEN_FOR * self.links.down_after

    def forget_taken(self) -> None:
        """The items taken over TAKEN_FOR down_afters ago are no longer named."""
        since = self.taken_since()
        for node, taken in list(self._taken.items()):
            while taken and taken[0][0] < since:
                taken.popleft()
            if not taken:
                del self._taken[node]

    def node_down(self, node: str) -> None:
        """`node` went down: what it lent here is given up (it keeps the items)."""
        for a in self._by_node.get(node, ()):
            a.failed = True  # (a read under way ends, or fails, before its block goes)
