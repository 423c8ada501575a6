"""The `tensorbroker` command, run as users run it: `python -P -m tensorbroker ...`."""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import tensorbroker as tb
from tensorbroker.common.config import ADDRESS_ENV, format_size, shm_bytes_available
from tensorbroker.server.durability.journal import read_journal
from tensorbroker.server.durability.state import discard
from tests.support import segments_of

MiB = 2**20


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop(ADDRESS_ENV, None)  # every command here names its address
    return env


def tb_cli(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-P", "-m", "tensorbroker", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env=_env(),
    )


@pytest.fixture
def spare_address(tmp_path: Path) -> str:
    return f"ipc://{tmp_path / 'cli.sock'}"


# -- admin commands against a running broker -------------------------------------------------


def test_ping(broker: tb.BrokerProcess) -> None:
    done = tb_cli("ping", "--address", broker.address)
    assert done.returncode == 0, done.stderr
    assert f"pid {broker.pid}" in done.stdout
    assert broker.address in done.stdout


def test_stat(broker: tb.BrokerProcess) -> None:
    done = tb_cli("stat", "--address", broker.address)
    assert done.returncode == 0, done.stderr
    lines = {line.split()[0]: line.split(None, 1)[1] for line in done.stdout.splitlines()}
    assert lines["capacity_bytes"] == format_size(broker.memory)
    assert lines["pid"] == str(broker.pid)


def test_stat_json(broker: tb.BrokerProcess, client: tb.Client) -> None:
    client.put("stat-json", np.ones(1000, dtype=np.float64))
    done = tb_cli("stat", "--json", "--address", broker.address)
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout)
    assert stats["capacity_bytes"] == broker.memory
    assert stats["objects"] >= 1 and stats["used_bytes"] >= 8000
    assert stats["pid"] == broker.pid


def test_stats_say_the_cpu_time_the_broker_used_all_its_threads(
    broker: tb.BrokerProcess, client: tb.Client
) -> None:
    """What the kernel counts for the broker's process (bench/scaling_hosts.py reads it on
    each machine), to its clock ticks (user and system time are each rounded down)."""

    def kernel() -> float:
        with open(f"/proc/{broker.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    for i in range(200):
        client.put(f"cpu-{i % 4}", np.ones(1000))
    before = kernel()
    said = client.stats()["cpu_s"]
    after = kernel()
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert before - tick <= said <= after + 2 * tick and said > 0


def test_ls_shows_each_object_with_its_version_size_dtype_shape_device_and_leases(
    broker: tb.BrokerProcess, client: tb.Client
) -> None:
    keys = ["ls/b", "ls/a", "ls/\u00e9t\u00e9"]
    for i, key in enumerate(keys):
        client.put(key, np.full((2, 3), i, dtype=np.int32))
    client.put("ls/a", np.zeros(1000, dtype=np.float64))  # version 2
    held = client.get("ls/b")
    done = tb_cli("ls", "--address", broker.address)
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()[1:-1]}
    assert list(rows) == sorted(keys)  # in key order
    assert rows["ls/a"] == ["ls/a", "2", "7.8", "KiB", "float64", "1000", "cpu", "0"]
    assert rows["ls/b"] == ["ls/b", "1", "24", "B", "int32", "2x3", "cpu", "1"]  # held once
    assert done.stdout.splitlines()[-1] == "(3 objects)"
    del held


def test_ls_prefix_and_json(broker: tb.BrokerProcess, client: tb.Client) -> None:
    client.put("lj/x", {"w": np.ones((4, 2), np.float32), "b": np.ones(2, np.int64)})
    client.put("other", np.ones(3))
    q = client.queue("lj/jobs", maxsize=4)
    q.put(np.ones(2))
    done = tb_cli("ls", "lj/", "--json", "--address", broker.address)
    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout)
    assert [o["key"] for o in listed["objects"]] == ["lj/x"]
    (obj,) = listed["objects"]
    assert obj["bundle"] and obj["nbytes"] == 4 * 2 * 4 + 2 * 8
    assert sorted(map(tuple, (t[:2] for t in obj["tensors"]))) == [("b", "int64"), ("w", "float32")]
    (queue,) = [row for row in listed["queues"] if row["name"] == "lj/jobs"]
    assert (queue["depth"], queue["maxsize"], queue["in_flight"]) == (1, 4, 1)
    client.delete_queue("lj/jobs")


