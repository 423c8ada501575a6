"""Where keys live (Note [homes] in server/cluster/homes.py): a key's claim reaches
its two homes only, a node that knows nothing of a key asks its home, and the homes move
with joins and leaves. Cluster objects stepped by hand in this process (tests/nodes.py); the
whole brokers: test_cluster.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tensorbroker.common.protocol import Request, decode
from tensorbroker.server.cluster import announcing, homes, moves, ordering, rendezvous
from tensorbroker.server.cluster.offers import OFFER_MAX
from tests.nodes import Node, homed, quad, run

__all__ = ["quad"]  # the fixture


def _started(quad: Callable[[str], Node]) -> list[Node]:
    nodes = [quad(n) for n in "abcd"]
    assert run(nodes, 5, lambda: all(n.up(m.name) for n in nodes for m in nodes if m is not n))
    return nodes


def test_a_new_key_is_heard_of_by_its_two_homes_only(quad: Callable[[str], Node]) -> None:
    """A put of a new key costs the other nodes one message each at its two homes, none
    elsewhere, whatever the cluster's size (it went to every node)."""
    a, b, c, d = _started(quad)
    key = homed("bc", "abcd")
    heard: list[str] = []
    listed = d.cluster.replicas.listed

    def hearing(node: str, k: str, *more: Any) -> None:
        heard.append(k)
        listed(node, k, *more)

    d.cluster.replicas.listed = hearing  # type: ignore[method-assign]
    a.put(key, 4096)
    assert run(
        [a, b, c, d], 3, lambda: b.cluster.replicas.holds(key) and c.cluster.replicas.holds(key)
    )
    run([a, b, c, d], 0.3)
    assert not heard and not d.cluster.replicas.holds(key)


