"""Fixtures shared by every test: private brokers on temporary addresses, clients that are
always closed, and a check that the suite leaves no segment, socket or broker behind."""

from __future__ import annotations

import atexit
import multiprocessing.util
import os
import shutil
import tempfile
from collections.abc import Generator, Iterator

import pytest
from support import ForkedBroker, run_segments

import tensorbroker as tb
from tensorbroker.launcher import BrokerProcess

# The host tests run JAX on the CPU, also on a machine where JAX would pick a GPU (its arrays
# would be CUDA tensors there, stored in GPU memory): in this process and in every worker it
# spawns. tests/gpu/conftest.py gives its own workers the GPU back.
if "JAX_PLATFORMS" not in os.environ:
    os.environ["JAX_PLATFORMS"] = "cpu"
# No test does linear algebra: the workers it spawns start no BLAS thread pool (0.1 CPU-s each
# on this 2-core VM, about 100 workers a run).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


# The suite's brokers are forked from its fork server, not started as new interpreters
# (ForkedBroker in support.py); test_cli.py and the others that run `tensorbroker serve` as a
# command still do.
BrokerProcess.spawn = ForkedBroker

# Each run of the suite keeps its temporary files (the brokers' sockets and state dirs,
# tmp_path, the default address's runtime dir) in a folder of its own, made before anything
# asks tempfile where: in this process and in every one it starts. The check after the suite
# counts only the segments of the states kept there (support.run_segments), so two runs at
# once on one machine do not count each other's.
#
# Under pytest-xdist (`make test` runs `-n`), each worker is a process of its own that
# imports this file itself: it inherits the controller's TMPDIR, so its RUN_DIR is a folder of
# its own inside the controller's (tb-run-…/gw0), and its tmp_path goes there too
# (pytest_configure). Its brokers, sockets, state dirs and segments are its own, and the check
# after its tests counts those alone: never those of a worker still running. The folder's name
# is short: the addresses of the brokers in it must stay short enough for `tensorbroker top`'s
# header to keep its "q: quit" in 120 columns (test_top.py).
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", ...; "" in a run without xdist
PARENT_DIR = os.path.realpath(tempfile.gettempdir())  # a worker's: the controller's RUN_DIR


def _make_run_dir() -> str:
    if not WORKER:
        return tempfile.mkdtemp(prefix="tb-run-")
    try:
        path = os.path.join(PARENT_DIR, WORKER)
        os.mkdir(path, 0o700)
        return path
    except FileExistsError:  # not expected: xdist names a worker started again anew
        return tempfile.mkdtemp(prefix=f"{WORKER}-")


multiprocessing.util.get_temp_dir()  # its own, first: it removes that at exit, after RUN_DIR
RUN_DIR = _make_run_dir()
os.environ["TMPDIR"] = os.environ["XDG_RUNTIME_DIR"] = tempfile.tempdir = RUN_DIR