def test_ls_of_an_empty_broker_says_so(broker: tb.BrokerProcess, client: tb.Client) -> None:
    assert client.keys() == []
    done = tb_cli("ls", "--address", broker.address)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "(0 objects)"


def test_rm_queue_removes_it(broker: tb.BrokerProcess, client: tb.Client) -> None:
    q = client.queue("rm-q")
    q.put(np.ones(3))
    done = tb_cli("rm", "--queue", "rm-q", "--address", broker.address)
    assert done.returncode == 0, done.stderr
    assert "rm-q" not in [row["name"] for row in client.list_queues()]
    with pytest.raises(tb.QueueClosed):
        q.get(timeout=0)


def test_rm_without_names_is_a_usage_error(broker: tb.BrokerProcess) -> None:
    done = tb_cli("rm", "--address", broker.address)
    assert done.returncode == 2
    assert "--queue" in done.stderr


def test_rm_deletes(broker: tb.BrokerProcess, client: tb.Client) -> None:
    client.put("rm-me", np.zeros(3))
    client.put("rm-me-too", np.zeros(3))
    client.put("keep-me", np.zeros(3))
    done = tb_cli("rm", "rm-me", "rm-me-too", "--address", broker.address)
    assert done.returncode == 0, done.stderr
    assert client.keys() == ["keep-me"]


def test_rm_of_a_missing_key_fails_naming_it(broker: tb.BrokerProcess) -> None:
    done = tb_cli("rm", "no-such-key", "--address", broker.address)
    assert done.returncode != 0
    assert "'no-such-key'" in done.stderr
    assert "Traceback" not in done.stderr


def test_ping_without_a_broker_fails_fast_naming_the_address(spare_address: str) -> None:
    started = time.monotonic()
    done = tb_cli("ping", "--address", spare_address, "--timeout", "0.5")
    elapsed = time.monotonic() - started
    assert done.returncode != 0
    assert spare_address in done.stderr
    assert "Traceback" not in done.stderr
    assert elapsed < 5, f"took {elapsed:.1f}s with --timeout 0.5"


def test_bad_address_is_refused(broker: tb.BrokerProcess) -> None:
    done = tb_cli("ping", "--address", "http://localhost:1")
    assert done.returncode == 2
    assert "http://localhost:1" in done.stderr


# -- serve --------------------------------------------------------------------------------


def test_serve_refuses_an_address_another_broker_serves(broker: tb.BrokerProcess) -> None:
    done = tb_cli("serve", "--address", broker.address, "--memory", "16MiB")
    assert done.returncode != 0
    assert "already serves" in done.stderr
    assert broker.address in done.stderr
    # and the running broker is untouched
    with tb.connect(broker.address) as c:
        assert c.ping()["pid"] == broker.pid


def test_serve_refuses_more_memory_than_shm_has(spare_address: str) -> None:
    too_much = shm_bytes_available() + 2**40
    done = tb_cli("serve", "--address", spare_address, "--memory", str(too_much))
    assert done.returncode == 2
    assert "--shm-size" in done.stderr
    assert "/dev/shm" in done.stderr
    assert not os.path.exists(spare_address[len("ipc://") :])


def test_serve_refuses_a_bad_memory_size(spare_address: str) -> None:
    done = tb_cli("serve", "--address", spare_address, "--memory", "lots")
    assert done.returncode == 2
    assert "'lots'" in done.stderr


