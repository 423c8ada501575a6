"""Brokers that find each other in etcd (`serve --etcd`, Note [membership] in
server/cluster/membership.py): a real etcd (tests/etcd.py) and brokers on this host, none told
another's address."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorbroker as tb
from tensorbroker.server.cluster.etcd import Etcd
from tensorbroker.server.cluster.local_etcd import local_etcd
from tensorbroker.server.cluster.membership import TTL
from tests.etcd import running_etcd
from tests.support import crash, free_port, wait_until

pytest.importorskip("nixl_cu12", reason="the cluster needs NIXL: make test installs nixl-cu12")


@pytest.fixture
def etcd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("UCX_TLS", "tcp")  # (the brokers': the network path)
    with running_etcd(tmp_path / "etcd") as url:
        yield url


@contextlib.contextmanager
def _broker(etcd: str, node: str, prefix: str = "/tensorbroker") -> Iterator[tb.BrokerProcess]:
    options = ["--node", node, "--cluster", f"tcp://127.0.0.1:{free_port()}", "--etcd", etcd,
               "--etcd-prefix", prefix, "--insecure-tcp"]  # fmt: skip
    with tb.start_broker(memory="32MiB", options=options, log_level="info") as b:
        yield b


def _peers(c: tb.Client) -> dict[str, str]:
    return {n: p["state"] for n, p in c.stats()["cluster"]["peers"].items()}


def _fresh(c: tb.Client, node: str) -> bool:
    return bool(c.stats()["cluster"]["peers"][node]["fresh"])


def _members(etcd: str, prefix: str = "/tensorbroker") -> list[str]:
    _, found = Etcd((etcd,)).range(f"{prefix}/members/".encode())
    return sorted(k.decode().rsplit("/", 1)[1] for k in found)


def test_brokers_find_each_other_in_etcd_and_one_that_stops_leaves_at_once(etcd: str) -> None:
    """No broker is told another's address: a and b join etcd, c joins later; all link up
    and read each other's keys. b stops: its entry goes at once, and a and c take it for
    down before its beats would have told them (DOWN_AFTER, 2 s)."""
    with contextlib.ExitStack() as stack:
        brokers = {n: stack.enter_context(_broker(etcd, n)) for n in "ab"}
        a = stack.enter_context(tb.connect(brokers["a"].address))
        assert wait_until(lambda: _peers(a) == {"b": "up"}, 10), _peers(a)
        a.put("w", np.arange(100_000))  # (over --prefetch: pulled at the first get)
        brokers["c"] = stack.enter_context(_broker(etcd, "c"))
        c = stack.enter_context(tb.connect(brokers["c"].address))
        assert wait_until(lambda: _peers(c) == {"a": "up", "b": "up"}, 10), _peers(c)
        assert wait_until(lambda: _peers(a) == {"b": "up", "c": "up"}, 10), _peers(a)
        np.testing.assert_array_equal(c.get("w", timeout=10).numpy(), np.arange(100_000))
        assert _members(etcd) == ["a", "b", "c"]
        received = c.stats()["cluster"]["bytes_received"]
        a.put("small", np.arange(8))  # no node asked for prefetching (the default): not read
        assert wait_until(lambda: c.exists("small"), 5)
        time.sleep(0.3)
        assert c.stats()["cluster"]["bytes_received"] == received
        assert c.stats()["cluster"]["prefetched"] == 0

        brokers["b"].stop()
        stopped = time.monotonic()
        assert _members(etcd) == ["a", "c"]
        for client in (a, c):
            assert wait_until(lambda: _peers(client)["b"] == "down", 5), _peers(client)  # noqa: B023
        assert time.monotonic() - stopped < 1.5


def test_a_broker_killed_leaves_etcd_as_its_lease_expires_and_rejoins(etcd: str) -> None:
    """b is SIGKILLed: its entry goes once its lease expires (TTL, 3 s); restarted on its
    state, it joins again and a reads what b held."""
    with _broker(etcd, "a") as broker_a, _broker(etcd, "b") as broker_b:
        with tb.connect(broker_a.address) as a, tb.connect(broker_b.address) as b:
            assert wait_until(lambda: _peers(a) == {"b": "up"}, 10), _peers(a)
            b.put("on-b", np.arange(50_000))
            crash(broker_b)
            killed = time.monotonic()
            assert wait_until(lambda: _members(etcd) == ["a"], TTL + 2), _members(etcd)
            assert time.monotonic() - killed < TTL + 1.5
            assert wait_until(lambda: _peers(a)["b"] == "down", 3)
            broker_b.restart()
            assert wait_until(lambda: _peers(a) == {"b": "up"}, 10), _peers(a)
            assert _members(etcd) == ["a", "b"]
            got = a.get("on-b", timeout=10)
            np.testing.assert_array_equal(got.numpy(), np.arange(50_000))


def test_the_brokers_ride_out_an_etcd_restart_and_see_a_node_that_joins_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd stops for 3 s and comes back on its data, at the same address: the brokers keep
    each other up meanwhile, their leases and watches go on, and a broker that joins
    afterwards is seen by both. While a broker cannot renew its lease, the others may take
    it for down as it expires: it reads no offer of theirs then (not `fresh`, Note [beats]
    in beats.py), and reads each other's keys again once etcd is back."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    ports, data = [free_port(), free_port()], str(tmp_path / "etcd")
    first: Any = local_etcd(data, iter(ports).__next__)
    url = first.__enter__()
    try:
        with _broker(url, "a") as broker_a, _broker(url, "b") as broker_b:
            a, b = tb.connect(broker_a.address), tb.connect(broker_b.address)
            with a, b:
                up = lambda c, *names: _peers(c) == dict.fromkeys(names, "up")  # noqa: E731
                assert wait_until(lambda: up(a, "b") and up(b, "a"), 10)
                x, y = np.arange(1000), np.arange(2000)
                a.put("x", x)
                b.put("y", y)
                first, stopping = None, first
                stopping.__exit__(None, None, None)
                time.sleep(3.0)
                assert up(a, "b") and up(b, "a")
                assert not _fresh(a, "b") and not _fresh(b, "a")
                with local_etcd(data, iter(ports).__next__) as again:
                    assert again == url
                    np.testing.assert_array_equal(b.get("x", timeout=10), x)
                    np.testing.assert_array_equal(a.get("y", timeout=10), y)
                    with _broker(url, "c") as broker_c, tb.connect(broker_c.address) as c:
                        assert wait_until(lambda: up(c, "a", "b"), 15), _peers(c)
                        assert wait_until(lambda: up(a, "b", "c") and up(b, "a", "c"), 15)
                        assert _members(url) == ["a", "b", "c"]
    finally:
        if first is not None:
            first.__exit__(None, None, None)


def test_clusters_under_other_prefixes_of_one_etcd_do_not_meet(etcd: str) -> None:
    with _broker(etcd, "a", "/one") as one, _broker(etcd, "a", "/two") as two:
        with tb.connect(one.address) as c1, tb.connect(two.address) as c2:
            with _broker(etcd, "b", "/one"):
                assert wait_until(lambda: _peers(c1) == {"b": "up"}, 10), _peers(c1)
                assert _peers(c2) == {}
                assert _members(etcd, "/one") == ["a", "b"] and _members(etcd, "/two") == ["a"]


def test_an_etcd_member_that_does_not_answer_does_not_make_leases_expire(etcd: str) -> None:
    """--etcd names a member that takes connections and never answers, first: each call
    gives it TTL/3 seconds (2 s at the start), then goes to the next, and later calls start
    from the one that answered. a's entry stays in etcd throughout, and b never sees a down
    (the renewals used to take 2 s each on the silent member: the lease expired now and
    then)."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        urls = f"http://127.0.0.1:{silent.getsockname()[1]},{etcd}"
        with _broker(urls, "a") as broker_a, _broker(etcd, "b") as broker_b:
            with tb.connect(broker_b.address) as b:
                assert wait_until(lambda: _peers(b) == {"a": "up"}, 15), _peers(b)
                end = time.monotonic() + 2 * TTL  # (six renewals)
                while time.monotonic() < end:
                    assert "a" in _members(etcd) and _peers(b) == {"a": "up"}
                    time.sleep(0.1)
            assert broker_a.alive


