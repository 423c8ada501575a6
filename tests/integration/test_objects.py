"""put, get, create, delete, bundles, versions and waiting, as a user sees them."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

import tensorbroker as tb


def test_put_get_round_trip_and_metadata(client: tb.Client) -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert client.put("x", x) == 1
    t = client.get("x")
    assert isinstance(t, tb.Tensor)
    assert (t.key, t.version, t.shape, t.dtype, t.device, t.nbytes) == (
        "x", 1, (3, 4), "float32", "cpu", 48,
    )  # fmt: skip
    assert t.__dlpack_device__() == (1, 0)
    np.testing.assert_array_equal(t.numpy(), x)
    np.testing.assert_array_equal(np.asarray(t), x)
    assert client.exists("x") and not client.exists("y")
    assert client.keys() == ["x"]


def _resident_bytes(address: int) -> tuple[int, int]:
    """The size and resident bytes (Rss) of this process's mapping that starts at `address`."""
    size = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if head:
                start, end = int(head[1], 16), int(head[2], 16)
                size = end - start if start == address else None
            elif size is not None and line.startswith("Rss:"):
                return size, int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping starts at {address:#x}")


def test_a_reader_maps_a_segment_without_faulting_it_all_in(broker: tb.BrokerProcess) -> None:
    """A client that only reads maps the broker's segment lazily (Note [populating mappings]
    in client/shm.py): its first get does not bring the whole segment in (about 20-40 ms per
    256 MiB), and what it reads is there."""
    x = np.arange(1024, dtype=np.float32)
    with tb.connect(broker.address) as writer, tb.connect(broker.address) as reader:
        writer.put("lazy", x)
        t = reader.get("lazy")
        np.testing.assert_array_equal(t.numpy(), x)
        size, resident = _resident_bytes(t.lease.mapping.address)
        assert size >= 64 * 2**20, size  # the module's broker: one 256 MiB segment
        assert resident <= 4 * 2**20, f"{resident} of {size} bytes resident after one 4 KiB get"
        del t


def test_a_writer_populates_a_segment_at_its_first_large_put_only(broker: tb.BrokerProcess) -> None:
    """A writer of small items does not fault the whole segment in either (a new client's
    first 4 KiB put took 17-20 ms so); its first put of 1 MiB or more does, at once, so that
    its large copies do not fault page by page (Note [populating mappings])."""
    with tb.connect(broker.address) as c:
        c.put("small-write", np.ones(1024, np.float32))
        small = c.get("small-write")
        size, resident = _resident_bytes(small.lease.mapping.address)
        assert resident <= 4 * 2**20, f"{resident} of {size} bytes resident after a 4 KiB put"
        c.put("large-write", np.ones(2**20, np.uint8))
        large = c.get("large-write")
        size, resident = _resident_bytes(large.lease.mapping.address)
        assert resident == size, f"{resident} of {size} bytes resident after a 1 MiB put"
        del small, large
        c.delete("small-write")
        c.delete("large-write")


def test_put_accepts_every_kind_of_source(client: tb.Client) -> None:
    import jax.numpy as jnp
    import torch

    base = np.arange(6, dtype=np.int32)
    sources: dict[str, Any] = {
        "numpy": base,
        "numpy-strided": np.arange(12, dtype=np.int32)[::2],
        "torch": torch.from_numpy(base.copy()),
        "torch-transposed": torch.arange(6, dtype=torch.int32).reshape(2, 3).T,
        "torch-param": torch.nn.Parameter(torch.ones(3)),
        "jax": jnp.asarray(base),
        "memoryview": memoryview(base),
        "bytes": b"\x01\x02\x03",
    }
    for key, value in sources.items():
        client.put(key, value)
    np.testing.assert_array_equal(client.get("numpy-strided").numpy(), base * 2)
    np.testing.assert_array_equal(
        client.get("torch-transposed").numpy(), np.arange(6).reshape(2, 3).T
    )
    np.testing.assert_array_equal(client.get("jax").numpy(), base)
    np.testing.assert_array_equal(client.get("memoryview").numpy(), base)
    assert client.get("bytes").numpy().tobytes() == b"\x01\x02\x03"
    assert client.get("torch-param").torch().tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(tb.InvalidRequest, match="numpy.asarray"):
        client.put("list", [1, 2, 3])


def test_bundle_is_published_whole(client: tb.Client) -> None:
    import torch

    model = torch.nn.Linear(4, 3)
    state = model.state_dict()
    client.put("weights", state)
    got = client.get("weights")
    assert isinstance(got, dict) and set(got) == set(state)
    for name, value in state.items():
        assert torch.equal(got[name].torch(), value)
        assert got[name].data_ptr % 64 == 0
    assert all(t.version == 1 for t in got.values())


def test_snapshot_reader_keeps_version_1_while_version_2_is_put(client: tb.Client) -> None:
    client.put("w", np.full(1000, 1.0))
    v1 = client.get("w")
    held = v1.numpy()
    assert client.put("w", np.full(1000, 2.0)) == 2
    v2 = client.get("w")
    assert (v1.version, v2.version) == (1, 2)
    assert held.min() == held.max() == 1.0
    assert v2.numpy().min() == 2.0
    assert v1.data_ptr != v2.data_ptr


def test_sealed_objects_read_only_through_numpy(client: tb.Client) -> None:
    client.put("ro", np.zeros(4))
    t = client.get("ro")
    assert not t.numpy().flags.writeable
    assert not np.from_dlpack(t).flags.writeable
    with pytest.raises(ValueError):
        t.numpy()[0] = 1


def test_create_seals_on_exit_and_aborts_on_error(client: tb.Client) -> None:
    with client.create("c", (2, 3), "float32") as buf:
        assert not client.exists("c")
        view = np.from_dlpack(buf)
        view[:] = 5.0
    assert buf.version == 1
    np.testing.assert_array_equal(client.get("c").numpy(), np.full((2, 3), 5.0, np.float32))

    used = client.stats()["pending"]
    with pytest.raises(RuntimeError, match="boom"):
        with client.create("aborted", (16,), "int64"):
            raise RuntimeError("boom")
    assert not client.exists("aborted")
    assert client.stats()["pending"] == used
    with pytest.raises(tb.InvalidRequest, match="dtype"):
        with client.create("bad", (2,), "float8"):
            pass


def test_delete_and_not_found(client: tb.Client) -> None:
    client.put("gone", np.zeros(3))
    client.delete("gone")
    assert not client.exists("gone")
    with pytest.raises(tb.NotFound, match="gone"):
        client.get("gone")
    with pytest.raises(KeyError):
        client.delete("gone")


def test_get_waits_for_the_put(broker: tb.BrokerProcess, client: tb.Client) -> None:
    got: list[Any] = []

    def wait() -> None:
        got.append(client.get("late", timeout=30).numpy().tolist())

    # The waiting thread and this one share the client: the parked get must not block us.
    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.2)
    assert client.stats()["waiters"] == 1
    start = time.monotonic()
    client.put("late", np.array([1, 2, 3]))
    waiter.join(10)
    assert got == [[1, 2, 3]]
    assert time.monotonic() - start < 2.0


