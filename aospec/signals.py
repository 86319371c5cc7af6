"""SIGTERM and SIGHUP stop a command the way Ctrl-C does, so they clean up the same way.

A long-running command cleans up on SIGINT because Python turns it into an orderly
unwinding: ``KeyboardInterrupt`` in plain code; under ``anyio.run`` (asyncio) the
cancellation of the main task, then ``KeyboardInterrupt`` once everything has unwound;
under trio its own delivery to the main task. Every ``finally``, ``with`` and ``async
with`` runs: sandboxes unmount, forks are discarded, state directories and shared memory
are freed. SIGTERM (``kill``, a service manager, ``timeout``) and SIGHUP (the terminal
closed) kill the process outright by default, skipping all of it.

Inside ``with interrupt_on_signals():`` they take the SIGINT path instead: each calls
whatever handles SIGINT *at that moment* (asyncio's runner, trio, uvicorn's shutdown, or
Python's default, which raises ``KeyboardInterrupt``), or raises ``KeyboardInterrupt``
when SIGINT itself is ignored (a background job of a script). So the same code path runs,
whatever the framework, and a second signal is a second Ctrl-C::

    from aospec.signals import interrupt_on_signals

    with interrupt_on_signals():
        anyio.run(main)  # SIGTERM and SIGHUP now cancel main() as SIGINT does

Only signals at their default disposition are taken over: one the parent ignores (``nohup``
ignores SIGHUP) stays ignored, one a handler already owns stays with it. SIGINT itself is
the exception: when it is ignored (what a non-interactive shell does to a command started
with ``&``), the block gives it Python's default handler back, since SIGINT's path is the
one every signal takes here and asyncio and trio set up their handling of it only over
that default. The previous handlers come back when the block ends. Outside the main thread
(where Python cannot set handlers) the block does nothing. A process forked inside the block (a multiprocessing
worker) starts with SIGTERM and SIGHUP at their defaults again, so ``terminate()`` still
ends it; a worker that must clean up opens a block of its own.

The ``KeyboardInterrupt`` that leaves the block after SIGTERM or SIGHUP carries the signal
as its ``signum`` attribute (:func:`interrupting_signal` reads it; an uncaught one still ends
a script as an interrupt does); ``aospec``'s command line exits with ``128 + signum`` for it
(143 for SIGTERM), 130 for Ctrl-C.

A process that several senders may stop at once (a pool worker: a terminal's Ctrl-C or a
service manager reaches its whole process group, then its parent passes the stop on) opens
``with interrupt_once():`` where its work runs, inside ``anyio.run`` or ``trio.run`` (whose
SIGINT handling is in place by then): the first of SIGINT, SIGTERM and SIGHUP does what
SIGINT did at the block's start (cancel the main task); the later ones are only noted, where
a second Ctrl-C would have raised ``KeyboardInterrupt`` in the middle of the unwinding and
left the event loop cancelling tasks that never finish.

Clean-up that must not be cut short (removing a state directory after an interrupt, while a
second signal may come) runs inside ``with deferred_signals():``: SIGINT, SIGTERM and SIGHUP
are only noted there, and the first one noted is raised as ``KeyboardInterrupt`` when the
block ends, unless an exception already leaves it. Blocking the signals with
``pthread_sigmask`` is not enough in a process with threads: the kernel hands a signal to
any thread that does not block it, and Python then runs the handler in the main thread
anyway.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterable, Iterator
from types import FrameType

__all__ = [
    "INTERRUPTING_SIGNALS",
    "deferred_signals",
    "interrupt_on_signals",
    "interrupt_once",
    "interrupting_signal",
    "signals_received",
]

#: The signals :func:`interrupt_on_signals` takes over by default.
INTERRUPTING_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGHUP)


def interrupting_signal(exc: KeyboardInterrupt) -> int:
    """The signal behind ``exc``: the taken-over one it carries (``signum``), else SIGINT."""
    signum = exc.__dict__.get("signum")
    return signum if isinstance(signum, int) else int(signal.SIGINT)


#: The taken-over signals received, newest last (main thread only, so no lock is needed).
_received: list[int] = []


def _as_sigint(signum: int, frame: FrameType | None) -> None:
    _received.append(signum)
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)
    else:  # SIGINT at its C default or ignored by someone since: what Python's handler raises
        raise KeyboardInterrupt


def _default_in_child() -> None:
    """A forked child (a multiprocessing worker) starts with the signals at their defaults:
    the takeover is its parent's (``Process.terminate()`` must still end a worker); a child
    that cleans up on SIGTERM opens its own block."""
    for sig in (*INTERRUPTING_SIGNALS, signal.SIGINT):
        if signal.getsignal(sig) is _as_sigint:
            signal.signal(sig, signal.SIG_DFL)


os.register_at_fork(after_in_child=_default_in_child)


def signals_received() -> tuple[int, ...]:
    """The signals taken over by an open :func:`interrupt_on_signals` block or noted by
    :func:`deferred_signals` so far, oldest first (a thread that must not signal a second time
    reads it)."""
    return tuple(_received)


#: what interrupt_once and deferred_signals take over
_STOPPING = (signal.SIGINT, *INTERRUPTING_SIGNALS)


def _restore(previous: dict[int, object]) -> None:
    """Put back the handlers a block replaced (None, a handler not set from Python: the default)."""
    for sig, handler in previous.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)  # type: ignore[arg-type]
    previous.clear()


class interrupt_once(contextlib.AbstractContextManager["interrupt_once"]):
    """Inside the block the first of SIGINT, SIGTERM and SIGHUP runs SIGINT's handler of the
    block's start; the later ones are noted only (module doc). An ignored signal stays
    ignored; a handler other than aospec's own keeps SIGTERM or SIGHUP. Outside the main
    thread it does nothing."""

    def __init__(self) -> None:
        self._previous: dict[int, object] = {}
        self._sigint: object = None
        self._fired = False

    def _first(self, signum: int, frame: FrameType | None) -> None:
        _received.append(signum)
        if self._fired:
            return
        self._fired = True
        handler = self._sigint
        if callable(handler):
            handler(signal.SIGINT, frame)
        else:
            raise KeyboardInterrupt

    def __enter__(self) -> interrupt_once:
        if threading.current_thread() is threading.main_thread():
            self._sigint = signal.getsignal(signal.SIGINT)
            for sig in _STOPPING:
                current = signal.getsignal(sig)
                if current is signal.SIG_IGN or (sig != signal.SIGINT and current not in (_as_sigint, signal.SIG_DFL)):
                    continue
                self._previous[sig] = signal.signal(sig, self._first)
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        _restore(self._previous)


class deferred_signals(contextlib.AbstractContextManager["deferred_signals"]):
    """SIGINT, SIGTERM and SIGHUP are noted, not acted on, inside the block (module doc); the
    first noted one is raised when it ends, as ``KeyboardInterrupt`` carrying ``signum``. A
    signal that is ignored stays ignored. Outside the main thread it does nothing."""

    def __init__(self) -> None:
        self._previous: dict[int, object] = {}
        self._noted: list[int] = []

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self._noted.append(signum)
        _received.append(signum)

    def __enter__(self) -> deferred_signals:
        if threading.current_thread() is threading.main_thread():
            for sig in _STOPPING:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        _restore(self._previous)
        if self._noted and exc_type is None:
            interrupt = KeyboardInterrupt()
            if self._noted[0] != signal.SIGINT:
                interrupt.signum = self._noted[0]  # type: ignore[attr-defined]
            raise interrupt


@contextlib.contextmanager
def interrupt_on_signals(signals: Iterable[int] = INTERRUPTING_SIGNALS) -> Iterator[None]:
    """Within the block, each of ``signals`` (default SIGTERM and SIGHUP) does what SIGINT
    does (module doc)."""
    previous: dict[int, object] = {}
    mark = len(_received)
    if threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None):
            # a background job of a non-interactive shell: SIGINT is the way out here, and
            # asyncio's runner and trio take it over only from Python's default handler
            previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in signals:
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                signal.signal(sig, _as_sigint)
                previous[sig] = signal.SIG_DFL
    try:
        yield
    except KeyboardInterrupt as exc:
        if len(_received) > mark and "signum" not in exc.__dict__:
            exc.signum = _received[mark]  # type: ignore[attr-defined]
        raise
    finally:
        del _received[mark:]
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
