"""A broker that dies loses nothing: a broker restarted on its state adopts it, and clients
come back to it with their sessions and leases (Note [recovery] in server/durability/state.py)."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

import tensorbroker as tb
from tensorbroker.client import leases
from tensorbroker.common.protocol import decode, encode
from tensorbroker.server.durability.journal import read_journal
from tensorbroker.server.durability.state import discard
from tests.integration import chaos
from tests.support import (
    CHILDREN,
    GaveUp,
    crash,
    in_thread,
    interrupt_after,
    join_all,
    keep_a_cancelled_get,
    run_segments,
    wait_until,
)  # fmt: skip

pytestmark = pytest.mark.usefixtures("transport")  # lanes and ZeroMQ both

MiB = 2**20


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-P", "-m", "tensorbroker", "serve", "--memory", "16MiB", *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.fixture
def crashable() -> Iterator[tb.BrokerProcess]:
    """A broker on the default state dir (next to its socket) that tests kill and restart."""
    with tb.start_broker(memory="64MiB") as b:
        yield b


def test_objects_queues_and_versions_survive_a_kill(crashable: tb.BrokerProcess) -> None:
    with tb.connect(crashable.address) as c:
        c.put("x", np.arange(1000.0))
        c.put("x", np.arange(1000.0) * 2)  # v2
        c.put("bundle", {"w": np.ones((3, 4), np.float32), "b": np.arange(4)})
        c.put("gone", np.ones(3))
        c.delete("gone")  # its version goes on after the restart
        q = c.queue("frames", maxsize=4)
        for i in range(3):
            q.put(np.full(10, i))
        assert q.get().numpy().tolist() == [0] * 10
        crash(crashable)
        crashable.restart()

        x = c.get("x")
        assert x.version == 2 and x.numpy().tolist() == (np.arange(1000.0) * 2).tolist()
        bundle = c.get("bundle")
        assert bundle["w"].numpy().tolist() == np.ones((3, 4)).tolist()
        assert sorted(c.keys()) == ["bundle", "x"]
        assert c.put("gone", np.ones(3)) == 2
        assert [q.get(timeout=5).numpy()[0] for _ in range(2)] == [1, 2]
        assert q.put(np.full(10, 3)) == 4  # the stream goes on
        assert q.maxsize == 4 and q.in_flight() == 1
        assert q.get().numpy()[0] == 3
        del x, bundle
        for key in c.keys():
            c.delete(key)
        q.close()
        assert wait_until(lambda: c.stats()["used_bytes"] == 0, 5)


def test_a_call_made_after_a_quick_restart_is_not_taken_for_one_cut_short(
    crashable: tb.BrokerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An idle client whose broker was killed and is back before its next call: that call
    went to no broker before the new one (the old one had exited), so it is sent again, also
    where a call cut short by the restart could not be (a delete, a queue list). The client's
    release thread, which looks every 0.1 s and would mostly see the exit first, waits here."""
    monkeypatch.setattr(leases, "RELEASE_WINDOW", 60.0)
    with tb.connect(crashable.address) as c:
        c.put("x", np.arange(4.0))
        c.queue("frames", maxsize=2)
        for _ in range(2):
            crash(crashable)
            crashable.restart()
            assert [q["name"] for q in c.list_queues()] == ["frames"]
        crash(crashable)
        crashable.restart()
        c.delete("x")
        assert not c.exists("x")
        c.delete_queue("frames")