@pytest.fixture
def served(spare_address: str) -> Iterator[subprocess.Popen[bytes]]:
    """`tensorbroker serve` started as a user would, returned once it says it is ready."""
    read_fd, write_fd = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "tensorbroker", "serve", "--address", spare_address,
             "--memory", "32MiB", "--ready-fd", str(write_fd)],
            pass_fds=(write_fd,), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env=_env(),
        )  # fmt: skip
        os.close(write_fd)
        write_fd = -1
        ready, _, _ = select.select([read_fd], [], [], 30)
        assert ready and os.read(read_fd, 16) == b"ready\n", "the broker did not start"
    finally:
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def test_serve_stops_on_sigterm_and_releases_shared_memory(
    served: subprocess.Popen[bytes], spare_address: str
) -> None:
    with tb.connect(spare_address) as c:
        assert c.ping()["pid"] == served.pid
        c.put("x", np.arange(10_000, dtype=np.float32))
        held = c.get("x")
        assert float(np.asarray(held)[-1]) == 9999.0
        del held
        state = c.stats()["state_dir"]
    segments = segments_of(state)
    assert len(segments) >= 3, "the broker made no segment for the object"
    served.send_signal(signal.SIGTERM)
    out, err = served.communicate(timeout=15)
    assert served.returncode == 0, err
    assert not any(os.path.exists(p) for p in segments) and not os.path.exists(state)
    assert b"Traceback" not in err


def test_serve_stops_on_sigint(served: subprocess.Popen[bytes], spare_address: str) -> None:
    served.send_signal(signal.SIGINT)
    _, err = served.communicate(timeout=15)
    assert served.returncode == 0, err
    assert not os.path.exists(spare_address[len("ipc://") :])  # the socket file went with it


# -- gc: the shared memory of brokers no longer running --------------------------------------
# Each names the states it may touch: a bare `gc` would also take what the brokers of other
# test runs on this machine left for a moment (killed, to be restarted).


def _state_of(b: tb.BrokerProcess) -> tuple[str, str, dict[str, int]]:
    """The broker's state dir, state id, and its segments with their sizes."""
    with tb.connect(b.address) as c:
        state = c.stats()["state_dir"]
    found = read_journal(state)
    assert found is not None, state
    return state, str(found.meta["id"]), {p: os.stat(p).st_size for p in segments_of(state)}


def _killed(b: tb.BrokerProcess) -> None:
    with tb.connect(b.address) as c:
        c.put("x", np.arange(1000, dtype=np.float32))
    b.send_signal(signal.SIGKILL)
    assert b.wait(10) == -signal.SIGKILL


def test_gc_removes_what_a_killed_broker_left_and_keeps_a_running_ones(tmp_path: Path) -> None:
    dead_dir = str(tmp_path / "state")
    with (
        tb.start_broker(memory="32MiB") as live,
        tb.start_broker(memory="32MiB", state_dir=dead_dir) as dead,
    ):
        with tb.connect(live.address) as c:
            c.put("x", np.arange(1000, dtype=np.float32))
        live_state, live_id, live_segments = _state_of(live)
        state, dead_id, segments = _state_of(dead)
        _killed(dead)
        assert segments and all(os.path.exists(p) for p in segments)

        tried = tb_cli("gc", "--dry-run", live_id, dead_id)
        assert tried.returncode == 0, tried.stderr
        assert f"would remove state {dead_id} (state dir {state}): no broker runs" in tried.stdout
        assert f"would free {format_size(sum(segments.values()))}" in tried.stdout
        assert all(os.path.exists(p) for p in [*segments, *live_segments])

        done = tb_cli("gc", live_id, dead_id)
        assert done.returncode == 0, done.stderr
        assert f"removed state {dead_id} (state dir {state})" in done.stdout
        for path, size in segments.items():
            assert f"  {path}  {format_size(size)}\n" in done.stdout
        assert f"kept state {live_id} ({len(live_segments)} segments" in done.stdout
        assert f"a broker is running on it (state dir {live_state})" in done.stdout
        assert not any(os.path.exists(p) for p in segments)
        assert not os.path.exists(f"/dev/shm/tb-{dead_id}.owner") and not os.path.exists(state)
        assert all(os.path.exists(p) for p in live_segments)
        with tb.connect(live.address) as c:  # untouched
            assert c.get("x").numpy()[-1] == 999.0
        again = tb_cli("gc", dead_id)
        assert again.returncode == 1 and f"no state {dead_id} in /dev/shm" in again.stderr


