"""Which nodes hear of a queue (Note [queue homes] in server/cluster/queue_homes.py): only
those with a part of it, which learn each other from the queue's home. Cluster objects
stepped by hand in this process (tests/nodes.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tensorbroker.common.protocol import Request
from tensorbroker.server.cluster.queue_homes import KEY, QueueHomes
from tensorbroker.server.cluster.rendezvous import homes_of
from tests.nodes import Node, run, trio

__all__ = ["trio"]  # the fixture


def _homed(home: str, names: str = "abc") -> str:
    """A queue name whose home is node `home` among nodes `names`, all up."""
    members = tuple(sorted(names))
    return next(
        q for q in (f"q{i}" for i in range(10_000)) if homes_of(KEY + q, members)[0] == home
    )


def _up(trio: Callable[[str], Node]) -> list[Node]:
    nodes = [trio(n) for n in "abc"]
    assert run(nodes, 5, lambda: all(n.up(o.name) for n in nodes for o in nodes if n is not o))
    return nodes


def _close(node: Node, name: str) -> None:
    node.queues.close(
        node.session, b"client", Request("close", 2, {"queue": node.queue(name).id}, [])
    )


def test_a_node_with_no_part_of_a_queue_hears_nothing_of_its_consumers(
    trio: Callable[[str], Node],
) -> None:
    """a and b have parts of a queue, c none: a's waiting consumer is told to b only (a
    change of a queue's consumers costs the nodes that use it, not all)."""
    a, b, c = nodes = _up(trio)
    name = _homed("c")  # (its home is c: c keeps its members, and still hears none of it)
    b.queue(name)
    a.cluster.queues.asked(a.queue(name))
    assert run(nodes, 3, lambda: b.cluster.queues.wants.get(name) == {"a": 4})
    _close(a, name)
    assert run(nodes, 3, lambda: b.queue(name).closed and a.queue(name).closed)
    run(nodes, 0.2)
    assert not c.cluster.queues.wants and name not in c.queues.by_name
    assert set(c.cluster.queues.homes.kept[name]) == {"a", "b"}
    assert ("sent", "want") not in c.journal.events


def test_a_part_made_after_a_consumer_waits_lends_to_it(trio: Callable[[str], Node]) -> None:
    """a's consumer waits on a queue no other node has a part of; c makes its part later and
    a producer there puts an item: c meets a through the queue's home (b), hears a's want,
    and lends the item."""
    a, b, c = nodes = _up(trio)
    name = _homed("b")
    a.cluster.queues.asked(a.queue(name))
    run(nodes, 0.2)
    c.queue_put(name, 4096)
    assert run(nodes, 3, lambda: a.reads.started == [name])
    assert not b.cluster.queues.wants and name not in b.queues.by_name


def test_the_members_of_a_queue_are_learned_again_by_its_home_restarted(
    trio: Callable[[str], Node],
) -> None:
    """A queue's home keeps its members in memory only: c, the home, restarts and forgets
    them. a, a member, says so again when it hears c's hello: b, whose part is made after,
    still meets a, and a's item reaches b's consumer."""
    a, b, c = nodes = _up(trio)
    name = _homed("c")
    a.queue_put(name, 4096)
    assert run(nodes, 3, lambda: set(c.cluster.queues.homes.kept.get(name, ())) == {"a"})
    c.close()  # it crashed
    nodes[2] = c = trio("c")
    assert run(nodes, 5, lambda: c.up("a") and c.up("b") and a.up("c") and b.up("c"))
    assert run(nodes, 3, lambda: set(c.cluster.queues.homes.kept.get(name, ())) == {"a"})
    b.cluster.queues.asked(b.queue(name))
    assert run(nodes, 3, lambda: b.reads.started == [name])


def test_a_member_restarted_without_its_part_is_forgotten_by_the_home(
    trio: Callable[[str], Node],
) -> None:
    """a and b have parts of a queue homed at c; a crashes and comes back without them (a
    new process, no state). At its hello c forgets a's part."""
    a, b, c = nodes = _up(trio)
    name = _homed("c")
    a.queue(name)
    b.queue(name)
    assert run(nodes, 3, lambda: b.cluster.queues.homes.up(name) == ["a"])
    a.close()  # it crashed
    nodes[0] = a = trio("a")
    assert run(nodes, 5, lambda: a.up("c") and c.up("a") and a.up("b") and b.up("a"))
    assert run(nodes, 3, lambda: set(c.cluster.queues.homes.kept.get(name, ())) == {"b"})


def test_a_queue_closed_before_a_node_made_its_part_is_closed_there_too(
    trio: Callable[[str], Node],
) -> None:
    """close() on any node closes the queue on every node: also on one whose part is made
    after the close (it meets the closed part's node)."""
    a, b, c = nodes = _up(trio)
    name = _homed("a")
    a.queue(name)
    run(nodes, 0.2)
    _close(a, name)
    assert run(nodes, 3, lambda: a.queue(name).closed)
    b.queue(name)
    assert run(nodes, 3, lambda: b.queue(name).closed)


