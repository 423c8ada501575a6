"""Where the cluster's control plane stops scaling: a model of each node's CPU, from per-message
costs measured on the 2-core VM, at N = 10, 100 and 1,000 nodes. No brokers run.

Measured (bench/results/scaling.md, 2026-12-02 05:03 and 07:10, 4 KiB puts; idle by /proc):
    CLAIM_US      CPU a node spends hearing of a key new on another node (its claim, with
                  its offer): the other brokers' CPU per put of a new key over N - 1 when
                  every node heard it (115/3, 639/7 and 2474/15 us: 38 to 165); over its two
                  homes with Note [homes] (334/2 at 16 brokers: 167). 165 taken; a
                  lookup (a node asks a key's home) is taken to cost the home as much
    FOLLOW_US     CPU a follower spends on a new version of a key it follows (an
                  announcement, then its read: 115 us before Note [follows], when every node
                  heard every put)
    SEND_US       the putting broker's extra CPU per peer told (the put's median grew from
                  276 to 585 us between a lone broker and 16 when every put went to all:
                  about 20 us a peer)
    BEAT_US       idle CPU per peer a second (beats every 2 s with etcd): 0.35% of a core
                  at 4 brokers, 0.44% at 16: about 75 us a second a peer beaten. Since
                  Note [beats] (server/cluster/beats.py) only the links in use are beaten:
                  a node's followed owners and followers, and each peer it sent a request
                  in the last beat (a claim to a home, a lookup) until a beat confirms it
    PROGRESS_PCT  the rest of idle (NIXL's progress thread, the loop): about 0.33%
    LONE_PUT_US   a put on a lone broker (182 us in that run)
    POLL_PEER_US  what each peer added to a loop turn when ZeroMQ polled every peer's DEALER
                  (bench/results/polling.md, 2026-12-02 09:41: 37 us a turn at 16 peers,
                  797 at 1,000): 0.77 us. Every message heard is a turn, and beats alone are
                  N - 1 messages a second (a beat and an answer each 2 s with each peer), so
                  that grew as N squared; with one epoll for the DEALERs (dealers.py) a turn
                  costs 35-37 us whatever N, as the per-message costs above, measured at 16
                  brokers, already count

The workload: each node puts P versions a second; a fraction `new` of them are of keys new
on that node (the rest new versions of keys it put before), and each key has F followers on
other nodes (Note [follows]: readers, watchers). Modelled: before Note [follows] (every put
told to every node, beats every 0.5 s: the costs measured then), with Note [follows] only
(a key's claim told to every node), and now (Note [homes]: a key's claim told to its
two homes, each follower's first get asking one of them; only the links in use beaten).
Usage: python bench/simulate.py
[--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

from harness.report import emit  # noqa: E402

CLAIM_US = 165.0
FOLLOW_US = 115.0
SEND_US = 20.0
BEAT_US = 75.0
PROGRESS_PCT = 0.33
LONE_PUT_US = 182.0
POLL_PEER_US = 0.77
BEATS_A_SECOND = 1.0  # messages a second a peer: a beat and an answer, each every 2 s
HOMES = 2  # the nodes a key's claim goes to (server/cluster/homes.py)
BEAT_EVERY = 2.0  # seconds between beats with etcd (server/cluster/beats.py)
BEFORE_BEAT_US, BEFORE_PROGRESS_PCT = 350.0, 2.0  # (measured 2026-12-01/02, before)
NODES = (10, 100, 1000)
PUTS = (10, 100, 1000)


def before(n: int, puts: float) -> float:
    """A node's CPU, in % of a core, when every put was told to every node."""
    own = puts * (LONE_PUT_US + SEND_US * (n - 1))
    heard = (n - 1) * puts * FOLLOW_US
    polls = _polls(n, (n - 1) * puts, 4.0)  # (beats every 0.5 s)
    return (own + heard + polls + BEFORE_BEAT_US * (n - 1)) / 1e4 + BEFORE_PROGRESS_PCT


def _polls(n: int, heard: float, beats: float = BEATS_A_SECOND) -> float:
    """The CPU (us a second) that ZeroMQ's poll of every peer's DEALER added to the turns
    of `heard` messages a second and the beats, past the 15 peers the costs were measured
    with (bench/polling.py)."""
    return (heard + beats * (n - 1)) * POLL_PEER_US * max(0, n - 16)


def follows(n: int, puts: float, new: float, followers: int = 1) -> float:
    """Note [follows] alone: a new key's claim goes to every node, a new version of a key to
    its `followers`; this node hears the claims of the N - 1 others and, on average, as many
    followed versions as it sends."""
    told = new * (n - 1) + (1 - new) * followers
    own = puts * (LONE_PUT_US + SEND_US * told)
    heard = puts * (new * (n - 1) * CLAIM_US + (1 - new) * followers * FOLLOW_US)
    polls = _polls(n, puts * told)
    return (own + heard + polls + BEAT_US * (n - 1)) / 1e4 + PROGRESS_PCT


