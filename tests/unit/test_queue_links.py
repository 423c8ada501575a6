"""Queue items lent between the brokers of a cluster (Note [queues across nodes] in
server/queue_links.py): Cluster objects stepped by hand in this process (tests/nodes.py)."""

from __future__ import annotations

from collections.abc import Callable

from tests.nodes import Node, pair, run

__all__ = ["pair"]  # the fixture


def _lent_to_b(pair: Callable[[str], Node], items: int = 1) -> tuple[Node, Node]:
    """a with `items` items of queue q, b with a consumer at work: a lends them to b."""
    a, b = pair("a"), pair("b")
    assert run([a, b], 5, lambda: a.up("b") and b.up("a") and b.cluster.links.fresh("a"))
    for _ in range(items):
        a.queue_put("q", 4096)
    b.cluster.queues.asked(b.queue("q"))  # (it wants AHEAD items)
    assert run([a, b], 3, lambda: len(b.reads.started) == items)
    return a, b


def test_an_item_is_said_taken_only_once_the_journal_has_it(
    pair: Callable[[str], Node],
) -> None:
    """b reads an item a lent it and seals it into its part. a frees the item when b says
    it has it: so b must not say so before its journal has the seal, or a broker killed in
    between loses the item on both nodes."""
    a, b = _lent_to_b(pair)
    b.reads.over = True
    assert run([a, b], 3, lambda: not a.cluster.queues.loans)
    events = b.journal.events
    assert ("sealed", "q") in events
    assert events.index(("sealed", "q")) < events.index(("sent", "qtaken"))
    assert len(b.queue("q").items) == 1 and not a.queue("q").items


def test_an_item_lent_before_its_lender_knew_it_was_forgotten_is_given_back_unread(
    pair: Callable[[str], Node],
) -> None:
    """a takes b for down (a's link to b stalls; b's to a works) and forgets it. b says hello
    again and, before it reads a's welcome (which says a forgot it), lends a an item: b lets
    it go once it knows, so a must not keep it (to read once b is fresh again: by then the
    item may be another consumer's)."""
    a, b = pair("a"), pair("b")
    assert run([a, b], 5, lambda: a.up("b") and b.up("a") and a.cluster.links.fresh("b"))
    q = a.queue("q")
    a.cluster.queues.asked(q)
    assert run([a, b], 3, lambda: bool(b.cluster.queues.wants.get("q")))
    router = b.cluster.links.router
    while a.up("b"):
        a.step()
        b.step(skip=router)  # nothing comes in from a's link: a hears no beat answered
    link = b.cluster.links.peer("a")
    assert link is not None and link.up
    b.cluster._answer(link, {"op": "hello_first"})  # (a did not know b's route any more)
    a.step()  # a knows b's route again, and welcomes it
    b.queue_put("q", 4096)  # lent to a before b reads the welcome
    b.cluster.flush()
    assert b.cluster.queues.loans
    for _ in range(5):
        a.step()
    assert not a.cluster.queues.arrivals.of(q) and not a.reads.started


def test_an_item_is_not_read_after_its_lender_may_have_taken_this_node_for_down(
    pair: Callable[[str], Node],
) -> None:
    """a's loop pauses with an item b lent it unread; b takes a for down, and the item goes
    back to b's part (and may go to a consumer there, and be freed). When a resumes it
    handles the item before its own tick: it must not read it."""
    a, b = pair("a"), pair("b")
    assert run([a, b], 5, lambda: a.up("b") and b.up("a") and a.cluster.links.fresh("b"))
    a.cluster.queues.asked(a.queue("q"))
    assert run([a, b], 3, lambda: bool(b.cluster.queues.wants.get("q")))
    b.queue_put("q", 4096)
    b.step()
    assert b.cluster.queues.loans
    while b.up("a"):  # a's loop pauses
        b.step()
    assert not b.cluster.queues.loans and len(b.queue("q").items) == 1
    a.step()
    assert not a.reads.started
    a.cluster.queues.asked(a.queue("q"))  # (its consumer asks again: still at work)
    a.reads.over = True
    assert run([a, b], 5, lambda: a.up("b") and b.up("a") and len(a.queue("q").items) == 1)
    assert not b.queue("q").items  # lent again once a was back, and read then


def test_an_item_lent_while_the_link_reconnects_goes_once_it_is_back(
    pair: Callable[[str], Node],
) -> None:
    """b lends a an item while b's link to a is reconnecting (within DOWN_AFTER: a is still
    up): the item must reach a once the link is back, not stay lent to a for good."""
    a, b = pair("a"), pair("b")
    assert run([a, b], 5, lambda: a.up("b") and b.up("a") and a.cluster.links.fresh("b"))
    a.cluster.queues.asked(a.queue("q"))
    assert run([a, b], 3, lambda: bool(b.cluster.queues.wants.get("q")))
    link = b.cluster.links.peer("a")
    assert link is not None
    link.socket.disconnect(link.address)
    b.queue_put("q", 4096)
    b.step()
    assert b.cluster.queues.loans and b.up("a")
    link.socket.connect(link.address)
    assert run([a, b], 3, lambda: bool(a.reads.started))
