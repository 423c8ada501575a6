"""The asyncio client (tb.aio): many tasks share one client, waits never block the event
loop, pipelines with synchronous processes, and cancellation that leaves nothing held."""

from __future__ import annotations

import asyncio
import random
import signal
from typing import Any

import numpy as np
import pytest
import stages
from support import CHILDREN, crash, join_all, keep_a_cancelled_get

import tensorbroker as tb


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


class Ticker:
    """Counts how often the event loop gets to run a task meanwhile."""

    def __init__(self) -> None:
        self.ticks = 0
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            self.ticks += 1
            await asyncio.sleep(0.005)

    def stop(self) -> None:
        self._task.cancel()


def test_many_tasks_wait_on_one_client_without_blocking_the_loop(
    fresh_broker: tb.BrokerProcess,
) -> None:
    keys = [f"later/{i}" for i in range(20)]
    putter = CHILDREN.Process(target=stages.delayed_puts, args=(fresh_broker.address, keys, 0.5))

    async def main() -> None:
        async with tb.aio.connect(fresh_broker.address) as c:
            ticker = Ticker()
            putter.start()
            got = await asyncio.gather(*(c.get(key, timeout=30) for key in keys))
            ticker.stop()
            assert [int(np.from_dlpack(t)[0]) for t in got] == list(range(20))
            assert ticker.ticks >= 20  # the loop ran all along the half-second wait
            assert (await c.stats())["waiters"] == 0

    try:
        run(main())
    finally:
        join_all([putter])


def test_put_get_create_delete(fresh_broker: tb.BrokerProcess) -> None:
    async def main() -> None:
        async with tb.aio.connect(fresh_broker.address) as c:
            assert await c.put("a", np.arange(6.0)) == 1
            big = np.arange(2**19, dtype=np.float32)  # 2 MiB: copied in a worker thread
            assert await c.put("big", big) == 1
            async with c.create("made", (3,), "int32") as buf:
                np.from_dlpack(buf)[:] = [7, 8, 9]
            assert np.from_dlpack(await c.get("made")).tolist() == [7, 8, 9]
            assert np.array_equal(np.from_dlpack(await c.get("big")), big)
            assert sorted(await c.keys()) == ["a", "big", "made"]
            await c.delete("a")
            assert not await c.exists("a")
            with pytest.raises(tb.NotFound):
                await c.get("a")
            with pytest.raises(tb.Timeout):
                await c.get("a", timeout=0.1)

    run(main())


def test_an_async_stage_between_a_sync_producer_and_a_torch_consumer(
    fresh_broker: tb.BrokerProcess,
) -> None:
    address, items = fresh_broker.address, 100
    report = CHILDREN.Queue()
    procs = [
        CHILDREN.Process(target=stages.numbered_producer, args=(address, "raw", 0, items)),
        CHILDREN.Process(target=stages.async_relay, args=(address, "raw", "doubled", report)),
        CHILDREN.Process(target=stages.torch_sink, args=(address, "doubled", report)),
    ]
    for p in procs:
        p.start()
    with tb.connect(address) as c:
        procs[0].join(60)
        c.queue("raw").close()
    out = dict(report.get(timeout=60) for _ in range(2))
    join_all(procs)
    assert out["torch"] == [[0, 2 * seq] for seq in range(items)]  # every item, in order
    assert out["relay"] > 0


def test_a_cancelled_queue_get_holds_nothing_and_loses_no_item(
    fresh_broker: tb.BrokerProcess,
) -> None:
    items = 200

    async def main() -> list[int]:
        seen: list[int] = []
        async with tb.aio.connect(fresh_broker.address) as c:
            q = await c.queue("racy")

            async def produce() -> None:
                for i in range(items):
                    await q.put(np.array([i]))
                    await asyncio.sleep(random.uniform(0, 0.002))

            producer = asyncio.create_task(produce())
            while not producer.done() or len(seen) < items:
                getter = asyncio.create_task(q.get())
                await asyncio.sleep(random.uniform(0, 0.003))
                getter.cancel()  # may cross the broker's answer
                try:
                    item = await getter
                except asyncio.CancelledError:
                    continue
                seen.append(int(np.from_dlpack(item)[0]))
                del item, getter  # the task keeps its result
            await producer
            assert (await c.stats())["waiters"] == 0
            for _ in range(100):  # releases go out in the background
                if c.sync.list_queues()[0]["in_flight"] == 0:  # every item let go
                    break
                await asyncio.sleep(0.05)
            assert c.sync.list_queues()[0]["in_flight"] == 0
        return seen

    assert run(main()) == list(range(items))  # each once, in order


def test_an_item_kept_for_a_cancelled_get_goes_back_when_the_client_closes(
    fresh_broker: tb.BrokerProcess,
) -> None:
    """An item answered to a get cancelled as it was answered is kept for the next get; a
    client that closes first gives it back to the queue, for another consumer."""

    async def main() -> int:
        async with tb.aio.connect(fresh_broker.address) as p:
            pq = await p.queue("back")
            c = await tb.aio.connect(fresh_broker.address)
            q = await c.queue("back")
            await pq.put(np.array([7]))
            await keep_a_cancelled_get(c, q)
            await c.aclose()
            item = await pq.get(timeout=5)
            return int(np.from_dlpack(item)[0])

    assert run(main()) == 7


