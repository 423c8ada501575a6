"""Ordinary queues across the nodes of a cluster (Note [queues across nodes]): consumers that
want items, items lent to the nodes that want them, and items arriving here, read by NIXL.

Note [queues across nodes]

Each node holds its own part of a queue: the items its producers put, bounded by its own
`maxsize`. A consumer takes from its node's part first; while it waits there, its node
says so to every peer (`want`, the count of its consumers waiting), and a peer with items
waiting and no consumer of its own lends them, oldest first:

    node c: a get waits ── want(q, 1) ──> node b: its oldest item leaves its part, pinned:
                                                  qitem(q, loan, layout, address)
    c takes a block in its part of q, NIXL READs the bytes, seals the item into its part
    (to the consumer waiting there) ── qtaken(loan) ──> b frees the item: its slot opens

So an item is in one node's part at a time and is handed to one consumer: exactly once. A
node lends its items in order and seals what it received from one peer in the order it was
lent, so the items of one producer reach each consumer in the order they were put. A part
keeps each item's slot until the node that took it has it: a producer still waits while
its node's part is full.

More items may arrive than consumers wait (two peers lend to one want): they wait in the
part they came to, for its consumers. They are not lent on while that node has had a
consumer asking within REPASS seconds: an item lent on could reach a consumer elsewhere
after a later item of its producer. Only items whose consumers went away are, and those
may come out of order. An item lent to a node that goes down, or sent back (`qback`: its
queue went there), goes back to the front of its part. A node that dies after it took an
item and before the lender heard so may see the item handed out twice: once more after the
lender restarts with it.

Closing closes every node's part (`qclose`). A consumer whose node's part is closed and
drained asks the peers up what they have left (`qleft`), and waits while any has items;
QueueClosed once none has. Items in the part of a node that is down are not waited for:
they come when it is back. Broadcast queues and GPU items stay on their node.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..common.errors import BrokerError, QueueClosed
from ..common.protocol import reply_error
from .queue_state import BrokerQueue
from .queues import Queues
from .records import Session, StoredObject
from .replicas import POLL, SPIN, Links
from .transfers import Transfers

REPASS = 5.0  # seconds without a consumer asking before items that arrived here are lent on


@dataclass(slots=True)
class Arrival:
    """An item lent to this node by `node` (its `loan`), read into put `put` of part `q`."""

    node: str
    loan: int
    q: BrokerQueue
    put: int
    handle: Any = None  # the read under way (None: done, or it failed)
    size: int = 0
    started: float = 0.0
    failed: bool = False


@dataclass(slots=True)
class Asked:
    """This node asked the peers what they have left of a closed queue (`qleft`)."""

    waiting: set[str]  # the peers not answered yet
    left: dict[str, int] = field(default_factory=dict)


class QueueLinks:
    """The wants of the other nodes, the items lent to them (`loans`) and those arriving here
    (Note [queues across nodes]). Queues calls `asked`, `item`, `closed` and `supplies`;
    the cluster hands this room its messages and calls `poll` every loop, `beat` every beat."""

    def __init__(
        self, node: str, queues: Queues, transfers: Transfers, links: Links, session: Session
    ) -> None:
        self.node, self.queues, self.registry = node, queues, queues.registry
        self.transfers, self.links, self.session = transfers, links, session
        self.wants: dict[str, dict[str, int]] = {}  # queue -> node -> its consumers waiting
        self.loans: dict[tuple[str, int], tuple[BrokerQueue, StoredObject]] = {}
        self._arriving: dict[str, deque[Arrival]] = {}  # by the node that lent them, in order
        self._said: dict[str, int] = {}  # queue -> the want this node said last
        self._asked: dict[int, Asked] = {}  # closed part's id -> what the peers have left
        self._over: set[int] = set()  # closed parts no peer has items for: the stream ended
        self._came: set[int] = set()  # the oids of items that arrived here from a peer
        self._waited: dict[int, float] = {}  # part id -> when a consumer last asked in it
        self._ids = 0
        self.bytes_sent = self.bytes_received = 0

    # -- what Queues tells and asks ---------------------------------------------------------------

    def asked(self, q: BrokerQueue) -> None:
        """A consumer asked for an item of `q` (took one, or waits): the peers hear how many
        wait."""
        self._waited[q.id] = time.monotonic()
        self._say_want(q)

    def item(self, q: BrokerQueue) -> None:
        """An item went to the back of `q`: a peer that wants one may get it."""
        self._lend(q)

    def closed(self, q: BrokerQueue) -> None:
        """`q` was closed here: so is its part on every other node."""
        self.links.everyone({"op": "qclose", "queue": q.name})

    def supplies(self, q: BrokerQueue) -> bool:
        """Whether another node may still hand an item to a consumer of closed and drained
        `q`: while items are arriving, or a peer up has items left or has not said (asked
        now). False once none has."""
        if q.id in self._over:
            return False
        if any(a.q is q for arriving in self._arriving.values() for a in arriving):
            return True
        if q.id in self._asked:
            return True
        up = {n for n in self.links.nodes() if self.links.up(n)}
        if not up:
            return False
        self._asked[q.id] = Asked(up)
        for node in up:
            self.links.send(node, {"op": "qleft", "queue": q.name})
        return True

    # -- wants and loans (the lending side) -------------------------------------------------------

    def _say_want(self, q: BrokerQueue) -> None:
        n = len(q.getters)
        if q.subs is None and self._said.get(q.name, 0) != n:
            self._said[q.name] = n
            self.links.everyone({"op": "want", "queue": q.name, "n": n})

    def want(self, node: str, name: str, n: int) -> None:
        """`node` has `n` consumers waiting in its part of `name`."""
        self.wants.setdefault(name, {})[node] = n
        q = self.queues.by_name.get(name)
        if q is not None:
            self._lend(q)

    def _lend(self, q: BrokerQueue) -> None:
        """Lend the oldest items of `q` to the peers that want them (this node's own
        consumers took theirs already: an item waits in `items` only when none waits here)."""
        wants = self.wants.get(q.name)
        if not wants or q.subs is not None or q.removed:
            return
        repass = time.monotonic() - self._waited.get(q.id, 0.0) >= REPASS
        for node, n in wants.items():
            out = sum(1 for (to, _), (lq, _) in self.loans.items() if to == node and lq is q)
            while out < n and self.links.up(node):
                obj = self._lendable(q, repass)
                if obj is None:
                    break
                self._ids += 1
                self.transfers.register(obj.block.segment)
                self.registry.pin(obj)
                self.loans[node, self._ids] = (q, obj)
                specs = [[t.name, t.dtype, list(t.shape)] for t in obj.tensors]
                self.links.send(node, {
                    "op": "qitem", "queue": q.name, "loan": self._ids, "bundle": obj.bundle,
                    "specs": specs, "size": obj.nbytes, "agent": self.transfers.metadata,
                    "address": self.transfers.address(obj.block.segment, obj.block.offset),
                })  # fmt: skip
                self.bytes_sent += obj.nbytes
                out += 1
        self.queues.table.note_if_ended(q)

    def _lendable(self, q: BrokerQueue, repass: bool) -> StoredObject | None:
        """The oldest item of `q` that may be lent (taken out of it): a host item put here,
        or, `repass`, one that arrived here from another node too."""
        for i, obj in enumerate(q.items):
            if obj.device == "cpu" and (repass or obj.oid not in self._came):
                del q.items[i]
                self._came.discard(obj.oid)
                return obj
        return None

    def taken(self, node: str, loan: int) -> None:
        """`node` has the item it was lent: freed here, its slot opens."""
        lent = self.loans.pop((node, loan), None)
        if lent is not None:
            q, obj = lent
            self.registry.retire(obj)
            self.registry.unpin(obj)
            self.queues.table.note_if_ended(q)

    def back(self, node: str, loan: int) -> None:
        """`node` could not take the item it was lent: back to the front of its part."""
        lent = self.loans.pop((node, loan), None)
        if lent is not None:
            self.registry.unpin(lent[1])
            self.queues.requeue(lent[0], lent[1])

    def left(self, node: str, name: str) -> None:
        """`node` asks what this node has left of closed queue `name`."""
        q = self.queues.by_name.get(name)
        n = 0 if q is None else len(q.items) + q.pending
        self.links.send(node, {"op": "qhas", "queue": name, "left": n})

    def has(self, node: str, name: str, n: int) -> None:
        """`node` has `n` items left of `name`, which this node asked about."""
        q = self.queues.by_name.get(name)
        asked = None if q is None else self._asked.get(q.id)
        if q is None or asked is None or node not in asked.waiting:
            return
        asked.waiting.discard(node)
        asked.left[node] = n
        if not asked.waiting:
            self._settle(q, asked)

    def _settle(self, q: BrokerQueue, asked: Asked) -> None:
        """Every peer asked answered (or went down): none has items left, so the consumers
        waiting here end; else they wait for the items their wants bring."""
        del self._asked[q.id]
        if any(asked.left.values()) or q.items or q.pending:
            return
        self._over.add(q.id)
        for w in list(q.getters):
            closed = QueueClosed(f"queue {q.name!r} is closed and drained on every node")
            self.queues.objects.answer(w, reply_error(w.request.id, closed))

    # -- arrivals (the taking side) ---------------------------------------------------------------

    def arrived(self, node: str, m: dict[str, Any]) -> None:
        """`node` lent this node an item of its part of a queue: read it into this node's."""
        loan, name = int(m["loan"]), str(m["queue"])
        q = self.queues.by_name.get(name)
        if q is None or q.subs is not None or q.removed:
            self.links.send(node, {"op": "qback", "loan": loan})
            return
        try:
            self.transfers.add_peer(node, bytes(m["agent"]))
            specs = [(str(n), str(d), tuple(s)) for n, d, s in m["specs"]]
            put, obj = self.registry.begin_put(self.session, name, specs, bool(m["bundle"]),
                                               queue=q)  # fmt: skip
        except (BrokerError, KeyError, TypeError, ValueError):  # no room here, say
            self.links.send(node, {"op": "qback", "loan": loan})
            return
        q.in_flight += 1
        q.pending += 1
        arrival = Arrival(node, loan, q, put, size=min(int(m["size"]), int(obj.nbytes)))
        self._arriving.setdefault(node, deque()).append(arrival)
        try:
            self.transfers.register(obj.block.segment)
            local = self.transfers.address(obj.block.segment, obj.block.offset)
            arrival.handle = self.transfers.read(node, int(m["address"]), local, arrival.size)
            arrival.started = time.monotonic()
        except OSError:
            arrival.failed = True

    @property
    def poll_in(self) -> float:
        """Seconds until the reads under way are looked at again (as Replicas.poll_in)."""
        now, due = time.monotonic(), math.inf
        for arriving in self._arriving.values():
            for a in arriving:
                if a.handle is not None:
                    due = min(due, 0.0 if now - a.started < SPIN else POLL)
        return due

    def poll(self) -> None:
        """Reads that ended: sealed, each peer's in the order it lent them."""
        for node, arriving in list(self._arriving.items()):
            for a in arriving:
                if a.handle is not None:
                    try:
                        if self.transfers.done(a.handle):
                            a.handle = None
                    except OSError:
                        a.handle, a.failed = None, True
            while arriving and arriving[0].handle is None:
                self._end(arriving.popleft())
            if not arriving:
                del self._arriving[node]

    def _end(self, a: Arrival) -> None:
        q = a.q
        if a.failed:
            self.registry.abort(self.session, a.put, False)
            self.links.send(a.node, {"op": "qback", "loan": a.loan})
        else:
            self.bytes_received += a.size
            # Not lent on from here (REPASS), should it stay in the part (it may, also
            # with a consumer waiting: a producer here may hand that one its item first).
            self._came.add(self.registry.pending[a.put].oid)
            self.queues.deliver(self.session, a.put, q)
            self.links.send(a.node, {"op": "qtaken", "loan": a.loan})
        self._say_want(q)
        if q.closed and not q.items and q.getters and q.id not in self._over:
            self.supplies(q)  # (asks again: what the peers have left may have changed)

    # -- peers coming and going -------------------------------------------------------------------

    def beat(self) -> None:
        """The wants said again (consumers that gave up leave no stale want), items that
        arrived here and wait without a consumer lent on, and closed parts whose consumers
        still wait: the peers are asked again what they have left."""
        for q in list(self.queues.by_name.values()):
            if q.subs is not None:
                continue
            self._say_want(q)
            if q.items and self.wants.get(q.name):
                self._lend(q)
            if q.closed and q.getters and not q.items and q.id not in self._asked:
                if not self.supplies(q):
                    self._settle(q, Asked(set()))
        self._came.intersection_update(o.oid for q in self.queues.by_name.values()
                                       for o in q.items)  # fmt: skip

    def node_down(self, node: str) -> None:
        """What `node` was lent goes back to the front of its parts; what it was lending
        here is dropped (it has the items still); its wants and answers go."""
        for key in sorted((k for k in self.loans if k[0] == node), reverse=True):
            q, obj = self.loans.pop(key)
            self.registry.unpin(obj)
            self.queues.requeue(q, obj)
        for a in self._arriving.get(node, ()):
            a.failed = True  # (a read under way ends, or fails, before its block goes)
        for wants in self.wants.values():
            wants.pop(node, None)
        for qid, asked in list(self._asked.items()):
            if node in asked.waiting:
                asked.waiting.discard(node)
                part = self.queues.by_id.get(qid)
                if part is not None and not asked.waiting:
                    self._settle(part, asked)

    def node_up(self, node: str) -> None:
        """`node` (re)joined: it hears the wants of this node's consumers."""
        for name, n in self._said.items():
            if n:
                self.links.send(node, {"op": "want", "queue": name, "n": n})
