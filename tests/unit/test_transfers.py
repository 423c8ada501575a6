"""The agents of a cluster's brokers (server/cluster/transfers.py): a peer's agent metadata, the
newest kept. NIXL's agent is stood in for (the integration tests run the real one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tensorbroker.server.cluster.transfers import Transfers


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


def _transfers(name: str, shm: Path) -> Transfers:
    t = object.__new__(Transfers)
    t.agent, t.shm_dir, t._mapped, t._peers, t._versions = Agent(name), str(shm), {}, {}, {}
    t.incarnation, t._registered = 7, 0
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
