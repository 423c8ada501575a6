"""The agents of a cluster's brokers (server/cluster/transfers.py): a peer's agent metadata, the
newest kept; reads run off the broker's loop (mover.py). NIXL's agent is stood in for (the
integration tests run the real one)."""

from __future__ import annotations

import select
import threading
from pathlib import Path
from typing import Any

import pytest

from tensorbroker.server.cluster.transfers import Transfers
from tests.support import wait_until


class Agent:
    """NIXL's agent as Transfers uses it for metadata: it names what is registered."""

    def __init__(self, name: str) -> None:
        self.name, self.segments, self.remote = name, 0, {}  # type: ignore[var-annotated]

    def register_memory(self, regions: Any, kind: str) -> None:
        self.segments += 1

    def get_agent_metadata(self) -> bytes:
        return f"{self.name}:{self.segments}".encode()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        name = metadata.split(b":")[0]
        self.remote[name.decode()] = metadata
        return name

    def remove_remote_agent(self, name: str) -> None:
        del self.remote[name]


def _transfers(name: str, shm: Path, agent: Any = None) -> Transfers:
    t = Transfers(name, str(shm), agent or Agent(name))
    t.incarnation = 7
    return t


def test_older_agent_metadata_does_not_undo_newer(tmp_path: Path) -> None:
    """a's `lent` (on its ROUTER) and its `agent` message (on its DEALER) keep no order
    between them: metadata of before a segment was registered, read after the one of after,
    must not make b forget that segment."""
    a, b = _transfers("a", tmp_path), _transfers("b", tmp_path)
    old = a.agent_fields()
    (tmp_path / "seg").write_bytes(bytes(4096))
    a.register("seg")
    new = a.agent_fields()
    assert new["agent_v"] == [7, 1] and new["agent"] != old["agent"]
    b.add_peer("a", new["agent"], new["agent_v"])
    b.add_peer("a", old["agent"], old["agent_v"])
    assert b.agent.remote["a"] == new["agent"]
    b.add_peer("a", old["agent"], [8, 0])  # a restarted (a new incarnation): taken
    assert b.agent.remote["a"] == old["agent"]
    a.close()
    b.close()


class Reading(Agent):
    """An agent whose reads are under way until the test says (`over`), and whose look at a
    read blocks while `stuck` (as one `check_xfer_state` did for 2.84 s on a busy host)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.over, self.state = threading.Event(), "DONE"
        self.stuck, self.looking = threading.Event(), threading.Event()
        self.released: list[Any] = []

    def get_xfer_descs(self, regions: Any, kind: str) -> Any:
        return regions

    def initialize_xfer(self, op: str, local: Any, remote: Any, node: str) -> Any:
        if node == "nobody":
            raise RuntimeError("nixlNotFoundError")
        return object()

    def transfer(self, handle: Any) -> str:
        return "PROC"

    def check_xfer_state(self, handle: Any) -> str:
        self.looking.set()
        if self.stuck.is_set():
            assert self.over.wait(10), "the test never let the read end"
        return self.state if self.over.is_set() else "PROC"

    def release_xfer_handle(self, handle: Any) -> None:
        self.released.append(handle)


def _ended(t: Transfers) -> bool:
    return bool(select.select([t.fd], [], [], 5)[0])


def test_a_read_whose_nixl_look_blocks_does_not_block_the_loop(tmp_path: Path) -> None:
    """Issue 50's second fault: NIXL's look at a read blocked the broker's loop. Now the
    mover's thread looks; the loop's `done` makes no NIXL call, and the loop is woken (`fd`)
    when the read ends."""
    agent = Reading("b")
    t = _transfers("b", tmp_path, agent)
    agent.stuck.set()
    read = t.read("a", 1000, 2000, 4096)
    assert agent.looking.wait(5)  # the thread is in NIXL's call, and stays there
    for _ in range(3):
        assert not t.done(read)  # (it would hang here if it called NIXL)
    agent.over.set()
    assert _ended(t) and t.done(read) and agent.released == [read.handle]
    t.close()


def test_reads_that_fail_say_why_when_the_loop_looks(tmp_path: Path) -> None:
    agent = Reading("b")
    t = _transfers("b", tmp_path, agent)
    refused = t.read("nobody", 1000, 2000, 4096)
    assert _ended(t)
    with pytest.raises(OSError, match="could not start a read of 4096 bytes from 'nobody'"):
        t.done(refused)
    agent.state = "ERR"
    failed = t.read("a", 1000, 2000, 4096)
    agent.over.set()
    assert wait_until(lambda: failed.error is not None, 5)
    with pytest.raises(OSError, match="ended in state ERR"):
        t.done(failed)
    t.close()
