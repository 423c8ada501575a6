"""Queues across the nodes of a cluster (Note [queues across nodes]): the consumers each node
wants items for, the subscribers each has, and the items lent to them. The items lent to
this node are arrivals.py's.

Note [queues across nodes]

Each node holds its own part of a queue: the items its producers put, bounded by its own
`maxsize`. A consumer takes from its node's part first; while it waits there, its node
says so to the other nodes with a part of the queue (`want`, the count of its consumers
waiting; the members, Note [queue homes] in queue_homes.py), and a member with items waiting
and no consumer of its own lends them, oldest first, to the nodes that want them in
turn:

    node c: a get waits ── want(q, 1) ──> node b: its oldest item leaves its part, pinned:
                                                  qitem(q, loan, layout, address)
    c takes a block in its part of q, NIXL READs the bytes, seals the item into its part
    (to the consumer waiting there) ── qtaken(loan) ──> b frees the item: its slot opens
    (once c's journal has the seal: Links.after)

A node whose consumers are at work (one asked within REPASS) wants AHEAD items more than
wait, less what its part holds: a stream's items come ahead of their gets, not one trip
each.

So an item is in one node's part at a time and is handed to one consumer: exactly once. A
node lends its items in order and seals what it received from one peer in the order it was
lent, so the items of one producer reach each consumer in the order they were put. A part
keeps each item's slot until the node that took it has it: a producer still waits while
its node's part is full.

More items may arrive than consumers wait (two peers lend to one want): they wait in the
part they came to, for its consumers. They are not lent on while that node has had a
consumer asking within REPASS seconds: an item lent on could reach a consumer elsewhere
after a later item of its producer. Only items whose consumers went away are, and those
may come out of order. An item lent to a node that goes down or restarts, or sent back
(`qback`: its queue went there), goes back to the front of its part. So the items a node took
just before it died, whose `qtaken` was lost with it (its consumers' and those it took
AHEAD, at most), are handed out again: across a node's death a queue is at least once, not
exactly once. (A lender that dies is not the case: its
part is adopted as it was journaled, without the items it freed.)

A broadcast queue's part on each node has that node's subscribers; each node tells the
other members how many (`subs`). An item a producer seals is lent to every node with subscribers
(as it is published to its own), and each seals it into its part, for its subscribers: so
every subscriber gets every item put on any node once it was heard of there, each
producer's in order. The item keeps its slot until every node read it, and a node reads it
once fewer than `maxsize` items that arrived wait for its subscribers: so the producer
waits for the slowest subscriber on any node, and a part holds at most `maxsize` items of
its own producers and `maxsize` that arrived (each bound apart: two nodes whose parts are
full of items lent to each other must not wait for each other). Items that arrived are
never lent on.

Closing a queue on one node closes it on every node. The node where it is closed, and each
node that hears so, takes no more puts and says `qclose` to every node up, after the
items it lent before (and to a member it meets later: its part may be newer). A node's
part closes once it heard `qclose` from every node up (or CLOSE_WAIT passed) and the items
lent to it are in: so no item put before the close is left out. A consumer whose node's
part is closed and drained asks the nodes up what they have left (`qleft`), and waits while any has
items; QueueClosed once none has (queue_ends.py). Items in the part of a node that is down
are not waited for: they come when it is back. GPU items stay on their node.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from ..queues.queue_state import BrokerQueue
from ..queues.queues import Queues
from ..store.records import Session, StoredObject
from .arrivals import Arrival, Arrivals
from .queue_ends import QueueEnds
from .queue_homes import QueueHomes
from .records import Links
from .transfers import Transfers

REPASS = 5.0  # seconds without a consumer asking before items that arrived here are lent on
AHEAD = 4  # items a node with consumers at work takes ahead of their gets (a stream's pace)


class QueueLinks:
    """What the other nodes want of this node's parts (`wants`, `subs`) and the items lent
    to them (`loans`), Note [queues across nodes]. Queues calls `asked`, `item`, `published`,
    `closed` and `supplies`; the cluster hands this room its messages and calls `poll` every
    loop and `beat` every beat. Who has a part of each queue is `homes`' (queue_homes.py;
    `home`: a key's home among the nodes up, Homes.home)."""

    def __init__(
        self, node: str, queues: Queues, transfers: Transfers, links: Links, session: Session,
        home: Callable[[str], str],
    ) -> None:  # fmt: skip
        self.node, self.queues, self.registry = node, queues, queues.registry
        self.transfers, self.links, self.session = transfers, links, session
        self.arrivals = Arrivals(queues, transfers, links, session, self._arrival_over)
        self.homes = QueueHomes(node, links, home, self._met)
        self.ends = QueueEnds(queues, links, self.arrivals, self._held)  # queue_ends.py
        self.wants: dict[str, dict[str, int]] = {}  # queue -> node -> its consumers waiting
        self.subs: dict[str, dict[str, int]] = {}  # broadcast queue -> node -> its subscribers
        self.loans: dict[tuple[str, int], tuple[BrokerQueue, StoredObject]] = {}
        # node -> (since when, its loans held): a relink's (`let_go`)
        self._relinking: dict[str, tuple[float, set[tuple[str, int]]]] = {}
        self._said: dict[tuple[str, str], int] = {}  # (op, queue) -> what this node said last
        self._waited: dict[int, float] = {}  # part id -> when a consumer last asked in it
        self._ids = time.time_ns() // 1000  # loans: never one of this broker's last run
        self.bytes_sent = 0

    # -- what Queues tells and asks ---------------------------------------------------------------

    def opened(self, q: BrokerQueue) -> None:
        """`q` has a part here now: its home hears so (Note [queue homes])."""
        self.homes.joined(q.name, q.id)

    def asked(self, q: BrokerQueue) -> None:
        """A consumer asked for an item of `q` (took one, or waits): the peers hear how many
        wait."""
        self._waited[q.id] = time.monotonic()
        self._say(q)

    def item(self, q: BrokerQueue) -> None:
        """An item went to the back of ordinary queue `q`: a peer that wants one may get it."""
        self._lend(q)

    def published(self, q: BrokerQueue, obj: StoredObject, session: Session) -> None:
        """A producer here sealed `obj` into broadcast queue `q`: lent to every node with
        subscribers (never an item that arrived from another node: its own lender did)."""
        if session is self.session or obj.device != "cpu":
            return
        for node, n in self.subs.get(q.name, {}).items():
            if n and self.links.up(node):
                self._lend_to(node, q, obj, broadcast=True)

    def subscribed(self, q: BrokerQueue) -> None:
        """Subscriptions of broadcast queue `q` came or went: the peers hear how many."""
        self._say(q)

    def removed(self, name: str) -> None:
        """Queue `name` was removed here: its part on every other node goes too."""
        self.links.everyone_after({"op": "qremove", "queue": name})
        self._forget(name)

    def _forget(self, name: str) -> None:
        """This node's part of queue `name` (if it had one) was removed."""
        self.homes.left(name)
        for table in (self.wants, self.subs):
            table.pop(name, None)
        self._said.pop(("want", name), None)
        self._said.pop(("subs", name), None)

    def closed(self, q: BrokerQueue) -> None:
        """`q` is closed here: so it is on every node, and here once they all closed it."""
        self.ends.close(q)

    def supplies(self, q: BrokerQueue) -> bool:
        """Whether another node may still hand an item to a consumer of closed and drained
        `q` (QueueEnds.supplies)."""
        return self.ends.supplies(q)

    # -- wants, subscribers and loans (the lending side) ------------------------------------------

    def _say(self, q: BrokerQueue) -> None:
        """Tell the other members how many items `q`'s consumers want (those waiting, and
        AHEAD more while they asked within REPASS), or its subscribers, if that changed."""
        if q.subs is not None:
            op, n = "subs", len(q.subs)
        else:
            busy = time.monotonic() - self._waited.get(q.id, -REPASS) < REPASS
            op, n = "want", len(q.getters) + (max(0, AHEAD - len(q.items)) if busy else 0)
        if self._said.get((op, q.name), 0) != n:
            self._said[op, q.name] = n
            for node in self.homes.up(q.name):
                self.links.after(node, {"op": op, "queue": q.name, "n": n})

    def request(self, node: str, op: str, m: dict[str, Any]) -> None:
        """A message of `node`'s about queues (Note [queues across nodes])."""
        name = str(m.get("queue", ""))
        if op in ("want", "subs"):
            self.want(node, name, int(m["n"]), op)
        elif op == "qitem":
            self.arrivals.arrived(node, m)
        elif op in ("qtaken", "qback") and m.get("of") != self.links.incarnation:
            return  # about a loan of the broker this one replaced (loan ids are its own)
        elif op == "qtaken":
            self.taken(node, int(m["loan"]))
        elif op == "qback":
            self.back(node, int(m["loan"]))
        elif op == "qclose":
            self.ends.close_from(node, name, bool(m.get("echo")))
        elif op == "qremove":
            q = self.queues.by_name.get(name)
            if q is not None:
                self.queues.remove_part(q)
                self._forget(name)
        elif op == "qjoin":
            self.homes.join(node, name, int(m["part"]))
        elif op == "qleave":
            self.homes.leave(node, name, int(m["part"]))
        elif op == "qparts":
            self.homes.parts_of(node, m.get("parts", []))
        elif op == "qmembers":
            self.homes.heard(name, [str(n) for n in m["nodes"]])
        elif op == "qleft":
            self.ends.left(node, name)
        elif op == "qhas":
            self.ends.has(node, name, int(m["left"]))

    def want(self, node: str, name: str, n: int, op: str = "want") -> None:
        """`node` has `n` consumers waiting in its part of `name` (or, op "subs", `n`
        subscribers of broadcast queue `name`)."""
        (self.wants if op == "want" else self.subs).setdefault(name, {})[node] = n
        self.homes.heard(name, (node,))  # (it has a part: word enough, Note [queue homes])
        q = self.queues.by_name.get(name)
        if q is not None and op == "want":
            self._lend(q)

    def _lend(self, q: BrokerQueue) -> None:
        """Lend the oldest items of `q` to the peers that want them, one each in turn (this
        node's own consumers took theirs already: an item waits in `items` only when none
        waits here): not in the order the wants were heard, which starved the later node."""
        wants = self.wants.get(q.name)
        if not wants or q.subs is not None or q.removed:
            return
        repass = time.monotonic() - self._waited.get(q.id, 0.0) >= REPASS
        out = Counter(to for (to, _), (lq, _) in self.loans.items() if lq is q)
        while True:  # (one at a time, in turn: the node lent to goes to the back of `wants`)
            node = next((to for to, n in wants.items() if out[to] < n and self.links.up(to)), "")
            if not node or (obj := self._lendable(q, repass)) is None:
                break
            self._lend_to(node, q, obj)
            out[node] += 1
            wants[node] = wants.pop(node)
        self.queues.table.note_if_ended(q)

    def _lendable(self, q: BrokerQueue, repass: bool) -> StoredObject | None:
        """The oldest item of `q` that may be lent (taken out of it): a host item put here,
        or, `repass`, one that arrived here from another node too."""
        came = self.arrivals.came
        for i, obj in enumerate(q.items):
            if obj.device == "cpu" and (repass or obj.oid not in came):
                del q.items[i]
                came.discard(obj.oid)
                return obj
        return None

    def _lend_to(
        self, node: str, q: BrokerQueue, obj: StoredObject, broadcast: bool = False
    ) -> None:
        """Pin `obj` for `node` and say where its bytes are."""
        self._ids += 1
        self.registry.pin(obj)
        self.loans[node, loan := self._ids] = (q, obj)

        def qitem() -> dict[str, Any]:  # (made as it is sent: the agent metadata of then)
            return {
                "op": "qitem", "queue": q.name, "loan": loan, "broadcast": broadcast,
                "from": self.links.incarnation, **self.links.ack(node),
                **self.transfers.offer(obj, inline=True),
            }  # fmt: skip

        self.links.after(node, qitem)
        self.bytes_sent += obj.nbytes

    def hello(self, node: str, m: dict[str, Any]) -> None:
        """`node`'s hello or welcome `m` names the items it took of this node's whose
        `qtaken` may have been lost (Arrivals.taken): freed, before anything lent to it is
        put back in its part (a forget that follows). What a relink held lent to it goes
        back once `m` says it knows this node forgot it (`acked`): it dropped its reads of
        them then (a hello it sent before may come while it still reads one)."""
        for entry in m.get("qtaken", ()):
            try:
                loan, of = int(entry[0]), entry[1]
            except (TypeError, ValueError, IndexError):
                continue
            if of == self.links.incarnation:
                self.taken(node, loan)
        if self.links.acked(node, m):
            self._release(node)

    def _held(self, q: BrokerQueue) -> int:
        """The items of `q` a relink holds lent (`let_go`): they come back to its part."""
        keys = (k for _, held in self._relinking.values() for k in held)
        return sum(1 for k in keys if k in self.loans and self.loans[k][0] is q)

    def _release(self, node: str) -> None:
        """What a relink held lent to `node` (`let_go`) goes back to the front of its parts."""
        held = self._relinking.pop(node, None)
        for key in sorted(held[1] if held else (), reverse=True):
            if key in self.loans:
                self._back(*self.loans.pop(key))

    def taken(self, node: str, loan: int) -> None:
        """`node` has the item it was lent: an ordinary queue's is freed here, its slot
        opens; a broadcast queue's, once this node's subscribers have it too."""
        lent = self.loans.pop((node, loan), None)
        if lent is not None:
            q, obj = lent
            if q.subs is None:
                self.registry.retire(obj)
            self.registry.unpin(obj)
            self.queues.table.note_if_ended(q)

    def back(self, node: str, loan: int) -> None:
        """`node` could not take the item it was lent: back to the front of its part (a
        broadcast item: that node's subscribers go without it)."""
        lent = self.loans.pop((node, loan), None)
        if lent is not None:
            self._back(*lent)

    def _back(self, q: BrokerQueue, obj: StoredObject) -> None:
        self.registry.unpin(obj)
        if q.subs is None:
            self.queues.requeue(q, obj)

    def _arrival_over(self, a: Arrival, delivered: bool) -> None:
        """An item lent to this node is in its part (or was given back)."""
        if a.q.subs is None:
            self._say(a.q)
        self.ends.arrived(a.q)

    # -- the loop, and peers coming and going -----------------------------------------------------

    def beat(self) -> None:
        """The wants and subscribers said again (consumers that gave up leave no stale
        want), items that arrived here and wait without a consumer lent on, and closed parts
        whose consumers still wait: the peers are asked again what they have left."""
        for q in list(self.queues.by_name.values()):
            self._say(q)
            if q.subs is None and q.items and self.wants.get(q.name):
                self._lend(q)
            self.ends.beat(q)
        self.homes.sync(self._parts())
        self.arrivals.forget_taken()
        since = self.arrivals.taken_since()  # (a relink holds no longer than that)
        for node in [n for n, (t, _) in self._relinking.items() if t < since]:
            self._release(node)
        self.arrivals.came.intersection_update(
            o.oid for q in self.queues.by_name.values() for o in q.items
        )

    def let_go(self, node: str, hold: bool = False) -> None:
        """`node` went down, or restarted: what it was lent goes back to the front of its
        parts; what it was lending here is dropped (it has the items still); its wants go
        (it says them again), and it is asked again what this node asked it. `hold`: the
        two forgot each other to link again (Note [beats]), both up: what it was lent stays
        lent until its hello or welcome says which it took (`hello`; Note in arrivals.py),
        TAKEN_FOR down_afters at most."""
        keys = sorted((k for k in self.loans if k[0] == node), reverse=True)
        if hold:
            since, held = self._relinking.get(node, (time.monotonic(), set()))
            self._relinking[node] = (since, held | set(keys))
        else:
            self._relinking.pop(node, None)
            for key in keys:
                self._back(*self.loans.pop(key))
        self.arrivals.node_down(node)
        for by_node in [*self.wants.values(), *self.subs.values()]:
            by_node.pop(node, None)
        self.ends.let_go(node)

    def node_down(self, node: str, hold: bool = False) -> None:
        """`node` is down: as `let_go`, and it is not waited for; the queues' homes may have
        moved."""
        self._moved()
        self.let_go(node, hold)
        self.ends.node_down(node)

    def node_up(self, node: str) -> None:
        """`node` (re)joined: the queues' homes may have moved (and one there may have
        forgotten its members); it hears what this node said of the queues it is a member
        of."""
        self.homes.node_up(node)
        self._moved()
        for name, members in self.homes.members.items():
            if node in members:
                self._met(name, node)  # (said again: it may have missed it while down)

    def _moved(self) -> None:
        """The nodes up changed: each queue's home may have moved (and the parts adopted
        from the journal are said to theirs: Queues.adopt does not call `opened`)."""
        self.homes.sync(self._parts())
        self.homes.changed()

    def _parts(self) -> dict[str, int]:
        """This node's parts: queue name -> part id."""
        return {q.name: q.id for q in self.queues.by_name.values()}

    def _say_to(self, node: str, name: str) -> None:
        """Tell `node` the wants or subscribers this node said last of queue `name`."""
        for op in ("want", "subs"):
            if n := self._said.get((op, name), 0):
                self.links.after(node, {"op": op, "queue": name, "n": n})

    def _met(self, name: str, node: str) -> None:
        """`node` has a part of queue `name`, new to this node (Note [queue homes]), or
        came up again: it hears what the other members heard (wants, subscribers, the
        close)."""
        self._say_to(node, name)
        q = self.queues.by_name.get(name)
        if q is not None:
            self.ends.met(q, node)
