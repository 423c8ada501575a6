"""The requests a broker's peers send on the links they opened to it (its ROUTER: Note
[cluster] in cluster.py): hello, beats, announcements, offers given back, lends and loans
returned, lookups (Note [homes] in homes.py) and the queues' messages (Note [queues across
nodes] in queue_links.py). Cluster's, beside its peers' answers (answers.py)."""

from __future__ import annotations

import logging
from typing import Any

from ...common.errors import BrokerError
from .dealers import Peer
from .joining import speaks
from .links import Links
from .queue_links import QueueLinks
from .replicas import Replicas
from .transfers import Transfers

log = logging.getLogger(__name__)


class Requests:
    """Cluster's handling of its peers' requests (`_request`); what it uses of Cluster is
    named here."""

    node: str
    links: Links
    replicas: Replicas
    queues: QueueLinks
    transfers: Transfers

    def _forget_node(self, node: str, mutual: bool = False) -> None:
        raise NotImplementedError

    def _down(self, peer: Peer, relink: bool = False) -> None:
        raise NotImplementedError

    def _hello(self, op: str = "hello", to: str | None = None) -> dict[str, Any]:
        raise NotImplementedError

    def _served(self) -> bool:
        """Answer the pieces written since (Note [pushes] in pushes.py): on this broker's own
        link to the reader if it has no route here (it was forgotten since it asked), as
        the reader holds the block until it hears. Whether there were any."""
        served = self.transfers.served()
        for node, answer in served:
            if not self.links.answer(node, answer):
                self.links.send(node, answer)
        return bool(served)

    def _stopped(self) -> bool:
        """Tell the nodes up that this broker stopped (its writes have ended): those that
        asked it for pieces hold no block for them (Note [pushes] in pushes.py). Whether
        any was told."""
        links = self.links
        said = {"op": "stopped", "node": self.node, "inc": links.incarnation}
        return sum(links.send(node, said) for node in links.nodes() if links.up(node)) > 0

    def _pushes(self, op: str, m: dict[str, Any]) -> None:
        """A lender's answer about a piece, sent on its own link (`_served`), its stop
        (`_stopped`), or a reader's question about its pieces (Note [pushes] in pushes.py)."""
        node = str(m.get("node", ""))
        try:
            if op == "stopped":
                # From its process (not an older one's late word): down now, as after a leave
                # from etcd, so that what it was asked is given up, then over.
                if not self.links.older(node, m.get("inc")):
                    for peer in [p for p in self.links.peers if p.node == node and p.up]:
                        self._down(peer)
                self.transfers.stopped(node, m.get("inc"))
            elif op == "wrote":
                self.transfers.wrote(node, m)
            else:
                self.transfers.writing(node, m["tokens"], m.get("inc"))
                self._served()
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("a cluster message %r from %r could not be used: %s", op, node, exc)

    def _request(self, route: bytes, m: dict[str, Any]) -> None:
        op, replicas, links = m["op"], self.replicas, self.links
        lost = links.tally(route, m)  # (each request its sender counted: Note [beats])
        if op in ("wrote", "writing", "stopped"):  # (Note [pushes]: with or without a route
            self._pushes(op, m)  # of the node's, which may have forgotten it meanwhile)
            return
        try:
            if op == "hello":
                if not speaks(m, links.refused):
                    return
                node, address = str(m["node"]), str(m.get("address", ""))
                self.transfers.add_peer(node, bytes(m["agent"]), m.get("agent_v"))
                restarted = links.restarted(node, m.get("incarnation"))
                same = links.same(node, m)
                if same is None:  # from an incarnation that a newer one replaced
                    return
                self.queues.hello(node, m)  # (before a forget puts its items back)
                if not same:  # restarted, or forgot this one: forgotten too
                    self._forget_node(node, mutual=True)
                for peer in links.peers if restarted else ():  # (a new process: a link to
                    if peer.node == node and peer.address != address:  # another address, up
                        peer.up = False  # and idle, may lead to the old one: says hello)
                links.route(route, node)
                links.reply(route, self._hello("welcome", to=node))
                links.meet(address)
                return
            node = links.routes.get(route, "")
            if not node:  # this broker restarted (or forgot the peer): say hello first
                first: dict[str, Any] = {"op": "hello_first"}
                if op == "announce":  # the offers not kept: their owner unpins them
                    first["unoffered"] = [e[:2] for e in m["keys"] if isinstance(e[3], dict)]
                elif op == "lend":  # asked again after the hello, else its get waits it out
                    again = ("op", "pull", "key", "direct", "ask", "t")
                    first["again"] = {k: m[k] for k in again if k in m}
                elif op in ("where", "ls"):  # (so is a lookup, or a listing: Note [homes])
                    first["again"] = m
                elif op == "qitem":  # not read: its lender puts it back in its part
                    first["qback"] = [m["loan"]]
                elif op == "write":  # not written (Note [pushes] in pushes.py)
                    first["unwritten"] = [m["token"]]
                links.reply(route, first)
            elif op == "beat":  # its answer: when this broker last heard it (links.py, `kept`)
                replicas.lending.open_pulls(node, m.get("pulls"), m.get("t"))
                if lost:  # (its requests were lost: it forgets this node, and lets go what
                    # it lent it, as it reads the answer. What this node reads of it is
                    # dropped now, before: nothing read of its memory is used after that)
                    log.warning("cluster: requests of node %r were lost; it links again", node)
                    links.relinking.add(node)  # (not `fresh` until it forgot this one; each
                    # answer says resync till then: one lost does not leave it so for good)
                    replicas.drop_reads(node)
                    self.queues.arrivals.node_down(node)
                heard, forgot = links.heard_ago(node), links.forgot.get(node, 0)
                answer = {"op": "beat", "t": m.get("t"), "heard_ago": heard, "forgot": forgot,
                          "down_after": links.down_after, "resync": node in links.relinking,
                          "registration": links.registrations.get(node)}  # fmt: skip
                links.reply(route, {**answer, "incarnation": links.incarnation})
            elif op == "announce":
                acked = links.acked(node, m)
                for key, version, size, offer, *gone in m["keys"]:
                    offer = offer if isinstance(offer, dict) else None
                    if offer is not None and not acked:  # it will let it go
                        replicas.held.refuse(node, str(key), int(version))
                        offer = None
                    was, age = (gone + [0, None])[:2]  # (a claim's age: Note [homes])
                    replicas.listed(node, str(key), int(version), int(size), offer, int(was), age)
            elif op == "offers_back":  # (the reads first: a version read, then given back)
                for key, version in m.get("read", ()):
                    replicas.lending.offer_read(node, str(key), int(version))
                replicas.lending.offers_back(node, m["offers"])
            elif op == "agent":
                self.transfers.add_peer(node, bytes(m["agent"]), m.get("agent_v"))
            elif op == "keys":  # (its link here is up: what this node follows is said again,
                replicas.welcome(node, m["keys"])  # as what went while it was not was lost)
                follows = replicas.follows(node)
                if follows is not None:
                    links.after(node, follows)
            elif op == "follow":
                replicas.lending.follow(
                    node, m.get("keys", []), m.get("prefixes", []), m.get("prefetch", 0)
                )
            elif op == "lend":
                pull, direct, ask = int(m["pull"]), bool(m.get("direct")), int(m.get("ask", 0))
                replicas.lending.lend(node, pull, str(m["key"]), direct, ask, m.get("t"))
            elif op == "write":  # a piece of a loan, pushed (Note [pushes] in pushes.py)
                self.transfers.serve(node, m)
                self._served()
            elif op == "returned":
                replicas.lending.returned(node, int(m["pull"]), int(m.get("ask", 0)))
            elif op == "delete":
                replicas.deleted(node, str(m["key"]))
            elif op in ("where", "dir", "ls", "renumber", "claimed"):  # (Note [homes])
                replicas.request(node, op, m)
            elif op.startswith("q") or op in ("want", "subs"):
                self.queues.request(node, op, m)
        except (KeyError, TypeError, ValueError, BrokerError) as exc:
            log.warning("a cluster message %r from %r could not be used: %s", op, route, exc)
