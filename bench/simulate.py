"""Where the cluster's control plane stops scaling: a model of each node's CPU, from per-message
costs measured on the 2-core VM, at N = 10, 100 and 1,000 nodes. No brokers run.

Measured (bench/results/scaling.md, 2026-12-02; the idle figures by thread, /proc):
    ANNOUNCE_US   CPU a node spends on one announcement of another node's put: the other
                  brokers' CPU per put over N - 1 (333/3, 867/7 and 1767/15 us: about 115)
    SEND_US       the putting broker's extra CPU per peer told (the put's median grew from
                  276 to 585 us between a lone broker and 16: about 20 us a peer)
    BEAT_US       the loop's idle CPU per peer a second (beats both ways): 0.2% of a core
                  with 3 peers, 0.6% with 15: about 350 us a second a peer
    PROGRESS_PCT  NIXL's progress thread, whatever N: about 2% of a core
    LONE_PUT_US   a put on a lone broker (185-276 us in those runs)

The workload: each node puts P versions a second to keys no other node reads. Today every
put is announced to every node (Note [cluster]); with a directory (the next step, issue 50)
a put tells its key's home node only, and beats give way to etcd's lease: both modelled.
Usage: python bench/simulate.py [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

from harness.report import emit  # noqa: E402

ANNOUNCE_US = 115.0
SEND_US = 20.0
BEAT_US = 350.0
PROGRESS_PCT = 2.0
LONE_PUT_US = 230.0
NODES = (10, 100, 1000)
PUTS = (10, 100, 1000)


def today(n: int, puts: float) -> float:
    """A node's CPU, in % of a core: its own puts, announcing each to N - 1 peers, the N - 1
    peers' puts announced to it, beats with each peer, NIXL's progress thread."""
    own = puts * (LONE_PUT_US + SEND_US * (n - 1))
    heard = (n - 1) * puts * ANNOUNCE_US
    return (own + heard + BEAT_US * (n - 1)) / 1e4 + PROGRESS_PCT


def directory(n: int, puts: float) -> float:
    """The same with a home node per key: a put tells one node (this one is home to 1/N of
    all keys: it hears as many announcements as it makes, on average), no beats."""
    own = puts * (LONE_PUT_US + SEND_US)
    heard = puts * ANNOUNCE_US
    return (own + heard) / 1e4 + PROGRESS_PCT


def limit(puts: float) -> int:
    """The number of nodes at which today's design takes a whole core of each."""
    n = 2
    while today(n, puts) < 100.0:
        n += 1
    return n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(HERE, "results", "simulate.md"))
    args = parser.parse_args()
    head = "| puts a second a node | " + " | ".join(f"N = {n}" for n in NODES) + " |"
    rule = "|---|" + "---|" * len(NODES)
    lines = [
        "# Each node's CPU as the cluster grows (bench/simulate.py: a model from measured costs)",
        "", "In % of one core; over 100% the node cannot keep up.", "",
        "## Today: every put announced to every node, beats between every pair", "", head, rule,
        *(f"| {p} | " + " | ".join(f"{today(n, p):.0f}%" for n in NODES) + " |" for p in PUTS),
        "", f"Today's design saturates a node at about {limit(10)} nodes with 10 puts a second "
        f"a node, {limit(100)} with 100 and {limit(1000)} with 1,000.",
        "", "## With a directory: a put tells its key's home node, membership by etcd's lease",
        "", head, rule,
        *(f"| {p} | " + " | ".join(f"{directory(n, p):.0f}%" for n in NODES) + " |"
          for p in PUTS),
        "", "Not modelled: the announcements a home forwards to the nodes that asked (watchers,",
        "replica holders: one each), keys put unevenly (a hot home), etcd's own CPU (about",
        "0.5 ms a lease renewal: 1,000 nodes renewing every second take half a core there),",
        "and the network.", "",
    ]  # fmt: skip
    emit(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