def test_new_keys_put_close_together_cost_each_home_one_message(
    quad: Callable[[str], Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream of new keys: a home told of a claim hears of the next ones once
    `claim_every` passed (longer as more nodes are up), all in one message, so it wakes once
    per `claim_every`, not once per key. A home told of nothing lately hears at once."""
    every = 3.0  # (this test's steps take a while on a loaded machine): with 3 peers up,
    monkeypatch.setattr(announcing, "CLAIMS_A_SECOND", 3 / every)  # a's claims wait `every`
    monkeypatch.setattr(announcing, "CLAIM_WAIT_MAX", 10.0)
    a, b, c, d = _started(quad)
    assert a.cluster.replicas.lending.claim_every == every
    nodes = [a, b, c, d]
    first, second, third = (
        homed("bc", "abcd", "x"),
        homed("bc", "abcd", "y"),
        homed("cb", "abcd", "z"),
    )
    a.put(first, 4096)
    assert run(nodes, 1.0, lambda: b.knows(first) and c.knows(first))
    sent = a.journal.events.count(("sent", "announce"))
    a.put(second, 4096)
    a.put(third, 4096)
    run(nodes, 0.1)
    assert not b.cluster.replicas.holds(second) and not c.cluster.replicas.holds(third)
    assert a.journal.events.count(("sent", "announce")) == sent
    fresh = homed("db", "abcd", "w")  # d was told nothing lately: at once (b waits)
    a.put(fresh, 4096)
    assert run(nodes, 1.0, lambda: d.cluster.replicas.holds(fresh))
    assert not b.cluster.replicas.holds(fresh)
    assert run(
        nodes, 2 * every, lambda: all(b.cluster.replicas.holds(k) for k in (second, third, fresh))
    )
    assert all(c.cluster.replicas.holds(k) for k in (second, third))
    assert a.journal.events.count(("sent", "announce")) == sent + 3  # d, then b and c


def test_a_get_on_a_node_that_knows_nothing_of_a_key_waits_for_its_put_elsewhere(
    quad: Callable[[str], Node],
) -> None:
    """d asks the key's home, which has not heard of it; the get waits, and the home tells
    d of the put on a (d is a looker of the key): d pulls it for the get."""
    a, b, c, d = _started(quad)
    key = homed("bc", "abcd")
    answers: list[dict[str, Any]] = []
    d.objects._send = lambda route, payload, last=False: answers.append(decode(payload))
    assert (
        d.objects.get(d.session, b"client", Request("get", 9, {"key": key, "timeout": 10.0}, []))
        is None
    )
    run([a, b, c, d], 0.3)
    assert not answers and key in b.cluster.replicas.homes.lookers
    a.put(key, 2 * OFFER_MAX)
    assert run([a, b, c, d], 3, lambda: key in d.reads.started)
    d.reads.over = True
    assert run([a, b, c, d], 3, lambda: bool(answers))
    assert answers[-1].get("version") == 1, answers


def test_claims_of_one_key_on_two_nodes_that_are_not_its_homes_converge_at_its_home(
    quad: Callable[[str], Node],
) -> None:
    """c and d put k at once, neither hears of the other's: its home picks the winner (d's:
    its name) and tells c, which drops its version; every node that knows k names d."""
    a, b, c, d = _started(quad)
    nodes = [a, b, c, d]
    key = homed("ab", "abcd")
    c.put(key, 4096)
    d.put(key, 4096)
    assert run(nodes, 3, lambda: key not in c.registry.objects or c.cluster.replicas.holds(key))
    run(nodes, 0.3)
    assert key in d.registry.objects and not d.cluster.replicas.holds(key)
    assert c.knows(key) and c.cluster.replicas.where()[key][0] == "d"
    assert c.cluster.stats()["puts_lost"] == 1 and d.cluster.stats()["puts_lost"] == 0
    for n in (a, b):
        assert n.cluster.replicas.where()[key][:2] == ("d", 1), n.name


def test_a_key_whose_home_went_down_is_found_at_its_second_and_claimed_to_its_new(
    quad: Callable[[str], Node],
) -> None:
    """b, k's home, dies: c, its second home, still knows where k lives (on a), d asks it,
    and a claims k to the node that is one of its homes now."""
    a, b, c, d = _started(quad)
    key = homed("bc", "abcd")
    a.put(key, 4096)
    assert run([a, b, c, d], 3, lambda: c.cluster.replicas.holds(key))
    b.close()
    rest = [a, c, d]
    assert run(rest, 6, lambda: not any(n.up("b") for n in rest))
    homes = d.cluster.replicas.homes.homes(key)
    assert "c" in homes
    assert run(rest, 3, lambda: d.knows(key)) and d.cluster.replicas.where()[key][0] == "a"
    other = next(h for h in homes if h != "c")
    if other != "a":  # (its owner is its own home: no message)
        node = {"d": d}[other]
        assert run(rest, 3, lambda: node.cluster.replicas.holds(key))


def _get(node: Node, key: str, answers: list[dict[str, Any]]) -> None:
    """A get of `key` on `node` that may wait 10 s; its answers go to `answers`."""
    node.objects._send = lambda route, payload, last=False: answers.append(decode(payload))
    req = Request("get", 9, {"key": key, "timeout": 10.0}, [])
    assert node.objects.get(node.session, b"client", req) is None


def test_a_get_waiting_for_a_key_is_told_of_its_put_after_the_keys_home_restarted(
    quad: Callable[[str], Node],
) -> None:
    """b, k's home, restarts at once (before any node takes it for down): it forgot that d
    asks of k. d asks again (its ask, refused by b's new process, goes again after its
    hello), so a's put of k still reaches the get waiting on d."""
    a, b, c, d = _started(quad)
    key = homed("bc", "abcd")
    answers: list[dict[str, Any]] = []
    _get(d, key, answers)
    run([a, b, c, d], 0.3)
    assert key in b.cluster.replicas.homes.lookers
    b.close()
    b = quad("b")
    nodes = [a, b, c, d]
    assert run(nodes, 5, lambda: all(n.up(m.name) for n in nodes for m in nodes if m is not n))
    assert run(nodes, 3, lambda: key in b.cluster.replicas.homes.lookers)
    a.put(key, 2 * OFFER_MAX)
    assert run(nodes, 3, lambda: key in d.reads.started)


def test_a_stream_of_new_keys_costs_the_cluster_the_same_claims_a_second_whatever_its_size(
    quad: Callable[[str], Node],
) -> None:
    """A node putting new keys as fast as it can sends a claim message to each home once
    per `claim_every`: at most CLAIMS_A_SECOND such messages a second in all, whatever the
    number of nodes, up to the size where CLAIM_WAIT_MAX bounds the wait."""
    claims = quad("a").cluster.replicas.lending
    largest = int(announcing.CLAIM_WAIT_MAX * announcing.CLAIMS_A_SECOND)  # peers
    for peers in (1, 3, 4, 15, 20, largest):
        claims.peers = peers
        assert announcing.CLAIM_EVERY <= claims.claim_every <= announcing.CLAIM_WAIT_MAX
        assert peers / claims.claim_every <= announcing.CLAIMS_A_SECOND + 1e-9
    claims.peers = 3  # (at 4 nodes, the 10 ms of a small cluster)
    assert claims.claim_every == announcing.CLAIM_EVERY
    claims.peers = 999
    assert claims.claim_every == announcing.CLAIM_WAIT_MAX


def test_a_key_its_owner_no_longer_has_is_forgotten_once_a_get_asks_it(
    quad: Callable[[str], Node],
) -> None:
    """d knows k lives on a, but missed its delete (told by k's home, which had forgotten
    that d asks of it): d's get asks a, which has none. The get raises NotFound, and d
    forgets k: `exists` is not True for good."""
    a, b, c, d = _started(quad)
    key = homed("bc", "abcd")
    a.put(key, 2 * OFFER_MAX)
    assert run([a, b, c, d], 3, lambda: d.knows(key))
    b.cluster.replicas.homes.lookers.pop(key)  # (as if the home forgot d)
    a.objects.delete(a.session, b"client", Request("delete", 8, {"key": key}, []))
    run([a, b, c, d], 0.3)
    assert d.cluster.replicas.holds(key)  # stale
    answers: list[dict[str, Any]] = []
    _get(d, key, answers)
    assert run([a, b, c, d], 3, lambda: bool(answers))
    assert "not_found" in str(answers[-1]), answers
    assert not d.cluster.replicas.holds(key)


def test_a_put_and_delete_that_lose_to_the_owners_later_version_leave_it_findable(
    quad: Callable[[str], Node],
) -> None:
    """c claimed k (its home a heard of version 1), then put versions 2 and 3 (no follower:
    nobody heard). d, which knew of version 1, puts k (2) and deletes it in one batch: the
    home forgets k, but c's version 3 wins over d's 2, and c claims k again, so its home
    knows where it lives."""
    a, b, c, d = nodes = _started(quad)
    key = homed("ab", "abcd")
    c.put(key, 4096)
    assert run(nodes, 3, lambda: a.cluster.replicas.holds(key) and d.knows(key))
    c.put(key, 4096)
    c.put(key, 4096)
    run(nodes, 0.3)
    d.put(key, 4096)
    d.objects.delete(d.session, b"client", Request("delete", 8, {"key": key}, []))
    run(nodes, 1.0)
    assert c.registry.objects[key].version == 3
    assert a.cluster.replicas.where()[key][:2] == ("c", 3)


def test_a_put_on_a_node_that_heard_of_no_version_of_a_key_goes_above_the_owners(
    quad: Callable[[str], Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner put k (versions 1 to 3) a while ago; a node that never heard of k puts it
    (its version 1): that put came later, and wins everywhere, above the owner's version 3
    (it was lost to the older version 3). Both orders of the two nodes' names (a tie of
    claims goes to the greater)."""
    monkeypatch.setattr(ordering, "SETTLED", 0.2)
    a, b, c, d = nodes = _started(quad)
    _a_late_put_wins(nodes, a, d, homed("bc", "abcd", "x"))
    _a_late_put_wins(nodes, d, a, homed("bc", "abcd", "y"))


def _a_late_put_wins(nodes: list[Node], owner: Node, late: Node, key: str) -> None:
    for _ in range(3):
        owner.put(key, 4096)
    run(nodes, 0.4)
    late.put(key, 4096)
    home = nodes[1].cluster.replicas
    assert run(nodes, 3, lambda: key not in owner.registry.objects), owner.name
    assert run(nodes, 3, lambda: home.where().get(key) == (late.name, 4, 4096))
    assert late.registry.objects[key].version == 4 and not late.cluster.replicas.holds(key)
    assert owner.knows(key) and owner.cluster.replicas.where()[key][:2] == (late.name, 4)
    assert late.cluster.stats()["puts_lost"] == 0, late.name


def test_puts_of_a_new_key_on_two_nodes_at_once_go_to_the_greater_name(
    quad: Callable[[str], Node],
) -> None:
    """a and d put k within SETTLED of each other, neither having heard of it: neither came
    surely later, and d's (its name) wins; a's is dropped (and counted)."""
    a, b, c, d = nodes = _started(quad)
    key = homed("bc", "abcd")
    a.put(key, 4096)
    d.put(key, 4096)
    assert run(nodes, 3, lambda: key not in a.registry.objects)
    run(nodes, 0.3)
    assert d.registry.objects[key].version == 1 and a.cluster.stats()["puts_lost"] == 1


def test_a_put_that_loses_to_the_version_of_a_node_that_is_down_is_told_so(
    quad: Callable[[str], Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """d owns k and is down; a, which never heard of k, puts it (its claim loses to d's:
    the name). Its home cannot ask d, so it tells a that d's version wins (a get of k raises
    PeerUnavailable until d is back): a does not go on holding a version only its own
    readers see, while the homes name d."""
    monkeypatch.setattr(ordering, "SETTLED", 0.2)
    a, b, c, d = _started(quad)
    key = homed("bc", "abcd", "z")
    d.put(key, 4096)
    rest = [a, b, c]
    assert run([*rest, d], 3, lambda: b.cluster.replicas.holds(key))
    d.close()
    assert run(rest, 6, lambda: not any(n.up("d") for n in rest))
    a.put(key, 4096)
    assert run(rest, 3, lambda: key not in a.registry.objects)
    assert a.cluster.replicas.where()[key][0] == "d" and a.cluster.stats()["puts_lost"] == 1


def test_a_deleted_keys_lookers_are_forgotten(quad: Callable[[str], Node]) -> None:
    """d asked b (k's home) where k lives; a deletes k: b tells d, then forgets that d asked,
    and d that it did (neither grows with every key that ever lived)."""
    a, b, c, d = nodes = _started(quad)
    key = homed("bc", "abcd")
    a.put(key, 4096)
    assert run(nodes, 3, lambda: d.knows(key))
    assert key in b.cluster.replicas.homes.lookers and key in d.cluster.replicas.homes.asked
    a.objects.delete(a.session, b"client", Request("delete", 8, {"key": key}, []))
    assert run(nodes, 3, lambda: not d.cluster.replicas.holds(key))
    assert key not in b.cluster.replicas.homes.lookers
    assert key not in d.cluster.replicas.homes.asked


def test_exists_of_keys_that_never_live_leaves_nothing_behind(
    quad: Callable[[str], Node],
) -> None:
    """d asks whether 30 keys that no node holds exist (a poll on unique names): each asks
    the key's home once and is answered False; neither the homes' lookers nor d's asks
    keep them (they grew with every name ever asked). A get that waits for such a key still
    hears of its put."""
    a, b, c, d = nodes = _started(quad)
    keys = [homed("b", "abcd", f"never{i}-") for i in range(30)]
    answers: list[dict[str, Any]] = []
    d.objects._send = lambda route, payload, last=False: answers.append(decode(payload))
    for i, key in enumerate(keys):
        req = Request("exists", 100 + i, {"key": key}, [])
        assert d.objects.exists(d.session, b"client", req) is None  # (its home is asked)
    assert run(nodes, 3, lambda: len(answers) == len(keys))
    assert all(m.get("exists") is False for m in answers), answers
    assert not set(keys) & set(b.cluster.replicas.homes.lookers)
    assert not set(keys) & set(d.cluster.replicas.homes.asked)
    waiting = Request("get", 9, {"key": keys[0], "timeout": 10.0}, [])
    assert d.objects.get(d.session, b"client", waiting) is None
    assert run(nodes, 3, lambda: keys[0] in b.cluster.replicas.homes.lookers)
    a.put(keys[0], 2 * OFFER_MAX)
    assert run(nodes, 3, lambda: keys[0] in d.reads.started)
    d.reads.over = True
    assert run(nodes, 3, lambda: any(m.get("version") == 1 for m in answers))


def test_keys_move_to_their_new_homes_in_slices_when_a_node_leaves(
    quad: Callable[[str], Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """d leaves: a's keys that had d for a home are claimed to their new one, a slice of
    keys a turn of the loop (so that it answers meanwhile), until every key's homes among
    a, b and c know where it lives."""
    monkeypatch.setattr(moves, "MOVE_SLICE", 10)
    a, b, c, d = _started(quad)
    keys = [f"m{i}" for i in range(60)]
    for key in keys:
        a.put(key, 4096)
    run([a, b, c, d], 0.5)
    d.close()
    rest, slices = [a, b, c], []
    a.cluster.replicas.homes.tick = _counting(a.cluster.replicas.homes, slices)  # type: ignore[method-assign]
    assert run(rest, 6, lambda: not any(n.up("d") for n in rest))
    nodes = {"a": a, "b": b, "c": c}

    def placed() -> bool:
        return all(
            nodes[h].cluster.replicas.holds(k)
            for k in keys
            for h in homes.Homes.homes_of(k, "abc")
            if h != "a"
        )

    assert run(rest, 3, placed)
    assert len(slices) >= 5  # (60 keys of a's, 10 a turn: the first at once)


def _counting(h: homes.Homes, slices: list[None]) -> Callable[[float], None]:
    """`h.tick`, counting the turns that found a move under way."""
    tick = h.tick

    def counted(now: float) -> None:
        if h.moving:
            slices.append(None)
        tick(now)

    return counted


def test_a_replica_dropped_on_a_node_is_no_delete_of_its_key(quad: Callable[[str], Node]) -> None:
    """d's replica of a's k is evicted: k lives on, so neither its homes nor its lookers hear
    of a delete, and when a deletes k, d (a looker of it) is told."""
    a, b, c, d = nodes = _started(quad)
    key = homed("bc", "abcd")
    a.put(key, 2 * OFFER_MAX)
    assert run(nodes, 3, lambda: d.knows(key))
    d.reads.over = True
    assert d.get(key)
    assert run(nodes, 3, lambda: key in d.registry.objects and not d.cluster.replicas.pulls.pulls)
    d.objects._evicted(d.registry.objects[key])  # (as the eviction of a replica tells)
    run(nodes, 0.3)
    assert "d" in b.cluster.replicas.homes.lookers.get(key, ())
    assert b.cluster.replicas.holds(key) and c.cluster.replicas.holds(key)
    a.objects.delete(a.session, b"client", Request("delete", 8, {"key": key}, []))
    assert run(nodes, 3, lambda: not d.cluster.replicas.holds(key))


def test_a_put_made_after_the_owners_versions_wins_though_its_node_heard_only_the_first(
    quad: Callable[[str], Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """d asked where k lives and heard of a's version 1 only; a put versions 2 to 4, then
    nothing for a while; d's put of k (its version 2) came after all of them: it wins,
    above a's 4, though d had not heard of them."""
    monkeypatch.setattr(ordering, "SETTLED", 0.2)
    a, b, c, d = nodes = _started(quad)
    key = homed("bc", "abcd")
    a.put(key, 4096)
    assert run(nodes, 3, lambda: d.knows(key))
    for _ in range(3):
        a.put(key, 4096)
    run(nodes, 0.4)
    assert d.put(key, 4096).version == 2
    assert run(nodes, 3, lambda: key not in a.registry.objects)
    assert run(nodes, 3, lambda: b.cluster.replicas.where().get(key) == ("d", 5, 4096))
    assert d.registry.objects[key].version == 5


def test_homed_at_says_what_homes_of_says() -> None:
    """`homed_at` (a few hashes a key: welcomes and moves) against the two homes that
    `homes_of` finds with a hash a node, for clusters of 1 to 100 nodes."""
    for n in (1, 2, 3, 16, 100):
        members = tuple(f"node{i}" for i in range(n))
        for key in (f"key{i}" for i in range(300)):
            two = homes.Homes.homes_of(key, members)
            assert {m for m in members if homes.Homes.homed_at(key, m, members)} == set(two)


def test_a_node_that_comes_up_costs_a_move_a_few_hashes_a_key(
    quad: Callable[[str], Node],
) -> None:
    """d comes back: only the keys homed at d change homes, and it hears of them with its
    welcome. a finds that without the homes of each of its keys among every node (N hashes
    a key: 100 s for 100,000 keys at 1,000 nodes), and d knows where each of its keys lives."""
    a, b, c, d = _started(quad)
    keys = [f"m{i}" for i in range(60)]
    for key in keys:
        a.put(key, 4096)
    d.close()
    rest = [a, b, c]
    moving = a.cluster.replicas.homes
    assert run(rest, 6, lambda: not any(n.up("d") for n in rest) and not moving.moving)
    found: list[str] = []
    homes_of = homes.Homes.homes_of

    def counting(key: str, members: Any) -> list[str]:
        found.append(key)
        return homes_of(key, members)

    a.cluster.replicas.homes.homes_of = counting  # type: ignore[method-assign]
    d = quad("d")
    nodes = [a, b, c, d]
    assert run(nodes, 6, lambda: all(n.up(m.name) for n in nodes for m in nodes if m is not n))
    run(nodes, 0.5)
    assert len(found) < len(keys) / 2, len(found)  # (2 a key before)
    at_d = [k for k in keys if "d" in homes_of(k, "abcd")]
    assert at_d and run(nodes, 3, lambda: all(d.cluster.replicas.holds(k) for k in at_d))


def test_the_homes_are_spread_evenly_and_scored_alike_by_python_and_numpy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each of 50 nodes is the home of about a fiftieth of the keys, and the homes found
    with numpy (past VECTOR nodes) are those found one node at a time: every broker of a
    cluster must find the same."""
    members = tuple(f"n{i:02d}" for i in range(50))
    keys = [f"key{i}" for i in range(5000)]
    counts = dict.fromkeys(members, 0)
    for key in keys:
        counts[homes.Homes.homes_of(key, members)[0]] += 1
    assert 50 <= min(counts.values()) and max(counts.values()) <= 150, counts  # (100 each)
    vector = [homes.Homes.homes_of(k, members) for k in keys[:500]]
    monkeypatch.setattr(rendezvous, "VECTOR", 1000)
    assert [homes.Homes.homes_of(k, members) for k in keys[:500]] == vector


def test_moves_one_after_the_other_go_a_slice_a_turn(
    quad: Callable[[str], Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """d goes, then c, before a's first move ended: the second waits for the first, a slice
    a turn of the loop each (it ran the rest of the first at once: as brokers come up one
    by one in a large cluster, the loop stopped at each), and b gets the claim of each key
    of a's that had it for no home before."""
    monkeypatch.setattr(moves, "MOVE_SLICE", 10)
    a, b, c, d = _started(quad)
    keys = [f"m{i}" for i in range(120)]
    for key in keys:
        a.put(key, 4096)
    h = a.cluster.replicas.homes
    assert not h.moving
    claims: list[tuple[str, str]] = []

    def claim(node: str, entries: list[list[Any]]) -> None:
        claims.extend((node, e[0]) for e in entries)

    h.changed(["b", "c"], claim, lambda key: False, lambda key: None)
    h.changed(["b"], claim, lambda key: False, lambda key: None)
    assert h.moving and len(claims) <= 20  # (two slices of 10 keys ran, of 120)
    while h.moving:
        h.tick(0.0)
    to_b = {k for node, k in claims if node == "b"}  # (c's, of the first move, are moot)
    assert to_b == {k for k in keys if "b" not in homes.Homes.homes_of(k, "abcd")}


def test_a_waiting_get_that_races_an_exists_of_its_key_stays_a_looker(
    quad: Callable[[str], Node],
) -> None:
    """d asks whether k exists (not a looker at its home b), then a get waits for k (a
    looker): the exists' answer comes first, and must not make d forget that it asked b,
    or a restart of b or a move of k would leave the get unheard of."""
    a, b, c, d = nodes = _started(quad)
    key = homed("b", "abcd")
    d.objects._send = lambda route, payload, last=False: None
    assert d.objects.exists(d.session, b"client", Request("exists", 1, {"key": key}, [])) is None
    waiting = Request("get", 2, {"key": key, "timeout": 10.0}, [])
    assert d.objects.get(d.session, b"client", waiting) is None
    h = d.cluster.replicas.homes
    assert run(nodes, 3, lambda: not h.asks)
    assert h.asked.get(key) == "b" and "d" in b.cluster.replicas.homes.lookers[key]


def test_a_queued_move_asks_by_the_nodes_up_now(
    quad: Callable[[str], Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """d goes and comes back before a's first move reaches its asks; meanwhile a get on a
    asked d (k's home again, a its second) where k lives. The first move must not take a for
    k's home (it was, while d was away) and forget that ask: the nodes up now decide."""
    monkeypatch.setattr(moves, "MOVE_SLICE", 10)
    a, b, c, d = _started(quad)
    for i in range(20):  # (a's own keys: the move's first slices)
        a.put(f"m{i}", 4096)
    names = (f"q{i}" for i in range(10_000))
    key = next(k for k in names if homes.Homes.homes_of(k, "abcd") == ["d", "a"])
    h = a.cluster.replicas.homes
    h.changed(["b", "c"], lambda node, entries: None, lambda k: False, lambda k: None)
    h.changed(["b", "c", "d"], lambda node, entries: None, lambda k: False, lambda k: None)
    h.asked[key] = "d"  # (a get here asked d, up again)
    while h.moving:
        h.tick(0.0)
    assert h.asked.get(key) == "d"
