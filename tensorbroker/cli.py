"""The `tensorbroker` command: `serve` (serving.py), admin commands against a running broker,
and `gc` for the shared memory of brokers no longer running."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence

from . import __version__, serving
from .common.config import SHM_DIR, format_size
from .common.errors import BrokerError, NotFound

log = logging.getLogger("tensorbroker")


def _gc(args: argparse.Namespace) -> int:
    """Remove the shared memory of the brokers not running (server/durability/leftovers.py
    says how it tells); print each state removed with its segments, then those kept and why."""
    from .server.durability.leftovers import REMOVED, RUNNING, STARTING, STOPPED, collect, state_id

    only = {state_id(text) for text in args.states} or None
    found = collect(SHM_DIR, only=only, dry_run=args.dry_run)
    removed = [f for f in found if f.status == REMOVED]
    verb = "would remove" if args.dry_run else "removed"
    for f in removed:
        where = f"state dir {f.state_dir}" if f.state_dir else "its state dir unknown"
        print(f"{verb} state {f.state_id} ({where}): no broker runs on it")
        for name, size in f.segments:
            print(f"  {os.path.join(SHM_DIR, name)}  {format_size(size)}")
    for f in found:
        if f.status == REMOVED:
            continue
        count = f"{len(f.segments)} segment{'' if len(f.segments) == 1 else 's'}"
        what = f"kept state {f.state_id} ({count}, {format_size(f.nbytes)})"
        if f.status in (RUNNING, STARTING):
            doing = "running" if f.status == RUNNING else "starting"
            print(f"{what}: a broker is {doing} on it (state dir {f.state_dir})")
        elif f.status == STOPPED:
            print(
                f"{what}: a broker stopped and kept it for the next one on {f.state_dir}; "
                f"`tensorbroker gc {f.state_id}` removes it (its objects are lost)"
            )
        else:
            print(
                f"{what}: it has no owner file (left by an older tensorbroker, or removed by "
                "hand), so gc cannot tell whether a broker uses it. Once sure that none does: "
                f"rm {os.path.join(SHM_DIR, f'tb-{f.state_id}-')}*"
            )
    total = sum(f.nbytes for f in removed)
    segments = sum(len(f.segments) for f in removed)
    if removed:
        print(
            f"{'would free' if args.dry_run else 'freed'} {format_size(total)}: {segments} "
            f"segment{'' if segments == 1 else 's'} of {len(removed)} stopped "
            f"broker{'' if len(removed) == 1 else 's'}"
        )
    else:
        print(f"nothing to remove in {SHM_DIR}")
    missing = sorted((only or set()) - {f.state_id for f in found})
    for sid in missing:
        print(f"tensorbroker: no state {sid} in {SHM_DIR}", file=sys.stderr)
    return 1 if missing else 0


def _keys(args: argparse.Namespace) -> int:
    from .common.curve import make_keys

    public, secret = make_keys(args.out, args.name)
    print(f"public key: {public}   (give it to the clients: $TENSORBROKER_SERVER_KEY)")
    print(f"secret key: {secret}   (keep it private: serve --curve-secret {secret})")
    return 0


def _client(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from .client.client import connect

    return connect(args.address, timeout=args.timeout, server_key=args.server_key)


def _ping(args: argparse.Namespace) -> int:
    with _client(args) as c:
        info = c.ping()
    print(f"broker pid {info['pid']} serves {info['address']} (protocol {info['protocol']})")
    return 0


def _stat(args: argparse.Namespace) -> int:
    with _client(args) as c:
        stats = c.stats()
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    devices = stats.pop("devices", {})
    cuda = stats.pop("cuda", "")
    for name, value in stats.items():
        shown = format_size(value) if name.endswith("_bytes") else value
        print(f"{name:20} {shown}")
    for device, counters in devices.items():
        for name, value in counters.items():
            shown = format_size(value) if name.endswith("_bytes") else value
            print(f"{device + ' ' + name:20} {shown}")
    if cuda:
        print(f"{'cuda':20} off: {cuda}")
    return 0


def _ls(args: argparse.Namespace) -> int:
    """Objects (a row each, printed page by page as they come), then queues."""
    with _client(args) as c:
        objects = c.list_objects(args.prefix)
        if args.json:
            print(json.dumps({"objects": list(objects), "queues": c.list_queues()}, indent=2))
            return 0
        node = " NODE" if "cluster" in c.stats() else ""  # where each lives, in a cluster
        print(
            f"{'KEY':32} {'VERSION':>7} {'SIZE':>10} {'DTYPE':10} {'SHAPE':16} {'DEVICE':7} "
            f"LEASES{node}"
        )
        count = 0
        for o in objects:
            dtypes = ",".join(dict.fromkeys(t[1] for t in o["tensors"]))
            shapes = ",".join("x".join(map(str, t[2])) or "()" for t in o["tensors"])
            if o["bundle"]:
                shapes = f"{len(o['tensors'])} tensors: {shapes}"
            print(
                f"{o['key']:32} {o['version']:>7} {format_size(o['nbytes']):>10} {dtypes:10} "
                f"{shapes:16} {o['device']:7} {o['leases']:>6}" + (f" {o['node']}" if node else "")
            )
            count += 1
        print(f"({count} object{'' if count == 1 else 's'})")
        queues = [q for q in c.list_queues() if q["name"].startswith(args.prefix)]
        if queues:
            print(f"\n{'QUEUE':32} {'DEPTH':>7} {'MAXSIZE':>7} {'IN FLIGHT':>9} STATE")
            for q in queues:
                kind = "" if q["subscribers"] is None else f", broadcast to {q['subscribers']}"
                state = ("closed" if q["closed"] else "open") + kind
                maxsize = q["maxsize"] or "-"
                print(f"{q['name']:32} {q['depth']:>7} {maxsize:>7} {q['in_flight']:>9} {state}")
    return 0


def _rm(args: argparse.Namespace) -> int:
    """Delete every key and queue named; say which were not there (exit status 1)."""
    if not args.keys and not args.queue:
        raise ValueError("rm: name the keys to delete, or --queue NAME")
    missing = []
    with _client(args) as c:
        for key in args.keys:
            try:
                c.delete(key)
            except NotFound:
                missing.append(f"key {key!r}")
        for name in args.queue:
            try:
                c.delete_queue(name)
            except NotFound:
                missing.append(f"queue {name!r}")
    for what in missing:
        print(f"tensorbroker: no {what}", file=sys.stderr)
    return 1 if missing else 0


def _top(args: argparse.Namespace) -> int:
    """A live view (tensorbroker/top.py); one frame as text with --once or off a terminal."""
    from . import top

    if args.interval <= 0:
        raise ValueError(f"top: --interval must be above 0 seconds, not {args.interval}")
    if args.once or not (sys.stdout.isatty() and sys.stdin.isatty()):
        top.once(args.address, args.timeout, args.server_key)
        return 0
    # Each try to reach a broker that went away waits at most a second: q still answers.
    feed = top.Feed(args.address, min(args.timeout, 1.0), args.server_key, args.interval / 2)
    top.live(feed, args.interval)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tensorbroker", description=__doc__)
    p.add_argument("--version", action="version", version=f"tensorbroker {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        sp.add_argument(
            "--address",
            help="ipc:///path or tcp://127.0.0.1:PORT "
            "(default: $TENSORBROKER_ADDRESS, else a per-user socket)",
        )
        return sp

    serve = command("serve", "run a broker")
    serving.add_arguments(serve)
    serve.set_defaults(run=serving.run)
    for name, run, help in (
        ("ping", _ping, "check that a broker answers"),
        ("stat", _stat, "show a broker's counters"),
        (
            "ls",
            _ls,
            "list the objects (key, version, size, dtype, shape, device, leases) and queues",
        ),
        ("rm", _rm, "delete keys, and queues (--queue NAME)"),
        ("top", _top, "a live view of a broker: memory, ops/s, clients, objects, queues"),
    ):
        sp = command(name, help)
        sp.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the broker")
        sp.add_argument(
            "--server-key",
            help="a tcp:// broker's public key (40 characters, or its .key file; default: "
            "$TENSORBROKER_SERVER_KEY)",
        )
        sp.set_defaults(run=run, log_level="warning")
        if name in ("stat", "ls"):
            sp.add_argument("--json", action="store_true", help="print JSON")
        if name == "ls":
            sp.add_argument("prefix", nargs="?", default="", help="only keys starting so")
        if name == "rm":
            sp.add_argument("keys", nargs="*", metavar="KEY")
            sp.add_argument(
                "--queue", action="append", default=[], metavar="NAME",
                help="remove this queue (its consumers get QueueClosed); may repeat",
            )  # fmt: skip
        if name == "top":
            sp.add_argument(
                "--interval", type=float, default=1.0, help="seconds between refreshes (default 1)"
            )
            sp.add_argument(
                "--once", action="store_true",
                help="print one frame as plain text and exit (also off a terminal: in a pipe, say)",
            )  # fmt: skip
    keys = sub.add_parser(
        "keys",
        help="make a key pair for a tcp:// broker (or a client of one)",
        description="make a CurveZMQ key pair: NAME.key (public) and NAME.key_secret",
    )
    keys.add_argument("--out", default=".", help="the folder to write them in (default: here)")
    keys.add_argument("--name", default="broker", help="their file name (default: broker)")
    keys.set_defaults(run=_keys, log_level="warning")
    gc = sub.add_parser(
        "gc",
        help="remove the shared memory that brokers no longer running left in /dev/shm",
        description="Remove from /dev/shm the segments of every broker state that no running "
        "broker owns (a broker killed and not started again), with their state dirs, and print "
        "each segment and its size. A running broker's are never touched, whatever its state "
        "dir or container: a broker holds a lock on its state's owner file (tb-<id>.owner) as "
        "long as it runs, and objects a broker stopped with --state-dir kept for the next one "
        "stay unless their state is named.",
    )
    gc.add_argument(
        "states", nargs="*", metavar="STATE",
        help="only these states (kept ones too): the id in their segments' names (tb-<id>-...)",
    )  # fmt: skip
    gc.add_argument("--dry-run", action="store_true", help="say what would go; remove nothing")
    gc.set_defaults(run=_gc, log_level="warning")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s tensorbroker %(levelname)s %(message)s"
    )
    try:
        return int(args.run(args))
    except BrokerError as exc:
        print(f"tensorbroker: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"tensorbroker: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