def test_a_queue_removed_and_made_again_at_once_is_one_queue_again(
    trio: Callable[[str], Node],
) -> None:
    """delete_queue on c, which has no part of the queue: a's and b's parts go, and its home
    (a) forgets them. b makes its part again at once, and a too: they meet again (the
    home keeps b's new part, not the one removed), and b's item reaches a's consumer."""
    a, b, c = nodes = _up(trio)
    name = _homed("a")
    a.queue(name)
    b.queue(name)
    assert run(nodes, 3, lambda: set(a.cluster.queues.homes.kept.get(name, ())) == {"a", "b"})
    c.queues.remove(c.session, b"client", Request("delete_queue", 3, {"name": name}, []))
    assert run(nodes, 3, lambda: name not in a.queues.by_name and name not in b.queues.by_name)
    b.queue_put(name, 4096)
    a.cluster.queues.asked(a.queue(name))
    assert run(nodes, 3, lambda: a.reads.started == [name])
    assert a.cluster.queues.homes.kept[name] == {"a": a.queue(name).id, "b": b.queue(name).id}


def test_a_close_then_a_remove_leaves_no_close_going_back_and_forth(
    trio: Callable[[str], Node],
) -> None:
    """A queue closed and at once removed on a: a and c, with no part of it then, answer
    each other's qclose once, not for good (the loop would never sleep)."""
    a, b, c = nodes = _up(trio)
    name = _homed("b")
    a.queue(name)
    b.queue(name)
    run(nodes, 0.2)
    _close(a, name)
    a.queues.remove(a.session, b"client", Request("delete_queue", 3, {"name": name}, []))
    run(nodes, 0.5)
    closes = [e for n in nodes for e in n.journal.events if e == ("sent", "qclose")]
    run(nodes, 0.5)
    assert [e for n in nodes for e in n.journal.events if e == ("sent", "qclose")] == closes


def test_a_part_forgotten_or_made_again_is_said_to_its_home() -> None:
    """The parts a node said to their homes follow its queue table (QueueHomes.sync): an
    old ended queue the table forgot leaves its home (`qleave`), and a part made again
    under that name joins with its new id (its home would otherwise keep the old one)."""
    sent: list[tuple[str, dict[str, Any]]] = []

    class Links:
        def after(self, node: str, message: dict[str, Any]) -> None:
            sent.append((node, message))

        def up(self, node: str) -> bool:
            return True

    homes = QueueHomes("a", Links(), lambda key: "h", lambda name, node: None)  # type: ignore[arg-type]
    homes.sync({"q": 1})
    homes.sync({})  # (the table forgot it)
    homes.sync({"q": 7})
    ops = [(m["op"], m["part"]) for _, m in sent]
    assert ops == [("qjoin", 1), ("qleave", 1), ("qjoin", 7)] and {n for n, _ in sent} == {"h"}


class _Net:
    """QueueHomes of named nodes, each `after` delivered at once unless its node is `down`
    (then lost); every queue's home is h."""

    def __init__(self, names: str) -> None:
        self.down: set[str] = set()
        self.nodes: dict[str, QueueHomes] = {}
        for name in names:
            self.start(name)

    def start(self, name: str) -> QueueHomes:
        """Node `name`, new (or restarted without its state)."""
        net = self

        class Links:
            def after(self, node: str, m: dict[str, Any]) -> None:
                if node in net.down:
                    return  # (lost)
                to, op = net.nodes[node], m["op"]
                if op == "qjoin":
                    to.join(name, m["queue"], m["part"])
                elif op == "qleave":
                    to.leave(name, m["queue"], m["part"])
                elif op == "qparts":
                    to.parts_of(name, m["parts"])
                elif op == "qmembers":
                    to.heard(m["queue"], m["nodes"])

            def up(self, node: str) -> bool:
                return node not in net.down

        homes = QueueHomes(name, Links(), lambda key: "h", lambda q, n: None)  # type: ignore[arg-type]
        self.nodes[name] = homes
        return homes


def test_a_part_whose_leave_was_lost_while_its_home_was_down_is_forgotten_at_its_hello() -> None:
    """A `qleave` to a home that is down is lost, and the home kept the part as a member
    (told to the others, who said their wants to a node with no part). When the home says
    hello again, the node says which parts it may keep (`qparts`), and the home forgets the
    others."""
    net = _Net("ah")
    a, h = net.nodes["a"], net.nodes["h"]
    a.sync({"q1": 1, "q2": 2})
    assert h.kept == {"q1": {"a": 1}, "q2": {"a": 2}}
    net.down.add("h")
    a.sync({"q2": 2})  # q1's part removed: its qleave lost
    net.down.clear()
    assert h.kept["q1"] == {"a": 1}
    a.node_up("h")
    assert h.kept == {"q2": {"a": 2}}
    a.node_up("h")  # (again: the same)
    assert h.kept == {"q2": {"a": 2}}


def test_a_node_restarted_without_its_state_leaves_its_queues_at_its_hello() -> None:
    """a had a part of q, and restarts without its state: it has no part left to say
    leaves, and knows no home it told. At its hello the home (h) forgets a's old part: a
    node that opens q later is not told of a."""
    net = _Net("ahm")
    net.nodes["a"].sync({"q": 1})
    m, h = net.nodes["m"], net.nodes["h"]
    m.sync({"q": 5})
    assert h.kept == {"q": {"a": 1, "m": 5}} and m.up("q") == ["a"]
    a = net.start("a")  # restarted, its state lost
    a.node_up("h")
    assert h.kept == {"q": {"m": 5}}
    c = net.start("c")
    c.sync({"q": 3})
    assert c.up("q") == ["m"]
    a.sync({"q": 9})  # it opens q again: a member again, and met
    assert h.kept == {"q": {"m": 5, "c": 3, "a": 9}} and sorted(a.up("q")) == ["c", "m"]
