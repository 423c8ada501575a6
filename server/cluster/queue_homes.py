"""Which nodes have a part of each queue, found in O(1) whatever the cluster's size (Note
[queue homes]).

Note [queue homes]

A queue's wants, subscribers, close and remove (Note [queues across nodes] in
queue_links.py) went to every node: a change in a queue's consumers cost each of N nodes a
message, and with etcd put every link in use (Note [beats]). Now they go only to the nodes
with a part of the queue, its members, which each member learns from the queue's home:

    node b opens q (its part is made, or adopted) ── qjoin(q) ──> q's home h (rendezvous
    hashing over the nodes up, as a key's: Note [homes]) keeps b among q's members, and
    answers ── qmembers(q, [a, c]) ──> b; and tells a and c ── qmembers(q, [b]) ──>

A member that meets another (`met`) says to it what it said to the members before: its
wants or subscribers, and its close (queue_links.py). A node with no part of a queue hears
nothing of it; a remove said on such a node goes to the queue's home, which says it to the
members.

The home keeps its members in memory only. A member says qjoin again to each queue's home
when the home changes (a join or a leave: `changed`) and when it says hello again (it
restarted, or forgot this node: `node_up`), so a home that restarted, or a new one, learns
every member again. Members stay members while down (a node that restarts on its state
keeps its parts): what is said to them waits for their links to be up (Links.after). While
the nodes do not agree on who is up, two members may register at two homes and not meet
until they agree: within a beat of a join or a leave (as a key's lookup, Note [homes]).
"""

from __future__ import annotations

from collections.abc import Callable

from .records import Links

KEY = "\0queue "  # a queue's home is the home of key KEY + its name (Note [homes])


class QueueHomes:
    """The members of the queues with a part here (`members`, told by their homes), and
    the members of the queues homed here (`kept`). `home(key)` is a key's home among the
    nodes up (Homes.home); `met(name, node)` is told each member new to this node."""

    def __init__(
        self, node: str, links: Links, home: Callable[[str], str], met: Callable[[str, str], None]
    ) -> None:
        self.node, self.links, self.met = node, links, met
        self._home = home
        self.members: dict[str, set[str]] = {}  # a queue with a part here -> the other members
        self.registered: dict[str, str] = {}  # a queue with a part here -> its home when told
        self.kept: dict[str, set[str]] = {}  # a queue homed here -> its members

    def home(self, name: str) -> str:
        """Queue `name`'s home among the nodes up."""
        return self._home(KEY + name)

    def up(self, name: str) -> list[str]:
        """The other members of queue `name` that are up."""
        return [n for n in self.members.get(name, ()) if self.links.up(n)]

    def joined(self, name: str) -> None:
        """This node has a part of queue `name` (opened, or adopted): its home hears so."""
        if name not in self.registered:
            self.members.setdefault(name, set())
            self._register(name)

    def _register(self, name: str) -> None:
        home = self.registered[name] = self.home(name)
        if home == self.node:
            self.join(self.node, name)
        else:
            self.links.after(home, {"op": "qjoin", "queue": name})

    def join(self, node: str, name: str) -> None:
        """`node` has a part of queue `name`, homed here (`qjoin`): it hears of the other
        members, and they of it if it is new."""
        kept = self.kept.setdefault(name, set())
        others, new = kept - {node}, node not in kept
        kept.add(node)
        self._tell(node, name, others)
        for other in others if new else ():
            self._tell(other, name, {node})

    def _tell(self, to: str, name: str, nodes: set[str]) -> None:
        if not nodes:
            return
        if to == self.node:
            self.heard(name, nodes)
        else:
            self.links.after(to, {"op": "qmembers", "queue": name, "nodes": sorted(nodes)})

    def heard(self, name: str, nodes: list[str] | set[str]) -> None:
        """`nodes` have a part of queue `name` (its home says, `qmembers`): those new to this
        node are met. Nothing if this node has no part of it (it was removed meanwhile)."""
        members = self.members.get(name)
        if members is None:
            return
        for node in nodes:
            if node != self.node and node not in members:
                members.add(node)
                self.met(name, node)

    def changed(self) -> None:
        """The nodes up changed: each queue whose home moved is said to its new home; the
        members of queues no longer homed here are dropped (their new home learns them)."""
        for name, home in list(self.registered.items()):
            if self.home(name) != home:
                self._register(name)
        for name in [n for n in self.kept if self.home(n) != self.node]:
            del self.kept[name]

    def node_up(self, node: str) -> None:
        """`node` said hello again (it restarted, or forgot this node): the queues homed
        there are said to it again."""
        for name, home in list(self.registered.items()):
            if home == node:
                self._register(name)

    def removed(self, name: str, by: str | None = None) -> list[str]:
        """Queue `name` was removed here: the nodes that must hear so. Removed by a client
        here: its other members known here and its home, which says it to the members it
        keeps. Removed by `by` (`qremove`): the members kept here, if its home, but `by`.
        This node forgets the queue's members."""
        told = self.kept.pop(name, set())
        self.registered.pop(name, None)
        if by is None:
            told |= self.members.get(name, set()) | {self.home(name)}
        self.members.pop(name, None)
        return sorted(told - {self.node, by})