def test_closing_a_client_just_after_its_broker_died_raises_nothing(
    crashable: tb.BrokerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its bye finds the broker gone (the release thread, which looks every 0.1 s and would
    mostly see it first, waits here): close says nothing and closes everything."""
    monkeypatch.setattr(leases, "RELEASE_WINDOW", 60.0)
    c = tb.connect(crashable.address)
    c.put("x", np.arange(3))
    crash(crashable)
    c.close()
    crashable.restart()


def test_a_client_connecting_as_its_broker_is_killed_waits_for_the_next(
    crashable: tb.BrokerProcess,
) -> None:
    """The broker is killed while a new client's hello waits in it: the client waits for
    the broker that comes back (as a client does once connected), not raise."""
    crashable.send_signal(signal.SIGSTOP)
    connecting, out = in_thread(lambda: tb.connect(crashable.address, timeout=20))
    time.sleep(0.3)  # its hello is sent, and waits in the stopped broker
    crash(crashable)
    crashable.restart()
    connecting.join(30)
    assert out and not isinstance(out[0], BaseException), out
    with out[0] as c:
        c.put("x", np.arange(3))
        assert c.exists("x")


def _kept_for_a_get_given_up(crashable: tb.BrokerProcess, p: tb.Client, name: str) -> tb.Client:
    """A consumer whose get of queue `name` was answered, then given up (Ctrl-C): the item is
    kept for its next get. It is returned, still open."""
    pq, consumer = p.queue(name), tb.connect(crashable.address)

    def answer_then_give_up() -> None:
        pq.put(np.full(4, 7.0))
        assert wait_until(lambda: len(pq) == 0, 5)
        raise GaveUp

    with interrupt_after(0.3, answer_then_give_up), pytest.raises(GaveUp):
        consumer.queue(name).get(timeout=10)
    return consumer


@pytest.mark.parametrize("crash_first", [False, True], ids=["close-then-kill", "kill-then-close"])
def test_an_item_kept_for_a_get_given_up_goes_back_once_whenever_the_broker_dies(
    crashable: tb.BrokerProcess, crash_first: bool
) -> None:
    """The journal has an item given back untaken (a get given up, then its client closed)
    as waiting in its queue again: the broker that comes back hands it out, once. And if
    the broker died before the client closed, the client gives it back to the new one."""
    with tb.connect(crashable.address) as p:
        pq = p.queue("back")  # unbounded: through the broker (a ring get never takes early)
        consumer = _kept_for_a_get_given_up(crashable, p, "back")
        if not crash_first:
            consumer.close()
            assert wait_until(lambda: len(pq) == 1, 5)
        crash(crashable)
        crashable.restart()
        if crash_first:
            consumer.close()
            assert wait_until(lambda: len(pq) == 1, 5), len(pq)
        assert pq.get(timeout=5).numpy().tolist() == [7.0] * 4
        with pytest.raises(tb.Timeout):
            pq.get(timeout=0.2)


def test_a_parked_get_resumes_on_the_new_broker(crashable: tb.BrokerProcess) -> None:
    with tb.connect(crashable.address) as c, tb.connect(crashable.address) as writer:
        got: list[Any] = []

        def wait() -> None:
            got.append(c.get("late", timeout=30))  # noqa: F821 (ruff misreads the closure)

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.2)
        crash(crashable)
        crashable.restart()
        writer.put("late", np.full(4, 9))
        waiter.join(30)
        assert not waiter.is_alive() and got[0].numpy().tolist() == [9] * 4
        del got
        writer.delete("late")


@pytest.mark.parametrize("read", ["during", "after"])
def test_blocks_the_dead_broker_granted_read_after_the_resume_hello_are_not_used(
    crashable: tb.BrokerProcess, monkeypatch: pytest.MonkeyPatch, read: str
) -> None:
    """Blocks granted ahead that a thread reads from the broker that died after another
    thread's hello to the new one listed what this client holds (`read` while that
    reconnection is under way, or after it), and that a put takes: the new broker aborted
    them. Written into, a queue item was answered as put (version 0) and never delivered
    (test_chaos lost an item so); now they are not used, and the item goes in."""
    with tb.connect(crashable.address) as c:
        q = c.queue("late-grants")  # unbounded: no ring, every item through the broker
        q.put(np.arange(2))
        assert q.get(timeout=5).numpy().tolist() == [0, 1]
        conn, ahead = c._conn, c._transfer.writes.ahead
        assert conn is not None
        late = [stock.pop() for stock in ahead.grants.values() if stock]  # read too late:
        assert late
        for g in late:  # not held when the hello lists what this client holds
            conn.leases.forget(g.put)
        epoch, new_channel, take_grant, taken = (
            conn.leases.epoch,
            conn.new_channel,
            ahead.take_grant,
            [],
        )

        def read_late() -> None:  # off the dead broker's socket, and taken by a put
            ahead.add_grants([[g.put, g.oid, g.segment, g.offset, g.size] for g in late], epoch)
            for stock in ahead.grants.values():
                taken.extend(g for g in stock if g.put in {x.put for x in late})
                stock[:] = [g for g in stock if g not in taken]

        def hello(*args: Any, **kwargs: Any) -> Any:
            channel = new_channel(*args, **kwargs)
            if kwargs.get("resume") and read == "during":  # (answered; not over yet)
                read_late()
            return channel

        def take(size: int, device: str = "cpu") -> Any:
            return taken.pop() if taken else take_grant(size, device)

        monkeypatch.setattr(conn, "new_channel", hello)
        monkeypatch.setattr(ahead, "take_grant", take)
        crash(crashable)
        crashable.restart()
        if read == "after":
            assert not c.exists("x")  # (the reconnection)
            read_late()
        for n in range(len(late) + 2):
            assert q.put(np.array([n, n])) != 0  # (0: "sealed and freed since")
        for n in range(len(late) + 2):
            assert q.get(timeout=5).numpy().tolist() == [n, n]
        q.close()


@pytest.mark.parametrize("got", ["queue item", "key"])
def test_what_a_get_took_just_before_the_broker_died_keeps_its_memory(
    crashable: tb.BrokerProcess, monkeypatch: pytest.MonkeyPatch, got: str
) -> None:
    """A get's answer came from the broker that died, and the hello to the new one went
    before the client held its lease: the new broker must still keep the memory under the
    consumer's array (a queue item: its get was still waiting when the hello named the
    calls; a key: asked again of the new broker), not free it for the next puts to reuse."""
    with tb.connect(crashable.address) as c:
        q = c.queue("taken-late")  # unbounded: no ring, the item through the broker
        put = q.put if got == "queue item" else functools.partial(c.put, "k")
        put(np.full(512, 7, np.int64))
        conn, reads = c._conn, c._transfer.reads
        assert conn is not None
        monkeypatch.setattr(reads, "read_directly", lambda key: None)  # (the broker answers)
        leased, restarted = conn.leases.leased, []

        def leased_late(*args: Any, **kwargs: Any) -> Any:
            if not restarted:  # the broker dies, and the hello goes, before the lease
                restarted.append(True)
                crash(crashable)
                crashable.restart()
                conn.reconnect(conn.generation)
            return leased(*args, **kwargs)

        monkeypatch.setattr(conn.leases, "leased", leased_late)
        item = q.get(timeout=5) if got == "queue item" else c.get("k")
        assert restarted
        for _ in range(40):  # (blocks the new broker freed would be reused)
            put(np.full(512, 9, np.int64))
        assert item.numpy().tolist() == [7] * 512
        del item
        q.close()


def test_a_queue_item_whose_get_and_lease_a_resume_hello_both_name_is_freed_once_dropped(
    crashable: tb.BrokerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker died as a queue get's answer came; the client held its lease just after
    the hello to the new broker named the get, and before it listed the leases: the hello
    names both. The new broker leases the item and keeps no hold for a get sent again
    (none is): once the consumer drops it, its memory is free (it was held until the
    session ended)."""
    with tb.connect(crashable.address) as c:
        q = c.queue("named-twice")  # unbounded: no ring, the item through the broker
        q.put(np.ones(8 << 20, np.uint8))
        conn = c._conn
        assert conn is not None
        leases, done = conn.leases, []
        leased, resume = leases.leased, leases.resume

        def resume_late() -> list[int]:  # the calls named; the lease held before the leases
            if not done:  # (once: a hello not answered in time is said again)
                done.append(leased(*kept[0], **kept[1]))
            return resume()

        def leased_late(*args: Any, **kwargs: Any) -> bool:
            if done:
                return leased(*args, **kwargs)
            kept.extend([args, kwargs])
            monkeypatch.setattr(leases, "resume", resume_late)
            crash(crashable)
            crashable.restart()
            conn.reconnect(conn.generation)
            monkeypatch.setattr(leases, "resume", resume)
            return bool(done[0])

        kept: list[Any] = []
        monkeypatch.setattr(leases, "leased", leased_late)
        item = q.get(timeout=5)
        assert done == [True] and item.numpy()[-1] == 1
        used = c.stats()["used_bytes"]
        del item
        assert wait_until(lambda: c.stats()["used_bytes"] <= used - (8 << 20), 5)
        q.close()


