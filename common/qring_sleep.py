"""The sleeping side of a queue ring (Note [queue ring] in qring.py): the futex bells that
consumers and producers sleep on, and the count of sleepers that tells a waker whether to
make a system call at all, kept per owner so that the broker can take a dead one's out."""

from __future__ import annotations

from . import _shm

# header words of the ring (a bell word is at its address + 8: _shm.bell, bell_wait,
# ring_wake): the consumers' bell is the header's first word
Q_PBELL, Q_CSLEEP, Q_PSLEEP = 24, 40, 48
Q_COWNERS, Q_POWNERS = 1024, 1280  # each owner's sleepers, a byte each (owner n at +n)


def _add(at: int, delta: int) -> None:
    """Add `delta` to the word at `at` (mod 2**64)."""
    while True:
        n = _shm.load(at)
        if _shm.cas(at, n, (n + delta) & 0xFFFFFFFFFFFFFFFF):
            return


class Sleeping:
    """QueueRingView's bells and sleepers, over the ring mapped at `addr`."""

    __slots__ = ()
    addr: int

    def consumer_bell(self) -> int:
        return _shm.bell(self.addr)

    def producer_bell(self) -> int:
        return _shm.bell(self.addr + Q_PBELL)

    def sleeping(self, producer: bool, count: int, owner: int) -> None:
        """Count a sleeper of `owner` in (count 1, before it reads again) or out (-1): in
        the total the wakers read, and in the owner's own count (a byte), which the broker
        takes out of the total when the owner dies. In: the total first; out: the total
        last, so a death between the two leaves the total high (a needless wake-up), never
        low (a sleeper not woken)."""
        total = self.addr + (Q_PSLEEP if producer else Q_CSLEEP)
        mine = self.addr + (Q_POWNERS if producer else Q_COWNERS) + owner // 8 * 8
        shift = owner % 8 * 8
        if count > 0:
            _add(total, count)
            _add(mine, count << shift)
        else:
            _add(mine, count << shift)
            _add(total, count)
        _shm.fence()

    def sleeping_of(self, producer: bool, owner: int) -> int:
        """How many sleepers of `owner` are counted in."""
        mine = self.addr + (Q_POWNERS if producer else Q_COWNERS) + owner // 8 * 8
        return (_shm.load(mine) >> (owner % 8 * 8)) & 0xFF

    def sleep(self, producer: bool, seen: int, timeout: float) -> None:
        _shm.bell_wait(self.addr + (Q_PBELL if producer else 0), seen, timeout)

    def wake_consumers(self) -> None:
        _shm.fence()
        if _shm.load(self.addr + Q_CSLEEP):
            _shm.ring_wake(self.addr)

    def wake_producers(self) -> None:
        _shm.fence()
        if _shm.load(self.addr + Q_PSLEEP):
            _shm.ring_wake(self.addr + Q_PBELL)

    def wake_all(self) -> None:
        _shm.ring_wake(self.addr)
        _shm.ring_wake(self.addr + Q_PBELL)
