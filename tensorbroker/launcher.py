"""`start_broker`: a broker subprocess on a fresh private address, for tests, notebooks, demos."""

from __future__ import annotations

import atexit
import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import IO, ClassVar, Protocol

from .common.config import SOCKET_NAME, default_state_dir, parse_size
from .common.errors import BrokerError, BrokerUnavailable
from .server.durability.state import discard


class Running(Protocol):
    """A broker process as BrokerProcess drives it (what subprocess.Popen has)."""

    pid: int

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


def popen(argv: list[str], pass_fds: tuple[int, ...], log: IO[bytes]) -> Running:
    """`argv` run as a new process: its output to `log`, with `pass_fds` open in it."""
    return subprocess.Popen(
        argv, pass_fds=pass_fds, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
    )


class BrokerProcess:
    """A running `tensorbroker serve`. `.stop()` (or leaving `with`) ends it and removes its
    socket; the broker unlinks its shared memory as it exits (unless given a `state_dir`:
    then its objects stay there for the next broker). `.restart()` starts a new broker on
    the same address and state, which adopts what a killed one left. A broker started here
    and never stopped is sent SIGTERM when this interpreter exits, and stops by itself when
    this process ends any other way (a signal, os._exit): it watches a pipe only this process
    holds (and children it forks, until they exit)."""

    _proc: Running | None = None
    # How `tensorbroker serve` is started: a new interpreter (popen). The test suite forks
    # its brokers from a process that imported the broker once (tests/support.py).
    spawn: ClassVar[Callable[[list[str], tuple[int, ...], IO[bytes]], Running]] = popen
    _parent: int = -1  # our end of a pipe whose closing (this process exits) stops the broker
    _tmpdir: str | None = None  # the temporary address's directory, until stopped
    _own_dir: str | None = None
    _unstopped: ClassVar[set[int]] = set()  # pids started by this process and not stopped

    @classmethod
    def unstopped(cls) -> frozenset[int]:
        """The pids of brokers this process started and has not stopped."""
        return frozenset(cls._unstopped)

    @classmethod
    def _stop_forgotten(cls) -> None:
        for pid in list(cls._unstopped):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    def __init__(
        self,
        memory: str | int,
        address: str | None = None,
        *,
        ready_timeout: float = 30.0,
        log_level: str = "warning",
        cuda_memory: str | None = None,
        state_dir: str | None = None,
        reset: bool = False,
        options: Sequence[str] = (),
    ) -> None:
        if address is None:
            self._tmpdir = self._own_dir = tempfile.mkdtemp(prefix="tb-")
            address = f"ipc://{os.path.join(self._tmpdir, SOCKET_NAME)}"
        self.address = address
        self.memory = parse_size(memory)
        self.state_dir = state_dir
        self._options = ["--log-level", log_level]
        if cuda_memory is not None:
            self._options += ["--cuda-memory", cuda_memory]
        if state_dir is not None:
            self._options += ["--state-dir", state_dir]
        self._options += options
        self._ready_timeout = ready_timeout
        self._start(["--reset"] if reset else [])

    def restart(self) -> None:
        """Start a broker again on this address and state (after the last one exited: a
        crash, say); it adopts what that one left (Note [recovery] in
        server/durability/state.py)."""
        if self.alive:
            raise BrokerUnavailable(f"the broker at {self.address} is still running: stop it first")
        if self._proc is not None:
            BrokerProcess._unstopped.discard(self._proc.pid)
        if self._own_dir is not None and self._tmpdir is None:  # stopped: the address again
            os.makedirs(self._own_dir, mode=0o700)
            self._tmpdir = self._own_dir
        self._start([])

    def _start(self, once: list[str]) -> None:
        ready_timeout, address = self._ready_timeout, self.address
        log_dir = self._tmpdir or tempfile.gettempdir()
        self.log_path = os.path.join(log_dir, f"broker-{os.getpid()}-{time.monotonic_ns()}.log")
        read_fd, write_fd = os.pipe()
        if self._parent >= 0:  # the last broker's (restart)
            os.close(self._parent)
        parent_r, self._parent = os.pipe()  # (neither is inherited by what this runs later)
        try:
            with open(self.log_path, "wb") as log:
                argv = [
                    sys.executable, "-P", "-m", "tensorbroker", "serve", "--address", address,
                    "--memory", str(self.memory), *self._options, *once,
                    "--ready-fd", str(write_fd), "--parent-fd", str(parent_r),
                ]  # fmt: skip
                self._proc = BrokerProcess.spawn(argv, (write_fd, parent_r), log)
            BrokerProcess._unstopped.add(self._proc.pid)
            os.close(write_fd)
            write_fd = -1
            ready, _, _ = select.select([read_fd], [], [], ready_timeout)
            if not ready or not os.read(read_fd, 16):
                raise BrokerUnavailable(
                    f"the broker for {address} did not start within {ready_timeout:.0f}s:\n"
                    + self._log_tail()
                )
        except BaseException:
            self.stop()
            raise
        finally:
            os.close(read_fd)
            os.close(parent_r)
            if write_fd >= 0:
                os.close(write_fd)

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc is not None else -1

    @property
    def alive(self) -> bool:
        """Whether the broker process is running (False once it exited or was stopped)."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """The broker's exit code once it has exited (negative: the signal that ended it)."""
        return self._proc.poll() if self._proc is not None else None

    def send_signal(self, sig: int) -> None:
        """Send `sig` to the broker (SIGKILL to test a crash, say); stop() still cleans up."""
        if self._proc is not None:
            self._proc.send_signal(sig)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the broker to exit; its exit code. subprocess.TimeoutExpired on timeout."""
        if self._proc is None:
            raise BrokerUnavailable("this broker was stopped: there is nothing to wait for")
        return self._proc.wait(timeout)

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait, SIGKILL if need be; remove the temporary address, and the objects
        of a broker that did not stop cleanly (unless it was given a `state_dir`).
        Idempotent. Returns the broker's exit code."""
        proc, self._proc = self._proc, None
        code = None
        parent, self._parent = self._parent, -1
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            BrokerProcess._unstopped.discard(proc.pid)
            if code != 0 and self.state_dir is None:  # killed: it left its state behind
                with contextlib.suppress(BrokerError):  # unless another broker holds it
                    discard(default_state_dir(self.address))
        if parent >= 0:
            os.close(parent)
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
        elif os.path.exists(self.log_path):
            os.unlink(self.log_path)
        return code

    def __enter__(self) -> BrokerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<tb.BrokerProcess pid={self.pid} {self.address}>"


def start_broker(
    memory: str | int = "1GiB",
    address: str | None = None,
    *,
    log_level: str = "warning",
    cuda_memory: str | None = None,
    state_dir: str | None = None,
    reset: bool = False,
    options: Sequence[str] = (),
) -> BrokerProcess:
    """Start `tensorbroker serve` as a subprocess (on a fresh temporary ipc address unless
    one is given) and return once it serves. `cuda_memory` is its --cuda-memory (default:
    every GPU CuPy finds, half of each one's free memory); `state_dir` its --state-dir;
    `reset` starts it empty (--reset); `options`: more of its options, such as
    ["--insecure-tcp"] or ["--curve-secret", FILE]."""
    return BrokerProcess(
        memory, address, log_level=log_level, cuda_memory=cuda_memory, state_dir=state_dir,
        reset=reset, options=options,
    )  # fmt: skip


atexit.register(BrokerProcess._stop_forgotten)
