"""aospec.signals: SIGTERM and SIGHUP take SIGINT's path (cleanup included) in plain code,
under anyio on asyncio and under trio; real processes, real signals."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from aospec.signals import interrupt_on_signals

PROGRAMS = {
    "sync": """
        import time
        try:
            print("ready", flush=True)
            time.sleep(600)
        finally:
            open(OUT, "w").write("cleaned")
    """,
    "anyio": """
        import anyio

        async def main():
            try:
                print("ready", flush=True)
                await anyio.sleep(600)
            finally:
                with anyio.CancelScope(shield=True):
                    await anyio.sleep(0.05)  # an await in the cleanup: the loop still runs it
                    open(OUT, "w").write("cleaned")

        anyio.run(main)
    """,
    "trio": """
        import trio

        async def main():
            try:
                print("ready", flush=True)
                await trio.sleep(600)
            finally:
                with trio.CancelScope(shield=True):
                    await trio.sleep(0.05)
                    open(OUT, "w").write("cleaned")

        trio.run(main)
    """,
}


def _start(tmp_path: Path, kind: str, *, ignore: tuple[int, ...] = ()) -> tuple[subprocess.Popen[str], Path]:
    out = tmp_path / f"{kind}.out"
    body = textwrap.indent(textwrap.dedent(PROGRAMS[kind]), "    ")
    code = f"OUT = {str(out)!r}\nfrom aospec.signals import interrupt_on_signals\nwith interrupt_on_signals():\n{body}"

    def ignore_signals() -> None:
        for sig in ignore:
            signal.signal(sig, signal.SIG_IGN)

    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=ignore_signals,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc, out


@pytest.mark.parametrize("kind", sorted(PROGRAMS))
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_sigterm_and_sighup_interrupt_and_clean_up_as_sigint(tmp_path: Path, kind: str, sig: int) -> None:
    proc, out = _start(tmp_path, kind)
    time.sleep(0.2)  # into the sleep
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert out.read_text() == "cleaned"
    assert "KeyboardInterrupt" in err and proc.returncode == -signal.SIGINT  # how Python exits on an interrupt


@pytest.mark.parametrize("kind", ["sync", "anyio"])
def test_an_ignored_sighup_stays_ignored(tmp_path: Path, kind: str) -> None:
    """nohup ignores SIGHUP: the command keeps running through it."""
    proc, out = _start(tmp_path, kind, ignore=(signal.SIGHUP,))
    time.sleep(0.2)
    proc.send_signal(signal.SIGHUP)
    time.sleep(0.5)
    assert proc.poll() is None and not out.exists()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert out.read_text() == "cleaned"


@pytest.mark.parametrize("kind", sorted(PROGRAMS))
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_an_ignored_sigint_takes_its_path_again(tmp_path: Path, kind: str, sig: int) -> None:
    """A command a script starts with ``&`` has SIGINT ignored: SIGTERM (and SIGINT) still
    unwind it as SIGINT would have, through asyncio's and trio's own handling."""
    proc, out = _start(tmp_path, kind, ignore=(signal.SIGINT,))
    time.sleep(0.2)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert out.read_text() == "cleaned" and "KeyboardInterrupt" in err


def test_the_previous_handlers_come_back_and_owned_signals_are_left_alone() -> None:
    def mine(signum: int, frame: object) -> None:
        pass

    before = signal.signal(signal.SIGHUP, mine)
    # SIGTERM's default, as a fresh process has it (a test run earlier in this process, Ray's
    # for one, may have left a handler of its own)
    term_before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with interrupt_on_signals():
            assert signal.getsignal(signal.SIGHUP) is mine  # a handler already owns it
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        assert signal.getsignal(signal.SIGHUP) is mine
    finally:
        signal.signal(signal.SIGHUP, before)
        if term_before is not None:  # None: a handler not set from Python, left as it is now
            signal.signal(signal.SIGTERM, term_before)


def test_a_forked_worker_starts_with_the_default_sigterm(tmp_path: Path) -> None:
    """A multiprocessing worker forked inside the block must still die on terminate()."""
    code = textwrap.dedent(
        """
        import multiprocessing, signal, time
        from aospec.signals import interrupt_on_signals

        def work():
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
            time.sleep(600)

        with interrupt_on_signals():
            p = multiprocessing.get_context("fork").Process(target=work)
            p.start()
            time.sleep(0.5)
            p.terminate()
            p.join(60)
            print(p.exitcode)
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == str(-signal.SIGTERM), r.stderr


@pytest.mark.parametrize("threads", [False, True])
def test_a_signal_during_a_deferred_cleanup_waits_for_its_end(tmp_path: Path, threads: bool) -> None:
    """A second stop signal, sent while a clean-up runs in ``deferred_signals()`` (what
    check_lossless's workers remove their state roots in), does not cut it short: it is raised
    once the block ends. With a thread that does not block signals, ``pthread_sigmask`` alone
    would not have held it (the kernel hands the signal to that thread)."""
    out = tmp_path / "out"
    code = textwrap.dedent(
        f"""
        import signal, sys, threading, time
        from aospec.signals import deferred_signals, interrupt_on_signals, interrupting_signal
        if {threads!r}:
            threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
        with interrupt_on_signals():
            try:
                with deferred_signals():
                    print("ready", flush=True)
                    for i in range(20):
                        time.sleep(0.05)
                    open({str(out)!r}, "w").write("cleaned")
            except KeyboardInterrupt as exc:
                print("raised", interrupting_signal(exc), flush=True)
                sys.exit(3)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=60)
    assert out.read_text() == "cleaned", err
    assert rest == f"raised {int(signal.SIGTERM)}\n" and proc.returncode == 3, err


def test_deferred_signals_raises_nothing_without_a_signal_and_restores_the_handlers() -> None:
    from aospec.signals import deferred_signals

    before = signal.getsignal(signal.SIGTERM)
    with deferred_signals():
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.parametrize("once", [True, False])
def test_interrupt_once_lets_the_first_stop_unwind_whatever_follows(tmp_path: Path, once: bool) -> None:
    """A worker told to stop twice (its process group's SIGTERM, then its parent's): under
    ``interrupt_once()`` the second one does not cut the async clean-up short; without it, it
    does (asyncio's second Ctrl-C), which is what the block is for."""
    out = tmp_path / "out"
    code = textwrap.dedent(
        f"""
        import contextlib
        import anyio
        from aospec.signals import interrupt_on_signals, interrupt_once

        async def main():
            with interrupt_once() if {once!r} else contextlib.nullcontext():
                try:
                    print("ready", flush=True)
                    await anyio.sleep(600)
                finally:
                    with anyio.CancelScope(shield=True):
                        print("cleaning", flush=True)
                        await anyio.sleep(1.0)
                        open({str(out)!r}, "w").write("cleaned")

        with interrupt_on_signals():
            anyio.run(main)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline() == "cleaning\n"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert "KeyboardInterrupt" in err
    assert out.exists() == once, err
