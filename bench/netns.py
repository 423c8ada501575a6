"""Machines emulated on this host, for the cluster benches' --link option: each node in a
network namespace of its own, reached through a veth pair from one bridge (the host, at
HOST), both ends rate-limited (tc tbf): a node's upload and its download are each at most
the rate given, as through a NIC of that speed. Only the network is apart: the processes
share this host's CPUs, memory and /dev/shm (so a client reaches its broker through an ipc://
socket as before). Needs root and iproute2 (ip, tc).

    with machines(["a", "b"], "4gbit") as ips:   # {"a": "10.77.0.1", "b": "10.77.0.2"}
        proc = subprocess.Popen(argv, preexec_fn=functools.partial(enter, "a"))
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from typing import IO, Any

SUBNET = "10.77.0"
HOST = f"{SUBNET}.254"  # the bridge's address: what runs in this namespace (etcd)
BRIDGE = "tbbr0"
DEVICE = "eth0"  # each node's end, in its namespace (UCX_NET_DEVICES, GLOO_SOCKET_IFNAME)
CLONE_NEWNET = 0x40000000


def available() -> bool:
    """Whether this process may make namespaces and links (root, with ip and tc)."""
    return os.geteuid() == 0 and all(shutil.which(tool) for tool in ("ip", "tc"))


def namespace(node: str) -> str:
    return f"tb-{node}"


def _run(*argv: str, ns: str | None = None) -> None:
    full = list(argv) if ns is None else ["ip", "netns", "exec", ns, *argv]
    done = subprocess.run(full, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(full)}: {done.stderr.strip()} (root and iproute2 needed)")


def _ip(*args: str, ns: str | None = None) -> None:
    _run("ip", *args, ns=ns)


def _limit(device: str, rate: str, ns: str | None = None) -> None:
    """At most `rate` out of `device` (burst: a few of veth's 64 KiB packets; the queue holds
    50 ms at the rate)."""
    _run("tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", rate, "burst", "4mb",
         "latency", "50ms", ns=ns)  # fmt: skip


@contextlib.contextmanager
def machines(nodes: Sequence[str], rate: str) -> Iterator[dict[str, str]]:
    """A namespace per node in `nodes`, each linked at `rate` (tc's units: 4gbit, 500mbit)
    each way; yields node -> its address. Everything made is removed at the end."""
    made: list[str] = []
    try:
        _ip("link", "add", BRIDGE, "type", "bridge")
        made.append(BRIDGE)
        _ip("addr", "add", f"{HOST}/24", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        ips = {}
        for i, node in enumerate(nodes):
            ns, outer = namespace(node), f"tbv{i}"
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", f"tbn{i}")
            made.append(outer)
            _ip("link", "set", f"tbn{i}", "netns", ns)
            _ip("link", "set", f"tbn{i}", "name", DEVICE, ns=ns)
            ips[node] = f"{SUBNET}.{i + 1}"
            _ip("addr", "add", f"{ips[node]}/24", "dev", DEVICE, ns=ns)
            _ip("link", "set", DEVICE, "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
            _ip("link", "set", outer, "master", BRIDGE)
            _ip("link", "set", outer, "up")
            _limit(outer, rate)  # its download
            _limit(DEVICE, rate, ns)  # its upload
        yield ips
    finally:
        for thing in reversed(made):  # (a veth's end here takes the other with it, now)
            argv = ["netns", "del", thing] if thing.startswith("tb-") else ["link", "del", thing]
            subprocess.run(["ip", *argv], capture_output=True)


def enter(node: str) -> None:
    """Move this process (its calling thread: call it before any other starts) into `node`'s
    namespace: a subprocess's preexec_fn, or the first call of a multiprocessing target."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{namespace(node)}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace(node)} failed")
    finally:
        os.close(fd)


@contextlib.contextmanager
def spawning_in(node: str | None) -> Iterator[None]:
    """Brokers started meanwhile (tb.start_broker) run in `node`'s namespace (None: here)."""
    from tensorbroker.launcher import BrokerProcess

    if node is None:
        yield
        return
    base = BrokerProcess.spawn

    def spawn(argv: list[str], pass_fds: tuple[int, ...], log: IO[bytes]) -> Any:
        return subprocess.Popen(
            argv, pass_fds=pass_fds, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, preexec_fn=functools.partial(enter, node),
        )  # fmt: skip

    BrokerProcess.spawn = spawn  # type: ignore[assignment]
    try:
        yield
    finally:
        BrokerProcess.spawn = base  # type: ignore[method-assign]