def test_an_item_kept_for_a_cancelled_asyncio_get_keeps_its_memory_through_a_restart(
    crashable: tb.BrokerProcess,
) -> None:
    """An item answered to an asyncio get cancelled as it was answered is kept for the next
    get; its lease is claimed again when the broker restarts (it was not held: the broker
    after freed the item, and the next puts wrote over it)."""

    async def main() -> list[int]:
        async with tb.aio.connect(crashable.address) as c:
            q = await c.queue("kept-late")  # unbounded: no ring, the item through the broker
            await q.put(np.full(512, 7, np.int64))
            await keep_a_cancelled_get(c, q)
            crash(crashable)
            crashable.restart()
            for _ in range(40):  # (blocks the new broker freed would be reused)
                await q.put(np.full(512, 9, np.int64))
            item = await q.get(timeout=5)
            return [int(v) for v in np.from_dlpack(item)]

    assert asyncio.run(asyncio.wait_for(main(), 60)) == [7] * 512


def test_a_client_whose_first_answer_from_the_new_broker_was_lost_keeps_its_state(
    crashable: tb.BrokerProcess,
) -> None:
    """A resume hello that timed out (a busy machine) is said again on a new socket: the
    second one must be told the session carried over, not that it was lost."""
    with tb.connect(crashable.address) as c:
        q = c.queue("kept", maxsize=2)
        c.put("x", np.arange(4))
        held = c.get("x")
        conn = c._conn
        assert conn is not None
        crash(crashable)
        crashable.restart()
        with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(crashable.address)
            hello = {**conn.hello_message(), "leases": [n for p in conn.held.items() for n in p]}
            sock.send(encode(hello))
            assert sock.poll(10_000)  # answered, and the answer never reaches the client
            assert decode(sock.recv())["resumed"] is True
        assert q.put(np.ones(3)) == 1  # raised "restarted without the state" before
        assert conn.resumed and c.stats()["leases"] >= 1
        assert held.numpy().tolist() == [0, 1, 2, 3]
        del held
        assert q.get(timeout=5).numpy().tolist() == [1, 1, 1]
        c.delete("x")
        q.close()


