"""SIGTERM and SIGHUP handled as SIGINT is, for every long-running command.

Python answers SIGINT with a cancellation that runs every ``finally`` and ``async with``
exit (inside ``anyio.run`` the main task is cancelled, then KeyboardInterrupt is raised),
so sandboxes, mounts, cgroups and state directories are released. SIGTERM (systemd,
``docker stop``, ``kill``) and SIGHUP (a closed terminal) would otherwise end the process
at once and leak all of it. ::

    from aospec.signals import interrupt_on_termination

    with interrupt_on_termination():
        anyio.run(main)        # SIGTERM/SIGHUP now do exactly what Ctrl-C does

The KeyboardInterrupt that leaves the block after SIGTERM or SIGHUP is a
:class:`Terminated` (a KeyboardInterrupt) naming the signal; ``aospec``'s command line
exits with ``128 + signal`` for it (143 for SIGTERM), 130 for Ctrl-C.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

__all__ = ["TERMINATION_SIGNALS", "Terminated", "interrupt_on_termination"]

TERMINATION_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """The interruption a termination signal caused; ``signum`` is that signal."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


@contextlib.contextmanager
def interrupt_on_termination(signals: tuple[int, ...] = TERMINATION_SIGNALS) -> Iterator[None]:
    """While the block runs, each of ``signals`` does what SIGINT does at that moment:
    it calls the SIGINT handler in place then (asyncio's and trio's cancel the main task;
    Python's default raises KeyboardInterrupt), or raises KeyboardInterrupt where SIGINT
    has no Python handler (ignored by a parent, as for a background job). A
    KeyboardInterrupt leaving the block after one of them is re-raised as
    :class:`Terminated`. The previous handlers come back afterwards. Outside the main
    thread (where no signal handler can be set) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler):
            handler(signal.SIGINT, frame)
        else:
            raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, forward) for sig in signals}
    try:
        yield
    except KeyboardInterrupt as exc:
        if received and not isinstance(exc, Terminated):
            raise Terminated(received[0]) from None
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
