"""Three brokers on this host as three nodes of a cluster (Note [cluster] in
server/cluster/cluster.py), the bytes between them moved by NIXL over UCX's TCP transport
(UCX_TLS=tcp), as between machines."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorbroker as tb
from tensorbroker.common.curve import make_keys
from tensorbroker.server.cluster.queue_links import AHEAD
from tests.support import crash, free_port, in_thread, wait_until

pytest.importorskip("nixl_cu12", reason="the cluster needs NIXL: make test installs nixl-cu12")

NODES = ("a", "b", "c")


def _cluster_options(node: str, ports: dict[str, int]) -> list[str]:
    peers = ",".join(f"tcp://127.0.0.1:{p}" for n, p in ports.items() if n != node)
    return ["--node", node, "--cluster", f"tcp://127.0.0.1:{ports[node]}", "--peers", peers,
            "--insecure-tcp", "--prefetch", "64KiB"]  # fmt: skip


@contextlib.contextmanager
def _cluster(
    nodes: tuple[str, ...], more: dict[str, list[str]] | None = None
) -> Iterator[dict[str, tb.BrokerProcess]]:
    """Brokers of a cluster, one per node; `more`: more options, by node."""
    ports = {node: free_port() for node in nodes}
    started: dict[str, tb.BrokerProcess] = {}
    try:
        for node in nodes:
            options = [*_cluster_options(node, ports), *(more or {}).get(node, [])]
            started[node] = tb.start_broker(memory="64MiB", options=options, log_level="info")
        yield started
    finally:
        for b in started.values():
            b.stop()


@pytest.fixture(scope="module")
def shared() -> Iterator[dict[str, tb.BrokerProcess]]:
    """A cluster for the tests that neither kill a broker nor count memory (their keys are
    their own)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("UCX_TLS", "tcp")  # the network path, not shared memory
        with _cluster(NODES) as started:
            yield started


