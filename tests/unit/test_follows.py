"""Who hears of a version (Note [follows] in server/cluster/follows.py): a key's claim and
delete reach its homes, its later versions the nodes that follow it. Cluster objects
stepped by hand in this process (tests/nodes.py); the whole brokers: test_cluster.py."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tensorbroker.common.protocol import Request
from tensorbroker.server.cluster.follows import PREFIXES
from tensorbroker.server.cluster.membership import Member
from tests.nodes import Node, homed, pair, run, trio

__all__ = ["pair", "trio"]  # the fixtures


def test_a_first_get_of_a_small_key_put_again_since_reads_the_newest(
    pair: Callable[[str], Node],
) -> None:
    """b heard of k's version 1 (its claim) and nothing since: its first get must read
    version 2, not an offer of version 1, and b follows k from then on."""
    a, b = pair("a"), pair("b")
    assert run([a, b], 5, lambda: b.up("a") and a.up("b") and b.cluster.links.fresh("a"))
    a.put("k", 4096)
    assert run([a, b], 3, lambda: b.knows("k"))
    a.put("k", 4096)
    run([a, b], 0.3)
    assert b.cluster.replicas.where()["k"][1] == 1  # (not told of version 2)
    b.reads.over = True
    assert b.get("k")
    assert run([a, b], 3, lambda: "k" in b.registry.objects and not b.cluster.replicas.pulls.pulls)
    assert b.registry.objects["k"].version == 2
    v3 = a.put("k", 4096).version
    assert run([a, b], 3, lambda: b.cluster.replicas.where()["k"][1] == v3)


def test_a_small_version_no_other_node_reads_is_not_kept_for_them_once_replaced(
    trio: Callable[[str], Node],
) -> None:
    """Offers go to the nodes that follow a key only: nobody follows k, so each version of
    it is freed once replaced (an offer to a node that is never told of the next version
    would pin it for good)."""
    a, b, c = trio("a"), trio("b"), trio("c")
    nodes = [a, b, c]
    assert run(nodes, 5, lambda: all(n.up(m) for n in nodes for m in "abc" if m != n.name))
    first = a.put("k", 4096)
    run(nodes, 0.3)
    for _ in range(3):
        a.put("k", 4096)
        run(nodes, 0.2)
    assert first.freed and not a.cluster.replicas.lending.offered


def test_an_announcement_its_link_refused_goes_once_the_link_takes_it(
    pair: Callable[[str], Node],
) -> None:
    """A claim is sent once (the versions after it go to followers only): one that b's link
    refused (its queue full, or it reconnects while b is up) must still reach b, its home."""
    a, b = pair("a"), pair("b")
    k = homed("b", "ab")
    assert run([a, b], 5, lambda: b.up("a") and a.up("b"))
    links, refused = a.cluster.links, []
    send_to = links.send_to

    def refusing(peer: Any, message: dict[str, Any]) -> bool:
        if message.get("op") == "announce" and not refused:
            refused.append(message)
            return False  # (as zmq.Again)
        return send_to(peer, message)

    links.send_to = refusing  # type: ignore[method-assign]
    a.put(k, 2 * 65536)
    assert run([a, b], 3, lambda: b.cluster.replicas.holds(k))
    assert refused


def test_a_node_whose_put_lost_to_a_claim_in_the_same_turn_claims_its_next_put_again(
    pair: Callable[[str], Node],
) -> None:
    """b's claim of k reaches a in the turn a sealed its own k (b's wins a tie: its name):
    a's announcement, made before, must not count as a's claim, or a's next version (which
    wins) would go to k's followers only, and b would hold its own for good."""
    a, b = pair("a"), pair("b")
    assert run([a, b], 5, lambda: b.up("a") and a.up("b"))
    b.put("k", 2 * 65536)
    b.step()  # b's claim goes out
    time.sleep(0.05)
    a.put("k", 2 * 65536)  # a's version 1: its announcement waits for a's flush
    a.step()  # a reads b's claim first (a's loses), then flushes
    run([a, b], 0.5)
    v = a.put("k", 2 * 65536).version  # above b's: it wins
    assert run([a, b], 3, lambda: b.cluster.replicas.where().get("k", ("",))[0] == "a")
    assert "k" not in b.registry.objects or b.cluster.replicas.where()["k"][1] == v


