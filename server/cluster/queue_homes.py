"""Which nodes have a part of each queue, found in O(1) whatever the cluster's size (Note
[queue homes]).

Note [queue homes]

A queue's wants and subscribers (Note [queues across nodes] in queue_links.py) went to
every node: a change in a queue's consumers cost each of N nodes a message, and with etcd
put every link in use (Note [beats]). Now they go only to the nodes with a part of the
queue, its members, which each member learns from the queue's home:

    node b opens q (its part is made, or adopted) ── qjoin(q, part) ──> q's home h
    (rendezvous hashing over the nodes up, as a key's: Note [homes]) keeps b's part among
    q's, and answers ── qmembers(q, [a, c]) ──> b; and tells a and c ── qmembers(q, [b]) ──>

A member that meets another (`met`) says to it what it said to the members before: its
wants or subscribers, and its close. A want or a subscriber count from a node is word
enough that it is a member. A node with no part of a queue hears nothing of its wants.
A queue's end, rare, still goes to every node up (a close, what is left, a remove: that
way no part is missed while its node is not yet known to the others); a part removed says
`qleave(q, part)` to each home it told of it, which forgets that part (and not one made
since on the same node: the ids tell them apart).

The home keeps its members in memory only. A member says qjoin again when the queue's
home changes (a join or a leave: `changed`) and when the home says hello again (it
restarted, or forgot this node: `node_up`); the home tells a member that says hello again
of the others. So a home that restarted, or a new one, learns every member again. A home
keeps what it was told after it no longer is one (a node may register with it before it
agrees that it is the home: it would not say so again), until the part leaves. A `qleave`
to a home that is down is lost, and a node that restarts without its state has no part
left to say leaves: so at each hello a node says to the other which parts it may keep
(`qparts`, none if it told it of none), and that one forgets the others. Members stay
members while down (a node that restarts on its state keeps its parts): what is said to
them waits for their links to be up. While the nodes do not agree on who is up, two
members may register at two homes and not meet until they agree: within a beat of a join
or a leave (as a key's lookup, Note [homes]). A member never forgets another (but for a
queue's end): a node whose part left stays among the others' members, who say their wants
to it for nothing. A home telling them so (tried, and reverted) could make a member forget
a node that still has a part for good: a home in its own view only infers a leave from
`qparts` that a node with a part sends it, and what members hear is a node, not a part.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .records import Links

KEY = "\0queue "  # a queue's home is the home of key KEY + its name (Note [homes])


class QueueHomes:
    """The members of the queues with a part here (`members`, told by their homes), and the
    parts of the queues homed here (`kept`). `home(key)` is a key's home among the nodes up
    (Homes.home); `met(name, node)` is told each member new to this node."""

    def __init__(
        self, node: str, links: Links, home: Callable[[str], str], met: Callable[[str, str], None]
    ) -> None:
        self.node, self.links, self._home, self.met = node, links, home, met
        self.members: dict[str, set[str]] = {}  # a queue with a part here -> the other members
        # a queue with a part here -> (the part's id, its home when last told, the homes told)
        self.registered: dict[str, tuple[int, str, set[str]]] = {}
        self.kept: dict[str, dict[str, int]] = {}  # a queue homed here -> node -> its part

    def home(self, name: str) -> str:
        """Queue `name`'s home among the nodes up."""
        return self._home(KEY + name)

    def up(self, name: str) -> list[str]:
        """The other members of queue `name` that are up."""
        return [n for n in self.members.get(name, ()) if self.links.up(n)]

    def joined(self, name: str, part: int) -> None:
        """This node has part `part` of queue `name` (opened, or adopted): its home hears."""
        if name not in self.registered:
            self.members.setdefault(name, set())
            self.registered[name] = (part, "", set())
            self._register(name)

    def _register(self, name: str) -> None:
        part, _, told = self.registered[name]
        home = self.home(name)
        told.add(home)
        self.registered[name] = (part, home, told)
        if home == self.node:
            self.join(self.node, name, part)
        else:
            self.links.after(home, {"op": "qjoin", "queue": name, "part": part})

    def join(self, node: str, name: str, part: int) -> None:
        """`node` has part `part` of queue `name`, homed here (`qjoin`): it hears of the other
        members, and they of it."""
        kept = self.kept.setdefault(name, {})
        kept[node] = part
        others = set(kept) - {node}
        self._tell(node, name, others)
        for other in others:
            self._tell(other, name, {node})

    def _tell(self, to: str, name: str, nodes: set[str]) -> None:
        if not nodes:
            return
        if to == self.node:
            self.heard(name, nodes)
        else:
            self.links.after(to, {"op": "qmembers", "queue": name, "nodes": sorted(nodes)})

    def heard(self, name: str, nodes: Iterable[str]) -> None:
        """`nodes` have a part of queue `name` (its home says, `qmembers`, or one of them
        said its wants): those new to this node are met. Nothing if this node has no part
        of it."""
        members = self.members.get(name)
        if members is None:
            return
        for node in nodes:
            if node != self.node and node not in members:
                members.add(node)
                self.met(name, node)

    def sync(self, parts: dict[str, int]) -> None:
        """The parts said to their homes are this node's `parts` (queue name -> part id):
        one gone (an old ended queue the table forgot: queue_state.py ENDED_QUEUES) leaves,
        one new (adopted, or made again under that name) joins."""
        for name, (part, _, _) in list(self.registered.items()):
            if parts.get(name) != part:
                self.left(name)
        for name, part in parts.items():
            self.joined(name, part)

    def changed(self) -> None:
        """The nodes up changed: each queue whose home moved is said to its new home."""
        for name, (_, home, _) in list(self.registered.items()):
            if self.home(name) != home:
                self._register(name)

    def node_up(self, node: str) -> None:
        """`node` said hello (again: it restarted, or forgot this node): the queues homed
        there are said to it again, then every part it was told of and may keep (`qparts`:
        it forgets the others, whose `qleave` it may have missed while down, or that this
        node had before it restarted without its state); and it hears of the members of
        those homed here."""
        for name, (_, home, _) in list(self.registered.items()):
            if home == node:
                self._register(name)
        parts = [[n, part] for n, (part, _, told) in self.registered.items() if node in told]
        self.links.after(node, {"op": "qparts", "parts": parts})
        for name, kept in self.kept.items():
            if node in kept:
                self._tell(node, name, set(kept) - {node})

    def parts_of(self, node: str, parts: Iterable[Any]) -> None:
        """`node`'s parts of the queues it told this one of are `parts` ([[name, part id],
        ...], `qparts`): the others it kept here left."""
        listed = {str(name): int(part) for name, part in parts}
        for name, kept in list(self.kept.items()):
            if node in kept and listed.get(name) != kept[node]:
                self.leave(node, name, kept[node])

    def left(self, name: str) -> None:
        """This node's part of queue `name` was removed: each home told of it forgets it,
        and this node the members."""
        self.members.pop(name, None)
        registered = self.registered.pop(name, None)
        if registered is not None:
            part, _, told = registered
            for home in told:
                if home == self.node:
                    self.leave(self.node, name, part)
                else:
                    self.links.after(home, {"op": "qleave", "queue": name, "part": part})

    def leave(self, node: str, name: str, part: int) -> None:
        """`node`'s part `part` of queue `name` was removed (`qleave`). The other members
        still count `node` among theirs (Note [queue homes]: what they hear of it is a
        node, not a part, and a home may be one in its own view only)."""
        kept = self.kept.get(name, {})
        if kept.get(node) == part:
            del kept[node]
            if not kept:
                del self.kept[name]