def test_a_broadcast_queue_and_its_subscriptions_survive_a_kill(
    crashable: tb.BrokerProcess,
) -> None:
    """Each subscriber goes on where it was (every item once, in order), an item held across
    the kill keeps its value, and the queue takes new subscriptions."""
    address = crashable.address
    with tb.connect(address) as p, tb.connect(address) as a, tb.connect(address) as b:
        cast = p.broadcast("cast", maxsize=8)
        sa, sb = a.subscribe("cast"), b.subscribe("cast")
        for i in range(3):
            cast.put(np.full(4, i))
        held = sa.get(timeout=5)
        crash(crashable)
        crashable.restart()

        cast.put(np.full(4, 3))
        assert [sa.get(timeout=5).numpy()[0] for _ in range(3)] == [1, 2, 3]
        assert [sb.get(timeout=5).numpy()[0] for _ in range(4)] == [0, 1, 2, 3]
        assert held.numpy().tolist() == [0] * 4
        late = p.subscribe("cast")  # what is sealed from now on
        cast.put(np.full(4, 4))
        assert [s.get(timeout=5).numpy()[0] for s in (sa, sb, late)] == [4, 4, 4]
        del held
        cast.close()
        with pytest.raises(tb.QueueClosed):
            sa.get(timeout=5)
        assert wait_until(lambda: p.stats()["used_bytes"] == 0, 5), p.stats()


