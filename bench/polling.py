"""A broker's loop turn as the cluster grows: the CPU of one turn that reads one answer from
one of N peers. Before, ZeroMQ's poll looked at the ROUTER and each peer's DEALER; now at the
ROUTER and one epoll descriptor for all the DEALERs (server/cluster/dealers.py). Every message
from a peer is a turn, and each node hears about N a second from beats alone, so a turn that
grows with N makes each node's CPU grow with N squared (bench/simulate.py takes these).

Written to bench/results/polling.md. Usage: python bench/polling.py [--peers 16,256,1000]
[--turns 2000]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import zmq

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from harness.report import emit  # noqa: E402

from tensorbroker.server.cluster.dealers import Dealers, readable  # noqa: E402


def turn_us(peers: int, turns: int, epoll: bool) -> float:
    """Median thread CPU, in us, of a poll that finds one answer and its read."""
    ctx = zmq.Context()
    ctx.max_sockets = 2 * peers + 64
    try:
        server = ctx.socket(zmq.ROUTER)  # (the peers' ROUTERs: one stands for all)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        router = ctx.socket(zmq.ROUTER)  # (this broker's: quiet)
        router.bind_to_random_port("tcp://127.0.0.1")
        dealers = Dealers(ctx, None)
        links = [dealers.link(f"tcp://127.0.0.1:{port}") for _ in range(peers)]
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        for item in [dealers.fd] if epoll else [p.socket for p in links]:
            poller.register(item, zmq.POLLIN)
        routes: list[bytes] = []  # (each says hello, once connected: its route at the peer)
        waiting, deadline = list(links), time.monotonic() + 60
        while len(routes) < peers and time.monotonic() < deadline:
            waiting = [peer for peer in waiting if not dealers.send(peer, b"hello")]
            while server.poll(10):
                routes.append(server.recv_multipart()[0])
        time.sleep(0.5)  # (the connections settle: what they signalled is read)
        list(dealers.read())
        took = []
        for _ in range(turns):
            server.send_multipart([random.choice(routes), b"answer"])
            time.sleep(0.0002)  # (it arrives: the turn measured does not wait)
            began, got = time.thread_time(), 0
            while not got:  # (an epoll may wake for a signal that is no message)
                events = poller.poll(1000)
                if epoll:
                    got = sum(1 for _ in dealers.read())
                else:
                    got = sum(_drain(s) for s, _ in events)
            took.append(time.thread_time() - began)
        return statistics.median(took) * 1e6
    finally:
        ctx.destroy(linger=0)


def _drain(socket: zmq.Socket[bytes]) -> int:
    n = 0
    while readable(socket):
        socket.recv_multipart()
        n += 1
    return n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", default="16,256,1000")
    parser.add_argument("--turns", type=int, default=2000)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "polling.md"))
    args = parser.parse_args()
    rows = []
    for n in (int(x) for x in args.peers.split(",")):
        print(f"polling bench: {n} peers ...", flush=True)
        every, one = turn_us(n, args.turns, False), turn_us(n, args.turns, True)
        rows.append(f"| {n} | {every:.1f} us | {one:.1f} us | {every / one:.1f}x |")
    stamp = time.strftime("%Y-%m-%d %H:%M")
    lines = [
        f"# A loop turn as the cluster grows ({stamp}, bench/polling.py, {os.cpu_count()} "
        "cores)", "",
        f"Thread CPU of a turn that polls and reads one answer from one of N peers (median of "
        f"{args.turns}): ZeroMQ's poll of the ROUTER and every peer's DEALER (before), and of "
        "the ROUTER and one epoll descriptor for the DEALERs (now).", "",
        "| peers | a DEALER a peer polled | one epoll for all | ratio |",
        "|---|---|---|---|", *rows, "",
    ]  # fmt: skip
    emit(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