def test_get_timeout_and_wait_forever(client: tb.Client) -> None:
    start = time.monotonic()
    with pytest.raises(tb.Timeout, match="never"):
        client.get("never", timeout=0.3)
    assert 0.25 < time.monotonic() - start < 3.0
    with pytest.raises(TimeoutError):
        client.get("never", timeout=0.05)
    result: list[Any] = []
    waiter = threading.Thread(target=lambda: result.append(client.get("later", timeout=None)))
    waiter.start()
    time.sleep(0.1)
    client.put("later", np.ones(2))
    waiter.join(10)
    assert result and result[0].version == 1


def test_capacity_error_names_the_sizes_and_broker_serves_on(
    fresh_broker: tb.BrokerProcess,
) -> None:
    with tb.connect(fresh_broker.address) as c:
        with pytest.raises(tb.CapacityError, match=r"'huge'.*100\.0 MiB.*64\.0 MiB.*--memory"):
            c.put("huge", np.zeros(100 * 2**20, np.uint8))
        c.put("small", np.ones(10))
        assert c.get("small").numpy().sum() == 10
        assert c.stats()["pending"] == 0


def test_capacity_freed_by_delete_is_reused(fresh_broker: tb.BrokerProcess) -> None:
    with tb.connect(fresh_broker.address) as c:
        for i in range(10):  # 10 x 40 MiB through a 64 MiB broker
            c.put("big", np.full(40 * 2**20, i, np.uint8))
            c.delete("big")
        assert c.stats()["used_bytes"] == 0


def test_many_threads_share_one_client(client: tb.Client) -> None:
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for i in range(50):
                client.put(f"t{n}", np.full(8, i))
                assert client.get(f"t{n}").numpy()[0] == i
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors


FORK_SCRIPT = """
import os, sys
import tensorbroker as tb
client = tb.connect(sys.argv[1])
pid = os.fork()
if pid == 0:
    try:
        client.keys()
        print("no error")
    except tb.BrokerError as exc:
        print(exc)
    os._exit(0)
os.waitpid(pid, 0)
client.close()
"""


def test_forked_child_gets_a_clear_error(broker: tb.BrokerProcess) -> None:
    # In a fresh interpreter: this one has imported JAX, which objects to fork().
    out = subprocess.run(
        [sys.executable, "-P", "-c", FORK_SCRIPT, broker.address],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert "forked child" in out.stdout and "tb.connect()" in out.stdout, out


def test_closed_client_and_missing_broker() -> None:
    with pytest.raises(tb.BrokerUnavailable, match="ipc:///tmp/tb-nobody-here.sock"):
        tb.connect("ipc:///tmp/tb-nobody-here.sock", timeout=0.3)
    with tb.start_broker(memory="16MiB") as b:
        c = tb.connect(b.address)
        c.close()
        c.close()  # closing a closed client is fine
        with pytest.raises(tb.BrokerError, match="closed"):
            c.keys()
        c2 = tb.connect(b.address, reconnect_timeout=0.5)
        b.stop()
        with pytest.raises(tb.BrokerUnavailable, match="exited and no broker came back"):
            c2.keys()
        c2.close()


def test_an_aborted_create_keeps_its_memory_while_its_buffer_lives(
    fresh_broker: tb.BrokerProcess,
) -> None:
    with tb.connect(fresh_broker.address) as c:
        with pytest.raises(RuntimeError):
            with c.create("k", (1024,), "float64") as buf:
                view = buf.numpy()
                raise RuntimeError("failed half way")
        # Not published, but the memory stays reserved while the writer's view exists:
        # nothing else can be put into it under the writer's feet.
        assert not c.exists("k") and c.stats()["used_bytes"] >= 8192
        view[:] = 1.0
        del buf, view
        assert c.stats()["used_bytes"] == 0 and c.stats()["leases"] == 0
