"""The end of a queue's stream across nodes (Note [queues across nodes] in queue_links.py):
a close said on one node closes the queue's part on every node (`qclose`), once the items
lent to it are in, and a consumer whose part is closed and drained ends once no other node
has items left (`qleft`, answered `qhas`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ...common.errors import QueueClosed
from ...common.protocol import reply_error
from ..queues.queue_state import BrokerQueue
from ..queues.queues import Queues
from .arrivals import Arrivals
from .records import Links

CLOSE_WAIT = 5.0  # seconds a part waits for the others' qclose before it closes without them


@dataclass(slots=True)
class Asked:
    """This node asked the nodes up what they have left of a closed queue (`qleft`)."""

    waiting: set[str]  # the nodes not answered yet
    left: dict[str, int] = field(default_factory=dict)


class QueueEnds:
    """The parts closing here (`closing`: the nodes whose `qclose` they wait for), and what
    the nodes were asked they have left (`asked`); QueueLinks hands this room the messages
    and events that concern them."""

    def __init__(
        self, queues: Queues, links: Links, arrivals: Arrivals, held: Callable[[BrokerQueue], int]
    ) -> None:
        self.queues, self.links, self.arrivals = queues, links, arrivals
        self.held = held  # the items of a part lent, held by a relink: they come back to it
        self.asked: dict[int, Asked] = {}  # closed part's id -> what the members have left
        self.over: set[int] = set()  # closed parts no member has items for: the stream ended
        # part id -> (the nodes not closed yet, since when)
        self.closing: dict[int, tuple[set[str], float]] = {}

    def close(self, q: BrokerQueue, heard: str | None = None) -> None:
        """`q` takes no more puts here; every node up hears so (after the items lent to it),
        and `q` closes once they closed theirs (`heard`: one did)."""
        if q.id not in self.closing:
            q.closing = True
            for h in [*q.putters]:  # producers waiting for a slot
                closed = QueueClosed(f"queue {q.name!r} was closed")
                self.queues.objects.answer(h, reply_error(h.request.id, closed))
            up = self._up()
            self.closing[q.id] = (up, time.monotonic())
            for node in up:
                self.links.after(node, {"op": "qclose", "queue": q.name})
        if heard is not None:
            self.closing[q.id][0].discard(heard)
        self.close_if_done(q)

    def close_from(self, node: str, name: str, echo: bool = False) -> None:
        """`node` closed its part of `name` (and lent this node all it will). `echo`: the
        answer of a node with no part, or with its part closed already: never answered
        (two nodes without a part would answer each other for good), and no close of a
        part."""
        q = self.queues.by_name.get(name)
        if q is None or q.closed:  # nothing to lend, nothing to wait for
            if not echo:
                self.links.after(node, {"op": "qclose", "queue": name, "echo": True})
        elif not echo:
            self.close(q, node)
        elif q.id in self.closing:
            self.closing[q.id][0].discard(node)
            self.close_if_done(q)

    def close_if_done(self, q: BrokerQueue) -> None:
        """Close `q` once every node closed its part (or CLOSE_WAIT passed) and the items
        lent here are in."""
        if q.id not in self.closing:
            return
        waiting, since = self.closing[q.id]
        if (waiting and time.monotonic() - since < CLOSE_WAIT) or self.arrivals.of(q):
            return
        del self.closing[q.id]
        self.queues.close_part(q)

    def supplies(self, q: BrokerQueue) -> bool:
        """Whether another node may still hand an item to a consumer of closed and drained
        `q`: while items are arriving, or a node up has items left or has not said (asked
        now). False once none has."""
        if q.id in self.over:
            return False
        if self.arrivals.of(q) or q.id in self.asked or self.held(q):
            return True
        up = self._up()
        if not up:
            return False
        self.asked[q.id] = Asked(up)
        for node in up:
            self.links.after(node, {"op": "qleft", "queue": q.name})
        return True

    def _up(self) -> set[str]:
        """The nodes up: a queue's end goes to each (Note [queue homes]: a part whose node
        is not known yet to the others is not missed)."""
        return {n for n in self.links.nodes() if self.links.up(n)}

    def left(self, node: str, name: str) -> None:
        """`node` asks what this node has left of closed queue `name`."""
        q = self.queues.by_name.get(name)
        n = 0 if q is None else len(q.items) + q.pending + self.held(q)
        self.links.after(node, {"op": "qhas", "queue": name, "left": n})

    def has(self, node: str, name: str, n: int) -> None:
        """`node` has `n` items left of `name`, which this node asked about."""
        q = self.queues.by_name.get(name)
        asked = None if q is None else self.asked.get(q.id)
        if q is None or asked is None or node not in asked.waiting:
            return
        asked.waiting.discard(node)
        asked.left[node] = n
        if not asked.waiting:
            self._settle(q, asked)

    def _settle(self, q: BrokerQueue, asked: Asked) -> None:
        """Every node asked answered (or went down): none has items left, so the consumers
        waiting here end; else they wait for the items their wants bring."""
        self.asked.pop(q.id, None)
        if any(asked.left.values()) or q.items or q.pending or self.held(q):
            return
        self.over.add(q.id)
        for w in list(q.getters):
            closed = QueueClosed(f"queue {q.name!r} is closed and drained on every node")
            self.queues.objects.answer(w, reply_error(w.request.id, closed))

    def arrived(self, q: BrokerQueue) -> None:
        """An item lent to this node is in `q` (or was given back)."""
        self.close_if_done(q)
        if q.subs is None and q.closed and not q.items and q.getters and q.id not in self.over:
            self.supplies(q)  # (asks again: what the others have left may have changed)

    def beat(self, q: BrokerQueue) -> None:
        """A closing part closes once CLOSE_WAIT passed; a closed one whose consumers still
        wait asks the nodes up again what they have left."""
        self.close_if_done(q)
        if q.subs is None and q.closed and q.getters and not q.items and q.id not in self.asked:
            if not self.supplies(q):
                self._settle(q, Asked(set()))

    def met(self, q: BrokerQueue, node: str) -> None:
        """`node` has a part of `q`, new to this node: if `q` is closing or closed, it hears
        so (its part may be newer than the close)."""
        if q.closed or q.closing:
            self.links.after(node, {"op": "qclose", "queue": q.name})

    def let_go(self, node: str) -> None:
        """`node` restarted, or forgot this node: it is asked again what this node asked."""
        for qid, asked in self.asked.items():
            q = self.queues.by_id.get(qid)
            if node in asked.waiting and q is not None:
                self.links.after(node, {"op": "qleft", "queue": q.name})

    def node_down(self, node: str) -> None:
        """`node` is down: it is not waited for."""
        for qid, (waiting, _) in list(self.closing.items()):
            if node in waiting:
                waiting.discard(node)
                part = self.queues.by_id.get(qid)
                if part is not None:
                    self.close_if_done(part)
        for qid, asked in list(self.asked.items()):
            if node in asked.waiting:
                asked.waiting.discard(node)
                part = self.queues.by_id.get(qid)
                if part is not None and not asked.waiting:
                    self._settle(part, asked)