def test_the_prefixes_a_node_follows_are_bounded(pair: Callable[[str], Node]) -> None:
    """watch_prefix of a new prefix each time (job/{i}/, say): past PREFIXES, the node
    follows every key, and its peers keep a bounded list for it."""
    a, b = pair("a"), pair("b")
    assert run([a, b], 5, lambda: b.up("a") and a.up("b"))
    for i in range(500):
        b.cluster.replicas.follow_prefix(f"job/{i}/")
    followers = a.cluster.replicas.lending.followers
    assert run([a, b], 3, lambda: "" in followers.prefixes.get("b", ()))
    assert len(followers.prefixes["b"]) == PREFIXES + 1
    assert followers.of("other/k", 10) == {"b"}


def test_a_broker_whose_lease_expired_keeps_what_it_lent_and_reads_nothing_stale(
    pair: Callable[[str], Node],
) -> None:
    """a's lease in etcd expired and a joined again (membership.py): b may still read what a
    lent it, so a keeps it pinned (b says at its next beat whether it took a for down); and
    a's own read of b's version, under way, is not sealed (b may have let it go)."""
    a, b = pair("a"), pair("b")
    assert run([a, b], 5, lambda: b.up("a") and a.up("b") and b.cluster.links.fresh("a"))
    v1 = a.put("k", 2 * 65536)  # (above OFFER_MAX: lent, not offered)
    b.put("j", 2 * 65536)
    assert run([a, b], 3, lambda: b.knows("k") and a.knows("j"))
    assert b.get("k") and a.get("j")
    both = [a.cluster.replicas.pulls.pulls, b.cluster.replicas.pulls.pulls]
    assert run([a, b], 3, lambda: all(p.handle for ps in both for p in ps.values()))
    a.cluster._members([Member("a", None)])  # (what Membership tells the loop then)
    assert a.cluster.replicas.lending.loans  # still pinned for b's read
    a.put("k", 2 * 65536)
    run([a], 0.2)
    assert not v1.freed
    a.reads.over = b.reads.over = True
    newest = a.registry.objects["k"].version  # (b follows k: told of it, pulls it too)
    assert run([a, b], 3, lambda: "k" in b.registry.objects)
    assert run([a, b], 3, lambda: b.registry.objects["k"].version == newest)
    assert all(p.suspect or p.cut for p in a.cluster.replicas.pulls.pulls.values())


def test_requests_lost_on_a_link_that_reconnected_are_said_again(
    pair: Callable[[str], Node],
) -> None:
    """ZeroMQ drops what it took for a link whose connection broke and came back (its route
    stays: no hello follows). b's follow of k is lost so: a's next beat from b says how many
    requests b sent, a finds one missing, and b says again what it follows; b hears of k's
    next versions."""
    a, b = pair("a"), pair("b")
    assert run([a, b], 5, lambda: b.up("a") and a.up("b") and b.cluster.links.fresh("a"))
    a.put("k", 2 * 65536)
    assert run([a, b], 3, lambda: b.knows("k"))
    links, lost = a.cluster.links, []
    read = links.read

    def losing(socket: Any) -> Any:
        for route, peer, m in read(socket):
            if m.get("op") == "follow" and not lost:
                lost.append(m)  # (taken by b's ZeroMQ, never delivered)
                continue
            yield route, peer, m

    links.read = losing  # type: ignore[method-assign]
    watch = Request("get", 8, {"key": "k", "after": 1, "timeout": 10.0}, [])
    assert not b.cluster.replicas.get(b.session, b"client", watch)  # it follows k now
    assert run([a, b], 3, lambda: bool(lost))
    v2 = a.put("k", 2 * 65536).version
    assert run([a, b], 6, lambda: b.cluster.replicas.where()["k"][1] == v2)  # (a beat: 2 s)


def test_a_broker_that_joined_etcd_again_reads_nothing_of_a_peer_that_has_not_seen_it(
    pair: Callable[[str], Node],
) -> None:
    """a's lease expired and a put its entry again (its second): b's watch of etcd lags,
    so b may still take a for down as it sees a's first entry go, and let go what it lent
    a. a reads nothing of b's until b answers a beat having seen the second entry."""
    a, b = pair("a"), pair("b")
    assert run([a, b], 5, lambda: a.up("b") and b.up("a") and a.cluster.links.fresh("b"))
    first = {"address": a.cluster.address, "registration": 1}
    b.cluster._members([Member("a", first)])  # (what b's watch saw when a joined)
    a.cluster.links.registration = lambda: 2  # a joined again: its second entry
    a.cluster._members([Member("a", None)])
    run([a, b], 1.5)  # beats answered: b has not seen a's second entry
    assert not a.cluster.links.fresh("b")
    b.cluster._members([Member("a", None), Member("a", {**first, "registration": 2})])
    assert run([a, b], 3, lambda: a.cluster.links.fresh("b"))