@pytest.fixture
def brokers(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[dict[str, tb.BrokerProcess]]:
    """A cluster of this test's own, of two nodes (a broker of a cluster costs 0.4 CPU-s to
    start, importing NIXL most of it). Marked `lazy`: b prefetches nothing (Note [prefetch]; the
    others here prefetch 64 KiB),
    for the tests of what a first get does."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    lazy = request.node.get_closest_marker("lazy") is not None
    with _cluster(("a", "b"), {"b": ["--prefetch", "0"]} if lazy else None) as started:
        yield started


@contextlib.contextmanager
def _connected(brokers: dict[str, tb.BrokerProcess]) -> Iterator[dict[str, tb.Client]]:
    opened = {node: tb.connect(b.address) for node, b in brokers.items()}
    try:
        assert wait_until(lambda: all(_all_up(c) for c in opened.values()), 10), {
            n: c.stats()["cluster"] for n, c in opened.items()
        }
        yield opened
    finally:
        for c in opened.values():
            c.close()


@pytest.fixture
def clients(shared: dict[str, tb.BrokerProcess]) -> Iterator[dict[str, tb.Client]]:
    with _connected(shared) as opened:
        yield opened


@pytest.fixture
def own(brokers: dict[str, tb.BrokerProcess]) -> Iterator[dict[str, tb.Client]]:
    with _connected(brokers) as opened:
        yield opened


def _all_up(c: tb.Client) -> bool:
    peers = c.stats()["cluster"]["peers"]
    return all(p["state"] == "up" for p in peers.values())


def _figures(c: tb.Client) -> dict[str, Any]:
    return dict(c.stats()["cluster"])


def _received(c: tb.Client) -> int:
    return int(c.stats()["cluster"]["bytes_received"])


def test_a_key_put_on_one_node_is_read_on_the_others_then_locally(
    clients: dict[str, tb.Client],
) -> None:
    a, b, c = clients["a"], clients["b"], clients["c"]
    x = np.random.default_rng(0).standard_normal((512, 256)).astype(np.float32)  # 512 KiB
    assert a.put("weights", x) == 1
    assert wait_until(lambda: "weights" in b.keys() and b.exists("weights"), 5)
    got = b.get("weights")  # pulled from a, once
    assert got.version == 1
    np.testing.assert_array_equal(got.numpy(), x)
    pulled = _received(b)
    assert pulled >= x.nbytes
    again = b.get("weights")  # b's own replica now: no second pull
    np.testing.assert_array_equal(again.numpy(), x)
    assert _received(b) == pulled
    assert a.stats()["cluster"]["bytes_sent"] >= x.nbytes
    bundle = {"w": np.arange(10, dtype=np.int64), "b": np.ones((3, 3), np.float16)}
    a.put("layer", bundle)  # a bundle keeps its names and dtypes
    assert wait_until(lambda: c.exists("layer"), 5)
    layer = c.get("layer")
    assert set(layer) == {"w", "b"}
    np.testing.assert_array_equal(layer["w"].numpy(), bundle["w"])
    np.testing.assert_array_equal(layer["b"].numpy(), bundle["b"])
    with pytest.raises(tb.NotFound):
        c.get("nowhere")
    del got, again, layer


def test_a_get_that_waits_for_a_key_is_answered_by_a_put_on_another_node(
    clients: dict[str, tb.Client],
) -> None:
    waiting, out = in_thread(lambda: clients["c"].get("later", timeout=10))
    time.sleep(0.2)  # parked on c before the key exists anywhere
    clients["a"].put("later", np.arange(7))
    waiting.join(10)
    assert out and not isinstance(out[0], BaseException), out
    np.testing.assert_array_equal(out[0].numpy(), np.arange(7))


@pytest.mark.parametrize("n", [16 * 1024, 512], ids=["128KiB-lent", "4KiB-offered"])
def test_a_watch_on_another_node_sees_whole_versions_in_order_to_the_last(
    clients: dict[str, tb.Client], n: int
) -> None:
    a, b = clients["a"], clients["b"]
    last, key = 40, f"policy-{n}"
    a.put(key, np.full(n, 1, np.int64))
    seen: list[int] = []

    def follow() -> None:
        for item in b.watch(key, timeout=10):
            assert item is not None
            values = item.numpy()
            assert (values == item.version).all(), f"version {item.version} torn"
            seen.append(item.version)
            if item.version == last:
                return

    watching, out = in_thread(follow)
    for v in range(2, last + 1):
        a.put(key, np.full(n, v, np.int64))
        time.sleep(0.005)
    watching.join(30)
    assert out == [None], out
    assert seen == sorted(set(seen)) and seen[-1] == last, seen
    before = _received(b)  # the watched key's next version is pulled as it is announced
    a.put(key, np.full(n, last + 1, np.int64))
    assert wait_until(lambda: _received(b) > before, 5), "the new version was not pulled ahead"
    assert b.get(key).version == last + 1


def test_small_versions_replaced_fast_are_never_read_torn_and_leave_nothing_pinned(
    own: dict[str, tb.Client],
) -> None:
    """Offers given back while their reads are under way, and reads of versions replaced
    meanwhile: every version read is whole, and the owner holds the last one alone."""
    a, b = own["a"], own["b"]
    assert wait_until(lambda: _figures(b)["peers"]["a"]["fresh"], 5)  # (offers readable)
    a.put("hot", np.full(512, 1, np.int64))  # 4 KiB: offered
    one = a.stats()["used_bytes"]
    last = 300

    def write() -> None:  # (paced: a pull chasing a writer faster than it reads the last)
        for v in range(2, last + 1):
            a.put("hot", np.full(512, v, np.int64))
            time.sleep(0.002)

    writing, out = in_thread(write)
    seen = [0]
    while seen[-1] < last:
        item = b.get("hot", timeout=10)
        values = item.numpy()
        assert (values == item.version).all(), f"version {item.version} torn"
        assert item.version >= seen[-1]
        seen.append(item.version)
        del item, values
    writing.join(30)
    assert out == [None], out
    assert len(set(seen)) > 2, seen  # (it read versions as they came)
    assert wait_until(lambda: a.stats()["used_bytes"] == one, 5), a.stats()["used_bytes"]
    assert _figures(a)["offered"] == 1 and _figures(b)["offers_held"] == 1
    a.delete("hot")
    assert wait_until(lambda: a.stats()["used_bytes"] == 0 and _figures(a)["offered"] == 0, 5)
    assert wait_until(lambda: b.stats()["used_bytes"] == 0 and _figures(b)["offers_held"] == 0, 5)


def test_a_key_deleted_on_another_node_is_gone_everywhere(clients: dict[str, tb.Client]) -> None:
    a, b, c = clients["a"], clients["b"], clients["c"]
    a.put("doomed", np.arange(4))
    assert wait_until(lambda: b.exists("doomed") and c.exists("doomed"), 5)
    held = c.get("doomed")  # a replica on c, held by its reader
    b.delete("doomed")  # b never held it: the delete goes to a
    assert not b.exists("doomed")
    assert wait_until(lambda: not a.exists("doomed") and not c.exists("doomed"), 5)
    with pytest.raises(tb.NotFound):
        c.get("doomed")
    assert held.numpy().tolist() == [0, 1, 2, 3]  # what a reader holds stays readable
    with pytest.raises(tb.NotFound):
        b.delete("doomed")
    del held


def test_get_many_wait_and_watch_prefix_see_keys_put_on_other_nodes(
    clients: dict[str, tb.Client],
) -> None:
    a, b, c = clients["a"], clients["b"], clients["c"]
    events = b.watch_prefix("many/", timeout=10)
    waiting, out = in_thread(lambda: c.wait(["many/0", "many/1"], timeout=10))
    a.put("many/0", np.zeros(3))
    b.put("many/1", np.ones(3))  # one on the watcher's own node
    waiting.join(10)
    assert out == [["many/0", "many/1"]], out
    got = c.get_many(["many/0", "many/1"])
    assert [float(got[k].numpy()[0]) for k in ("many/0", "many/1")] == [0.0, 1.0]
    seen = [next(events) for _ in range(2)]
    assert sorted((e.event, e.key, e.version) for e in seen) == [
        ("put", "many/0", 1), ("put", "many/1", 1)
    ]  # fmt: skip
    a.delete("many/0")
    assert next(events) == tb.KeyEvent("delete", "many/0", 1)
    del got


def test_a_newer_version_replaces_the_replica(clients: dict[str, tb.Client]) -> None:
    a, b = clients["a"], clients["b"]
    a.put("k", np.zeros(1000))
    assert wait_until(lambda: b.exists("k"), 5)
    first = b.get("k")
    assert first.version == 1 and first.numpy()[0] == 0
    for v in range(2, 12):  # each read on b sees a whole version, never an older one
        a.put("k", np.full(1000, v, np.float64))
        assert wait_until(lambda: _version_seen(b, "k") >= v, 5)  # noqa: B023
        item = b.get("k")
        arr = item.numpy()
        assert item.version == v and (arr == v).all()
        del item, arr
    assert first.numpy()[0] == 0  # the replica it held lives on while held
    del first


def _version_seen(c: tb.Client, key: str) -> int:
    try:
        return int(c.get(key).version)
    except tb.NotFound:
        return 0


def test_two_nodes_putting_one_key_at_once_converge_on_one_version(
    clients: dict[str, tb.Client],
) -> None:
    for i in range(50):  # a lender that lost the race to a node the puller had not heard yet
        key = f"race{i}"
        clients["a"].put(key, np.full(8, 1.0))
        clients["b"].put(key, np.full(8, 2.0))

        def agreed() -> bool:
            got = {n: c.get(key, timeout=5) for n, c in clients.items()}  # noqa: B023
            return len({(g.version, float(g.numpy()[0])) for g in got.values()}) == 1

        assert wait_until(agreed, 10), {n: c.get(key).version for n, c in clients.items()}
    # and a later put on the node that lost goes above every version seen
    clients["a"].put("race0", np.full(8, 3.0))
    assert wait_until(lambda: float(clients["c"].get("race0").numpy()[0]) == 3.0, 10)


def _consume(address: str, name: str, taken: list[int]) -> None:
    """Take items of queue `name` on the broker at `address` until it is closed and drained
    on every node: each item is (producer, its place in that producer's stream)."""
    with tb.connect(address) as c:
        for item in c.queue(name):
            taken.append(int(item.numpy()[0]))
            assert (item.numpy() == item.numpy()[0]).all(), "a torn item"
            del item
            time.sleep(0.002)  # a consumer that works on its item, as the others take theirs


def test_a_queue_across_nodes_hands_each_item_to_one_consumer_in_order(
    shared: dict[str, tb.BrokerProcess], clients: dict[str, tb.Client]
) -> None:
    """Producers on a and b, consumers on b and c: every item once, each producer's in
    order, and a's part never over its bound."""
    taken: dict[str, list[int]] = {"b": [], "c": []}
    consumers = [in_thread(lambda n=n: _consume(shared[n].address, "jobs", taken[n]))
                 for n in ("b", "c")]  # fmt: skip
    queues = {n: clients[n].queue("jobs", maxsize=4) for n in ("a", "b")}
    time.sleep(0.3)  # both consumers wait: their nodes want items
    peak = 0
    for i in range(60):  # a's items, each 32 KiB; b's own producer puts a few too
        queues["a"].put(np.full(4096, 1000 + i, np.int64))
        peak = max(peak, queues["a"].in_flight())
        if i % 10 == 0:
            queues["b"].put(np.full(4096, 2000 + i // 10, np.int64))
    queues["a"].close()  # closes the queue on every node: the consumers drain it, then end
    for thread, out in consumers:
        thread.join(30)
        assert out == [None], out
    got = taken["b"] + taken["c"]
    assert sorted(got) == [*range(1000, 1060), *range(2000, 2006)], got
    for node, seq in taken.items():  # each producer's items in the order it put them
        for producer in (1000, 2000):
            mine = [x for x in seq if producer <= x < producer + 1000]
            assert mine == sorted(mine), (node, mine)
    assert taken["b"] and any(x < 2000 for x in taken["c"]), taken  # a's items reached both
    assert peak <= 4, f"a's part held {peak} items in flight, over its maxsize of 4"
    assert wait_until(lambda: all(_loans_out(clients[n]) == 0 for n in clients), 5)


def _follow(address: str, name: str, seen: list[int], subscribed: threading.Event) -> None:
    with tb.connect(address) as c, c.subscribe(name) as sub:
        subscribed.set()
        for item in sub:
            assert (item.numpy() == item.numpy()[0]).all(), "a torn item"
            seen.append(int(item.numpy()[0]))
            del item


def test_a_broadcast_reaches_subscribers_on_every_node(
    shared: dict[str, tb.BrokerProcess], clients: dict[str, tb.Client]
) -> None:
    """Producers on a and b, two subscribers on c and one on each other node: each gets
    every item once, each producer's in order; the producer's node sends an item's bytes
    once to each other node with subscribers, however many subscribe there."""
    where = ("a", "b", "c", "c")
    seen: list[list[int]] = [[] for _ in where]
    ready = [threading.Event() for _ in where]
    subscribers = [in_thread(lambda i=i, n=n: _follow(shared[n].address, "news", seen[i], ready[i]))
                   for i, n in enumerate(where)]  # fmt: skip
    assert all(r.wait(10) for r in ready)
    time.sleep(0.3)  # the other nodes heard of the subscriptions
    queues = {n: clients[n].broadcast("news", maxsize=4) for n in ("a", "b")}
    sent = {n: int(clients[n].stats()["cluster"]["bytes_sent"]) for n in ("a", "b")}
    for i in range(40):  # 64 KiB each
        queues["a"].put(np.full(8192, 1000 + i, np.int64))
        if i % 8 == 0:
            queues["b"].put(np.full(8192, 2000 + i // 8, np.int64))
    queues["b"].close()
    queues["a"].close()
    for thread, out in subscribers:
        thread.join(30)
        assert out == [None], out
    expected = [*range(1000, 1040), *range(2000, 2005)]
    for node, got in zip(where, seen, strict=True):
        assert sorted(got) == expected, (node, got)
        for producer in (1000, 2000):
            mine = [x for x in got if producer <= x < producer + 1000]
            assert mine == sorted(mine), (node, mine)
    a_sent = int(clients["a"].stats()["cluster"]["bytes_sent"]) - sent["a"]
    assert a_sent == 2 * 40 * 8192 * 8, a_sent  # to b and to c, once each
    assert wait_until(lambda: all(_loans_out(clients[n]) == 0 for n in clients), 5)


def test_a_queue_deleted_on_one_node_is_gone_on_every_node(clients: dict[str, tb.Client]) -> None:
    a, b, c = clients["a"], clients["b"], clients["c"]
    waiting_on_b = b.queue("doomed-queue")
    a.queue("doomed-queue").put(np.arange(1000))  # an item in a's part
    c.queue("doomed-queue")
    got, out = in_thread(lambda: clients["c"].queue("doomed-queue").get(timeout=10))
    got.join(10)  # c's consumer took a's item: the queue has a part on each node
    assert out and not isinstance(out[0], BaseException), out
    del out[:]
    a.queue("doomed-queue").put(np.arange(1000))  # and one more, waiting in a's part
    c.delete_queue("doomed-queue")  # c has no item of it: a's and b's parts go too

    def gone_everywhere() -> bool:
        return not any(q["name"] == "doomed-queue" for n in clients
                       for q in clients[n].list_queues())  # fmt: skip

    assert wait_until(gone_everywhere, 5), {n: clients[n].list_queues() for n in clients}
    with pytest.raises(tb.QueueClosed):
        waiting_on_b.get(timeout=1)
    assert wait_until(lambda: a.stats()["queue_in_flight"] == 0, 5)  # a's item was freed


def _loans_out(c: tb.Client) -> int:
    return int(c.stats()["cluster"]["items_lent"])


def test_a_peer_killed_is_down_within_3s_and_rejoins_with_its_objects(
    brokers: dict[str, tb.BrokerProcess], own: dict[str, tb.Client]
) -> None:
    a, b = own["a"], own["b"]
    a.put("only-on-a", np.arange(20_000))  # 160 KB: over --prefetch, so not read on b
    a.put("pulled", np.arange(50))
    assert wait_until(lambda: b.exists("pulled"), 5)
    held = b.get("pulled")
    crash(brokers["a"])
    killed = time.monotonic()
    assert wait_until(lambda: b.stats()["cluster"]["peers"]["a"]["state"] == "down", 3.5)
    assert time.monotonic() - killed < 3.0
    with pytest.raises(tb.PeerUnavailable, match="only-on-a.*node 'a'.*down"):
        b.get("only-on-a")
    np.testing.assert_array_equal(b.get("pulled").numpy(), np.arange(50))  # the replica stays
    with pytest.raises(tb.Timeout, match="node 'a', which is down, and stayed down"):
        b.get("only-on-a", timeout=0.3)
    waiting, out = in_thread(lambda: b.get("only-on-a", timeout=20))  # waits for a to be back
    brokers["a"].restart()  # on its state: it adopts its objects
    assert wait_until(lambda: b.stats()["cluster"]["peers"]["a"]["state"] == "up", 10)
    assert wait_until(lambda: b.exists("only-on-a"), 5)
    waiting.join(20)
    assert out and not isinstance(out[0], BaseException), out
    np.testing.assert_array_equal(out[0].numpy(), np.arange(20_000))
    np.testing.assert_array_equal(b.get("only-on-a").numpy(), np.arange(20_000))
    del out[:]
    assert wait_until(lambda: _loans(a) == 0, 5), "a pull left the object pinned on a"
    del held


def test_small_versions_are_on_every_node_before_a_get_asks(
    brokers: dict[str, tb.BrokerProcess], own: dict[str, tb.Client]
) -> None:
    """Note [prefetch]: with --prefetch 64KiB (these brokers'), a version of at most 64 KiB
    is read on the node as it is announced, so that a first get there is local: it is read
    even with its owner killed."""
    a, b = own["a"], own["b"]
    x = np.arange(8192, dtype=np.int64)  # 64 KiB
    a.put("small", x)
    a.put("large", np.arange(8193, dtype=np.int64))  # over it: pulled as a get asks
    assert wait_until(lambda: _figures(b)["prefetched"] == 1 and _received(b) == x.nbytes, 5)
    crash(brokers["a"])
    np.testing.assert_array_equal(b.get("small").numpy(), x)
    assert wait_until(lambda: b.stats()["cluster"]["peers"]["a"]["state"] == "down", 3.5)
    with pytest.raises(tb.PeerUnavailable, match="large"):
        b.get("large")
    np.testing.assert_array_equal(b.get("small").numpy(), x)  # a replica, cached


def test_queue_items_on_a_node_killed_come_once_it_is_back(
    brokers: dict[str, tb.BrokerProcess], own: dict[str, tb.Client]
) -> None:
    qa = own["a"].queue("work")
    for i in range(10):
        qa.put(np.full(1000, i, np.int32))
    qb = own["b"].queue("work")
    crash(brokers["a"])
    assert wait_until(lambda: own["b"].stats()["cluster"]["peers"]["a"]["state"] == "down", 3.5)
    with pytest.raises(tb.Timeout, match="'work' stayed empty"):
        qb.get(timeout=0.3)  # its items are on a, which is down: they wait for it
    waiting, out = in_thread(lambda: [int(qb.get(timeout=20).numpy()[0]) for _ in range(10)])
    brokers["a"].restart()  # on its state: it adopts its part of the queue
    waiting.join(30)
    assert out == [list(range(10))], out
    assert wait_until(lambda: _loans_out(own["a"]) == 0, 5)


def test_queue_items_lent_to_a_node_killed_go_to_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A consumer's node dies: what it was lent and had not read goes back to the lender,
    what it read waits in its part until it is back: nothing is lost. The items it took
    last may come again (its lender may not have heard that they were taken: at least
    once): its consumer's, and those it took ahead for it (AHEAD) at most."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    with _cluster(("a", "b", "c")) as started, contextlib.ExitStack() as stack:
        cs = {n: stack.enter_context(tb.connect(started[n].address)) for n in started}
        assert wait_until(lambda: all(_all_up(c) for c in cs.values()), 10)
        qa, qc = cs["a"].queue("jobs"), cs["c"].queue("jobs")
        for i in range(20):
            qa.put(np.full(4096, i, np.int64))
        on_c = [int(qc.get(timeout=10).numpy()[0]) for _ in range(5)]
        crash(started["c"])
        started["c"].restart()  # an item c took and did not hand out is lent on from there
        qb = cs["b"].queue("jobs")
        on_b: list[int] = []
        while len(set(on_c + on_b)) < 20:
            on_b.append(int(qb.get(timeout=15).numpy()[0]))
        again = len(on_c) + len(on_b) - 20
        assert again <= 1 + AHEAD, (on_c, on_b)  # what c held when it died, at most
        assert wait_until(lambda: _loans_out(cs["a"]) == 0, 5)


def _loans(c: tb.Client) -> int:
    return int(c.stats()["cluster"]["loans"])


def test_pulls_leave_no_memory_held(own: dict[str, tb.Client]) -> None:
    a, b = own["a"], own["b"]
    for i in range(20):
        a.put(f"m{i}", np.full(64 * 1024, i, np.uint8))
    assert wait_until(lambda: all(b.exists(f"m{i}") for i in range(20)), 5)
    for i in range(20):
        assert int(b.get(f"m{i}").numpy()[-1]) == i
    assert wait_until(lambda: _loans(a) == 0, 5) and b.stats()["cluster"]["pulls"] == 0
    for i in range(20):
        a.delete(f"m{i}")
    assert wait_until(lambda: not b.keys(), 5), b.keys()  # the replicas went with the keys
    assert wait_until(lambda: b.stats()["used_bytes"] == 0, 5)
    assert wait_until(lambda: a.stats()["used_bytes"] == 0, 5)


@pytest.mark.lazy
def test_a_small_version_is_read_from_the_offer_sent_with_it_and_given_back_once_replaced(
    brokers: dict[str, tb.BrokerProcess], own: dict[str, tb.Client]
) -> None:
    """Note [offers]: a version of at most 64 KiB is announced with where its bytes are, so
    a first get on another node reads them without asking its owner first; the owner keeps
    the version it replaced only until the other nodes gave its offer back."""
    a, b = own["a"], own["b"]
    assert wait_until(lambda: _figures(b)["peers"]["a"]["fresh"], 5)  # (a beat answered)
    x = np.arange(1024, dtype=np.float32)  # 4 KiB
    a.put("small", x)
    one = a.stats()["used_bytes"]
    assert wait_until(lambda: b.exists("small") and _figures(b)["offers_held"] == 1, 5)
    assert _figures(a)["offered"] == 1
    np.testing.assert_array_equal(b.get("small").numpy(), x)
    assert _figures(b)["pulled"] == {"offered": 1, "lent": 0}
    assert wait_until(lambda: _figures(a)["bytes_sent"] == x.nbytes, 5)  # b said it read it
    a.put("small", x + 1)  # b read it before: its replica goes, and the new one is pulled
    assert wait_until(lambda: b.get("small", timeout=5).version == 2, 5)
    np.testing.assert_array_equal(b.get("small").numpy(), x + 1)
    assert _figures(b)["pulled"] == {"offered": 2, "lent": 0}
    # Version 1's offer came back from b: a holds version 2 alone.
    assert wait_until(lambda: a.stats()["used_bytes"] == one, 5), a.stats()["used_bytes"]
    assert _figures(a)["offered"] == 1 and _figures(b)["offers_held"] == 1
    a.put("large", np.ones(64 * 1024 + 1, np.uint8))  # over 64 KiB: lent when asked
    assert wait_until(lambda: b.exists("large"), 5)
    assert b.get("large").numpy().sum() == 64 * 1024 + 1
    assert _figures(b)["pulled"] == {"offered": 2, "lent": 1}
    crash(brokers["b"])  # what a node that died held is let go by the owner
    assert wait_until(lambda: _figures(a)["offered"] == 0, 3.5)
    a.delete("small")
    a.delete("large")
    assert wait_until(lambda: a.stats()["used_bytes"] == 0, 5)
    brokers["b"].restart()


@pytest.mark.lazy
def test_a_broker_that_stalled_past_down_after_reads_no_offer_its_owner_let_go(
    brokers: dict[str, tb.BrokerProcess], own: dict[str, tb.Client]
) -> None:
    """b's loop stalls (a long pause): a takes it for down and lets go what it offered it,
    and the memory goes to other puts. b's get, handled before b hears from a again, must
    not read that memory as version 1 (it may fail, PeerUnavailable: b finds a silent for
    longer than DOWN_AFTER too as it wakes)."""
    a, b = own["a"], own["b"]
    a.put("k", np.full(1024, 1, np.float32))
    assert wait_until(lambda: _figures(b)["offers_held"] == 1, 5)
    brokers["b"].send_signal(signal.SIGSTOP)
    try:
        assert wait_until(lambda: _figures(a)["peers"]["b"]["state"] == "down", 5)
        a.put("k", np.full(1024, 2, np.float32))  # version 1 is no one's now
        for i in range(200):  # and its block goes to other puts
            a.put(f"other{i}", np.full(1024, 99, np.float32))
        getting, out = in_thread(lambda: b.get("k", timeout=10))
        time.sleep(0.3)  # the get waits in b's socket
    finally:
        brokers["b"].send_signal(signal.SIGCONT)
    getting.join(15)
    assert out, "the get was not answered"
    if isinstance(out[0], tb.PeerUnavailable):  # b took a for down too, as it woke: fair
        return
    got = out[0]
    assert (got.version, set(np.unique(got.numpy()))) in [(1, {1.0}), (2, {2.0})], "torn"
    del got, out[:]


@pytest.mark.lazy
def test_an_owner_restarted_before_it_was_seen_down_lends_what_it_offered(
    brokers: dict[str, tb.BrokerProcess], own: dict[str, tb.Client]
) -> None:
    """a restarts on its state within DOWN_AFTER: b drops a's offers (their addresses are
    the old process's) and its gets pull each key whole; a lend sent while b's link to a
    was not connected yet goes out once it is."""
    a, b = own["a"], own["b"]
    for i in range(5):
        a.put(f"k{i}", np.full(1024, i, np.float32))
    assert wait_until(lambda: _figures(b)["offers_held"] == 5, 5)
    crash(brokers["a"])
    brokers["a"].restart()
    assert wait_until(lambda: _figures(b)["offers_held"] == 0, 5)
    for i in range(5):
        assert set(np.unique(b.get(f"k{i}", timeout=10).numpy())) == {float(i)}


def test_offers_to_a_peer_that_restarted_while_the_owner_put_are_all_given_back(
    brokers: dict[str, tb.BrokerProcess], own: dict[str, tb.Client]
) -> None:
    """Announcements with offers that reach a restarted peer before it knows the owner's
    link (hello_first) are not kept there, and not pinned on the owner either."""
    a = own["a"]
    stop, keys = threading.Event(), []

    def put() -> None:
        with tb.connect(brokers["a"].address) as c:
            while not stop.is_set():
                keys.append(f"p{len(keys)}")
                c.put(keys[-1], np.full(1024, len(keys), np.float32))
                time.sleep(0.002)

    putting, out = in_thread(put)
    time.sleep(0.2)
    crash(brokers["b"])
    brokers["b"].restart()
    time.sleep(1.0)
    stop.set()
    putting.join(10)
    assert out == [None], out
    with tb.connect(brokers["b"].address) as b:
        assert wait_until(lambda: _all_up(b) and _all_up(a), 10)
    for key in keys:
        a.delete(key)
    assert wait_until(lambda: _figures(a)["offered"] == 0 and a.stats()["used_bytes"] == 0, 5), (
        _figures(a)["offered"], a.stats()["used_bytes"],
    )  # fmt: skip


def test_a_peer_linked_twice_keeps_both_links_and_what_it_was_offered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """a knows b as localhost, b says it is 127.0.0.1: a links to it twice. Neither hello
    makes either broker forget the other's link (or its offers)."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    pa, pb = free_port(), free_port()
    with contextlib.ExitStack() as stack:
        for node, port, peer in (("a", pa, f"localhost:{pb}"), ("b", pb, f"127.0.0.1:{pa}")):
            options = ["--node", node, "--cluster", f"tcp://127.0.0.1:{port}",
                       "--peers", f"tcp://{peer}", "--insecure-tcp"]  # fmt: skip
            broker = stack.enter_context(tb.start_broker(memory="64MiB", options=options))
            if node == "a":
                a = stack.enter_context(tb.connect(broker.address))
            else:
                b = stack.enter_context(tb.connect(broker.address))
        assert wait_until(lambda: _all_up(a) and _all_up(b), 10)
        a.put("k", np.full(1024, 1, np.float32))
        assert wait_until(lambda: b.exists("k") and _figures(b)["offers_held"] == 1, 5)
        time.sleep(1.0)  # beats and hellos on both links
        assert _figures(a)["offered"] == 1 and _figures(b)["offers_held"] == 1
        assert set(np.unique(b.get("k", timeout=5).numpy())) == {1.0}


LOOPBACK = ["--node", "a", "--cluster", "tcp://127.0.0.1:1", "--insecure-tcp"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--node", "a"], "both --node NAME and --cluster"),
        (["--node", "a", "--cluster", "tcp://0.0.0.0:1"], "Make keys (`tensorbroker keys"),
        ([*LOOPBACK, "--peers", "tcp://10.0.0.9:1"], "without keys a cluster stays on loopback"),
        (["--node", "a/b", "--cluster", "tcp://127.0.0.1:1", "--insecure-tcp"], "--node"),
        (["--node", "a", "--cluster", "127.0.0.1:1", "--insecure-tcp"], "tcp://HOST:PORT"),
        ([*LOOPBACK, "--peers", "dns:no-such-host.invalid:1"], "does not resolve"),
        ([*LOOPBACK, "--prefetch", "1MiB"], "--prefetch 1MiB: at most 64.0 KiB"),
    ],
)
def test_cluster_options_that_cannot_work_are_refused_with_what_to_do(
    args: list[str], says: str, tmp_path: object
) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "tensorbroker", "serve", "--memory", "16MiB",
         "--address", f"ipc://{tmp_path}/b.sock", *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert says in run.stderr


def test_brokers_with_the_cluster_keys_join_and_one_without_them_does_not(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Every broker serves the cluster's key pair and reaches the others with it; a broker
    with another pair never completes the handshake (CURVE), so it never joins."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    shared, stray = tmp_path / "cluster", tmp_path / "stray"
    _, secret = make_keys(str(shared), "cluster")
    _, other = make_keys(str(stray), "cluster")
    ports = {node: free_port() for node in NODES}

    def options(node: str, key: str) -> list[str]:
        plain = [o for o in _cluster_options(node, ports) if o != "--insecure-tcp"]
        return [*plain, "--curve-secret", key, "--curve-clients", str(shared)]

    with contextlib.ExitStack() as stack:
        started = {
            node: stack.enter_context(
                tb.start_broker(
                    memory="32MiB", options=options(node, other if node == "c" else secret)
                )
            )
            for node in NODES
        }
        a, b, c = (stack.enter_context(tb.connect(started[n].address)) for n in NODES)
        assert wait_until(
            lambda: b.stats()["cluster"]["peers"].get("a", {}).get("state") == "up", 10
        )
        a.put("secret-weights", np.arange(16))
        assert wait_until(lambda: b.exists("secret-weights"), 5)
        np.testing.assert_array_equal(b.get("secret-weights").numpy(), np.arange(16))
        time.sleep(1.5)  # c had every chance to join
        assert all(p["state"] == "down" for p in c.stats()["cluster"]["peers"].values())
        assert "c" not in a.stats()["cluster"]["peers"] and not c.exists("secret-weights")


def test_a_version_read_on_many_nodes_leaves_its_owner_twice_at_most(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fan-out without a hot spot: the owner lends a version to two nodes; the others pull
    it from those (waiting, if they are still pulling it)."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    nodes = ("a", "b", "c", "d", "e")
    with _cluster(nodes) as started, contextlib.ExitStack() as stack:
        cs = {n: stack.enter_context(tb.connect(started[n].address)) for n in nodes}
        assert wait_until(lambda: all(_all_up(c) for c in cs.values()), 10)
        x = np.random.default_rng(1).integers(0, 255, 8 * 2**20, np.uint8)
        cs["a"].put("shard", x)
        readers = [cs[n] for n in nodes[1:]]
        assert wait_until(lambda: all(r.exists("shard") for r in readers), 5)
        threads = [in_thread(lambda r=r: r.get("shard")) for r in readers]  # at once
        for thread, out in threads:
            thread.join(30)
            assert out and not isinstance(out[0], BaseException), out
            np.testing.assert_array_equal(out[0].numpy(), x)
            del out[:]
        sent = cs["a"].stats()["cluster"]["bytes_sent"]
        assert x.nbytes <= sent <= 2 * x.nbytes, f"the owner sent {sent / x.nbytes:.1f}x"
        got = sum(r.stats()["cluster"]["bytes_received"] for r in readers)
        assert got >= len(readers) * x.nbytes
        assert wait_until(lambda: all(_loans(c) == 0 for c in cs.values()), 5)


def test_a_broker_that_knows_one_peer_joins_the_whole_cluster(
    own: dict[str, tb.Client],
) -> None:
    """A new node names one broker in --peers: that one links back to it, so both ways
    work (a node added to a DaemonSet after the others resolved their peers)."""
    port = free_port()
    a_cluster = own["a"].stats()["cluster"]["address"]
    options = ["--node", "d", "--cluster", f"tcp://127.0.0.1:{port}", "--peers", a_cluster,
               "--insecure-tcp"]  # fmt: skip
    with tb.start_broker(memory="32MiB", options=options) as d_broker:
        with tb.connect(d_broker.address) as d:
            a = own["a"]
            assert wait_until(
                lambda: a.stats()["cluster"]["peers"].get("d", {}).get("state") == "up", 10
            )
            d.put("from-d", np.arange(5))
            assert wait_until(lambda: a.exists("from-d"), 5)
            np.testing.assert_array_equal(a.get("from-d").numpy(), np.arange(5))
            a.put("from-a", np.arange(3))
            assert wait_until(lambda: d.exists("from-a"), 5)
            np.testing.assert_array_equal(d.get("from-a").numpy(), np.arange(3))


def test_a_pull_cut_off_by_its_owner_dying_leaves_nothing_listed_or_held(
    brokers: dict[str, tb.BrokerProcess], own: dict[str, tb.Client]
) -> None:
    a, b = own["a"], own["b"]
    a.put("big", np.ones(48 * 2**20, np.uint8))
    assert wait_until(lambda: b.exists("big"), 5)
    brokers["a"].send_signal(signal.SIGSTOP)  # the pull starts, and is never answered
    pulling, out = in_thread(lambda: b.get("big", timeout=20))
    assert wait_until(lambda: b.stats()["cluster"]["pulls"] == 1, 5)
    crash(brokers["a"])
    pulling.join(30)
    assert out and isinstance(out[0], tb.PeerUnavailable), out
    assert wait_until(lambda: b.stats()["cluster"]["pulls"] == 0, 5)
    assert wait_until(lambda: b.stats()["used_bytes"] == 0, 5), "a half-pulled block is held"
    with pytest.raises(tb.PeerUnavailable):
        b.get("big")
    brokers["a"].restart()  # its object is whole there, and pulled whole once it is back
    assert wait_until(lambda: b.stats()["cluster"]["peers"]["a"]["state"] == "up", 10)
    got = b.get("big", timeout=10)
    assert got.numpy().sum() == 48 * 2**20
    del got


def test_the_cluster_figures_are_served_as_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.integration.test_metrics import scrape, value

    monkeypatch.setenv("UCX_TLS", "tcp")
    port = free_port()
    more = {"b": ["--metrics", f"127.0.0.1:{port}", "--prefetch", "0"]}  # (b pulls at its get)
    with _cluster(("a", "b"), more) as started:
        with _connected(started) as cs:
            assert wait_until(lambda: _figures(cs["b"])["peers"]["a"]["fresh"], 5)
            cs["a"].put("scraped", np.ones(1000, np.uint8))
            assert wait_until(lambda: cs["b"].exists("scraped"), 5)
            cs["b"].get("scraped")
            figures = scrape(port)
            assert value(figures, "tensorbroker_cluster_peer_up", peer="a") == 1.0
            assert value(figures, "tensorbroker_cluster_bytes_received_total") >= 1000
            assert value(figures, "tensorbroker_cluster_pulls") == 0
            assert value(figures, "tensorbroker_cluster_pulled_total", how="offered") == 1
            assert value(figures, "tensorbroker_cluster_pulled_total", how="lent") == 0
            assert value(figures, "tensorbroker_cluster_prefetched_total") == 0  # (--prefetch 0)
            assert value(figures, "tensorbroker_cluster_offered") == 0  # b put nothing
        started["a"].stop()
        assert wait_until(
            lambda: value(scrape(port), "tensorbroker_cluster_peer_up", peer="a") == 0.0, 5
        )


def test_ls_says_where_each_key_lives(clients: dict[str, tb.Client]) -> None:
    a, b = clients["a"], clients["b"]
    a.put("ls/on-a", np.zeros(10))
    b.put("ls/on-b", np.zeros(20))
    assert wait_until(lambda: b.exists("ls/on-a"), 5)
    rows = {o["key"]: o for o in b.list_objects("ls/")}
    assert {k: (o["node"], o["version"]) for k, o in rows.items()} == {
        "ls/on-a": ("a", 1), "ls/on-b": ("b", 1)
    }  # fmt: skip
    b.get("ls/on-a")  # a replica on b now: still a's
    assert {o["key"]: o["node"] for o in b.list_objects("ls/")}["ls/on-a"] == "a"
    shown = subprocess.run(
        [sys.executable, "-m", "tensorbroker", "ls", "ls/", "--address", b.address],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].split()[-1] == "NODE"
    assert lines[1].split()[0] == "ls/on-a" and lines[1].split()[-1] == "a"
    assert lines[2].split()[0] == "ls/on-b" and lines[2].split()[-1] == "b"


def test_top_shows_the_node_and_its_peers(clients: dict[str, tb.Client]) -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "tensorbroker", "top", "--once", "--address", clients["b"].address],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "node b" in shown.stdout and "peers: a up, c up" in shown.stdout, shown.stdout


def test_a_node_restarted_after_a_crash_does_not_take_its_replicas_for_its_own(
    brokers: dict[str, tb.BrokerProcess], own: dict[str, tb.Client]
) -> None:
    a, b = own["a"], own["b"]
    a.put("owned-by-a", np.arange(1000))
    assert wait_until(lambda: b.exists("owned-by-a"), 5)
    b.get("owned-by-a")  # a replica on b
    crash(brokers["b"])
    brokers["b"].restart()  # adopts its state: the replica is not part of it
    assert wait_until(lambda: a.stats()["cluster"]["peers"]["b"]["state"] == "up", 10)
    assert wait_until(lambda: b.exists("owned-by-a"), 5)
    time.sleep(1)  # b's hello, and any announcement it would make, have come
    assert {o["key"]: o["node"] for o in a.list_objects()} == {"owned-by-a": "a"}
    assert {o["key"]: o["node"] for o in b.list_objects()} == {"owned-by-a": "a"}
    np.testing.assert_array_equal(b.get("owned-by-a").numpy(), np.arange(1000))
    assert a.stats()["objects"] == 1
    one_copy = a.stats()["used_bytes"]  # b holds one replica: the old one's block was freed
    assert wait_until(lambda: b.stats()["used_bytes"] <= one_copy, 5), b.stats()["used_bytes"]
