"""Shielded steps: a step that claims shared state (a ring's slot, position or item) and
must end it runs whole, whatever signal comes.

Note [shielded steps]
~~~~~~~~~~~~~~~~~~~~~
A queue ring's put takes a slot, claims a position and publishes it; its get takes the item
at the head and builds it (Note [queue ring], common/qring.py). Each step is a
compare-and-swap in shared memory, and Python runs a signal's handler between any two
bytecodes of the main thread: a KeyboardInterrupt (Ctrl-C), or any handler's exception,
raised just after a swap, before the code that undoes it is entered, leaves the claim to
the client's end, and the queue wedged or the item lost.

So the main thread runs each such step inside `shielded()`: the Python handlers of the
signals that may raise (SIGNALS, those that have one) are wrapped, once, in a `Holder` that
holds a signal that comes during a step, and the held handlers run, in order, once the
outermost step ends:

    put:  with shielded():  alloc slot -> copy -> claim position -> name -> publish
          (held: the handler runs after publish; its exception carries a note that the item
           went in, and its version)
    get:  with shielded() as s:  take (the head held) -> build the item ->
              s.pending ? give it back (it stays first in the queue) : commit
          (held: the handler runs after the item went back)

A signal that comes after a put's last step, before the put returns (a few bytecodes), runs
its handler at once; its exception carries that step's note too (`Shield.after`, from
`begin()` to `done()`), so a put that went in always says so. A get that has taken its item
defers a signal instead (`deferring`): it is sent to the main thread again about a
millisecond later (`_redeliver`), when the get has returned, so its handler runs in the
caller's code and the item is the caller's. Reads and writes of a socket are steps too
(client/transport.py, writes.py): a reply read is kept, and a message is sent whole. Waits
(a full or empty ring, a broker's answer) stay outside the steps, so Ctrl-C still ends them
at once. Other threads run no handlers, so they need no shield (their steps are not
interrupted). Outside a step a Holder calls its handler at once: nothing changes but what
`signal.getsignal` returns (so `asyncio.run` after a ring step in the same process leaves
SIGINT as it finds it, as before Python 3.11). A step checks that SIGINT's Holder is still
in place (a handler set since is wrapped then, and so are the other signals' set by then):
about 0.2 us, where swapping the handlers in and out took 2.5 us a step (a fifth of a put).
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # (signal.signal converts to enums: 10x slower)
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGALRM", "SIGUSR1", "SIGUSR2", "SIGQUIT")
    if hasattr(signal, name)
)
_MAIN = threading.main_thread().ident
_SIGINT = int(signal.SIGINT)
_getsignal, _ident = _signal.getsignal, threading.get_ident


class Holder:
    """A signal's handler, wrapped: held while the main thread is in a step."""

    __slots__ = ("shield", "handler")

    def __init__(self, shield: Shield, handler: Callable[[int, Any], Any]) -> None:
        self.shield, self.handler = shield, handler

    def __call__(self, signum: int, frame: FrameType | None) -> Any:
        shield = self.shield
        if shield.depth:
            shield.held.append((self.handler, signum, frame))
            return None
        if shield.deferring:  # a get took its item: the signal comes again once it returned
            _redeliver(signum)
            return None
        try:
            return self.handler(signum, frame)
        except BaseException as exc:
            if shield.after:  # between a step and its call's return: what the step did
                exc.add_note(shield.after)
            raise


class Shield:
    """The main thread's shield: `with shielded() as s:`; nested steps shield once."""

    __slots__ = ("depth", "held", "note", "after", "noting", "deferring", "_sigint")

    def __init__(self) -> None:
        self.depth = 0
        self.held: list[tuple[Callable[[int, Any], Any], int, FrameType | None]] = []
        self.note = ""  # said on the exception a held handler raises
        self.after = ""  # the note of a step, until its public call returns (`done`)
        self.noting = False  # in a call that says what it did (`begin` .. `done`)
        self.deferring = False  # its result is taken: signals come again after `done`
        self._sigint: Any = None  # what SIGINT's handler was when the holders were put in

    @property
    def pending(self) -> bool:
        """Whether a signal came during the step (its handler runs as the step ends)."""
        return bool(self.held)

    def _wrap(self) -> None:
        for s in SIGNALS:
            handler = _signal.getsignal(s)
            if callable(handler) and not isinstance(handler, Holder):
                _signal.signal(s, Holder(self, handler))
        self._sigint = _getsignal(_SIGINT)

    def __enter__(self) -> Shield:
        if _ident() != _MAIN:
            return _UNSHIELDED
        if not self.depth and _getsignal(_SIGINT) is not self._sigint:
            self._wrap()
        self.depth += 1
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if _ident() != _MAIN:
            return
        if self.depth > 1:
            self.depth -= 1
            return
        note, self.note = self.note or self.after, ""  # (a later step of the call: its note)
        held, self.held = self.held, []
        self.after = note  # (a signal from here on runs its handler at once, with the note)
        self.depth = 0
        if self.deferring:
            for _handler, signum, _frame in held:
                _redeliver(signum)
            return
        for handler, signum, frame in held:
            try:
                handler(signum, frame)
            except BaseException as exc:
                if note:
                    exc.add_note(note)
                raise


class _Unshielded(Shield):
    """What a thread other than the main one gets: no handler runs there."""

    __slots__ = ()

    def __enter__(self) -> Shield:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


_UNSHIELDED = _Unshielded()
_SHIELD = Shield()


def shielded() -> Shield:
    """A step no signal's handler interrupts (Note [shielded steps]): `with shielded() as s`."""
    return _SHIELD


def begin() -> None:
    """A public call that says what it did when interrupted (a queue's put) starts, in the
    main thread (others run no handlers); it ends with `done()`, from a `finally`."""
    if _ident() == _MAIN:
        _SHIELD.after, _SHIELD.noting = "", True


def done() -> None:
    """The call of `begin` returns: a signal from now on is not about it."""
    if _ident() == _MAIN:
        _SHIELD.after, _SHIELD.noting, _SHIELD.deferring = "", False, False


REDELIVER_S = 0.001  # a signal deferred comes again this long after (the call has returned)
_deferred: queue.SimpleQueue[int] | None = None


def _redeliver(signum: int) -> None:
    """Send `signum` to the main thread again shortly, from a thread of its own: the call
    that deferred it has returned by then, so its handler runs in the caller's code (if it
    has not, it is deferred again, until `done`)."""
    global _deferred
    if _deferred is None:
        _deferred = queue.SimpleQueue()
        threading.Thread(target=_resend, args=(_deferred,), daemon=True, name="tb-signals").start()
    _deferred.put(signum)


def _forked() -> None:
    """A child has no resending thread: it starts its own when it first defers."""
    global _deferred
    _deferred = None


os.register_at_fork(after_in_child=_forked)


def _resend(signals: queue.SimpleQueue[int]) -> None:
    while True:
        signum = signals.get()
        time.sleep(REDELIVER_S)
        signal.pthread_kill(_MAIN, signum)  # type: ignore[arg-type]