def test_gc_keeps_a_state_a_broker_is_starting_on(tmp_path: Path) -> None:
    state = str(tmp_path / "state")
    with tb.start_broker(memory="32MiB", state_dir=state) as b:
        _, sid, segments = _state_of(b)
        _killed(b)
        lock = os.open(os.path.join(state, "lock"), os.O_RDWR)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a starting broker does first
            done = tb_cli("gc", sid)
        finally:
            os.close(lock)
        assert done.returncode == 0, done.stderr
        assert f"kept state {sid}" in done.stdout and "a broker is starting on it" in done.stdout
        assert all(os.path.exists(p) for p in segments)
        b.restart()  # adopts it: nothing was lost
        with tb.connect(b.address) as c:
            assert c.get("x").numpy()[-1] == 999.0
    discard(state)


def test_gc_keeps_a_state_a_broker_stopped_and_kept_unless_it_is_named(tmp_path: Path) -> None:
    state = str(tmp_path / "state")
    with tb.start_broker(memory="32MiB", state_dir=state) as b:
        _, sid, segments = _state_of(b)
    try:  # stopped cleanly with --state-dir: kept for the next broker
        assert segments and all(os.path.exists(p) for p in segments)
        tried = tb_cli("gc", "--dry-run")  # every state there is (removing none)
        assert tried.returncode == 0, tried.stderr
        assert f"kept state {sid} ({len(segments)} segments" in tried.stdout
        assert f"stopped and kept it for the next one on {state}" in tried.stdout
        done = tb_cli("gc", sid)
        assert done.returncode == 0, done.stderr
        assert f"removed state {sid} (state dir {state})" in done.stdout
        assert not any(os.path.exists(p) for p in segments)
    finally:
        discard(state)


def test_gc_keeps_segments_it_cannot_tell_the_owner_of(tmp_path: Path) -> None:
    state = str(tmp_path / "state")
    with tb.start_broker(memory="32MiB", state_dir=state) as b:
        _, sid, segments = _state_of(b)
        _killed(b)
    os.unlink(f"/dev/shm/tb-{sid}.owner")  # as a broker from before owner files left it
    try:
        done = tb_cli("gc", sid)
        assert done.returncode == 0, done.stderr
        assert f"kept state {sid} ({len(segments)} segments" in done.stdout
        assert "no owner file" in done.stdout and f"rm /dev/shm/tb-{sid}-*" in done.stdout
        assert all(os.path.exists(p) for p in segments)
        assert "not a state" in tb_cli("gc", "xyz").stderr
    finally:
        discard(state)


# -- help ---------------------------------------------------------------------------------


def test_help() -> None:
    done = tb_cli("--help")
    assert done.returncode == 0, done.stderr
    for command in ("serve", "ping", "stat", "ls", "rm", "gc"):
        assert command in done.stdout


def test_serve_help() -> None:
    done = tb_cli("serve", "--help")
    assert done.returncode == 0, done.stderr
    assert "--memory" in done.stdout and "--address" in done.stdout


def test_no_command_is_a_usage_error() -> None:
    done = tb_cli()
    assert done.returncode == 2
    assert "usage" in done.stderr


def test_serve_refuses_a_bad_cuda_memory(spare_address: str) -> None:
    result = tb_cli("serve", "--address", spare_address, "--memory", "64MiB",
                    "--cuda-memory", "gpu0:8GiB")  # fmt: skip
    assert result.returncode == 2
    assert "--cuda-memory 'gpu0:8GiB'" in result.stderr and "0:8GiB,1:8GiB" in result.stderr


def test_stat_says_why_no_gpu_is_served(spare_address: str) -> None:
    with tb.start_broker(memory="64MiB", address=spare_address, cuda_memory="off"):
        result = tb_cli("stat", "--address", spare_address)
    assert result.returncode == 0, result.stderr
    assert (
        "cuda                 off: the broker was started with --cuda-memory off" in result.stdout
    )