@atexit.register
def _remove_run_dir(pid: int = os.getpid()) -> None:
    """Also where the suite never ran (--collect-only, a collection error); not in a child
    forked from this process. An xdist controller's also takes whatever its workers left."""
    if os.getpid() == pid:
        shutil.rmtree(RUN_DIR, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """An xdist worker's tmp_path in its own RUN_DIR (xdist gives it a folder in the
    controller's basetemp, where the worker's check would not count the states kept there);
    a --basetemp given by hand stays as given. Before the tmpdir plugin reads it."""
    given = config.option.basetemp
    if hasattr(config, "workerinput") and given:
        if os.path.realpath(given).startswith(os.path.join(PARENT_DIR, "")):
            config.option.basetemp = os.path.join(RUN_DIR, "tmp")


def _is_xdist_controller(config: pytest.Config) -> bool:
    """This process hands the tests to xdist workers and runs none itself."""
    return config.pluginmanager.has_plugin("dsession")


@pytest.hookimpl(wrapper=True)
def pytest_sessionfinish(session: pytest.Session) -> Generator[None, object, object]:
    """An xdist controller's check, once its workers are done (each checked its own): no
    segment of a state kept in any worker's folder is left, also of a worker that crashed."""
    result = yield
    if _is_xdist_controller(session.config):
        left = run_segments(RUN_DIR)
        if left:
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write_line("")  # after the progress line
                reporter.write_line(
                    f"the test suite left shared-memory segments behind: {sorted(left)} "
                    "(`tensorbroker gc` removes them)",
                    red=True,
                )
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    return result


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`make test-gpu` collects tests/gpu alone (the host tests import what a GPU image need
    not have, such as pyte): a test marked cuda anywhere else would never run there."""
    gpu = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu", "")
    stray = [
        i.nodeid for i in items if i.get_closest_marker("cuda") and not str(i.path).startswith(gpu)
    ]
    if stray:
        raise pytest.UsageError(f"move these tests marked cuda into tests/gpu: {stray}")
    # The longest files first: xdist hands files to its workers in this order (make test's
    # --dist loadfile --no-loadscope-reorder), so that none starts near the end and runs on
    # alone (test_chaos, 50 s, once started at 104 s of a run whose other workers were done
    # at 125 s; test_cluster_liveness, 30 s of waiting, started last, left the two cores
    # idle for the last 25 s of a 131 s run). The sort is stable: the other files keep their
    # order.
    items.sort(key=lambda i: LONGEST.index(i.path.name) if i.path.name in LONGEST else 99)


# The files that take longest in a parallel run, longest first: each file's time alone on
# the 2-core VM, its CPU time counted about twice (two cores shared by four workers). Those
# that mostly wait (test_etcd, test_cluster_liveness: a third of their time or less on a CPU)
# start early, their waits filled by the others' work.
LONGEST = ("test_cluster_nodes.py", "test_recovery.py", "test_etcd.py", "test_chaos.py",
           "test_hostile.py", "test_cluster_liveness.py", "test_dlpack_capsules.py",
           "test_homes.py", "test_directory.py", "test_pipelines.py", "test_outage.py",
           "test_leases.py", "test_beats.py", "test_device_protocol.py",
           "test_queue_links.py", "test_small_puts.py", "test_queues.py",
           "test_cross_framework.py", "test_handoff.py", "test_cli.py", "test_metrics.py",
           "test_broadcast.py", "test_queue_rings.py")  # fmt: skip


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="session", autouse=True)
def _leaves_nothing_behind() -> Iterator[None]:
    """After the suite: no segment of a state it made is left, and no broker it started
    runs; then its folder goes."""
    yield
    left = run_segments(RUN_DIR)
    running = [pid for pid in tb.BrokerProcess.unstopped() if _alive(pid)]
    shutil.rmtree(RUN_DIR, ignore_errors=True)
    assert not left, (
        f"the test suite left shared-memory segments behind: {sorted(left)} "
        "(`tensorbroker gc` removes them)"
    )
    assert not running, f"the test suite left brokers running: {running}"


@pytest.fixture(scope="module")
def broker() -> Iterator[tb.BrokerProcess]:
    """A broker shared by the tests of one module (256 MiB, its own temporary address)."""
    with tb.start_broker(memory="256MiB") as b:
        yield b
        assert b.alive, f"the broker died during the tests (exit code {b.returncode})"
    path = b.address[len("ipc://") :]
    assert not os.path.exists(path) and not os.path.exists(path + ".lane")


@pytest.fixture(params=["lanes", "zeromq"])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test twice: with clients on lanes (Note [lanes] in server/sessions/lanes.py), and with
    ZeroMQ only, in this process and in the workers it spawns."""
    if request.param == "zeromq":
        monkeypatch.setenv("TENSORBROKER_LANES", "off")
    else:
        monkeypatch.delenv("TENSORBROKER_LANES", raising=False)
    return str(request.param)


@pytest.fixture
def fresh_broker() -> Iterator[tb.BrokerProcess]:
    """A broker of this test's own, for tests that count memory or kill things."""
    with tb.start_broker(memory="64MiB") as b:
        yield b


@pytest.fixture
def group_address() -> Iterator[str]:
    """An address in a folder of its own under /tmp, for a broker that other users reach
    (serve --group): the run's own folder (RUN_DIR) is closed to them."""
    folder = tempfile.mkdtemp(prefix="tb-group-", dir="/tmp")
    try:
        yield f"ipc://{folder}/broker.sock"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def client(broker: tb.BrokerProcess) -> Iterator[tb.Client]:
    with tb.connect(broker.address) as c:
        yield c
        for key in c.keys():
            c.delete(key)
