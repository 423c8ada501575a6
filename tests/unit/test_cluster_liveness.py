"""Who forgets what, and when an offer may be read, between the brokers of a cluster
(Note [cluster] in server/cluster/cluster.py, Note [offers] in server/cluster/offers.py):
Cluster objects stepped by hand in this process (tests/nodes.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tensorbroker.common.protocol import Request, decode
from tensorbroker.server.cluster import announcing, lending
from tensorbroker.server.cluster.offers import OFFER_MAX
from tensorbroker.server.cluster.pulls import READ_AGAIN
from tests.nodes import MiB, Node, Taken, homed, pair, run, trio
from tests.support import free_port

__all__ = ["pair", "trio"]  # the fixtures


def test_loans_of_an_owner_restarted_quickly_stay_pinned_while_they_are_read(
    pair: Callable[[str], Node],
) -> None:
    """a restarts within DOWN_AFTER, b's two lends went out while its link was down: both go
    again at once, both reach the new a before it knows b's route (hello_first), and b says
    hello again for each. Neither hello may make a forget b: it just lent b the first."""
    a, b = pair("a"), pair("b")
    a.put("k1", MiB)
    a.put("k2", MiB)
    assert run([a, b], 5, lambda: a.up("b") and b.up("a") and b.knows("k2"))
    a.close()  # it crashed
    run([b], 0.2)
    assert b.up("a") and b.get("k1") and b.get("k2")
    a = pair("a")  # on its state: the same keys
    a.put("k1", MiB)
    a.put("k2", MiB)
    assert run([a, b], 3, lambda: len(b.reads.started) == 2)
    run([a, b], 0.3)
    pulls = {("b", pull) for pull in b.cluster.replicas.pulls.pulls}
    assert len(pulls) == 2 and {loan[:2] for loan in a.cluster.replicas.lending.loans} == pulls


def _follow_all(owner: Node, reader: Node) -> None:
    """`reader` follows every key (a watch_prefix of ""), once `owner` heard: `owner` offers
    it its small versions (Note [follows])."""
    reader.cluster.replicas.follow_prefix("")
    followers = owner.cluster.replicas.lending.followers
    assert run([owner, reader], 3, lambda: reader.name in followers.prefixes)


def test_an_offer_its_owner_let_go_is_not_read_after_beats_answered_late(
    pair: Callable[[str], Node],
) -> None:
    """The link a->b stalls while b->a works: a takes b for down and lets go what it offered
    it. When the link comes back, b answers a's old beats first: that must not let b read
    the offer (the version's memory went to other puts)."""
    a, b = pair("a"), pair("b")
    assert run([a, b], 5, lambda: a.up("b") and b.up("a"))
    _follow_all(a, b)  # (so that a offers b its small versions)
    v1 = a.put("k", 4096)
    assert run([a, b], 5, lambda: len(b.cluster.replicas.held) == 1)
    router = b.cluster.links.router
    end = time.monotonic() + 3.0
    while time.monotonic() < end and a.up("b"):
        a.step()
        b.step(skip=router)  # nothing comes in from a's link
    assert not a.up("b") and b.up("a")
    a.put("k", 4096)
    assert v1.freed and not b.cluster.links.fresh("a")
    for route, _, m in b.cluster.links.read(router):  # the old beats, not yet the hello
        if m["op"] != "beat":
            break
        b.cluster._request(route, m)  # type: ignore[arg-type]
    assert b.get("k")  # a client's get, handled first in b's next turn
    assert "k" not in b.reads.started


def test_a_lend_sent_again_for_a_pull_that_is_over_pins_nothing(
    pair: Callable[[str], Node],
) -> None:
    a, b = pair("a"), pair("b")
    assert run([a, b], 5, lambda: a.up("b") and b.up("a"))
    a.put("k", MiB)
    run([a, b], 0.3)
    peer = b.cluster.links.peer("a")
    assert peer is not None and not b.cluster.replicas.pulls.pulls
    again = {"op": "lend", "pull": 99, "key": "k"}  # pull 99: over, or never was
    b.cluster._answer(peer, {"op": "hello_first", "again": again})
    a.cluster.replicas.lending.lend("b", 99, "k")  # (a lend that reached it anyway)
    run([a, b], 1.0)
    assert not a.cluster.replicas.lending.loans


def test_an_announcement_made_after_the_loops_flush_wakes_the_loop_at_once(
    pair: Callable[[str], Node],
) -> None:
    """A key deleted after the batch's flush (evicted as grants are topped up, say) must not
    wait for the next beat to be told."""
    a = pair("a")
    a.step()
    assert a.cluster.wake_in > 0
    a.put("k", 4096)  # (sealed outside a batch: its announcement waits for a flush)
    assert a.cluster.wake_in == 0
    a.step()
    assert a.cluster.wake_in > 0


def test_a_loan_answered_before_its_lender_took_this_node_for_down_is_not_read(
    pair: Callable[[str], Node],
) -> None:
    """b's loop pauses between a's `lent` and reading it; a takes b for down meanwhile and
    lets go the loan. When b resumes it handles the `lent` before its own tick: not fresh
    any more, it gives the loan back and asks again."""
    a, b = pair("a"), pair("b")
    a.put("k", MiB)
    assert run([a, b], 5, lambda: a.up("b") and b.up("a") and b.knows("k"))
    assert run([a, b], 3, lambda: b.cluster.links.fresh("a"))
    assert b.get("k")
    end = time.monotonic() + 3.0
    while time.monotonic() < end and not a.cluster.replicas.lending.loans:
        a.step()
    end = time.monotonic() + 3.0  # b's loop pauses
    while time.monotonic() < end and a.up("b"):
        a.step()
    assert not a.up("b") and not a.cluster.replicas.lending.loans
    b.step()  # b resumes: the `lent` first
    assert "k" not in b.reads.started


def test_an_offer_made_before_its_owner_knew_it_was_forgotten_is_not_kept(
    pair: Callable[[str], Node],
) -> None:
    """a takes b for down (a's link to b stalls; b's to a works). b says hello again, not yet
    knowing, and offers a a new version; then hears that a forgot it, and forgets a in turn,
    letting go of that offer. a must not have kept it."""
    a, b = pair("a"), pair("b")
    assert run([a, b], 5, lambda: a.up("b") and b.up("a"))
    router, answer, put = b.cluster.links.router, b.cluster._answer, []

    def answer_then_put(peer: Any, m: dict[str, Any]) -> None:
        answer(peer, m)
        if m["op"] == "hello_first" and not put:  # b put right after its hello
            put.append(b.put("k", 4096))

    b.cluster._answer = answer_then_put  # type: ignore[method-assign]
    end = time.monotonic() + 6.0
    while time.monotonic() < end and not (put and not a.up("b")):
        a.step()
        b.step(skip=router)
    run([a, b], 1.5)  # the link is back
    assert put and a.get("k")
    b.put("k", 4096)  # version 1 replaced on b
    assert not (put[0].freed and "k" in a.reads.started)


def test_a_hello_of_a_replaced_incarnation_is_ignored(pair: Callable[[str], Node]) -> None:
    """A hello from a's old process, read after its new one's (a dead link's last message):
    b must not take it for a again, forget the new a, and unpin what it lent it."""
    a, b = pair("a"), pair("b")
    b.put("k", MiB)
    assert run([a, b], 5, lambda: a.up("b") and b.up("a") and a.knows("k"))
    old = a.cluster._hello(to="b")
    a.close()
    a = pair("a")
    assert run([a, b], 5, lambda: a.up("b") and b.up("a") and a.knows("k"))
    assert run([a, b], 3, lambda: a.cluster.links.fresh("b"))
    assert a.get("k")
    assert run([a, b], 3, lambda: bool(b.cluster.replicas.lending.loans))
    b.cluster._request(b"old-route", old)
    run([a, b], 1.0)
    assert b.cluster.replicas.lending.loans


def test_a_node_restarted_twice_while_its_peer_did_not_read_is_heard_again(
    pair: Callable[[str], Node],
) -> None:
    """a restarts twice while b reads none of its messages: the hellos of a's second and
    third processes wait in b's socket, and ZeroMQ often hands over the dead one's last.
    b must end up with a's third process, not ignore it as older."""
    a, b = pair("a"), pair("b")
    b.put("k", MiB)
    assert run([a, b], 5, lambda: a.up("b") and b.up("a") and a.knows("k"))
    for _ in range(2):
        a.close()
        a = pair("a")
        run([a], 0.6)  # it says hello; b does not read
    assert run([a, b], 4, lambda: a.up("b") and b.cluster.links.fresh("a"))
    assert a.knows("k") and a.get("k")
    assert run([a, b], 3, lambda: "k" in a.reads.started)


def test_a_loan_is_read_from_a_peer_whose_link_back_never_came_up(
    pair: Callable[[str], Node],
) -> None:
    """b's link to a never connects (it cannot reach a's address, say); a's to b works. b
    never had a up, so it cannot take a for down and let go its loans: a reads them."""
    a, b = pair("a"), pair("b")
    b.cluster.links.meet = lambda address: None  # type: ignore[method-assign]
    link = b.cluster.links.peers[0]
    link.socket.disconnect(link.address)
    b.put("k", MiB)
    assert run([a, b], 5, lambda: a.up("b") and a.knows("k"))
    assert not b.up("a") and a.get("k")
    assert run([a, b], 3, lambda: "k" in a.reads.started)


def test_answers_go_to_the_link_a_peer_reconnected_on(pair: Callable[[str], Node]) -> None:
    """b's link to a reconnects (a TCP reset, say) in less than DOWN_AFTER: a knows b by a
    new route. Its answers must go there, not to the dead one (a loan pinned, never read)."""
    a, b = pair("a"), pair("b")
    a.put("k1", MiB)
    a.put("k2", MiB)
    assert run([a, b], 5, lambda: b.knows("k2") and b.cluster.links.fresh("a"))
    assert b.get("k1")
    assert run([a, b], 3, lambda: "k1" in b.reads.started)
    link = b.cluster.links.peers[0]
    link.socket.disconnect(link.address)
    link.socket.connect(link.address)
    run([a, b], 1.5)
    assert b.get("k2")
    assert run([a, b], 3, lambda: "k2" in b.reads.started)


def test_a_node_restarted_after_its_clock_went_back_is_heard_as_new(
    pair: Callable[[str], Node],
) -> None:
    """a restarts on its state after its clock went back: its new incarnation must still be
    larger than its last (the broker follows the one its journal names), or b ignores it as
    a late message of the dead one and a's keys stay unreachable."""
    a, b = pair("a"), pair("b")
    ahead = a.cluster.links.incarnation + (3600 * 10**6 << 10)  # its clock, an hour ahead
    a.cluster.links.incarnation = ahead
    a.put("k", MiB)
    assert run([a, b], 5, lambda: b.knows("k") and b.cluster.links.fresh("a"))
    a.close()
    a = pair("a")
    assert a.cluster.links.follow(ahead) == ahead + 1
    a.put("k2", MiB)
    assert run([a, b], 5, lambda: b.knows("k2"))


def test_the_etcd_record_names_the_incarnation_a_restarted_broker_follows(
    tmp_path: Path,
) -> None:
    """A broker restarted on its state after its clock went back registers in etcd the
    incarnation it follows (its last, plus one), not its clock's: its peers tell a restart
    from the record (Cluster._members), and an older one than they knew says nothing."""
    ahead = time.time_ns() // 1000 + 3600 * 10**6 << 10  # the last one's clock, an hour ahead
    a = Node("a", free_port(), [], tmp_path / "a", etcd=("http://127.0.0.1:9",), last=ahead)
    try:
        assert a.cluster.membership is not None
        assert a.cluster.links.incarnation == ahead + 1
        assert a.cluster.membership.record["incarnation"] == ahead + 1
    finally:
        a.close()


def test_puts_close_together_are_announced_in_one_message_with_each_keys_last_version(
    pair: Callable[[str], Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Announcements made within ANNOUNCE_EVERY of the last batch wait for the next one: one
    message to each peer, naming each key's last version only, and only that one offered
    (pinned), so a burst of puts costs each peer one wake-up, not one per put."""
    every = 0.2  # (this test's puts take longer than 1 ms on a loaded machine)
    monkeypatch.setattr(announcing, "ANNOUNCE_EVERY", every)
    a, b = pair("a"), pair("b")
    assert run([a, b], 5, lambda: a.up("b") and b.up("a"))
    _follow_all(a, b)
    a.put("first", 4096)
    a.step()  # a batch just went: the next waits up to ANNOUNCE_EVERY
    a.put("k", 4096)
    a.put("j", 4096)
    a.put("k", 4096)
    assert 0 < a.cluster.wake_in <= every
    sent = a.journal.events.count(("sent", "announce"))
    a.step()
    assert a.journal.events.count(("sent", "announce")) == sent  # (not yet)
    time.sleep(every)
    a.step()
    assert a.journal.events.count(("sent", "announce")) == sent + 1
    assert len(a.cluster.replicas.lending.offered) == 3  # first, j, and k's version 2
    assert run([a, b], 3, lambda: b.knows("j"))
    assert b.cluster.replicas.index["k"].version == 2 and len(b.cluster.replicas.held) == 3


def test_a_loan_whose_returned_was_lost_is_unpinned_once_the_borrowers_beats_leave_it_out(
    pair: Callable[[str], Node],
) -> None:
    """b's `returned` is lost (ZeroMQ took it, then the connection broke): a must not keep
    the version pinned for good. b's beats name the pulls it has open; a unpins a loan that
    a beat sent after its lend leaves out."""
    a, b = pair("a"), pair("b")
    a.put("k", 2 * OFFER_MAX)  # (lent when asked, not offered)
    assert run([a, b], 5, lambda: b.knows("k") and b.cluster.links.fresh("a"))
    after = b.cluster.links.after

    def losing(node: str, message: dict[str, Any]) -> None:
        if message["op"] != "returned":
            after(node, message)

    b.cluster.links.after = losing  # type: ignore[method-assign]
    assert b.get("k")
    b.reads.over = True
    assert run([a, b], 3, lambda: not b.cluster.replicas.pulls.pulls)
    assert a.cluster.replicas.lending.loans
    assert run([a, b], 2, lambda: not a.cluster.replicas.lending.loans)


def test_a_beat_held_up_on_a_second_link_does_not_unpin_a_loan_being_read(
    pair: Callable[[str], Node],
) -> None:
    """b has two links to a (two addresses of one broker). A beat b sent on the second just
    before a pull began (naming no pull) is held up there (a stalled connection, under
    DOWN_AFTER) while the lend went on the first: when it comes in, a must not take it to
    say the pull is over (b still reads the loan)."""
    a, b = pair("a"), pair("b")
    port = a.cluster.address.rpartition(":")[2]
    b.cluster.links.meet(f"tcp://localhost:{port}")
    a.put("k", 2 * OFFER_MAX)  # (lent when asked, not offered)
    links = b.cluster.links
    assert run(
        [a, b], 5, lambda: links.fresh("a") and all(p.up for p in links.peers) and b.knows("k")
    )
    second, held, send_to = links.peers[1], [], links.send_to

    def stalled(peer: Any, message: dict[str, Any]) -> bool:
        if peer is second and message.get("op") == "beat":
            held.append(message)
            return True
        return send_to(peer, message)

    links.send_to = stalled  # type: ignore[method-assign]
    b.cluster._next_tick = b.cluster._next_beat = 0.0
    b.step()  # a beat on each link, no pull open; the second's held up
    assert held and held[-1]["pulls"] == []
    assert b.get("k")
    assert run([a, b], 3, lambda: "k" in b.reads.started)
    links.send_to = send_to
    send_to(second, held[-1])  # the second link flows again: its old beat comes in
    run([a, b], 0.3)
    assert b.cluster.replicas.pulls.pulls and a.cluster.replicas.lending.loans


def test_a_put_then_a_delete_in_one_batch_deletes_the_key_everywhere(
    trio: Callable[[str], Node],
) -> None:
    """b holds k; a puts k (its version wins) and deletes it within one batch of
    announcements. The put must still reach the others (it replaces b's version) before
    the delete: else b and c keep b's version while a has none."""
    a, b, c = trio("a"), trio("b"), trio("c")
    nodes = [a, b, c]
    assert run(nodes, 5, lambda: all(n.up(m) for n in nodes for m in "abc" if m != n.name))
    b.put("k", 4096)
    assert run(nodes, 5, lambda: a.knows("k") and c.knows("k"))
    a.put("k", 4096)
    a.objects.delete(a.session, b"client", Request("delete", 8, {"key": "k"}, []))
    run(nodes, 1.0)
    held = [n.name for n in nodes if "k" in n.registry.objects or n.knows("k")]
    assert held == []


def test_a_watch_of_a_replica_sees_a_put_then_a_delete_in_one_batch_as_a_delete(
    pair: Callable[[str], Node],
) -> None:
    """b holds a replica of a's k; a watch of k on b waits for a newer version (`deletes`).
    a puts k again and deletes it within one batch of announcements: the watch is told of
    the delete, as with a delete alone (not NotFound from a pull of the version deleted)."""
    a, b = pair("a"), pair("b")
    assert run([a, b], 5, lambda: b.up("a") and b.cluster.links.fresh("a"))
    v1 = a.put("k", 2 * OFFER_MAX).version  # (lent when asked, not offered)
    assert run([a, b], 3, lambda: b.knows("k"))
    b.reads.over = True
    assert b.get("k")
    assert run([a, b], 3, lambda: "k" in b.registry.objects and not b.cluster.replicas.pulls.pulls)
    answers: list[dict[str, Any]] = []
    b.objects._send = lambda route, payload, last=False: answers.append(decode(payload))
    fields = {"key": "k", "timeout": 10.0, "after": v1, "deletes": True}
    assert b.objects.get(b.session, b"watch", Request("get", 9, fields, [])) is None  # waits
    a.put("k", 2 * OFFER_MAX)
    a.objects.delete(a.session, b"client", Request("delete", 8, {"key": "k"}, []))
    assert run([a, b], 2, lambda: bool(answers))
    assert answers[-1].get("deleted") is True, answers


def test_a_lend_waiting_for_a_pull_is_dropped_once_its_borrower_gave_up(
    trio: Callable[[str], Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """c pulls a's k; b's pull of k is sent to c (fan-out) and waits there, then b gives up.
    Once b's beats leave it out, c must not lend b its replica when its read ends (nor keep
    one pinned for a `returned` that may be lost)."""
    monkeypatch.setattr(lending, "FANOUT", 1)
    a, b, c = trio("a"), trio("b"), trio("c")
    nodes = [a, b, c]
    assert run(nodes, 5, lambda: all(n.cluster.links.fresh(m) for n in nodes for m in "abc"
                                     if m != n.name))  # fmt: skip
    a.put("k", 2 * OFFER_MAX)
    assert run(nodes, 3, lambda: b.knows("k") and c.knows("k"))
    assert c.get("k")
    assert run(nodes, 3, lambda: "k" in c.reads.started)  # c reads; a lent it once
    assert b.get("k")
    assert run(nodes, 3, lambda: bool(c.cluster.replicas.pulls.pulling["k"].lends))
    (pull,) = b.cluster.replicas.pulls.pulls.values()
    for w in pull.waiters:  # b gives up: its get ran out of time ...
        w.done = True
    pull.started = -1e9  # ... and its lend went unanswered for PULL_WAIT
    assert run(nodes, 2, lambda: not b.cluster.replicas.pulls.pulls)
    assert run(nodes, 2, lambda: not c.cluster.replicas.pulls.pulling["k"].lends)
    c.reads.over = True
    assert run(nodes, 3, lambda: "k" in c.registry.objects)
    run(nodes, 0.3)
    assert not c.cluster.replicas.lending.loans


def test_a_watch_of_a_key_deleted_while_its_new_version_is_pulled_sees_the_delete(
    pair: Callable[[str], Node],
) -> None:
    """A watch of k on b (`deletes`) starts a pull of a's new version; a deletes k before
    the pull ends (its announcement in a batch of its own): the watch is told of the delete,
    not NotFound."""
    a, b = pair("a"), pair("b")
    assert run([a, b], 5, lambda: b.up("a") and b.cluster.links.fresh("a"))
    v1 = a.put("k", 2 * OFFER_MAX).version  # (lent when asked, not offered)
    assert run([a, b], 3, lambda: b.knows("k"))
    answers: list[dict[str, Any]] = []
    b.objects._send = lambda route, payload, last=False: answers.append(decode(payload))
    fields = {"key": "k", "timeout": 10.0, "after": v1, "deletes": True}
    assert b.objects.get(b.session, b"watch", Request("get", 9, fields, [])) is None  # waits
    a.put("k", 2 * OFFER_MAX)
    assert run([a, b], 3, lambda: "k" in b.reads.started)  # its pull reads version 2
    a.objects.delete(a.session, b"client", Request("delete", 8, {"key": "k"}, []))
    assert run([a, b], 3, lambda: not b.knows("k"))
    b.reads.over = True
    assert run([a, b], 2, lambda: bool(answers))
    assert answers[-1].get("deleted") is True, answers


def test_a_put_then_a_delete_of_a_key_indexed_from_its_node_raise_the_version_seen(
    pair: Callable[[str], Node],
) -> None:
    """b indexes a's k at 1. a puts k (2) and deletes it in one batch: b must go on above 2,
    as when told of the put then the delete; else b's next put is a second version 2, and a
    watch on a that saw a's 2 never hears of it."""
    a, b = pair("a"), pair("b")
    assert run([a, b], 5, lambda: a.up("b") and b.up("a"))
    a.put("k", 4096)
    assert run([a, b], 3, lambda: b.knows("k"))
    assert a.put("k", 4096).version == 2
    a.objects.delete(a.session, b"client", Request("delete", 8, {"key": "k"}, []))
    answers: list[dict[str, Any]] = []
    a.objects._send = lambda route, payload, last=False: answers.append(decode(payload))
    fields = {"key": "k", "timeout": 10.0, "after": 2}  # a reader on a saw version 2
    assert a.objects.get(a.session, b"watch", Request("get", 9, fields, [])) is None
    assert run([a, b], 3, lambda: not b.knows("k"))
    assert b.put("k", 4096).version == 3
    a.reads.over = True
    assert run([a, b], 2, lambda: bool(answers))


def test_a_watch_of_a_key_on_a_node_with_no_replica_of_it_hears_its_delete(
    pair: Callable[[str], Node],
) -> None:
    """A watch (`deletes`) on b of a's key, which b never read: a's delete tells it."""
    a, b = pair("a"), pair("b")
    assert run([a, b], 5, lambda: a.up("b") and b.up("a"))
    v1 = a.put("k", 4096).version
    assert run([a, b], 3, lambda: b.knows("k"))
    answers: list[dict[str, Any]] = []
    b.objects._send = lambda route, payload, last=False: answers.append(decode(payload))
    fields = {"key": "k", "timeout": 10.0, "after": v1, "deletes": True}
    assert b.objects.get(b.session, b"watch", Request("get", 9, fields, [])) is None
    a.objects.delete(a.session, b"client", Request("delete", 8, {"key": "k"}, []))
    assert run([a, b], 2, lambda: bool(answers))
    assert answers[-1].get("deleted") is True, answers


def test_a_watch_whose_key_now_lives_on_a_node_down_is_not_told_it_was_deleted(
    trio: Callable[[str], Node],
) -> None:
    """b's watch of k (`deletes`) pulls a's version 2; c's version 3 wins meanwhile, then c
    goes down; the read ends. k was never deleted (it lives on c): the watch must not hear
    that it was. It waits for c to be back, until its own deadline."""
    a, b, c = trio("a"), trio("b"), trio("c")
    nodes, k = [a, b, c], homed("ab", "abc")  # (its homes: a, then b)
    assert run(nodes, 5, lambda: all(x.up(y) for x in nodes for y in "abc" if y != x.name))
    v1 = a.put(k, 2 * OFFER_MAX).version
    assert run(nodes, 3, lambda: b.knows(k) and c.knows(k))
    answers: list[dict[str, Any]] = []
    b.objects._send = lambda route, payload, last=False: answers.append(decode(payload))
    fields = {"key": k, "timeout": 30.0, "after": v1, "deletes": True}
    asked = time.monotonic()
    assert b.objects.get(b.session, b"watch", Request("get", 9, fields, [])) is None
    a.put(k, 2 * OFFER_MAX)
    assert run(nodes, 3, lambda: k in b.reads.started)
    # (c follows nothing of k: it heard of version 1 only, and its 2 wins by its name)
    assert c.put(k, 2 * OFFER_MAX).version == 2
    assert run(nodes, 3, lambda: b.cluster.replicas.where()[k][:2] == ("c", 2))
    c.close()  # it crashed
    assert run([a, b], 5, lambda: not b.up("c"))
    b.reads.over = True
    run([a, b], 0.5)
    assert not answers, answers  # (not told it was deleted)
    (w,) = b.objects.lot.line(("get", k))  # waits for c, until its own deadline
    assert "'c', which is down, and stayed down" in w.timeout_message
    assert w.deadline is not None and w.deadline < asked + 30.1  # (not from now)


def test_a_get_that_may_wait_keeps_waiting_when_the_version_it_pulls_is_deleted(
    pair: Callable[[str], Node],
) -> None:
    """A watch's get after it saw version 1 (no `deletes`, as `client.watch` asks once it
    yielded None) pulls a's version 2, which a deletes before the read ends: the get waits
    on for the next version, as on one node, not NotFound."""
    a, b = pair("a"), pair("b")
    assert run([a, b], 5, lambda: b.up("a") and b.cluster.links.fresh("a"))
    v1 = a.put("k", 2 * OFFER_MAX).version
    assert run([a, b], 3, lambda: b.knows("k"))
    answers: list[dict[str, Any]] = []
    b.objects._send = lambda route, payload, last=False: answers.append(decode(payload))
    fields = {"key": "k", "timeout": 10.0, "after": v1}
    assert b.objects.get(b.session, b"watch", Request("get", 9, fields, [])) is None
    a.put("k", 2 * OFFER_MAX)
    assert run([a, b], 3, lambda: "k" in b.reads.started)
    a.objects.delete(a.session, b"client", Request("delete", 8, {"key": "k"}, []))
    assert run([a, b], 3, lambda: not b.knows("k"))
    b.reads.over = True
    run([a, b], 0.5)
    assert not answers, answers  # still waiting
    a.put("k", 4096)  # the next version: the get has it
    assert run([a, b], 3, lambda: bool(answers))
    assert answers[-1].get("version", 0) > 2, answers


def test_a_timed_get_of_a_key_its_owner_will_not_lend_ends(pair: Callable[[str], Node]) -> None:
    """a's k is announced but not lent (a device object whose chunk a's NIXL could not
    register: `lend` answers it has none). b's get with timeout=1 ends (NotFound) and does
    not ask a again and again."""
    a, b = pair("a"), pair("b")
    assert run([a, b], 5, lambda: b.up("a") and b.cluster.links.fresh("a"))
    obj = a.put("k", 2 * OFFER_MAX)
    assert run([a, b], 3, lambda: b.knows("k"))
    obj.device, a.reads.vram = "cuda:0", False  # (announced, never lent)
    answers: list[dict[str, Any]] = []
    b.objects._send = lambda route, payload, last=False: answers.append(decode(payload))
    fields = {"key": "k", "timeout": 1.0}
    assert b.objects.get(b.session, b"client", Request("get", 9, fields, [])) is None
    assert run([a, b], 3, lambda: bool(answers))
    assert "not_found" in str(answers[0]), answers


def test_a_get_whose_owner_stalled_past_down_after_waits_for_it_and_has_the_version(
    pair: Callable[[str], Node],
) -> None:
    """b's get (timeout 10 s) pulls a's k; a stalls before it answers the lend, past
    DOWN_AFTER: b takes it for down and the pull fails. The get waits on (a may be alive:
    it is) and has k once a is heard again. It was answered PeerUnavailable ("node 'a' went
    down during the pull"): weight-sync readers on a loaded host failed so (issue 50)."""
    a, b = pair("a"), pair("b")
    assert run([a, b], 5, lambda: b.up("a") and b.cluster.links.fresh("a"))
    a.put("k", 2 * OFFER_MAX)  # (lent when asked, not offered)
    assert run([a, b], 3, lambda: b.knows("k"))
    answers: list[dict[str, Any]] = []
    b.objects._send = lambda route, payload, last=False: answers.append(decode(payload))
    assert (
        b.objects.get(b.session, b"client", Request("get", 9, {"key": "k", "timeout": 10.0}, []))
        is None
    )
    assert b.cluster.replicas.pulls.pulls  # its lend is out: a does not step (it stalls)
    assert run([b], 4, lambda: not b.up("a"))
    run([b], 0.2)
    assert not answers, answers  # waiting, not PeerUnavailable
    b.reads.over = True
    assert run([a, b], 5, lambda: bool(answers))
    assert answers[-1].get("version") == 1, answers


@pytest.mark.parametrize("pushed", [False, True], ids=["read", "pushed"])
def test_a_get_whose_reads_fail_while_their_owner_is_up_is_answered_not_pulled_for_good(
    pair: Callable[[str], Node], monkeypatch: pytest.MonkeyPatch, pushed: bool
) -> None:
    """Every read from a fails (NIXL refused a's agent, say; or, pushed, each piece's
    request or answer lost: Note [pushes]) while a is up: the pull reads again READ_AGAIN
    times (a failure may pass: a request lost with a connection, an agent just replaced),
    then b's get with a timeout is answered PeerUnavailable, not pulled again and again
    until its deadline (a review counted 2,862 lends in one second so)."""
    a, b = pair("a"), pair("b")
    assert run([a, b], 5, lambda: b.up("a") and b.cluster.links.fresh("a"))
    a.put("k", 2 * OFFER_MAX)
    assert run([a, b], 3, lambda: b.knows("k"))
    monkeypatch.setattr(Taken, "push", pushed)

    def done(handle: Any) -> bool:
        raise OSError("a NIXL read ended in state ERR")

    b.reads.done = done  # type: ignore[method-assign]
    answers: list[dict[str, Any]] = []
    b.objects._send = lambda route, payload, last=False: answers.append(decode(payload))
    get = Request("get", 9, {"key": "k", "timeout": 3.0}, [])
    assert b.objects.get(b.session, b"client", get) is None
    assert run([a, b], 2, lambda: bool(answers))
    assert answers[0].get("code") == "peer_unavailable", answers
    assert len(b.reads.started) == 1 + READ_AGAIN


def test_questions_and_answers_about_pushed_pieces_count_as_requests(
    pair: Callable[[str], Node],
) -> None:
    """`writing` and a `wrote` sent on the lender's own link are requests its beats count
    (Note [beats]): the node they went to counts them too, or it took requests for lost and
    both nodes forgot each other, over every question about a piece (a review found it)."""
    a, b = pair("a"), pair("b")
    assert run([a, b], 5, lambda: b.up("a") and a.up("b") and b.cluster.links.fresh("a"))
    resync: list[bool] = []
    reply = a.cluster.links.reply

    def answering(route: bytes, m: dict[str, Any]) -> None:
        resync.append(bool(m.get("resync")))
        reply(route, m)

    a.cluster.links.reply = answering  # type: ignore[method-assign]
    forgot = dict(a.cluster.links.forgot)
    assert b.cluster.links.send("a", {"op": "writing", "node": "b", "tokens": [1], "inc": None})
    assert b.cluster.links.send("a", {"op": "wrote", "node": "b", "token": 2})
    run([a, b], 1.5)
    assert resync and not any(resync), "a took b's requests for lost"
    assert a.cluster.links.forgot == forgot and a.up("b") and b.up("a")
