"""Clusters of each test's own on this host (Note [cluster] in server/cluster/cluster.py):
brokers killed, restarted, stalled, linked twice or counted, the bytes between them moved by
NIXL over UCX's TCP transport (UCX_TLS=tcp). The tests that share one cluster:
test_cluster.py."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import tensorbroker as tb
from tensorbroker.common.curve import make_keys
from tensorbroker.server.cluster.queue_links import AHEAD
from tensorbroker.server.cluster.transfers import CHUNK
from tests.integration import clusters
from tests.support import crash, free_port, in_thread, wait_until

pytest.importorskip("nixl_cu12", reason="the cluster needs NIXL: make test installs nixl-cu12")


LOOPBACK = ["--node", "a", "--cluster", "tcp://127.0.0.1:1", "--insecure-tcp"]


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
    with clusters.cluster(("a", "b"), {"b": ["--prefetch", "0"]} if lazy else None) as started:
        yield started


@pytest.fixture
def own(brokers: dict[str, tb.BrokerProcess]) -> Iterator[dict[str, tb.Client]]:
    with clusters.connected(brokers) as opened:
        yield opened


def test_small_versions_replaced_fast_are_never_read_torn_and_leave_nothing_pinned(
    own: dict[str, tb.Client],
) -> None:
    """Offers given back while their reads are under way, and reads of versions replaced
    meanwhile: every version read is whole, and the owner holds the last one alone."""
    a, b = own["a"], own["b"]
    assert wait_until(lambda: clusters.figures(b)["peers"]["a"]["fresh"], 5)  # (offers readable)
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
    assert clusters.figures(a)["offered"] == 1 and clusters.figures(b)["offers_held"] == 1
    a.delete("hot")
    assert wait_until(
        lambda: a.stats()["used_bytes"] == 0 and clusters.figures(a)["offered"] == 0, 5
    )
    assert wait_until(
        lambda: b.stats()["used_bytes"] == 0 and clusters.figures(b)["offers_held"] == 0, 5
    )


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
    assert wait_until(lambda: clusters.loans(a) == 0, 5), "a pull left the object pinned on a"
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
    assert wait_until(
        lambda: clusters.figures(b)["prefetched"] == 1 and clusters.received(b) == x.nbytes, 5
    )
    assert b.exists("large")  # (its homes heard of it: a claim waits up to claim_every)
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
    assert wait_until(lambda: clusters.loans_out(own["a"]) == 0, 5)


def test_queue_items_lent_to_a_node_killed_go_to_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A consumer's node dies: what it was lent and had not read goes back to the lender,
    what it read waits in its part until it is back: nothing is lost. The items it took
    last may come again (its lender may not have heard that they were taken: at least
    once): its consumer's, and those it took ahead for it (AHEAD) at most."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    with clusters.cluster(("a", "b", "c")) as started, contextlib.ExitStack() as stack:
        cs = {n: stack.enter_context(tb.connect(started[n].address)) for n in started}
        assert wait_until(lambda: all(clusters.all_up(c) for c in cs.values()), 10)
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
        assert wait_until(lambda: clusters.loans_out(cs["a"]) == 0, 5)


def test_pulls_leave_no_memory_held(own: dict[str, tb.Client]) -> None:
    a, b = own["a"], own["b"]
    for i in range(20):
        a.put(f"m{i}", np.full(64 * 1024, i, np.uint8))
    assert wait_until(lambda: all(b.exists(f"m{i}") for i in range(20)), 5)
    for i in range(20):
        assert int(b.get(f"m{i}").numpy()[-1]) == i
    assert wait_until(lambda: clusters.loans(a) == 0, 5) and b.stats()["cluster"]["pulls"] == 0
    for i in range(20):
        a.delete(f"m{i}")
    assert wait_until(lambda: not b.keys(), 5), b.keys()  # the replicas went with the keys
    assert wait_until(lambda: b.stats()["used_bytes"] == 0, 5)
    assert wait_until(lambda: a.stats()["used_bytes"] == 0, 5)


@pytest.mark.lazy
def test_a_small_version_is_read_from_the_offer_sent_with_it_and_given_back_once_replaced(
    brokers: dict[str, tb.BrokerProcess], own: dict[str, tb.Client]
) -> None:
    """Note [offers]: a version of at most 64 KiB is announced with where its bytes are to
    the nodes that follow its key, so a first get there reads them without asking its owner
    first; the owner keeps the version it replaced only until they gave its offer back."""
    a, b = own["a"], own["b"]
    assert wait_until(lambda: clusters.figures(b)["peers"]["a"]["fresh"], 5)  # (a beat answered)
    clusters.follow(b, a)  # (a offers its small versions to the nodes that follow them)
    x = np.arange(1024, dtype=np.float32)  # 4 KiB
    a.put("small", x)
    one = a.stats()["used_bytes"]
    assert wait_until(lambda: b.exists("small") and clusters.figures(b)["offers_held"] == 1, 5)
    assert clusters.figures(a)["offered"] == 1
    np.testing.assert_array_equal(b.get("small").numpy(), x)
    assert clusters.figures(b)["pulled"] == {"offered": 1, "lent": 0}
    assert wait_until(lambda: clusters.figures(a)["bytes_sent"] == x.nbytes, 5)  # b said it read it
    a.put("small", x + 1)  # b read it before: its replica goes, and the new one is pulled
    assert wait_until(lambda: b.get("small", timeout=5).version == 2, 5)
    np.testing.assert_array_equal(b.get("small").numpy(), x + 1)
    assert clusters.figures(b)["pulled"] == {"offered": 2, "lent": 0}
    # Version 1's offer came back from b: a holds version 2 alone.
    assert wait_until(lambda: a.stats()["used_bytes"] == one, 5), a.stats()["used_bytes"]
    assert clusters.figures(a)["offered"] == 1 and clusters.figures(b)["offers_held"] == 1
    a.put("large", np.ones(64 * 1024 + 1, np.uint8))  # over 64 KiB: lent when asked
    assert wait_until(lambda: b.exists("large"), 5)
    assert b.get("large").numpy().sum() == 64 * 1024 + 1
    assert clusters.figures(b)["pulled"] == {"offered": 2, "lent": 1}
    crash(brokers["b"])  # what a node that died held is let go by the owner
    assert wait_until(lambda: clusters.figures(a)["offered"] == 0, 3.5)
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
    clusters.follow(b, a)
    a.put("k", np.full(1024, 1, np.float32))
    assert wait_until(lambda: clusters.figures(b)["offers_held"] == 1, 5)
    brokers["b"].send_signal(signal.SIGSTOP)
    try:
        assert wait_until(lambda: clusters.figures(a)["peers"]["b"]["state"] == "down", 5)
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
    clusters.follow(b, a)
    for i in range(5):
        a.put(f"k{i}", np.full(1024, i, np.float32))
    assert wait_until(lambda: clusters.figures(b)["offers_held"] == 5, 5)
    crash(brokers["a"])
    brokers["a"].restart()
    assert wait_until(lambda: clusters.figures(b)["offers_held"] == 0, 5)
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
        assert wait_until(lambda: clusters.all_up(b) and clusters.all_up(a), 10)
    for key in keys:
        a.delete(key)

    def offered() -> tuple[int, int]:
        return clusters.figures(a)["offered"], a.stats()["used_bytes"]

    assert wait_until(lambda: offered() == (0, 0), 5), offered()


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
        assert wait_until(lambda: clusters.all_up(a) and clusters.all_up(b), 10)
        clusters.follow(b, a)
        a.put("k", np.full(1024, 1, np.float32))
        assert wait_until(lambda: b.exists("k") and clusters.figures(b)["offers_held"] == 1, 5)
        time.sleep(1.0)  # beats and hellos on both links
        assert clusters.figures(a)["offered"] == 1 and clusters.figures(b)["offers_held"] == 1
        assert set(np.unique(b.get("k", timeout=5).numpy())) == {1.0}


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
    ports = {node: free_port() for node in clusters.NODES}

    def options(node: str, key: str) -> list[str]:
        plain = [o for o in clusters.cluster_options(node, ports) if o != "--insecure-tcp"]
        return [*plain, "--curve-secret", key, "--curve-clients", str(shared)]

    with contextlib.ExitStack() as stack:
        started = {
            node: stack.enter_context(
                tb.start_broker(
                    memory="32MiB", options=options(node, other if node == "c" else secret)
                )
            )
            for node in clusters.NODES
        }
        a, b, c = (stack.enter_context(tb.connect(started[n].address)) for n in clusters.NODES)
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
    it from those (lent what a relay has read while it still reads it, the rest as it comes:
    40 MiB, in CHUNK pieces, each pushed by its lender: Note [pushes]), every reader with
    the same bytes."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    nodes = ("a", "b", "c", "d", "e")
    with clusters.cluster(nodes) as started, contextlib.ExitStack() as stack:
        cs = {n: stack.enter_context(tb.connect(started[n].address)) for n in nodes}
        assert wait_until(lambda: all(clusters.all_up(c) for c in cs.values()), 10)
        x = np.random.default_rng(1).integers(0, 255, 2 * CHUNK + 8 * 2**20, np.uint8)
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
        pushed = sum(c.stats()["cluster"]["bytes_pushed"] for c in cs.values())
        assert pushed >= len(readers) * x.nbytes, "the pieces were read, not pushed"
        assert all(c.stats()["cluster"]["blocks_held"] == 0 for c in cs.values())
        assert wait_until(lambda: all(clusters.loans(c) == 0 for c in cs.values()), 5)


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
    pulling, out = in_thread(lambda: b.get("big", timeout=30))
    assert wait_until(lambda: b.stats()["cluster"]["pulls"] == 1, 5)
    crash(brokers["a"])
    assert wait_until(lambda: b.stats()["cluster"]["pulls"] == 0, 5)
    assert wait_until(lambda: b.stats()["used_bytes"] == 0, 5), "a half-pulled block is held"
    with pytest.raises(tb.PeerUnavailable):
        b.get("big")
    with pytest.raises(tb.Timeout, match="which is down, and stayed down"):
        b.get("big", timeout=0.5)
    assert not out, out  # the first get waits on for a: its timeout has not run out
    brokers["a"].restart()  # its object is whole there, and pulled whole once it is back
    pulling.join(30)
    assert out and not isinstance(out[0], BaseException), out
    assert out[0].numpy().sum() == 48 * 2**20
    del out[:]


def test_a_block_a_stalled_lender_may_still_write_into_is_not_reused_until_it_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Note [pushes]: a lender taken for down mid-push may be alive and still writing. Its
    reader gives the pull up but holds the block until the late pieces are over; the get
    waits on for the owner (its timeout has not run out) and reads it whole once back."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    size = 192 * 2**20  # (b holds one, and may pull it again beside it)
    with (
        clusters.cluster(("a", "b"), memory="512MiB") as brokers,
        clusters.connected(brokers) as cs,
    ):
        a, b = cs["a"], cs["b"]
        assert wait_until(lambda: clusters.all_up(a) and clusters.all_up(b), 10)
        for attempt in range(3):  # (a stop that came after the last piece holds nothing)
            x = np.random.default_rng(attempt).integers(0, 255, size, np.uint8)
            key = f"w{attempt}"
            a.put(key, x)
            assert wait_until(lambda k=key: b.exists(k), 5)
            pushed = a.stats()["cluster"]["bytes_pushed"]
            getting, out = in_thread(lambda k=key: b.get(k, timeout=60))
            started = wait_until(
                lambda p=pushed: a.stats()["cluster"]["bytes_pushed"] > p, 10, interval=0.0005
            )
            brokers["a"].send_signal(signal.SIGSTOP)  # mid-push: its pieces under way stay so
            try:
                assert started
                assert wait_until(lambda: b.stats()["cluster"]["peers"]["a"]["state"] == "down", 10)
                assert wait_until(lambda: b.stats()["cluster"]["pulls"] == 0, 5)
                held = b.stats()
            finally:
                brokers["a"].send_signal(signal.SIGCONT)
            assert wait_until(lambda: b.stats()["cluster"]["blocks_held"] == 0, 15)
            getting.join(60)
            assert out and not isinstance(out[0], BaseException), out
            np.testing.assert_array_equal(out[0].numpy(), x)
            del out[:]
            a.delete(key)
            if held["cluster"]["blocks_held"] == 1:
                assert held["used_bytes"] >= size  # (the block, out of use, still counted)
                break
        else:
            pytest.fail("the lender was never stopped with pieces under way (3 tries)")


def test_a_lender_that_stops_mid_push_leaves_its_reader_no_block_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lender stopped (not killed) while it pushes a version: its writes end before it
    says it stopped, so its reader lets the block go at once (it held it until the lender
    came back: a node taken out of a cluster left 192 MiB out of use on its reader, in 5
    of 5 tries), and its get waits out its timeout for the owner, as for any node down."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    size = 192 * 2**20
    with (
        clusters.cluster(("a", "b"), memory="512MiB") as brokers,
        clusters.connected(brokers) as cs,
    ):
        a, b = cs["a"], cs["b"]
        x = np.random.default_rng(0).integers(0, 255, size, np.uint8)
        a.put("w", x)
        assert wait_until(lambda: b.exists("w"), 5)
        pushed = a.stats()["cluster"]["bytes_pushed"]
        getting, out = in_thread(lambda: b.get("w", timeout=5))
        assert wait_until(
            lambda: a.stats()["cluster"]["bytes_pushed"] > pushed, 10, interval=0.0005
        )
        brokers["a"].stop()
        getting.join(30)
        assert out and isinstance(out[0], tb.Timeout), out
        assert "lives on node 'a', which is down" in str(out[0])
        assert wait_until(lambda: b.stats()["cluster"]["blocks_held"] == 0, 5)
        assert b.stats()["used_bytes"] == 0


def test_the_cluster_figures_are_served_as_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.integration.test_metrics import scrape, value

    monkeypatch.setenv("UCX_TLS", "tcp")
    port = free_port()
    more = {"b": ["--metrics", f"127.0.0.1:{port}", "--prefetch", "0"]}  # (b pulls at its get)
    with clusters.cluster(("a", "b"), more) as started:
        with clusters.connected(started) as cs:
            assert wait_until(lambda: clusters.figures(cs["b"])["peers"]["a"]["fresh"], 5)
            cs["a"].put("scraped", np.ones(1000, np.uint8))
            assert wait_until(lambda: cs["b"].exists("scraped"), 5)
            cs["b"].get("scraped")
            figures = scrape(port)
            assert value(figures, "tensorbroker_cluster_peer_up", peer="a") == 1.0
            assert value(figures, "tensorbroker_cluster_bytes_received_total") >= 1000
            assert value(figures, "tensorbroker_cluster_pulls") == 0
            # (b followed nothing of it: lent, not offered; Note [follows])
            assert value(figures, "tensorbroker_cluster_pulled_total", how="offered") == 0
            assert value(figures, "tensorbroker_cluster_pulled_total", how="lent") == 1
            assert value(figures, "tensorbroker_cluster_prefetched_total") == 0  # (--prefetch 0)
            assert value(figures, "tensorbroker_cluster_offered") == 0  # b put nothing
        started["a"].stop()
        assert wait_until(
            lambda: value(scrape(port), "tensorbroker_cluster_peer_up", peer="a") == 0.0, 5
        )


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
