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

from .common.config import SOCKET_NAME, parse_size
from .common.errors import BrokerUnavailable

started: set[int] = set()  # pids of brokers this process started and has not stopped


@atexit.register
def _stop_forgotten_brokers() -> None:
    """A broker started here and never stopped ends with this interpreter."""
    for pid in list(started):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


class BrokerProcess:
    """A running `tensorbroker serve`. `.stop()` (or leaving `with`) ends it and removes its
    socket; the broker unlinks its shared memory as it exits."""

    _proc: subprocess.Popen[bytes] | None = None
    _tmpdir: str | None = None

    def __init__(
        self,
        memory: str | int,
        address: str | None = None,
        *,
        ready_timeout: float = 30.0,
        log_level: str = "warning",
        cuda_memory: str | None = None,
    ) -> None:
        if address is None:
            self._tmpdir = tempfile.mkdtemp(prefix="tb-")
            address = f"ipc://{os.path.join(self._tmpdir, SOCKET_NAME)}"
        self.address = address
        self.memory = parse_size(memory)
        log_dir = self._tmpdir or tempfile.gettempdir()
        self.log_path = os.path.join(log_dir, f"broker-{os.getpid()}-{time.monotonic_ns()}.log")
        read_fd, write_fd = os.pipe()
        try:
            with open(self.log_path, "wb") as log:
                self._proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-P",
                        "-m",
                        "tensorbroker",
                        "serve",
                        "--address",
                        address,
                        "--memory",
                        str(self.memory),
                        "--log-level",
                        log_level,
                        "--ready-fd",
                        str(write_fd),
                        *(["--cuda-memory", cuda_memory] if cuda_memory is not None else []),
                    ],
                    pass_fds=(write_fd,),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            started.add(self._proc.pid)
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
            if write_fd >= 0:
                os.close(write_fd)

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc is not None else -1

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait, SIGKILL if need be; remove the temporary address. Idempotent.
        Returns the broker's exit code."""
        proc, self._proc = self._proc, None
        code = None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            started.discard(proc.pid)
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
) -> BrokerProcess:
    """Start `tensorbroker serve` as a subprocess (on a fresh temporary ipc address unless
    one is given) and return once it serves. `cuda_memory` is its --cuda-memory (default:
    every GPU CuPy finds, half of each one's free memory)."""
    return BrokerProcess(memory, address, log_level=log_level, cuda_memory=cuda_memory)