def test_a_node_restarted_at_a_new_address_is_unlinked_from_the_old(etcd: str) -> None:
    """b comes back at another --cluster address (a pod's new IP): a links to the new one
    and drops the old link, which no broker answers any more."""
    with _broker(etcd, "a") as broker_a, tb.connect(broker_a.address) as a:
        with _broker(etcd, "b"):
            assert wait_until(lambda: _peers(a) == {"b": "up"}, 10), _peers(a)
        assert wait_until(lambda: _peers(a) == {"b": "down"}, 5), _peers(a)
        with _broker(etcd, "b"):  # (another port)
            assert wait_until(lambda: _peers(a) == {"b": "up"}, 10), _peers(a)
            with open(broker_a.log_path) as log:
                assert "node 'b' left tcp://127.0.0.1:" in log.read()


def test_a_second_broker_with_a_node_name_served_elsewhere_does_not_start(
    etcd: str, tmp_path: Path
) -> None:
    """Two brokers with one --node would take each other's place in the cluster: the second
    waits for the first's entry to go (as after a restart elsewhere), then refuses, naming
    where that node is served."""
    with _broker(etcd, "a") as first, tb.connect(first.address) as a:
        served = a.stats()["cluster"]["address"]
        run = subprocess.run(
            [sys.executable, "-m", "tensorbroker", "serve", "--memory", "16MiB",
             "--address", f"ipc://{tmp_path}/b.sock", "--node", "a",
             "--cluster", f"tcp://127.0.0.1:{free_port()}", "--insecure-tcp", "--etcd", etcd],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert run.returncode != 0, run.stderr
        assert f"node 'a' is already in the cluster, served at {served}" in run.stderr
        assert _members(etcd) == ["a"] and first.alive
        a.put("still", np.arange(3))


@pytest.mark.parametrize(
    ("etcd_option", "says"),
    [
        ("http://127.0.0.1:{port}", "no etcd answers at http://127.0.0.1:{port}"),
        ("etcd.local:2379", "--etcd: http://HOST:PORT"),
    ],
)
def test_a_broker_whose_etcd_cannot_be_reached_does_not_start(
    etcd_option: str, says: str, tmp_path: Path
) -> None:
    port = free_port()
    run = subprocess.run(
        [sys.executable, "-m", "tensorbroker", "serve", "--memory", "16MiB",
         "--address", f"ipc://{tmp_path}/b.sock", "--node", "a",
         "--cluster", f"tcp://127.0.0.1:{free_port()}", "--insecure-tcp",
         "--etcd", etcd_option.format(port=port)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode != 0, run.stderr
    assert says.format(port=port) in run.stderr, run.stderr
    assert not list(tmp_path.iterdir()), "a broker that did not start left files"


@pytest.mark.slow
def test_sixteen_brokers_find_each_other_and_read_a_key_put_on_one(etcd: str) -> None:
    """16 brokers on this host (slow: make test-all), none told another's address: each
    sees the 15 others up, a key put on one is read on every other, and one killed is seen
    down by all the others and leaves etcd."""
    names = [f"n{i:02d}" for i in range(16)]
    with contextlib.ExitStack() as stack:
        brokers = {n: stack.enter_context(_broker(etcd, n)) for n in names}
        clients = {n: stack.enter_context(tb.connect(b.address)) for n, b in brokers.items()}
        up = lambda c: list(_peers(c).values()).count("up") == 15  # noqa: E731
        assert wait_until(lambda: all(up(c) for c in clients.values()), 90), {
            n: _peers(c) for n, c in clients.items()
        }
        clients["n00"].put("w", np.arange(100_000))
        for n in names[1:]:
            np.testing.assert_array_equal(
                clients[n].get("w", timeout=30).numpy(), np.arange(100_000)
            )
        crash(brokers["n15"])
        assert wait_until(lambda: "n15" not in _members(etcd), TTL + 3)
        for n in names[:15]:
            assert wait_until(lambda: _peers(clients[n])["n15"] == "down", 5), n  # noqa: B023
