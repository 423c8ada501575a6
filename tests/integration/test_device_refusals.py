"""A real broker process that serves no GPU refuses device objects, saying why; and a
client that cannot use CUDA says so. Runs everywhere (the simulated GPU needs none)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import numpy as np
import pytest
from simcuda import SimCudaTensor, SimRuntime
from support import wait_until

import tensorbroker as tb

HAS_CUPY = importlib.util.find_spec("cupy") is not None


@pytest.fixture
def no_gpu_broker() -> Iterator[tb.BrokerProcess]:
    with tb.start_broker(memory="64MiB", cuda_memory="off") as b:
        yield b


def test_cuda_put_create_and_queue_put_are_refused_naming_why(
    no_gpu_broker: tb.BrokerProcess,
) -> None:
    rt = SimRuntime()
    with tb.connect(no_gpu_broker.address) as c:
        with pytest.raises(tb.InvalidRequest, match=r"cuda:0: .*--cuda-memory off"):
            c.put("x", SimCudaTensor(rt, 0, np.ones(4, np.float32)))
        with pytest.raises(tb.InvalidRequest, match=r"cuda:1: .*--cuda-memory off"):
            with c.create("y", (4,), "float32", device="cuda:1"):
                pass
        q = c.queue("q", maxsize=2)
        with pytest.raises(tb.InvalidRequest, match="--cuda-memory off"):
            q.put(SimCudaTensor(rt, 0, np.ones(4, np.float32)))
        assert q.in_flight() == 0  # the refused put took no slot
        c.put("h", np.arange(3))  # the broker is fine, and so is the host path
        assert c.keys() == ["h"] and c.stats()["used_bytes"] > 0


@pytest.mark.skipif(HAS_CUPY, reason="CuPy is installed here: the no-CuPy refusal cannot occur")
def test_a_broker_without_cupy_says_to_install_it() -> None:
    with tb.start_broker(memory="64MiB") as b, tb.connect(b.address) as c:
        assert "CuPy is not installed" in c.stats()["cuda"]
        with pytest.raises(
            tb.InvalidRequest, match=r"CuPy is not installed.*tensorbroker\[cuda12\]"
        ):
            with c.create("y", (4,), "float32", device="cuda:0"):
                pass


@pytest.mark.skipif(HAS_CUPY, reason="CuPy is installed here: this process can use CUDA")
def test_a_client_without_cupy_cannot_open_a_device_object() -> None:
    """A device object put through a simulated GPU; a reader with no CUDA of its own."""
    from test_device_protocol import SimBroker

    sim = SimBroker(SimRuntime(), spec={0: 8 << 20})
    try:
        with sim.connect() as producer, tb.connect(sim.address) as reader:
            producer.put("x", SimCudaTensor(sim.rt, 0, np.ones(4, np.float32)))
            with pytest.raises(tb.InvalidRequest, match="this process cannot use CUDA: CuPy"):
                reader.get("x")
            assert wait_until(lambda: reader.stats()["leases"] == 0, 5)  # the lease went back
    finally:
        sim.stop()
