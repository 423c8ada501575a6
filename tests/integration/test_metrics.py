"""`tensorbroker serve --metrics HOST:PORT`: the Prometheus endpoint, read over HTTP as a
Prometheus server reads it, follows what clients do (server/metrics.py)."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import tensorbroker as tb
from tensorbroker.server.broker import Broker
from tensorbroker.server.metrics import Exporter
from tests.support import free_port, wait_until

REPO = Path(__file__).resolve().parents[2]
MiB = 2**20
Figures = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Figures:
    """Every sample the endpoint serves: (name, labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(figures: Figures, name: str, **labels: str) -> float:
    """The sample `name{labels}`; KeyError if the endpoint does not serve it."""
    return figures[(name, frozenset(labels.items()))]


def count(figures: Figures, name: str, **labels: str) -> float:
    """A counter's sample; 0 where no event made it appear yet (a new op or error code)."""
    return figures.get((name, frozenset(labels.items())), 0.0)


def serve(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """`tensorbroker serve ARGS` as users run it, expected to exit by itself."""
    return subprocess.run(
        [sys.executable, "-P", "-m", "tensorbroker", "serve", "--memory", "16MiB", *args],
        capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
    )  # fmt: skip


@pytest.fixture(scope="module")
def metrics_broker() -> Iterator[tuple[tb.BrokerProcess, int]]:
    """A broker of this module's own serving metrics on a free port: (broker, port)."""
    port = free_port()
    with tb.start_broker("64MiB", options=["--metrics", f"127.0.0.1:{port}"]) as b:
        yield b, port
        assert b.alive, f"the broker died during the tests (exit code {b.returncode})"


def test_figures_follow_puts_gets_and_a_failed_delete(
    metrics_broker: tuple[tb.BrokerProcess, int],
) -> None:
    broker, port = metrics_broker
    n, nbytes = 5, 64 * 1024
    with tb.connect(broker.address) as c:
        before = scrape(port)
        for i in range(n):
            c.put(f"m/{i}", np.full(nbytes // 4, i, dtype=np.float32))
        held = [c.get(f"m/{i}") for i in range(n)]
        with pytest.raises(tb.NotFound):
            c.delete("m/missing")
        after = scrape(port)
        stats = c.stats()  # the broker's own figures, for the exact ones

        def moved(name: str, **labels: str) -> float:
            return count(after, name, **labels) - count(before, name, **labels)

        assert value(after, "tensorbroker_memory_capacity_bytes", device="cpu") == broker.memory
        used = value(after, "tensorbroker_memory_used_bytes", device="cpu")
        assert used == stats["used_bytes"]
        assert used - value(before, "tensorbroker_memory_used_bytes", device="cpu") >= n * nbytes
        assert value(after, "tensorbroker_memory_granted_bytes", device="cpu") > 0  # the writer's
        assert moved("tensorbroker_objects") == n
        assert moved("tensorbroker_versions_published_total") == n
        assert moved("tensorbroker_leases") == n  # the arrays held
        assert value(after, "tensorbroker_clients") >= 1
        # Small puts are one `write` each; gets of sealed keys never ask the broker.
        assert moved("tensorbroker_requests_total", op="write") == n
        assert moved("tensorbroker_requests_total", op="delete") == 1
        assert moved("tensorbroker_requests_refused_total", code="not_found") == 1
        for op, done in (("write", n), ("delete", 1)):
            assert moved("tensorbroker_request_duration_seconds_count", op=op) == done
            assert moved("tensorbroker_request_duration_seconds_bucket", op=op, le="+Inf") == done
            assert moved("tensorbroker_request_duration_seconds_sum", op=op) > 0
            cumulative = [
                v for (name, labels), v in after.items()
                if name == "tensorbroker_request_duration_seconds_bucket" and ("op", op) in labels
            ]  # fmt: skip
            assert len(cumulative) == 13 and max(cumulative) == count(
                after, "tensorbroker_request_duration_seconds_count", op=op
            )

        del held
        for i in range(n):
            c.delete(f"m/{i}")
        assert wait_until(  # once the readers' lease slots are scanned
            lambda: (
                value(scrape(port), "tensorbroker_memory_used_bytes", device="cpu")
                == value(before, "tensorbroker_memory_used_bytes", device="cpu")
            ),
            timeout=5.0,
            interval=0.05,
        )
        last = scrape(port)
        assert value(last, "tensorbroker_objects") == value(before, "tensorbroker_objects")
        assert value(last, "tensorbroker_leases") == value(before, "tensorbroker_leases")
        assert value(last, "tensorbroker_memory_waiting_bytes", device="cpu") == 0


def test_parked_gets_and_queue_items_show(metrics_broker: tuple[tb.BrokerProcess, int]) -> None:
    broker, port = metrics_broker
    with tb.connect(broker.address) as c, tb.connect(broker.address) as waiter:
        got: list[object] = []
        t = threading.Thread(target=lambda: got.append(waiter.get("later", timeout=30)))
        t.start()
        try:
            assert wait_until(lambda: value(scrape(port), "tensorbroker_parked_requests") == 1, 10)
            c.put("later", np.ones(4, dtype=np.float32))
        finally:
            t.join(30)
        assert len(got) == 1 and isinstance(got[0], tb.Tensor) and got[0].numpy()[0] == 1.0
        got.clear()
        assert value(scrape(port), "tensorbroker_parked_requests") == 0
        c.delete("later")

        q = c.queue("metrics/q", maxsize=8)
        for i in range(3):
            q.put(np.full(1024, i, dtype=np.float32))
        figures = scrape(port)
        assert value(figures, "tensorbroker_queues") == 1
        assert value(figures, "tensorbroker_queue_items_waiting") == 3
        assert value(figures, "tensorbroker_queue_items_in_flight") == 3
        item = q.get(timeout=10)
        figures = scrape(port)
        assert value(figures, "tensorbroker_queue_items_waiting") == 2
        assert value(figures, "tensorbroker_queue_items_in_flight") == 3  # it holds its slot
        del item
        assert wait_until(
            lambda: value(scrape(port), "tensorbroker_queue_items_in_flight") == 2, 10, 0.05
        )
        c.delete_queue("metrics/q")


def test_a_sigkilled_client_counts_as_a_crash(metrics_broker: tuple[tb.BrokerProcess, int]) -> None:
    broker, port = metrics_broker

    def clients() -> float:
        return value(scrape(port), "tensorbroker_clients")

    # The module's earlier tests closed their clients, but a bye is not waited for: once
    # their sessions are gone, this one's client is the broker's only one. (And a scrape the
    # loop is slow to answer gets the last figures: each is waited for.)
    assert wait_until(lambda: clients() == 0, 10, 0.05), clients()
    before = scrape(port)
    with subprocess.Popen(
        [sys.executable, "-P", "-c",
         "import sys, time, tensorbroker as tb\n"
         "c = tb.connect(sys.argv[1]); print('connected', flush=True); time.sleep(600)",
         broker.address],
        stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
    ) as client:  # fmt: skip
        try:
            assert client.stdout is not None and client.stdout.readline() == "connected\n"
            assert wait_until(lambda: clients() == 1, 10, 0.05), clients()
        finally:
            client.send_signal(signal.SIGKILL)
    assert client.returncode == -signal.SIGKILL
    crashes = count(before, "tensorbroker_client_crashes_total")
    assert wait_until(
        lambda: count(scrape(port), "tensorbroker_client_crashes_total") == crashes + 1, 10, 0.05
    )
    assert wait_until(lambda: clients() == 0, 10, 0.05), clients()


def test_the_dashboard_shows_only_metrics_the_broker_serves(
    metrics_broker: tuple[tb.BrokerProcess, int],
) -> None:
    with tb.connect(metrics_broker[0].address) as c, pytest.raises(tb.NotFound):
        c.delete("dashboard/missing")  # a refusal: its counter has a sample
    dashboard = json.loads((REPO / "deploy/grafana/tensorbroker-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"\btensorbroker_\w+", e)}
    served = {name for name, _ in scrape(metrics_broker[1])}
    assert used and used <= served, f"not served: {sorted(used - served)}"


# -- starting it wrong ---------------------------------------------------------------------


def test_without_prometheus_client_serve_says_how_to_install_it(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path / 'b.sock'}"
    run = (  # the package cannot be imported, as where it is not installed
        "import sys; sys.modules['prometheus_client'] = None\n"
        "from tensorbroker.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    done = subprocess.run(
        [sys.executable, "-P", "-c", run, "serve", "--address", address, "--memory", "16MiB",
         "--metrics", f"127.0.0.1:{free_port()}"],
        capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 2
    assert "pip install 'tensorbroker[metrics]'" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "b.sock").exists()


@pytest.mark.parametrize("bad", ["9464", "localhost:http", "127.0.0.1:70000", ":9464"])
def test_a_bad_metrics_address_is_refused(tmp_path: Path, bad: str) -> None:
    done = serve("--address", f"ipc://{tmp_path / 'b.sock'}", "--metrics", bad)
    assert done.returncode == 2
    assert (
        f"--metrics must be HOST:PORT, such as 127.0.0.1:9464 or 0.0.0.0:9464, not {bad!r}"
        in done.stderr
    )
    assert "Traceback" not in done.stderr


def test_a_metrics_port_in_use_is_refused_and_nothing_is_left(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = serve("--address", f"ipc://{tmp_path / 'b.sock'}", "--metrics", f"127.0.0.1:{port}")
    assert done.returncode == 1
    assert f"cannot serve metrics on 127.0.0.1:{port}: the port is in use" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "b.sock").exists() and not (tmp_path / "b.sock.lane").exists()


# -- in this process: the threads ------------------------------------------------------------


def test_concurrent_scrapes_while_clients_work_and_the_server_stops_with_the_broker(
    tmp_path: Path,
) -> None:
    """Scrapes on several threads while a client publishes: each one answers, the counter
    never goes back, and stopping the broker stops the HTTP server and its threads."""
    port, n = free_port(), 300
    threads_before = set(threading.enumerate())
    broker = Broker(f"ipc://{tmp_path / 'b.sock'}", 16 * MiB)
    try:
        broker.bind()
        broker.export_metrics("127.0.0.1", port)
    except BaseException:
        broker.close()
        raise
    loop = threading.Thread(target=broker.serve)
    loop.start()
    seen: list[list[float]] = [[] for _ in range(4)]
    failed: list[BaseException] = []
    done = threading.Event()

    def scraper(mine: list[float]) -> None:
        try:
            while not done.is_set():
                mine.append(value(scrape(port), "tensorbroker_versions_published_total"))
        except BaseException as exc:
            failed.append(exc)

    scrapers = [threading.Thread(target=scraper, args=(s,)) for s in seen]
    try:
        for t in scrapers:
            t.start()
        with tb.connect(broker.address) as c:
            for i in range(n):
                c.put("hot", np.full(256, i, dtype=np.float32))
        done.set()
        for t in scrapers:
            t.join(30)
        assert not failed, failed
        assert all(s == sorted(s) and s for s in seen), "a counter went back"
        assert value(scrape(port), "tensorbroker_versions_published_total") == n
    finally:
        done.set()
        broker.stop()
        loop.join(30)
    assert not loop.is_alive()
    with pytest.raises(urllib.error.URLError):
        scrape(port)
    assert set(threading.enumerate()) <= threads_before  # the HTTP server's thread ended


def test_a_scrape_the_loop_does_not_answer_gets_the_last_figures(
    metrics_broker: tuple[tb.BrokerProcess, int],
) -> None:
    """A loop busy past the timeout must not hang a scrape: it is served the last figures."""
    with tb.connect(metrics_broker[0].address) as c:
        figures = c.stats()  # what Broker.stats() hands over
    woken, port = threading.Event(), free_port()
    exporter = Exporter("127.0.0.1", port, woken.set, timeout=0.2)
    try:
        assert scrape(port) == {}  # nothing answered yet
        assert woken.is_set()  # it asked the loop
        exporter.answer(lambda: figures)  # as the loop does, late
        assert value(scrape(port), "tensorbroker_objects") == figures["objects"]  # stale, served
    finally:
        exporter.close()
