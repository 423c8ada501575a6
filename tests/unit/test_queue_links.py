"""Queue items lent between the brokers of a cluster (Note [queues across nodes] in
server/cluster/queue_links.py): Cluster objects stepped by hand in this process (tests/nodes.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from tensorbroker.common.protocol import Request
from tests.nodes import Node, pair, run, trio

__all__ = ["pair", "trio"]  # the fixtures


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
    b.queue("q")  # (a part of q: b hears the wants, Note [queue homes])
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
    b.queue("q")  # (a part of q: b hears the wants, Note [queue homes])
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
    b.queue("q")  # (a part of q: b hears the wants, Note [queue homes])
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


def test_an_item_lent_to_a_node_restarted_before_its_lender_knew_is_not_read(
    pair: Callable[[str], Node],
) -> None:
    """a restarts within DOWN_AFTER: b still holds a up, with the old a's want. b says hello
    to the new a (a's beat said hello_first) and lends it an item before it reads the new
    a's hello: b lets the item go once it knows, so the new a must not read it (one item in
    two parts)."""
    a, b = pair("a"), pair("b")
    assert run([a, b], 5, lambda: a.up("b") and b.up("a") and a.cluster.links.fresh("b"))
    b.queue("q")  # (a part of q: b hears the wants, Note [queue homes])
    a.cluster.queues.asked(a.queue("q"))
    assert run([a, b], 3, lambda: bool(b.cluster.queues.wants.get("q", {}).get("a")))
    a.close()  # it crashed
    a = pair("a")
    a.queue("q")
    router, mark = b.cluster.links.router, len(b.journal.events)
    end = time.monotonic() + 3
    while ("sent", "hello") not in b.journal.events[mark:] and time.monotonic() < end:
        b.step(skip=router)  # the new a's hello not read yet
        a.step()
    assert ("sent", "hello") in b.journal.events[mark:] and b.up("a")
    b.queue_put("q", 4096)  # lent to a, on the old a's want
    b.cluster.flush()
    assert b.cluster.queues.loans
    a.reads.over = True
    run([a, b], 3, lambda: len(a.queue("q").items) + len(b.queue("q").items) == 2)
    assert not a.reads.started
    assert not b.cluster.queues.loans and len(b.queue("q").items) == 1


def _pause(node: Node, others: list[Node], seconds: float) -> None:
    """`node`'s loop pauses (a long request, say) while the others' run."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for n in others:
            n.step()


def test_items_read_just_before_a_pause_under_down_after_are_read_again_not_reversed(
    pair: Callable[[str], Node],
) -> None:
    """b lends a three items of one producer; their reads end, then a's loop pauses 1.6 s
    (b holds a up still). a's bound on b passed meanwhile: it reads them again once b is
    fresh, and seals them in their order (given back instead, they went to the front of b's
    part one by one: reversed)."""
    a, b = pair("a"), pair("b")
    assert run([a, b], 5, lambda: a.up("b") and b.up("a") and a.cluster.links.fresh("b"))
    for _ in range(3):
        b.queue_put("q", 4096)
    a.cluster.queues.asked(a.queue("q"))
    assert run([a, b], 3, lambda: len(a.reads.started) == 3)
    a.reads.over = True
    _pause(a, [b], 1.6)
    assert b.up("a") and len(b.cluster.queues.loans) == 3
    a.cluster.queues.asked(a.queue("q"))
    assert run([a, b], 3, lambda: len(a.queue("q").items) == 3 and not b.cluster.queues.loans)
    assert len(a.reads.started) == 6 and not b.queue("q").items  # (sealed in lent order)


def test_items_given_back_one_by_one_keep_their_order_in_the_part(
    pair: Callable[[str], Node],
) -> None:
    """Items lent and given back (each `qback` alone) go back to the front of the part in
    the order they were put, not reversed."""
    a, b = pair("a"), pair("b")
    assert run([a, b], 5, lambda: a.up("b") and b.up("a"))
    for _ in range(3):
        b.queue_put("q", 4096)
    q = b.queue("q")
    put = [o.version for o in q.items]
    lent = [q.items.popleft() for _ in range(3)]
    for obj in lent:  # given back in the order lent: the first goes back first
        b.queues.requeue(q, obj)
    assert [o.version for o in q.items] == put