def test_a_cancelled_put_waiting_for_a_slot_takes_none(fresh_broker: tb.BrokerProcess) -> None:
    async def main() -> None:
        async with tb.aio.connect(fresh_broker.address) as c:
            q = await c.queue("tight", maxsize=1)
            await q.put(np.zeros(4))
            ticker = Ticker()
            waiting = asyncio.create_task(q.put(np.ones(4)))
            await asyncio.sleep(0.3)
            assert not waiting.done() and ticker.ticks >= 10
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            ticker.stop()
            # Over the asyncio socket first: the broker has the cancel by then.
            assert (await c.stats())["waiters"] == 0
            for _ in range(100):  # (a thread asleep on a queue ring's bell is woken, and goes)
                (info,) = c.sync.list_queues()
                if info["producers"] == 0:
                    break
                await asyncio.sleep(0.01)
            assert (info["in_flight"], info["producers"]) == (1, 0)
            assert np.from_dlpack(await q.get(timeout=1)).tolist() == [0, 0, 0, 0]
            await q.put(np.full(4, 2.0), timeout=5)  # the slot freed is there to take
            assert np.from_dlpack(await q.get(timeout=5)).tolist() == [2, 2, 2, 2]

    run(main())


def test_a_cancelled_get_of_a_missing_key_holds_nothing(fresh_broker: tb.BrokerProcess) -> None:
    async def main() -> None:
        async with tb.aio.connect(fresh_broker.address) as c:
            waiting = asyncio.create_task(c.get("not-yet", timeout=None))
            await asyncio.sleep(0.2)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            assert (await c.stats())["waiters"] == 0
            await c.put("not-yet", np.ones(2))
            await asyncio.sleep(0.1)
            (row,) = c.sync.list_objects("not-yet")
            assert row["leases"] == 0

    run(main())


def test_watch(fresh_broker: tb.BrokerProcess) -> None:
    keys = ["w"] * 5  # five versions of one key

    async def main() -> list[int]:
        versions = []
        async with tb.aio.connect(fresh_broker.address) as c:
            putter = CHILDREN.Process(target=stages.delayed_puts, args=(c.address, keys, 0.2))
            putter.start()
            try:
                async for value in c.watch("w", timeout=30):
                    versions.append(value.version)
                    if value.version == 5:
                        break
            finally:
                join_all([putter])
        return versions

    versions = run(main())
    assert versions == sorted(set(versions)) and versions[-1] == 5  # newer each time


def test_watch_sees_a_delete(fresh_broker: tb.BrokerProcess) -> None:
    async def main() -> list[Any]:
        async with tb.aio.connect(fresh_broker.address) as c:
            await c.put("w", np.zeros(1))
            watch = c.watch("w", timeout=10)
            first = await anext(watch)
            later = asyncio.create_task(anext(watch))  # waits in the broker
            await asyncio.sleep(0.3)
            await c.delete("w")
            gone = await later
            await c.put("w", np.ones(1))
            back = await anext(watch)
            await watch.aclose()
            return [first.version, gone, back.version]

    assert run(main()) == [1, None, 2]


def test_connect_to_nothing_says_where(tmp_path: Any) -> None:
    async def main() -> None:
        with pytest.raises(tb.BrokerUnavailable, match="no broker answers"):
            await tb.aio.connect(f"ipc://{tmp_path}/none.sock", timeout=0.3)

    run(main())


def test_a_queue_get_waiting_when_the_broker_dies_is_sent_again_to_the_next() -> None:
    with tb.start_broker(memory="64MiB") as broker:

        async def main() -> None:
            async with tb.aio.connect(broker.address) as c:
                q = await c.queue("q")
                waiting = asyncio.create_task(q.get())
                await asyncio.sleep(0.2)
                broker.send_signal(signal.SIGKILL)
                await asyncio.to_thread(broker.wait, 10)
                await asyncio.sleep(0.2)
                assert not waiting.done()  # it waits for a broker to come back
                await asyncio.to_thread(broker.restart)
                await q.put(np.arange(3))  # the queue was adopted, and the get sent again
                got = await asyncio.wait_for(waiting, 20)
                assert np.from_dlpack(got).tolist() == [0, 1, 2]

        run(main())


def test_a_delete_after_the_broker_restarted_goes_to_the_next_one() -> None:
    """The broker dies between two calls (and the next is back) before the event loop runs
    again: the delete that follows never went to the one that died, so it goes to the next
    (which adopted the key), as the synchronous client's does; not "it may or may not have
    been done"."""
    with tb.start_broker(memory="64MiB") as broker:

        async def main() -> None:
            async with tb.aio.connect(broker.address) as c:
                await c.put("k", np.arange(3))
                crash(broker)  # (the loop does not run: the client has not seen it exit)
                broker.restart()
                await c.delete("k")
                assert not await c.exists("k")

        run(main())