SUBSCRIBER = """
import sys, numpy as np, tensorbroker as tb
with tb.connect(sys.argv[1], reconnect_timeout=60) as c:
    sub = c.subscribe(sys.argv[2])
    print("subscribed", sub._ring is not None, flush=True)
    while True:
        try:
            item = sub.get(timeout=30)
        except tb.QueueClosed as exc:
            print(exc, flush=True)
            break
        print(int(np.from_dlpack(item)[0]), flush=True)
        del item
"""


def test_subscriber_processes_go_on_after_a_kill_and_serve_again(
    crashable: tb.BrokerProcess,
) -> None:
    """Issue 31: the broker that comes back (`serve` on the same state dir) has the queue
    as a broadcast queue, with its subscribers, ring and positions: each subscriber process
    gets each later item once, in order, and is never told its subscription ended."""
    with tb.connect(crashable.address) as p:
        cast = p.broadcast("cast", maxsize=4)
        command = [sys.executable, "-c", SUBSCRIBER, crashable.address, "cast"]
        subs = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(2)]
        try:
            for s in subs:
                assert s.stdout is not None and s.stdout.readline() == "subscribed True\n"
            for i in range(3):
                cast.put(np.full(4, i))
            for s in subs:  # taken (and let go) before the kill
                assert s.stdout is not None
                assert [s.stdout.readline() for _ in range(3)] == ["0\n", "1\n", "2\n"]
            crash(crashable)
            crashable.restart()

            [row] = [r for r in p.list_queues() if r["name"] == "cast"]
            assert row["subscribers"] == 2 and row["maxsize"] == 4
            with pytest.raises(tb.InvalidRequest, match="broadcast queue"):
                p.queue("cast")
            for i in range(3, 13):  # round the ring more than once
                cast.put(np.full(4, i), timeout=30)
            cast.close()
            for s in subs:
                out, _ = s.communicate(timeout=60)
                assert s.returncode == 0
                ended = "queue 'cast' is closed and drained"  # never "subscription ... ended"
                assert out.splitlines() == [*map(str, range(3, 13)), ended]
        finally:
            for s in subs:
                if s.poll() is None:
                    s.kill()
                    s.wait()
        assert wait_until(lambda: p.stats()["used_bytes"] == 0, 10), p.stats()