def test_a_broadcast_item_read_just_before_a_pause_reaches_the_subscriber(
    pair: Callable[[str], Node],
) -> None:
    """As above, for a broadcast queue: an item given back is not lent again, so a's
    subscriber would never get it; read again, it does."""
    a, b = pair("a"), pair("b")
    assert run([a, b], 5, lambda: a.up("b") and b.up("a") and a.cluster.links.fresh("b"))
    for n in (a, b):
        n.queues.open(n.session, b"c", Request("queue", 1, {"name": "bq", "broadcast": True}, []))
    qa = a.queues.by_name["bq"]
    a.queues.subscribe(a.session, b"c", Request("subscribe", 2, {"queue": qa.id}, []))
    assert run([a, b], 3, lambda: bool(b.cluster.queues.subs.get("bq", {}).get("a")))
    qb = b.queues.by_name["bq"]
    put, _ = b.registry.begin_put(b.session, "bq", [("", "uint8", (4096,))], False, queue=qb)
    qb.in_flight += 1
    qb.pending += 1
    b.queues.seal(b.session, put, False, qb)  # published: lent to a
    assert run([a, b], 3, lambda: len(a.reads.started) == 1)
    a.reads.over = True
    _pause(a, [b], 1.6)
    assert b.up("a") and len(b.cluster.queues.loans) == 1
    assert run([a, b], 3, lambda: qa.sealed == 1)


def test_a_qtaken_for_a_loan_of_the_lenders_last_incarnation_is_ignored(
    pair: Callable[[str], Node],
) -> None:
    """Loan ids are each incarnation's own: a late `qtaken` meant for the broker that this
    one replaced must not free the item this one lent under the same id."""
    a, b = _lent_to_b(pair)
    ((node, loan),) = a.cluster.queues.loans
    a.cluster.queues.request(node, "qtaken", {"loan": loan, "of": a.cluster.links.incarnation - 1})
    assert a.cluster.queues.loans
    a.cluster.queues.request(node, "qtaken", {"loan": loan, "of": a.cluster.links.incarnation})
    assert not a.cluster.queues.loans


def test_an_item_lent_to_a_restarted_node_before_it_knew_the_lenders_route_is_not_lost(
    pair: Callable[[str], Node],
) -> None:
    """b restarts; its new process says hello to a and, a consumer waiting, wants an item.
    a lends it on its own link to b before that link said hello there (a's next beat): b
    answers `hello_first`, not reading it. a must take it back, not keep it lent for good."""
    a, b = pair("a"), pair("b")
    assert run([a, b], 5, lambda: a.up("b") and b.up("a") and b.cluster.links.fresh("a"))
    a.queue_put("q", 4096)
    b.close()
    b = pair("b")
    a.cluster._next_tick = time.monotonic() + 0.5  # a just beat: its next is BEAT away
    assert run([a, b], 3, lambda: b.up("a"))
    b.cluster.queues.asked(b.queue("q"))
    assert run([a, b], 1, lambda: bool(a.cluster.queues.loans))
    b.reads.over = True
    assert run([a, b], 3, lambda: len(b.queue("q").items) == 1 and not a.cluster.queues.loans)
    assert not a.queue("q").items


def test_a_qitem_made_before_a_new_segment_does_not_bring_back_older_agent_metadata(
    pair: Callable[[str], Node],
) -> None:
    """a lends b an item, then, in the same batch, makes a segment: Cluster.segment sends
    the new agent metadata at once. The qitem goes at the flush, after it: it must not carry
    the metadata of before (b would forget a's new segment, and offers in it fail)."""
    a, b = pair("a"), pair("b")
    assert run([a, b], 5, lambda: a.up("b") and b.up("a") and b.cluster.links.fresh("a"))
    a.queue("q")  # (a part of q: a hears the wants, Note [queue homes])
    b.cluster.queues.asked(b.queue("q"))
    assert run([a, b], 3, lambda: bool(a.cluster.queues.wants.get("q")))
    a.journal.begin()  # one turn of a's loop:
    a.queue_put("q", 4096)  # lent to b: the qitem waits for the flush
    assert a.cluster.queues.loans
    a.reads.metadata = b"agent+s2"  # type: ignore[misc]
    a.cluster.segment("s2")  # a put later in the turn needed a new segment: said at once
    a.journal.commit()
    a.cluster.flush()
    assert run([a, b], 3, lambda: len(b.reads.started) == 1)
    assert b.reads.known["a"] == b"agent+s2"


