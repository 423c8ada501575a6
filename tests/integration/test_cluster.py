"""Three brokers on this host as three nodes of a cluster (Note [cluster] in
server/cluster/cluster.py), shared by this file's tests (their keys and queues are their
own), the bytes between them moved by NIXL over UCX's TCP transport (UCX_TLS=tcp), as between
machines. The tests that kill, restart or count a broker have clusters of their own:
test_cluster_nodes.py."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

import tensorbroker as tb
from tests.integration import clusters
from tests.support import in_thread, wait_until

pytest.importorskip("nixl_cu12", reason="the cluster needs NIXL: make test installs nixl-cu12")


@pytest.fixture(scope="module")
def shared() -> Iterator[dict[str, tb.BrokerProcess]]:
    """A cluster for the tests that neither kill a broker nor count memory (their keys are
    their own)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("UCX_TLS", "tcp")  # the network path, not shared memory
        with clusters.cluster(clusters.NODES) as started:
            yield started


@pytest.fixture
def clients(shared: dict[str, tb.BrokerProcess]) -> Iterator[dict[str, tb.Client]]:
    with clusters.connected(shared) as opened:
        yield opened


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
    pulled = clusters.received(b)
    assert pulled >= x.nbytes
    again = b.get("weights")  # b's own replica now: no second pull
    np.testing.assert_array_equal(again.numpy(), x)
    assert clusters.received(b) == pulled
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
    before = clusters.received(b)  # the watched key's next version is pulled as it is announced
    a.put(key, np.full(n, last + 1, np.int64))
    assert wait_until(lambda: clusters.received(b) > before, 5), (
        "the new version was not pulled ahead"
    )
    assert b.get(key).version == last + 1


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


def _listed(c: tb.Client, key: str) -> int:
    """The version of `key` that `c`'s node lists (heard of), 0 if none."""
    rows = [o for o in c.list_objects(key) if o["key"] == key]
    return int(rows[0]["version"]) if rows else 0


def test_only_the_homes_and_followers_of_a_key_hear_of_it(clients: dict[str, tb.Client]) -> None:
    """Note [homes], Note [follows]: a key's claim reaches its two homes only, its next
    versions the nodes that read it; another node asks a home once, its first get reads the
    newest version, and it follows the key from then on."""
    a, b, c = clients["a"], clients["b"], clients["c"]
    key = clusters.homed(("a", "b"), "fol/k")  # (c is not one of its homes)
    big = 20_000  # float64s: above the nodes' --prefetch 64KiB (those follow small versions)
    a.put(key, np.zeros(big))
    asked = {n: clusters.figures(clients[n])["lookups"] for n in "bc"}
    assert wait_until(lambda: b.exists(key), 5)
    assert clusters.figures(b)["lookups"] == asked["b"]  # b, a home, heard of the claim
    assert b.get(key).version == 1  # b reads it: b follows it
    before = {n: clusters.received(clients[n]) for n in "bc"}
    for v in range(2, 6):
        a.put(key, np.full(big, v, np.float64))
    assert wait_until(lambda: clusters.received(b) >= before["b"] + 8 * big, 5)  # pulled as told
    time.sleep(0.2)  # (c would have been told with b)
    assert clusters.received(c) == before["c"], "a node that follows nothing of a key pulled it"
    assert c.exists(key) and clusters.figures(c)["lookups"] == asked["c"] + 1  # (asked a home)
    got = c.get(key)
    assert got.version == 5 and (got.numpy() == 5).all()  # lent the version of now
    pulled = clusters.received(c)
    a.put(key, np.full(big, 6, np.float64))
    assert wait_until(lambda: clusters.received(c) >= pulled + 8 * big, 5)  # c follows it now
    del got


def test_watch_prefix_hears_every_version_under_its_prefix_put_on_other_nodes(
    clients: dict[str, tb.Client],
) -> None:
    a, c = clients["a"], clients["c"]
    """A key's versions after its first reach a node where `watch_prefix` asked for its
    prefix (Note [follows]): each is an event there."""
    events = c.watch_prefix("wpf/", timeout=10)
    time.sleep(0.3)  # (one trip: the other nodes hear that c follows the prefix)
    for v in range(1, 4):  # (puts within 1 ms go as one announcement: the last of them)
        a.put("wpf/x", np.zeros(20_000))  # (above --prefetch: c follows the prefix)
        e = next(events)
        assert (e.event, e.key, e.version) == ("put", "wpf/x", v)


def test_a_claim_that_loses_to_a_version_its_node_never_heard_of_converges_on_that_version(
    clients: dict[str, tb.Client],
) -> None:
    """c heard of a's first version of k only (it follows nothing of it); its put of k
    (version 2) loses to a's version 4: every node converges on a's (Note [follows])."""
    a, b, c = clients["a"], clients["b"], clients["c"]
    big = 20_000  # float64s: above the nodes' --prefetch 64KiB (those follow small versions)
    a.put("claim/k", np.zeros(big))
    assert wait_until(lambda: c.exists("claim/k"), 5)
    for v in range(2, 5):
        a.put("claim/k", np.full(big, v, np.float64))
    assert c.put("claim/k", np.full(big, -1.0)) == 2

    def agreed() -> bool:
        return all(
            cl.get("claim/k").version == 4 and cl.get("claim/k").numpy()[0] == 4.0
            for cl in (a, b, c)
        )

    assert wait_until(agreed, 10), {n: cl.get("claim/k").version for n, cl in clients.items()}


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
    # Both consumers wait (a loaded machine starts them late), and their nodes want items:
    assert wait_until(lambda: all(clients[n].stats()["waiters"] for n in ("b", "c")), 30)
    time.sleep(0.3)
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
    assert wait_until(lambda: all(clusters.loans_out(clients[n]) == 0 for n in clients), 5)


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
    assert wait_until(lambda: all(clusters.loans_out(clients[n]) == 0 for n in clients), 5)


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
