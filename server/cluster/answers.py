"""The answers a broker's peers send back on the links it opened to them (its DEALERs: Note
[cluster] in cluster.py): welcome, hello_first, beat answers, lent, more, and the answers to
its lookups and listings (Note [homes] in homes.py). Cluster's, apart from its requests."""

from __future__ import annotations

import logging
import time
from typing import Any

from ...common.errors import BrokerError
from .dealers import Peer
from .joining import speaks
from .links import Links
from .queue_links import QueueLinks
from .replicas import Replicas
from .transfers import Transfers

log = logging.getLogger(__name__)


class Answers:
    """Cluster's handling of its peers' answers (`_answer`); what it uses of Cluster is
    named here."""

    links: Links
    replicas: Replicas
    queues: QueueLinks
    transfers: Transfers

    def _forget_node(self, node: str, mutual: bool = False, welcomed: Peer | None = None) -> None:
        raise NotImplementedError

    def _down(self, peer: Peer, relink: bool = False) -> None:
        raise NotImplementedError

    def _hello(self, op: str = "hello", to: str | None = None) -> dict[str, Any]:
        raise NotImplementedError

    def _answer(self, peer: Peer, m: dict[str, Any]) -> None:
        op = m["op"]
        if op in ("welcome", "beat") and self._stale(peer, m):
            return  # from an older incarnation of the node: it says nothing of the link now
        if op == "welcome" and not speaks(m, self.links.refused):
            if peer.up:  # (it restarted on another release: down, as it forgot this one)
                self._down(peer)
            return
        peer.heard = time.monotonic()
        try:
            if op == "welcome":
                node = str(m["node"])
                self.transfers.add_peer(node, bytes(m["agent"]), m.get("agent_v"))
                heard, same = self.links.heard_of(node), self.links.same(node, m)
                if same is None:  # from an incarnation that a newer one replaced
                    return
                self.queues.hello(node, m)  # (before a forget puts its items back)
                if not same and heard:  # it restarted, or forgot this one
                    self._forget_node(node, mutual=True, welcomed=peer)
                self.links.named(peer, node)
                peer.up = True
                self.replicas.changed()  # (keys' homes move: Note [homes])
                self.replicas.welcome(node, m["keys"])
                # What this node holds now, again: a put sealed while the peer was not up
                # yet here was announced to the others only (its hello went before it); and
                # what it follows of the peer's (Note [follows] in follows.py).
                self.links.send_to(peer, {"op": "keys", "keys": self.replicas.own(node)})
                follows = self.replicas.follows(node)
                if follows is not None:
                    self.links.send_to(peer, follows)
                # A beat at once: its answer makes the node `fresh` (its offers readable)
                # now, not a beat from now.
                self.links.beat_to(peer)
                self.queues.node_up(node)
                log.info("cluster: node %r at %s is up", node, peer.address)
            elif op == "hello_first":
                if peer.node is not None:  # an announcement, queue items or writes it dropped
                    self.replicas.lending.offers_back(peer.node, m.get("unoffered", ()))
                    self.transfers.unwritten(peer.node, m.get("unwritten", ()))
                    for loan in m.get("qback", ()):
                        self.queues.back(peer.node, int(loan))
                self.links.send_to(peer, self._hello(to=peer.node))
                again = m.get("again")
                if isinstance(again, dict) and peer.node is not None:
                    if self.replicas.again(peer.node, again):
                        self.links.send_to(peer, again)  # (after the hello, on the same link)
            elif op == "lent":
                self.replicas.pulls.lent(peer.node or "", m)
            elif op in ("where", "ls"):  # (Note [homes] in homes.py)
                self.replicas.homes.answered(peer.node or "", m)
            elif op == "more":
                self.replicas.pulls.more(peer.node or "", m)
            elif op == "wrote":  # (Note [pushes] in pushes.py)
                self.transfers.wrote(peer.node or "", m)
            elif op == "beat" and peer.node is not None:
                self.links.beaten(peer, m)
                same = self.links.same(peer.node, m)
                if same is False:  # it forgot this one: forgotten too
                    self._forget_node(peer.node, mutual=True)
                elif same:
                    got = m.get("t"), m.get("heard_ago"), m.get("down_after"), m.get("registration")
                    self.links.kept(peer.node, *got)
                if m.get("resync") and peer.up:
                    # Requests of this one's were lost on the way there: every link to the
                    # node goes down, as if it went down (each forgets what it lent the
                    # other, once; the hellos and welcomes that follow say all again). The
                    # node dropped what it was reading of this one's before it answered.
                    # Answers to beats sent before the forget, resync too, come before the
                    # welcome, on a link down by then: not acted on again.
                    log.warning("cluster: requests to node %r were lost; linking again", peer.node)
                    for link in [p for p in self.links.peers if p.node == peer.node and p.up]:
                        self._down(link, relink=True)
        except (KeyError, TypeError, ValueError, BrokerError, OSError) as exc:
            log.warning("a cluster answer %r from %s could not be used: %s", op, peer.address, exc)

    def _stale(self, peer: Peer, m: dict[str, Any]) -> bool:
        """Whether welcome or beat answer `m` comes from an older incarnation of its node
        than one heard already."""
        node, incarnation = m.get("node", peer.node), m.get("incarnation")
        return self.links.older(str(node), incarnation) if node is not None else False