def _loses(node: Node, op: str) -> list[dict[str, Any]]:
    """`node` loses the next request `op` a peer sends it, as ZeroMQ drops what it took for
    a link whose connection broke and came back (the route stays: no hello follows). The
    list has it once it is lost."""
    lost: list[dict[str, Any]] = []
    read = node.cluster.links.read

    def losing(socket: Any) -> Any:
        for route, peer, m in read(socket):
            if peer is None and m.get("op") == op and not lost:
                lost.append(m)
                continue
            yield route, peer, m

    node.cluster.links.read = losing  # type: ignore[method-assign]
    return lost


def _answered_resync(sender: Node, counter: Node) -> None:
    """`sender`'s next request to `counter` is lost: both step until `counter` answered a
    beat of `sender`'s with resync, which `sender` has not read yet."""
    lost, reply = _loses(counter, "want"), counter.cluster.links.reply
    resync: list[bool] = []

    def answering(route: bytes, m: dict[str, Any]) -> None:
        resync.append(bool(m.get("resync")))
        reply(route, m)

    counter.cluster.links.reply = answering  # type: ignore[method-assign]
    sender.cluster.links.after(counter.name, {"op": "want", "queue": "other", "n": 1})
    end = time.monotonic() + 5
    while not any(resync) and time.monotonic() < end:
        sender.step()
        counter.step()
    assert lost and any(resync)


def _told_resync(node: Node, by: Node) -> None:
    """`node` reads `by`'s answer to its beat saying resync (`by` counted its requests and
    came up short), as if it had come on its link."""
    link, links = node.cluster.links.peer(by.name), by.cluster.links
    assert link is not None
    resync = {
        "op": "beat", "node": by.name, "t": 0.0, "resync": True,
        "incarnation": links.incarnation, "forgot": links.forgot.get(node.name, 0),
    }  # fmt: skip
    node.cluster._answer(link, resync)


@pytest.mark.parametrize("quiet", [False, True], ids=["beaten", "quiet"])
def test_a_queue_item_lost_on_a_link_that_reconnected_is_lent_again(
    pair: Callable[..., Node], quiet: bool
) -> None:
    """ZeroMQ drops what it took for a link whose connection broke and came back (its route
    stays: no hello follows). b's qitem to a is lost so: b's next beat says how many
    requests it sent, a finds one missing, b links again (each forgets what it lent the
    other) and lends the item anew: at least once, as across a node's death. `quiet` (as
    with etcd: Note [beats]): a's link to b, idle, says hello again all the same, so that
    b hears a's want again."""
    a, b = pair("a", quiet=quiet), pair("b", quiet=quiet)
    assert run([a, b], 5, lambda: a.up("b") and b.up("a") and a.cluster.links.fresh("b"))
    b.queue("q")  # (a part of q: b hears the wants, Note [queue homes])
    a.cluster.queues.asked(a.queue("q"))
    assert run([a, b], 3, lambda: bool(b.cluster.queues.wants.get("q")))
    lost = _loses(a, "qitem")
    b.queue_put("q", 4096)
    assert run([a, b], 3, lambda: bool(lost))
    assert run([a, b], 6, lambda: bool(a.reads.started))  # (within a beat, and a hello)


def test_an_item_lent_before_the_lender_heard_its_requests_were_lost_is_not_sealed(
    pair: Callable[[str], Node],
) -> None:
    """b reads an item a lent it when a's next request to b is lost (a broken connection
    that came back). b's beat answer says so (`resync`), and a, as it hears it, takes the
    item back into its part (its memory may go to another consumer). b must not seal the
    read it still had under way: b forgets a as it answers, not a hello later."""
    a, b = _lent_to_b(pair)
    lost = _loses(b, "qitem")
    a.queue_put("q", 4096)  # lent to b too: lost on the way
    end = time.monotonic() + 5
    while time.monotonic() < end:  # (looked at after a's step: once b's hello comes, a
        a.step()  # lends the items to b again, as it should, in a later step of a's)
        if not a.cluster.queues.loans:
            break
        b.step()
    assert lost and not a.cluster.queues.loans and len(a.queue("q").items) == 2
    b.reads.over = True  # the read a took back ends now
    for _ in range(5):
        b.step(skip=b.cluster.links.router)  # (a's hello, which says a forgot b, not read)
    assert not b.queue("q").items, "b sealed an item its lender took back"


