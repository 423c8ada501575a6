"""A benchmark worker: `python -P bench/worker.py SYSTEM`, run by bench/run.py with the Python
of the environment SYSTEM needs.

Protocol (JSON lines): the worker sets the system up and writes {"ready": true, "info": ...,
"scenarios": [...]} (or {"ready": false, "error": ...}); then for each request line read from
stdin ({"cmd": "measure", "scenario": ..., "size": ..., ...}) it writes one answer,
{"ok": true, "metrics": {...}, "samples": n} or {"ok": false, "error": ...}. {"cmd": "quit"}
or the end of stdin stops it; it cleans up on SIGTERM too, and gets SIGTERM if the runner
dies. Everything else the system prints goes to stderr (the runner's log file).
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import signal
import sys
import traceback
from types import FrameType
from typing import IO, Any

PR_SET_PDEATHSIG = 1


def _send(out: IO[str], message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def main(name: str) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    out = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol channel
    os.dup2(2, 1)  # stray prints from the systems go to the log
    sys.stdout = sys.stderr
    _die_with_parent()
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the runner decides when to stop

    from systems import SYSTEMS
    from systems.base import Request, System

    module, _, attr = SYSTEMS[name].partition(":")
    system: System | None = None
    try:
        system = getattr(importlib.import_module(module), attr)()
        assert system is not None
        info = system.setup()
    except Exception:
        _send(out, {"ready": False, "error": traceback.format_exc()})
        if system is not None:
            system.close()
        return 1
    try:
        _send(out, {"ready": True, "info": info, "scenarios": sorted(system.scenarios)})
        for line in sys.stdin:
            message = json.loads(line)
            if message.get("cmd") == "quit":
                break
            try:
                metrics, samples = system.measure(Request.from_json(message))
                _send(out, {"ok": True, "metrics": metrics, "samples": samples})
            except Exception:
                _send(out, {"ok": False, "error": traceback.format_exc()})
    finally:
        system.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
