"""One broker per node, the same keys everywhere: the links to the other brokers of a cluster
and the messages on them (what the others hold, and the pulls: replicas.py; this node's keys
announced, announcing.py, and lent to theirs: lending.py).

Note [cluster]

    broker A (node a)                                   broker B (node b)
    ROUTER at --cluster  <──── DEALER ── hello(b, agent metadata, b's keys)
                         ──── welcome(a, agent metadata, a's keys) ───>  (and beats both ways)
    a put sealed on A  ── announce(k, version) ─> k's two homes if k is new on A (Note
                          [homes]), and the peers that follow k (Note [follows]): B's
                          index says k lives on a (a node that knows nothing of k asks a home)
                          (the puts of ANNOUNCE_EVERY in one message, each key's last)
                          (and keys(A's homed at the peer) to a peer as it comes up, in
                          case a put came between A's hello and the peer's welcome)
    client of B: get k ── not listed on B ──> B: lend k? ──> A pins it: lent(version, layout,
                                                              address of its bytes)
                          B allocates a block, NIXL READs the bytes from A's registered
                          memory, seals them as k's replica (A's version), answers the get,
                          and says `returned`: A unpins. From then on B's clients read k
                          from B's directory (microseconds), until a newer version is
                          announced: the replica is dropped (it is a cache, and evictable).
    a small version (at most 64 KiB) goes with its offer in its `key` message: B's first
    get reads it at once, without lend and lent (Note [offers] in offers.py).

With `serve --etcd`, the brokers find each other in etcd (Note [membership] in
membership.py): a broker that joins is linked to, one that leaves or dies is down once its
entry goes, whatever its beats say.

ZeroMQ carries only these control messages (msgpack, never pickle); the bytes go through NIXL
(transfers.py). Each direction of a pair talks over the link its sender opened: requests
(hello, beats, lend, returned, key) go out on this broker's DEALER to the peer, answers
(welcome, beat, lent) come back on it. A peer heard from within `down_after` seconds is
up (Note [beats] in beats.py); a peer that restarts gets this broker's hello again (its
DEALER keeps trying; a broker that gets a message from a link that has not said hello
answers `hello_first`) and its keys are listed again from its welcome. A peer that goes
down: its keys raise PeerUnavailable, the replicas pulled from it stay readable, its loans
here are unpinned. A `lent` carries the lender's agent metadata of now: NIXL learns a
peer's registered memory from its metadata only, and a segment may be newer than the
welcome (an arena grows; a broker that restarted adopts segments after it joined).

A hello, welcome or beat answer carries the broker's incarnation (new at each start) and how
often it forgot the peer (took it for down, or found it restarted): the peer forgets what it
lent that broker, and what that broker offered it, once for each (and the broker, the same
of the peer's), not when a second link (two addresses of one broker) says hello. A node is
down once no link to it is up. A beat's answer also says how long ago its sender last heard
this broker: until when it will not take it for down, so not let go what it offered
(`Links.fresh`, Note [offers]). A `hello_first` names the offer it did not keep (its owner
unpins it) or the lend it did not answer (asked again behind the hello). A DEALER keeps its
route at its peer across reconnects (its routing id), so what it sends after one is still
known. What tells a peer of a change (a queue item taken, a loan returned) goes out after
the loop's replies, once the journal has the change (`Links.after`): else a broker killed
in between loses it, as its peer acted on it. The sockets, routes, incarnations and counts
are links.py's.

Queues across nodes have messages of their own (want, subs, qitem, qtaken, qback, qclose,
qremove, qleft, qhas): Note [queues across nodes] in queue_links.py. Not yet: GPU replicas.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import zmq

from ..queues.queues import Queues
from ..store.devices import RECLAIM_POLL, DeviceChunk
from ..store.objects import Objects
from ..store.parking import ParkingLot
from .answers import Answers
from .beats import BEAT
from .dealers import Peer
from .joining import PROTOCOL
from .joining import Joining as Joining  # (the broker takes it from here)
from .links import Links
from .membership import Member, Membership
from .queue_links import QueueLinks
from .records import Watched as Watched  # (the broker takes it from here)
from .replicas import Replicas
from .requests import Requests
from .transfers import Transfers

log = logging.getLogger(__name__)


CLOSE_LINGER_MS = 200  # for the answers about pieces written, at the close (Note [pushes])


class Cluster(Answers, Requests):
    """The links to the peers (Note [cluster]) and the messages on them (their requests:
    Requests, requests.py; their answers to this broker's: Answers, answers.py); what the
    peers hold and the pulls are
    `replicas`' (replicas.py). The broker registers `sockets` in its poller,
    calls `ready` for them and `tick` each loop; Objects asks `replicas` about keys not held
    here."""

    def __init__(
        self, joining: Joining, objects: Objects, queues: Queues, lot: ParkingLot,
        transfers: Transfers, poller: zmq.Poller, last: Any = None,
    ) -> None:  # fmt: skip
        """`last`: as `join`'s (followed before the etcd record names the incarnation)."""
        self.node, self.address, self.transfers = joining.node, joining.address, transfers
        self.links = links = Links(joining, poller)
        links.follow(last)
        transfers.send = links.send  # (a loan's pieces asked for: Note [pushes] in pushes.py)
        transfers.up = links.up
        links.restarts = transfers.restarted  # (its writes went with its old process)
        self.peers, fds = links.peers, {transfers.fd}  # (a read ended: Transfers.fd)
        poller.register(transfers.fd, zmq.POLLIN)
        self.replicas = Replicas(self.node, objects, lot, transfers, links, joining.prefetch)
        self.queues = QueueLinks(
            self.node, queues, transfers, links, self.replicas.session, self.replicas.homes.home
        )
        links.pulls = lambda: list(self.replicas.pulls.pulls)  # (named in each beat)
        self._next_tick = self._next_beat = 0.0
        self.membership: Membership | None = None
        if joining.etcd:  # (its threads start with `start`, once the broker has bound)
            record = {"address": self.address, "incarnation": links.incarnation}
            self.membership = Membership(
                joining.etcd, joining.etcd_prefix, self.node, record, joining.etcd_tls
            )
            links.lease_until = lambda: self.membership.alive_until  # type: ignore[union-attr]
            links.registration = lambda: self.membership.registration  # type: ignore[union-attr]
            poller.register(self.membership.fd, zmq.POLLIN)
            fds.add(self.membership.fd)
        self.sockets = links.sockets | fds  # (the peers' DEALERs: links.fd)

    def start(self) -> None:
        """Join the cluster's etcd, if it has one (Note [membership]): EtcdUnavailable if
        none answers."""
        if self.membership is not None:
            self.membership.start()

    @classmethod
    def join(
        cls, joining: Joining, queues: Queues, shm_dir: str, poller: zmq.Poller, last: Any = None
    ) -> Cluster:
        """This broker in a cluster: its NIXL agent, its links, and Objects and Queues told.
        `last`: the incarnation of the broker whose state it took over (journaled)."""
        transfers = Transfers(joining.node, shm_dir)
        objects = queues.objects
        cluster = cls(joining, objects, queues, queues.lot, transfers, poller, last)
        objects.registry.journal.meta("incarnation", cluster.links.incarnation)
        transfers.incarnation = cluster.links.incarnation  # (its metadata's versions)
        for segment in objects.registry.arena.segments:
            transfers.register(segment)
        devices = objects.registry.devices
        for arena in devices.arenas.values():
            for name in arena.segments:
                cluster.chunk(arena.chunk(name))
        devices.on_chunk = cluster.chunk
        objects.elsewhere, queues.elsewhere = cluster.replicas, cluster.queues
        return cluster

    def segment(self, name: str) -> None:
        """A new arena segment: registered with NIXL now, not per transfer, and the peers
        given this agent's metadata of now (an offer sent with an announcement, Note [offers]
        in offers.py, may lie in it; this message goes before any such on each link)."""
        self.transfers.register(name)
        self.links.everyone({"op": "agent", **self.transfers.agent_fields()})

    def chunk(self, chunk: DeviceChunk) -> None:
        """A new device chunk: registered with NIXL as VRAM now (or its objects are not lent:
        a NIXL built without CUDA), and the peers given this agent's metadata of now."""
        try:
            self.transfers.register_chunk(chunk.name, chunk.ptr, chunk.size, chunk.device)
        except OSError as exc:
            log.warning("%s: its objects stay on this node: %s", chunk.name, exc)
            return
        self.links.everyone({"op": "agent", **self.transfers.agent_fields()})

    @property
    def wake_in(self) -> float:
        """Seconds until the loop must look again: reads under way are polled (Replicas),
        announcements go once ANNOUNCE_EVERY passed; at once if messages wait for a flush
        (made after this loop's: an eviction, say)."""
        links, lending = self.links, self.replicas.lending
        announce = lending.announce_in(time.monotonic())
        unwritten = RECLAIM_POLL if lending.unwritten else BEAT  # (GPU copies still to run)
        due = min(
            self.replicas.pulls.poll_in, self.queues.arrivals.poll_in, BEAT, announce, unwritten
        )
        # (a move of keys: a slice a turn; answers a send found: Links.read; peers found not
        # fresh, the polls' above too: Links.freshen)
        if links.holding or links.unread or links.stale or self.replicas.homes.moving:
            return 0.0
        return due

    # -- the loop ------------------------------------------------------------------------------

    def ready(self, socket: Any) -> None:
        """Read what `socket` (one of `sockets`) has. A fault here is logged: a peer's
        message must never take the broker down."""
        try:
            self._read(socket)
        except Exception:
            log.exception("cluster: a message could not be handled")

    def _read(self, socket: Any) -> None:
        if self.membership is not None and socket == self.membership.fd:
            self._members(self.membership.take())
            return
        if socket == self.transfers.fd:  # (the reads are looked at in `tick`)
            self.transfers.mover.woken()
            self._served()
            return
        for route, peer, message in self.links.read(socket):
            if peer is None:
                self._request(route, message)  # type: ignore[arg-type]
            else:
                self._answer(peer, message)

    def _members(self, changes: list[Member]) -> None:
        """Brokers that joined etcd are linked to (their hello follows); those that left it
        are down now (Note [membership] in membership.py)."""
        for node, record in changes:
            if node == self.node:  # its lease expired: the others let go what they lent or
                for other in self.links.nodes():  # offered it (they say so at their next
                    self.replicas.held.give_back(other)  # beat, and forget it: what it lent
                    self.replicas.pulls.forget(other)  # them stays pinned until then)
                continue
            if record is not None:
                if isinstance(record.get("registration"), int):  # (said in its beat answers)
                    self.links.registrations[node] = record["registration"]
                address = str(record.get("address", ""))
                restarted = self.links.restarted(node, record.get("incarnation"))
                if restarted:  # (its writes went with its old process: Note [pushes])
                    self.transfers.restarted(node)
                for peer in [p for p in self.peers if p.node == node and p.address != address]:
                    if peer.up and restarted:  # (elsewhere: a pod's new IP, say; an idle
                        self._down(peer)  # link there would stay up: Note [beats])
                    if not peer.up:
                        self.links.unlink(peer)
                self.links.meet(address)
                if restarted:
                    self._hello_again(node)  # (an idle link would not hear it: Note [beats])
                continue
            for peer in self.peers:
                if peer.node == node and peer.up:
                    self._down(peer)

    def tick(self, now: float) -> None:
        """Beats (Note [beats] in beats.py) and hellos, peers gone quiet, and reads that
        ended."""
        try:
            links = self.links
            if now >= self._next_tick:
                self._next_tick = now + BEAT
                beat = now >= self._next_beat
                if beat:
                    self._next_beat = now + links.beat
                busy = self._busy() if links.quiet else ()
                for peer in self.peers:
                    if peer.up and links.idle(peer, busy):
                        peer.heard = now  # (its silence says nothing: Note [beats])
                        continue
                    if peer.up and now - peer.heard > links.down_after:
                        self._down(peer)
                    if not peer.up:
                        links.send_to(peer, self._hello(to=peer.node))
                    elif beat:
                        links.beat_to(peer)
                self.queues.beat()
            if links.unread:  # (found by this turn's sends: Links)
                self.ready(self.links.fd)
            self.replicas.pulls.poll(now)
            self.transfers.ask_about(now)  # (Note [pushes] in pushes.py)
            self.replicas.homes.tick(now)
            self.queues.arrivals.poll()
            links.freshen()  # (last: the polls above may find a peer not fresh)
        except Exception:
            self.links.stale.clear()  # (else the loop would turn at once for good: wake_in)
            log.exception("cluster: the beat or a pull failed")

    def _busy(self) -> set[str]:
        """The nodes this one reads from or holds offers of: their links are in use, idle or
        not (Note [beats] in beats.py); and those asked to lend for a pull that ended
        without a loan, until a beat sent after that is answered (its `pulls` unpin a loan
        whose `lent` was lost: Lending.open_pulls)."""
        pulls = self.replicas.pulls
        busy = {p.source for p in pulls.pulls.values()}
        busy.update(p.node for p in pulls.pulls.values())
        busy.update(o.node for o in self.replicas.held.offers.values())
        busy.update(self.queues.arrivals.lenders())
        for node, ended in list(pulls.ended.items()):
            peer = self.links.peer(node)
            if peer is None or not peer.up or (peer.answered and peer.beat_t > ended):
                del pulls.ended[node]
            else:
                busy.add(node)
        return busy

    def flush(self) -> None:
        """Send what the loop's batch left for after its replies (announcements, loans and
        offers given back): off the path of the replies."""
        try:
            self.replicas.flush()
            self.links.flush()
        except Exception:
            log.exception("cluster: the announcements could not be sent")

    def _hello(self, op: str = "hello", to: str | None = None) -> dict[str, Any]:
        """This broker, its address, its agent, and the keys it holds homed at `to`;
        its incarnation, and how often it forgot node `to` (the node forgets it as often)."""
        keys, links = ([] if to is None else self.replicas.own(to)), self.links
        forgot = 0 if to is None else links.forgot.get(to, 0)
        taken = [] if to is None else self.queues.arrivals.taken(to)
        return {
            "op": op, "node": self.node, "address": self.address, "keys": keys, "qtaken": taken,
            **({} if to is None else links.ack(to)),  # (QueueLinks.hello)
            "protocol": PROTOCOL,
            "incarnation": links.incarnation, "forgot": forgot, **self.transfers.agent_fields(),
        }  # fmt: skip

    def _forget_node(
        self, node: str, mutual: bool = False, welcomed: Peer | None = None, hold: bool = False
    ) -> None:
        """Unpin what `node` was lent or offered (it will not return it), drop what it
        offered, and forget its routes. Unless `mutual` (it forgot this one first), it is
        told, and forgets this one too. This broker's links to it that are up (but
        `welcomed`, whose hello was just answered) say hello again: the node forgot their
        routes, or will. `hold`: a relink (QueueLinks.let_go)."""
        self.links.forget_routes(node)
        self.links.relinking.discard(node)
        self.replicas.let_go(node)
        self.queues.let_go(node, hold)
        if not mutual:
            self.links.forgetting(node)
        self._hello_again(node, welcomed)

    def _hello_again(self, node: str, welcomed: Peer | None = None) -> None:
        """Say hello again on the links to `node` that are up (but `welcomed`): its welcome
        says again what each told the other (wants, follows, keys). An idle link would hear
        `hello_first` only at its next request (Note [beats] in beats.py)."""
        for peer in self.peers:
            if peer.node == node and peer.up and peer is not welcomed:
                self.links.send_to(peer, self._hello(to=node))

    def _down(self, peer: Peer, relink: bool = False) -> None:
        """A link whose peer stopped answering (or, `relink`, lost requests of this one's:
        Note [beats]): its node is down once no link to it is up."""
        peer.up = False
        log.warning("cluster: node %r at %s is down", peer.node, peer.address)
        if peer.node is not None and not self.links.up(peer.node):
            self.replicas.changed()  # (keys' homes move: Note [homes])
            self.replicas.node_down(peer.node)
            self.queues.node_down(peer.node, relink)
            self._forget_node(peer.node, hold=relink)

    # -- seeing it -----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        now, index, r = time.monotonic(), self.replicas.index, self.replicas
        peers = {
            (p.node or p.address): {
                "address": p.address,
                "state": "up" if p.up else "down",
                "heard_s_ago": round(now - p.heard, 3) if p.heard else None,
                "fresh": p.node is not None and self.links.fresh(p.node, freshen=False),
                "keys": sum(1 for k in index.values() if k.node == p.node),
            }  # fmt: skip
            for p in self.peers
        }
        return {
            "node": self.node, "address": self.address, "peers": peers,
            "bytes_sent": r.lending.bytes_sent + self.queues.bytes_sent,
            "bytes_received": r.pulls.bytes_received + self.queues.arrivals.bytes_received,
            "pulls": len(r.pulls.pulls), "loans": len(r.lending.loans),
            "items_lent": len(self.queues.loans),
            "offered": len(r.lending.offered), "offers_held": len(r.held),
            "pulled": dict(r.pulls.done), "prefetched": r.prefetched,
            "lent_early": r.lending.lent_early, "followers": len(r.lending.followers),
            "lookers": len(r.homes.lookers), "lookups": r.homes.asked_count,
            "puts_lost": r.puts_lost, "bytes_pushed": self.transfers.bytes_pushed,
            "blocks_held": self.transfers.blocks_held,
        }  # fmt: skip

    def close(self) -> None:
        if self.membership is not None:  # (first: the others see this node leave now)
            self.membership.close()
        ended = self.transfers.close()  # (its writes under way end before a new process links)
        served = self._served()  # (their readers hold their blocks until told)
        told = ended and self._stopped()  # (and none is written after)
        self.links.close(CLOSE_LINGER_MS if served or told else 0)
