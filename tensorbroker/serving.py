"""`tensorbroker serve`: its options (`add_arguments`) and the broker they make (`run`)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import threading
from typing import TYPE_CHECKING

from .common.config import (
    SHM_DIR,
    check_address,
    default_address,
    default_capacity,
    format_size,
    parse_cuda_memory,
    parse_size,
    shm_bytes_available,
)
from .common.errors import BrokerError

if TYPE_CHECKING:
    from .server.broker import Broker

log = logging.getLogger("tensorbroker")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `serve`."""
    p.add_argument(
        "--memory",
        help="shared-memory capacity, e.g. 8GiB (default: 30%% of RAM, at most 90%% of /dev/shm)",
    )
    p.add_argument(
        "--cuda-memory",
        help="GPU memory to serve, e.g. 0:8GiB,1:8GiB; 'off' for none (default: every GPU "
        "CuPy finds, half of its free memory)",
    )
    p.add_argument(
        "--cuda-handles",
        choices=["legacy", "vmm"],
        default="legacy",
        help="how clients open the GPU memory: legacy IPC handles, or vmm: file descriptors "
        "passed to each client over its Unix socket (not yet run on a GPU; see docs/guide/gpu.md)",
    )
    p.add_argument(
        "--state-dir",
        help="where the broker keeps what a restarted broker needs to adopt its objects. "
        "Given: a clean stop (SIGTERM) keeps the objects for the next broker. Default: next "
        "to the socket, and a clean stop removes everything (a crash still leaves it to adopt)",
    )
    p.add_argument(
        "--reset",
        action="store_true",
        help="start empty: remove the state (and the objects) a previous broker left",
    )
    p.add_argument(
        "--curve-secret",
        metavar="FILE",
        help="on tcp://, encrypt and authenticate with this secret key (`tensorbroker keys`)",
    )
    p.add_argument(
        "--curve-clients",
        metavar="DIR",
        help="with --curve-secret, let in only the clients whose public keys are in DIR",
    )
    p.add_argument(
        "--insecure-tcp",
        action="store_true",
        help="serve tcp:// without keys, on a loopback address only (anyone on this host can "
        "read and delete every tensor)",
    )
    p.add_argument(
        "--evict",
        choices=["none", "lru"],
        default="none",
        help="lru: when memory is full, free the least recently used objects no one holds "
        "(default none: only those put with evictable=True)",
    )
    p.add_argument(
        "--group",
        metavar="NAME",
        help="let the members of this group connect and map the memory too (the socket's "
        "folder, the sockets and the segments become group-accessible)",
    )
    p.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics, e.g. 127.0.0.1:9464 "
        "(needs pip install 'tensorbroker[metrics]')",
    )
    p.add_argument("--node", metavar="NAME", help="this node's name in a cluster")
    p.add_argument(
        "--cluster", metavar="tcp://HOST:PORT", help="where the other brokers of a cluster reach "
        "this one; every broker serves the same --curve-secret (or --insecure-tcp on loopback)",
    )  # fmt: skip
    p.add_argument(
        "--etcd", metavar="URLS", help="the etcd where the brokers of a cluster find each other: "
        "http://HOST:2379 (https:// for one served with TLS), comma-separated for several "
        "members (no --peers needed)",
    )  # fmt: skip
    p.add_argument(
        "--etcd-cacert", metavar="FILE", help="with --etcd https://...: the CA certificates "
        "(PEM) that etcd's certificate is checked against (default: the system's)",
    )  # fmt: skip
    p.add_argument(
        "--etcd-cert", metavar="FILE", help="with --etcd https://...: the certificate (PEM) this "
        "broker shows an etcd served with --client-cert-auth; with --etcd-key",
    )  # fmt: skip
    p.add_argument(
        "--etcd-key", metavar="FILE", help="the private key (PEM) of --etcd-cert",
    )  # fmt: skip
    p.add_argument(
        "--etcd-prefix", metavar="PATH", default="/tensorbroker", help="this cluster's keys in "
        "etcd, so several clusters share one (default: /tensorbroker)",
    )  # fmt: skip
    p.add_argument(
        "--peers", metavar="ADDRS", default="", help="without etcd: the other brokers' --cluster "
        "addresses, comma-separated; dns:NAME:PORT stands for every address of NAME",
    )  # fmt: skip
    p.add_argument(
        "--prefetch", metavar="SIZE", help="read the other nodes' versions of at most SIZE (at "
        "most 64KiB) as they are announced, so that a first get here is local; it costs every "
        "small put a read by this node (default 0: read at the first get)",
    )  # fmt: skip
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    p.add_argument("--parent-fd", type=int, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    """`tensorbroker serve`: a broker on the options given, until SIGTERM or SIGINT."""
    from .common import cudart
    from .server.broker import Broker
    from .server.cluster.joining import Joining
    from .server.store.devices import DeviceMemory

    address = check_address(args.address or default_address())
    metrics = None
    if args.metrics is not None:
        try:  # before anything is made: nothing to undo
            from .server.metrics import listen_address

            metrics = listen_address(args.metrics)
        except BrokerError as exc:  # MetricsUnavailable (no prometheus_client), or not HOST:PORT
            print(f"tensorbroker: {exc}", file=sys.stderr)
            return 2
    devices = DeviceMemory(
        load=cudart.load, spec=parse_cuda_memory(args.cuda_memory), handles=args.cuda_handles
    )
    capacity = parse_size(args.memory) if args.memory else default_capacity(SHM_DIR)
    try:
        cluster = Joining.parse(
            args.node, args.cluster, args.peers, args.insecure_tcp, args.curve_secret,
            args.curve_clients, args.prefetch, args.etcd, args.etcd_prefix,
            (args.etcd_cacert, args.etcd_cert, args.etcd_key),
        )  # fmt: skip
        tcp = cluster is None or address.startswith("tcp://")  # the keys: clients' too?
        insecure = args.insecure_tcp and tcp
        broker = Broker(
            address, capacity, devices=devices, state_dir=args.state_dir,
            keep_state=args.state_dir is not None, reset=args.reset,
            curve_secret=args.curve_secret if tcp else None,
            curve_clients=args.curve_clients if tcp else None,
            insecure_tcp=insecure, group=args.group, evict=args.evict, cluster=cluster,
        )  # fmt: skip
    except BrokerError as exc:
        print(f"tensorbroker: {exc}", file=sys.stderr)
        return 2
    adopted = broker.state.recovered is not None  # a failed start must not lose its objects
    available = shm_bytes_available(SHM_DIR) + broker.arena.reserved_bytes
    if capacity > available:
        broker.close(keep=adopted or None)
        print(
            f"tensorbroker: --memory {format_size(capacity)} does not fit in {SHM_DIR}, which has "
            f"{format_size(available)} free. Lower --memory, or enlarge {SHM_DIR}: "
            "`docker run --shm-size=16g`, in Kubernetes mount an emptyDir "
            "{medium: Memory, sizeLimit: 16Gi} at /dev/shm, on a host "
            "`mount -o remount,size=16G /dev/shm`.",
            file=sys.stderr,
        )
        return 2
    try:
        broker.bind()
        if metrics is not None:
            broker.export_metrics(*metrics)
    except BrokerError as exc:
        broker.close(keep=adopted or None)
        print(f"tensorbroker: {exc}", file=sys.stderr)
        return 1

    def ready() -> None:
        if args.ready_fd is not None:
            os.write(args.ready_fd, b"ready\n")
            os.close(args.ready_fd)

    if args.parent_fd is not None:  # started by tb.start_broker: ends with its process
        threading.Thread(
            target=_stop_with_parent, args=(broker, args.parent_fd), name="parent", daemon=True
        ).start()
    broker.serve(ready)
    if broker.keep_state:
        log.info("stopped; the objects stay in %s for the next broker", broker.state.path)
    else:
        log.info("stopped; shared memory released")
    return 0


def _stop_with_parent(broker: Broker, fd: int) -> None:
    """Stop the broker (as SIGTERM does) once the process that started it has exited,
    however it exited: the other end of pipe `fd`, which only that process holds, closes."""
    with contextlib.suppress(OSError):
        while os.read(fd, 64):
            pass
    log.warning("the process that started this broker exited: stopping")
    broker.stop()