def test_an_item_read_as_its_lender_found_the_readers_requests_lost_is_had_once(
    pair: Callable[[str], Node],
) -> None:
    """The other way round: b reads an item a lent it, and b's next request to a is lost. a's
    beat answer says so (`resync`); b's read ends before b reads that answer, and b seals
    the item. a must not take the item back as it answers (it did: one item in two parts),
    only once b, having read the answer, forgot a and said hello."""
    a, b = _lent_to_b(pair)
    _answered_resync(b, a)
    assert a.cluster.queues.loans  # (a keeps its loan)
    b.reads.over = True  # b's read ends before b reads a's answer: b seals the item
    b.journal.begin()
    b.cluster.queues.arrivals.poll()
    b.journal.commit()
    b.cluster.flush()
    assert len(b.queue("q").items) == 1
    assert run([a, b], 5, lambda: not a.cluster.queues.loans and a.up("b") and b.up("a"))
    assert len(a.queue("q").items) + len(b.queue("q").items) == 1


def _settled(a: Node, b: Node) -> int | None:
    """The items of q in a's and b's parts, once none is lent (else None)."""
    if a.cluster.queues.loans or b.cluster.queues.loans:
        return None
    return len(a.queue("q").items) + len(b.queue("q").items)


def _taken_and_qtaken_lost(a: Node, b: Node) -> None:
    """a lends b an item, b takes it, and b's qtaken is lost on the way."""
    assert run([a, b], 5, lambda: a.up("b") and b.up("a") and b.cluster.links.fresh("a"))
    a.queue_put("q", 4096)
    b.cluster.queues.asked(b.queue("q"))
    assert run([a, b], 3, lambda: len(b.reads.started) == 1)
    lost = _loses(a, "qtaken")
    b.reads.over = True
    assert run([a, b], 3, lambda: bool(lost))


@pytest.mark.parametrize("quiet", [False, True], ids=["beaten", "quiet"])
def test_an_item_whose_qtaken_was_lost_is_not_lent_again(
    pair: Callable[..., Node], quiet: bool
) -> None:
    """b takes an item a lent it, and b's qtaken is lost on a link that broke and came back.
    The two forget each other and link again; a must not put the item back in its part (b
    has it: one item in two parts). b's hello names the items it took lately, and a frees
    them before it forgets b."""
    a, b = pair("a", quiet=quiet), pair("b", quiet=quiet)
    _taken_and_qtaken_lost(a, b)
    assert run([a, b], 8, lambda: not a.cluster.queues.loans)
    run([a, b], 0.5)
    assert len(b.queue("q").items) == 1 and not a.queue("q").items


def test_an_item_taken_as_its_lender_forgot_its_reader_to_link_again_is_had_once(
    pair: Callable[[str], Node],
) -> None:
    """As above, but the lender forgets first: b takes the item a lent it, b's qtaken is
    lost, and a's own requests to b were lost too, so b's beat answer says resync and a
    forgets b before b says hello. a keeps the item lent until b's hello or welcome names
    what b took, not put back in its part at once (b has it)."""
    a, b = pair("a"), pair("b")
    _taken_and_qtaken_lost(a, b)
    assert a.cluster.queues.loans
    _told_resync(a, b)
    assert a.cluster.queues.loans and not a.queue("q").items  # (held for b's word)
    assert run([a, b], 5, lambda: not a.cluster.queues.loans and a.up("b") and b.up("a"))
    run([a, b], 0.5)
    assert len(b.queue("q").items) == 1 and not a.queue("q").items


