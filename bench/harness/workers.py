"""A worker subprocess per system, spoken to in JSON lines (see bench/worker.py)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import time
from typing import IO, Any

from .config import REPO_DIR, WORKER, SystemSpec

START_TIMEOUT = 300.0  # Ray on a busy 2-core machine can take a minute
REQUEST_TIMEOUT = 600.0  # one measurement; mp.Queue moves 1 GiB in ~5 s, several times


class WorkerFailed(RuntimeError):
    """The worker died, timed out or broke the protocol; it is no longer usable."""


class Worker:
    def __init__(self, spec: SystemSpec, log_path: str) -> None:
        self.spec = spec
        self.log_path = log_path
        self.info: dict[str, Any] = {}
        self.scenarios: frozenset[str] = frozenset()
        self._buffer = b""
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        self._log: IO[bytes] = open(log_path, "wb")  # noqa: SIM115 (closed in stop)
        # A session of its own: Ctrl-C in the terminal reaches the runner only, which then
        # stops each worker in order, and a stuck one can be killed with its children.
        self.proc = subprocess.Popen(
            [self.spec.python, "-P", WORKER, spec.name],
            cwd=REPO_DIR,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            start_new_session=True,
        )

    @property
    def name(self) -> str:
        return self.spec.name

    def wait_ready(self) -> None:
        reply = self._read(START_TIMEOUT)
        if not reply.get("ready"):
            raise WorkerFailed(f"{self.name} did not start:\n{reply.get('error', reply)}")
        self.info = dict(reply.get("info") or {})
        self.scenarios = frozenset(reply.get("scenarios") or ())

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
        except OSError as exc:
            raise WorkerFailed(f"{self.name}: cannot send a request ({exc})") from None
        return self._read(REQUEST_TIMEOUT)

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerFailed(f"{self.name}: no answer within {timeout:.0f}s")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                code = self.proc.wait()
                raise WorkerFailed(f"{self.name}: the worker exited (code {code})")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            reply: dict[str, Any] = json.loads(line)
        except ValueError:
            raise WorkerFailed(f"{self.name}: not a protocol line: {line[:200]!r}") from None
        return reply

    def stop(self, timeout: float = 60.0) -> None:
        """Ask the worker to clean up and exit; SIGTERM, then SIGKILL its process group."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.write(b'{"cmd": "quit"}\n')
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGTERM)
                try:
                    self.proc.wait(15.0)
                except subprocess.TimeoutExpired:
                    pass
        # Whatever is left in the worker's session (its own children) goes with it.
        self._signal(signal.SIGKILL)
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        self._log.close()

    def _signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signum)

    def log_tail(self, chars: int = 2000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""