def now(
    n: int, puts: float, new: float, followers: int = 1, epoll: bool = True, quiet: bool = True
) -> float:
    """Now (Note [homes]): a new key's claim goes to its two homes, and each follower's
    first get of it asks one of them; a new version of a key to its `followers`. A node
    hears, on average, as many claims, lookups and followed versions as it makes. `epoll`:
    the peers' DEALERs polled through one epoll (dealers.py), else each by ZeroMQ's poll.
    `quiet`: only the links in use are beaten (Note [beats]), else every pair."""
    homes = min(HOMES, n - 1)
    told = new * (homes + followers) + (1 - new) * followers
    own = puts * (LONE_PUT_US + SEND_US * told)
    heard = puts * (new * (homes + followers) * CLAIM_US + (1 - new) * followers * FOLLOW_US)
    polls = 0.0 if epoll else _polls(n, puts * told)
    beaten = _in_use(n, puts * new * (homes + followers), followers) if quiet else n - 1
    return (own + heard + polls + BEAT_US * beaten) / 1e4 + PROGRESS_PCT


def _in_use(n: int, asks: float, followers: int) -> float:
    """The peers a node beats (Note [beats]): those it follows or that follow it (the same
    `followers` each put), and the distinct ones among the peers its `asks` a second went to
    in a beat's time, each to a peer drawn at random (a key's home)."""
    others = n - 1
    distinct = others * (1 - (1 - 1 / others) ** (asks * BEAT_EVERY))
    return min(others, followers + distinct)


def limit(cpu: object, puts: float) -> int:
    """The number of nodes at which `cpu(n, puts)` takes a whole core of each (or 100,000)."""
    n = 2
    while cpu(n, puts) < 100.0 and n < 100_000:  # type: ignore[operator]
        n += 1 if n < 1000 else 100
    return n


def table(title: str, cpu: object) -> list[str]:
    head = "| puts a second a node | " + " | ".join(f"N = {n}" for n in NODES) + " |"
    rule = "|---|" + "---|" * len(NODES)
    rows = [
        f"| {p} | " + " | ".join(f"{cpu(n, p):.0f}%" for n in NODES) + " |"  # type: ignore[operator]
        for p in PUTS
    ]
    saturates = ", ".join(
        f"{'over 100,000' if n >= 100_000 else f'about {n:,}'} nodes with {p}"
        for p in PUTS for n in [limit(cpu, p)]
    )  # fmt: skip
    return [f"## {title}", "", head, rule, *rows, "",
            f"A node is saturated at {saturates} puts a second a node.", ""]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(HERE, "results", "simulate.md"))
    args = parser.parse_args()
    lines = [
        "# Each node's CPU as the cluster grows (bench/simulate.py: a model from measured costs)",
        "", "In % of one core; over 100% the node cannot keep up. Each key has one follower "
        "on another node (a reader).", "",
        *table("Before Note [follows]: every put told to every node, beats every 0.5 s", before),
        *table("Note [follows] alone (claims to every node), every put of a new key (a key "
               "per step)", lambda n, p: follows(n, p, 1.0)),
        *table("Now, puts of keys put before (new versions: weight sync, a parameter "
               "server)", lambda n, p: now(n, p, 0.0)),
        *table("Now, one put in ten of a new key", lambda n, p: now(n, p, 0.1)),
        *table("Now, every put of a new key (a key per step): its claim to its two homes, "
               "its reader's lookup", lambda n, p: now(n, p, 1.0)),
        *table("The same, every pair of nodes beaten (before Note [beats]: only the links "
               "in use)", lambda n, p: now(n, p, 1.0, quiet=False)),
        *table("The same with a DEALER a peer in ZeroMQ's poll (before one epoll for them: "
               "bench/polling.py), every pair beaten",
               lambda n, p: now(n, p, 1.0, epoll=False, quiet=False)),
        "Not modelled: keys put unevenly (a hot home, or a key with many followers), "
        "watch_prefix and --prefetch (each node that asks for them hears their puts), "
        "queues across nodes (a change in a queue's consumers is told to the nodes with a "
        "part of it), "
        "etcd's own CPU (about 0.5 ms a lease renewal: 1,000 nodes renewing every second "
        "take half a core there), every join and leave heard by every node, a connection "
        "from each broker to every other, the broker's look at every peer each 0.5 s "
        "(whether to beat it), and the network.", "",
    ]  # fmt: skip
    emit(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