def test_an_item_held_by_a_relink_goes_back_only_once_its_reader_knows(
    pair: Callable[[str], Node],
) -> None:
    """a forgets b to link again while b still reads an item a lent it. A hello b sent
    before it heard so must not put the item back in a's part (b may still seal its read);
    b's welcome, which says it knows, does. Meanwhile the item is still the part's: a
    consumer of a's part, closed, waits for it (`supplies`)."""
    a, b = _lent_to_b(pair)
    _told_resync(a, b)
    a.cluster.queues.hello("b", b.cluster._hello(to="a"))  # (sent before b heard)
    assert a.cluster.queues.loans and not a.queue("q").items
    assert a.cluster.queues.supplies(a.queue("q"))
    queues = a.cluster.queues  # (b's welcome lets it go: lent again at once, maybe)
    assert run([a, b], 5, lambda: a.up("b") and b.up("a") and not queues._relinking)
    b.reads.over = True
    assert run([a, b], 5, lambda: _settled(a, b) == 1)  # (lent again to b's consumer, say)


def test_an_item_lent_after_the_short_beat_is_not_read_before_the_lender_forgot(
    pair: Callable[[str], Node],
) -> None:
    """b finds a's requests missing and answers resync; a lends b another item before it
    reads that answer. b must not read it: a lets go of what it lent b as it reads the
    answer (b reads nothing of a's until a forgot it, and the item comes again after)."""
    a, b = _lent_to_b(pair)
    _answered_resync(a, b)
    a.queue_put("q", 4096)  # lent to b (its consumer is at work) before a reads the answer
    a.cluster.flush()
    started = len(b.reads.started)
    for _ in range(5):
        b.step()
    assert len(b.reads.started) == started, "b read an item a is about to let go of"
    b.reads.over = True
    assert run([a, b], 8, lambda: _settled(a, b) == 2)


def test_a_resync_answer_lost_is_said_again_at_the_next_beat(pair: Callable[[str], Node]) -> None:
    """b finds a's requests missing and reads nothing of a's until a forgot it. If the
    answer that says so is lost too, the next beat's answer says it again: b is not left
    reading nothing of a's for good."""
    a, b = _lent_to_b(pair)
    _loses(b, "want")
    read, dropped = a.cluster.links.read, []

    def dropping(socket: Any) -> Any:
        for route, peer, m in read(socket):
            if peer is not None and m.get("resync") and not dropped:
                dropped.append(m)  # (the answer, lost on the way back)
                continue
            yield route, peer, m

    a.cluster.links.read = dropping  # type: ignore[method-assign]
    a.cluster.links.after("b", {"op": "want", "queue": "other", "n": 1})
    assert run([a, b], 5, lambda: bool(dropped))
    assert "a" in b.cluster.links.relinking
    assert run([a, b], 8, lambda: not b.cluster.links.relinking and a.up("b") and b.up("a"))
    assert run([a, b], 3, lambda: b.cluster.links.fresh("a"))  # (it reads of a again)


def test_two_resync_answers_make_the_lender_forget_its_reader_once(
    pair: Callable[[str], Node],
) -> None:
    """Two beats were under way when a's requests to b were found missing: both answers
    say resync. a forgets b once (a second forget would make b's welcome, which knows of
    one, look stale: a would hold what it lent b, and refuse b's offers, until b beats)."""
    a, b = _lent_to_b(pair)
    forgot = a.cluster.links.forgot.get("b", 0)
    _told_resync(a, b)
    _told_resync(a, b)
    assert a.cluster.links.forgot.get("b", 0) == forgot + 1
    queues = a.cluster.queues  # (what a held goes back at b's welcome, not TAKEN_FOR later)
    assert run([a, b], 3.5, lambda: a.up("b") and b.up("a") and not queues._relinking)


def test_the_nodes_that_want_items_get_them_in_turn(trio: Callable[[str], Node]) -> None:
    """b and c both have consumers at work on queue q and want items of a's part: a's items
    go to them in turn, not all to the node whose want a heard first (a suite run saw c's
    consumer starve while b took all 60 of a's items)."""
    a, b, c = trio("a"), trio("b"), trio("c")
    nodes = [a, b, c]
    assert run(nodes, 5, lambda: all(x.up(y) for x in nodes for y in "abc" if x.cluster.node != y))
    a.queue("q")
    for n in (b, c):  # (b's want heard first)
        n.cluster.queues.asked(n.queue("q"))
        assert run(nodes, 3, lambda n=n: n.cluster.node in a.cluster.queues.wants.get("q", {}))
    for _ in range(4):
        a.queue_put("q", 4096)
    lent = [node for node, _ in sorted(a.cluster.queues.loans, key=lambda k: k[1])]
    assert lent == ["b", "c", "b", "c"], lent