def test_a_removed_queue_stays_removed_across_a_kill(crashable: tb.BrokerProcess) -> None:
    """Its item a consumer holds stays valid and takes memory until let go; its name starts
    a new queue, before and after the restart."""
    with tb.connect(crashable.address) as c:
        q = c.queue("gone-q", maxsize=2)
        q.put(np.full(MiB // 8, 5.0))
        q.put(np.full(MiB // 8, 6.0))
        held = q.get()
        c.delete_queue("gone-q")
        renewed = c.queue("gone-q", maxsize=3)
        renewed.put(np.ones(4))
        crash(crashable)
        crashable.restart()

        assert [r["name"] for r in c.list_queues()] == ["gone-q"]
        again = c.queue("gone-q")
        assert (again.maxsize, len(again), again.closed) == (3, 1, False)
        assert held.numpy()[0] == 5.0 and c.stats()["used_bytes"] >= MiB
        del held
        assert again.get(timeout=5).numpy().tolist() == [1, 1, 1, 1]
        assert wait_until(lambda: c.stats()["used_bytes"] == 0, 5)
        assert c.stats()["queues"] == 1


def test_a_broker_restarts_on_a_state_where_a_ring_queue_ended(
    crashable: tb.BrokerProcess,
) -> None:
    """Issue 48, defect 1: the ring of an ended queue was unlinked while the journal kept
    it, and the next broker exited on the missing segment, losing every object."""
    with tb.connect(crashable.address) as c:
        c.put("x", np.arange(10.0))
        c.queue("run1", maxsize=4).close()  # ended at once: its ring goes
        q = c.queue("run2", maxsize=4)
        q.put(np.full(4, 7.0))
        q.close()
        assert q.get(timeout=5).numpy().tolist() == [7.0] * 4  # drained: ended
        crash(crashable)
        crashable.restart()

        assert c.get("x", timeout=5).numpy().tolist() == list(range(10))
        with pytest.raises(tb.QueueClosed):
            c.queue("run1").get(timeout=5)
        fresh = c.queue("run3", maxsize=2)
        fresh.put(np.ones(2))
        assert fresh.get(timeout=5).numpy().tolist() == [1.0, 1.0]


def test_a_ring_that_cannot_be_adopted_drops_its_queue_only(crashable: tb.BrokerProcess) -> None:
    """A part of a state that is gone (a ring segment removed by hand) is logged and dropped;
    the rest of the state is adopted."""
    with tb.connect(crashable.address) as c:
        c.put("x", np.arange(10.0))
        lost = c.queue("lost", maxsize=4)
        lost.put(np.ones(3))
        kept = c.queue("kept", maxsize=4)
        kept.put(np.full(3, 2.0))
        ring = lost._ring
        assert ring is not None
        crash(crashable)
        os.unlink(f"/dev/shm/{ring.segment}")
        crashable.restart()

        assert c.get("x", timeout=5).numpy().tolist() == list(range(10))
        assert kept.get(timeout=5).numpy().tolist() == [2.0] * 3
        assert sorted(r["name"] for r in c.list_queues()) == ["kept"]
        with open(crashable.log_path) as log:
            assert "queue 'lost' of the state is dropped" in log.read()


def test_reader_keeps_its_arrays_and_leases_across_a_kill() -> None:
    """Its arrays keep their values and the new broker does not reuse their memory while
    other clients fill it."""
    with tb.start_broker(memory="8MiB") as broker, tb.connect(broker.address) as c:
        c.put("a", np.ones(MiB, np.uint8))
        c.put("b", np.full(MiB, 2, np.uint8))
        ready, go, out = CHILDREN.Event(), CHILDREN.Event(), CHILDREN.Queue()
        reader = CHILDREN.Process(target=chaos.hold_through, args=(broker.address, ready, go, out))
        reader.start()
        assert ready.wait(60)
        crash(broker)
        broker.restart()
        filled = 0
        while True:  # every free byte, in objects of the same size as theirs
            try:
                c.put(f"fill{filled}", np.full(MiB, 7, np.uint8))
            except tb.CapacityError:
                break
            filled += 1
        assert filled >= 3
        go.set()
        first = out.get(timeout=60)
        assert first["same"] and first["leases"] >= 2
        join_all([reader])
        for key in c.keys():
            c.delete(key)
        assert wait_until(lambda: c.stats()["used_bytes"] == 0, 5)


def test_a_put_in_place_when_the_broker_dies_is_sealed_after_it_comes_back(
    crashable: tb.BrokerProcess,
) -> None:
    ready, go, out = CHILDREN.Event(), CHILDREN.Event(), CHILDREN.Queue()
    writer = CHILDREN.Process(
        target=chaos.create_and_wait, args=(crashable.address, 16 * MiB, ready, go, out)
    )
    writer.start()
    assert ready.wait(60)
    crash(crashable)
    crashable.restart()
    go.set()
    assert out.get(timeout=60) == {"version": 1, "ok": True}
    join_all([writer])
    with tb.connect(crashable.address) as c:
        c.delete("big")
        assert wait_until(lambda: c.stats()["used_bytes"] == 0, 5)


def test_memory_of_a_put_whose_writer_died_with_the_broker_is_freed() -> None:
    with tb.start_broker(memory="600MiB") as broker:
        ready, go, out = CHILDREN.Event(), CHILDREN.Event(), CHILDREN.Queue()
        writer = CHILDREN.Process(
            target=chaos.create_and_wait, args=(broker.address, 256 * MiB, ready, go, out)
        )
        writer.start()
        assert ready.wait(60)
        with tb.connect(broker.address, reconnect_timeout=0) as c:
            assert c.stats()["used_bytes"] >= 256 * MiB
        crash(broker)
        writer.kill()
        writer.join()
        broker.restart()
        with tb.connect(broker.address) as c:
            assert c.stats()["used_bytes"] == 0 and c.keys() == []
            c.put("fits", np.zeros(300 * MiB, np.uint8))  # the memory really is free
            c.delete("fits")


def test_a_clean_stop_keeps_the_objects_with_an_explicit_state_dir(tmp_path: Path) -> None:
    state = str(tmp_path / "state")
    before = _segments()
    with tb.start_broker(memory="16MiB", state_dir=state) as broker:
        with tb.connect(broker.address) as c:
            c.put("kept", np.arange(5))
        assert broker.stop() == 0
        assert _segments() - before  # still there, for the next broker
        broker.restart()
        with tb.connect(broker.address) as c:
            assert c.get("kept").numpy().tolist() == list(range(5))
    with tb.start_broker(memory="16MiB", state_dir=state, reset=True) as broker:
        with tb.connect(broker.address) as c:
            assert c.keys() == []
    discard(state)  # what --reset does
    assert _segments() - before == set() and not os.path.exists(state)


def test_refusals_of_a_state_say_what_to_do(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/b.sock"
    state = str(tmp_path / "state")
    with tb.start_broker(memory="16MiB", address=address, state_dir=state):
        with tb.connect(address) as c:
            c.put("x", np.ones(10))
        other = _serve("--address", f"ipc://{tmp_path}/other.sock", "--state-dir", state)
        assert other.returncode == 2 and "belongs to a running broker" in other.stderr
    with open(os.path.join(state, "journal"), "ab") as journal:  # as a later version writes
        journal.write(msgpack.packb(("meta", "layout", 999)))
    refused = _serve("--address", address, "--state-dir", state)
    assert refused.returncode == 2 and "layout 999" in refused.stderr
    assert "--reset" in refused.stderr and "Traceback" not in refused.stderr
    with tb.start_broker(memory="16MiB", address=address, state_dir=state, reset=True) as b:
        with tb.connect(b.address) as c:
            assert c.keys() == []
    discard(state)
    not_dir = tmp_path / "file"
    not_dir.write_text("")
    bad = _serve("--address", f"ipc://{tmp_path}/c.sock", "--state-dir", f"{not_dir}/state")
    assert bad.returncode == 2 and "cannot use the state dir" in bad.stderr


def test_a_state_whose_segments_were_removed_is_refused(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/b.sock"
    state = str(tmp_path / "state")
    with tb.start_broker(memory="16MiB", address=address, state_dir=state):
        with tb.connect(address) as c:
            c.put("x", np.ones(10))
    found = read_journal(state)
    assert found is not None
    names = list(found.segments)
    os.unlink(f"/dev/shm/{next(n for n, (_, kind) in found.segments.items() if kind == 'arena')}")
    refused = _serve("--address", address, "--state-dir", state)
    assert refused.returncode == 2 and "removed by hand" in refused.stderr
    assert "--reset" in refused.stderr and "Traceback" not in refused.stderr
    with tb.start_broker(memory="16MiB", address=address, state_dir=state, reset=True):
        assert not any(os.path.exists(f"/dev/shm/{n}") for n in names)  # the rest, gone
    discard(state)


def _segments() -> set[str]:
    """The files in /dev/shm of this test run's states (not another run's at the same time)."""
    return run_segments(tempfile.gettempdir())


def test_a_ring_put_carried_over_a_restart_then_aborted_holds_nothing_up(
    crashable: tb.BrokerProcess,
) -> None:
    """Issue 48: a put through the broker for a ring's position, granted, carried over a
    broker restart and then aborted kept its position claimed: the items after it stopped
    there."""
    with tb.connect(crashable.address) as c:
        q = c.queue("carried", maxsize=2)
        q.put(np.full(2, 1.0))
        with pytest.raises(GaveUp), q.create((4,), "float32") as buf:
            buf.numpy()[:] = 5.0
            crash(crashable)
            crashable.restart()
            raise GaveUp
        del buf
        q.put(np.full(2, 2.0), timeout=5)
        assert [q.get(timeout=5).numpy()[0] for _ in range(2)] == [1.0, 2.0]
        assert wait_until(lambda: q.in_flight() == 0 and c.stats()["used_bytes"] == 0, 5)
