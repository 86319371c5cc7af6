"""Language-model backends of the LM drafters, chosen by name (``drafters.LM_BACKENDS``).

A backend turns chat messages into a prompt string (``render``), counts tokens
(``count_tokens``) and samples completions with their sequence log-probabilities
(``complete``). Names: ``transformers`` (in-process PyTorch, CPU or GPU), ``vllm``
(in-process ``vllm.LLM``, LoRA adapters) and ``openai`` (any OpenAI-compatible
``/v1/completions`` endpoint that returns logprobs). Each is imported only when built;
a missing package gives one MissingDependencyError naming the pip command.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

import anyio

from aospec.drafting import charge_offloaded_cpu

__all__ = [
    "BlockingCompletions",
    "Completion",
    "DecodeMode",
    "LMBackend",
    "Offload",
    "in_virtual_time",
    "is_inline",
    "make_backend",
    "merge_completions",
    "run_blocking",
]

T = TypeVar("T")

#: Where blocking model calls run: ``thread`` (a worker thread), ``inline`` (in the event
#: loop), ``auto`` (inline under a virtual clock, threaded otherwise).
Offload = Literal["auto", "thread", "inline"]

#: ``sample``: n independent samples; ``greedy``: the argmax continuation;
#: ``beam``: the n best beams (rescored to exact sequence log-probabilities).
DecodeMode = Literal["sample", "greedy", "beam"]


@dataclass(frozen=True, slots=True)
class Completion:
    """One generated continuation.

    ``logprob`` is the sum of the token log-probabilities under the model (temperature
    1, including the end token when ``finished``); ``tokens`` counts generated tokens;
    ``finished`` is False when generation stopped at the token limit; ``token_ids`` are
    the generated ids and ``token_logprobs`` their log-probabilities, when the backend
    knows them.
    """

    text: str
    logprob: float
    tokens: int
    finished: bool
    token_ids: tuple[int, ...] = ()
    token_logprobs: tuple[float, ...] = ()


@runtime_checkable
class LMBackend(Protocol):
    """What the LM drafters need from a language model."""

    def render(self, messages: Sequence[Mapping[str, str]]) -> str: ...

    def count_tokens(self, text: str) -> int: ...

    async def complete(
        self,
        prompt: str,
        *,
        n: int,
        max_new_tokens: int,
        mode: DecodeMode = "sample",
        temperature: float = 1.0,
        seed: int = 0,
    ) -> list[Completion]: ...


def merge_completions(completions: Sequence[Completion]) -> list[Completion]:
    """Distinct texts, most probable first (duplicate samples of one text collapse)."""
    best: dict[str, Completion] = {}
    for c in completions:
        old = best.get(c.text)
        if old is None or (c.finished, c.logprob) > (old.finished, old.logprob):
            best[c.text] = c
    return sorted(best.values(), key=lambda c: (not c.finished, -c.logprob))


def make_backend(name: str, options: Mapping[str, Any] | None = None) -> LMBackend:
    """Build the backend registered as ``name`` (or a dotted path) with keyword ``options``."""
    import inspect

    from aospec.drafters import resolve

    from aospec.errors import ConfigError

    cls = resolve("LM backend", name)
    options = dict(options or {})
    try:
        inspect.signature(cls).bind(**options)
    except TypeError as exc:
        raise ConfigError(f"LM backend {name!r}: {exc}") from None
    return cls(**options)


def in_virtual_time() -> bool:
    """True under trio's MockClock (replay): there, model compute must not yield to the
    event loop, or the clock would jump while the model is still computing."""
    try:
        import sniffio

        if sniffio.current_async_library() != "trio":
            return False
        import trio
        import trio.testing

        return isinstance(trio.lowlevel.current_clock(), trio.testing.MockClock)
    except Exception:
        return False


def is_inline(offload: Offload) -> bool:
    """Whether :func:`run_blocking` runs work under ``offload`` in the caller's thread:
    ``inline``, or ``auto`` in replay's virtual time."""
    return offload == "inline" or (offload == "auto" and in_virtual_time())


async def run_blocking(work: Callable[[threading.Event | None], T], offload: Offload = "auto") -> T:
    """Run ``work(stop)`` for an async caller. Threaded, a cancelled caller sets ``stop``
    and waits until ``work`` returns: no computation outlives the call. The worker
    thread's CPU time is charged to the drafting round of the engine's drafter call this
    runs for (:func:`aospec.drafting.charge_offloaded_cpu`: a drafting round is priced by
    its CPU; the CPU of a library's own thread pool, such as torch's intra-op threads
    beyond the first, is not seen)."""
    if is_inline(offload):
        return work(None)
    stop = threading.Event()
    done = threading.Event()
    lock = threading.Lock()
    state = {"started": False, "cancelled": False}
    spent = [0]

    def run() -> T:
        with lock:
            if state["cancelled"]:
                raise _NotStarted  # (the caller is gone: nothing to compute)
            state["started"] = True
        t0 = time.thread_time_ns()
        try:
            return work(stop)
        finally:
            spent[0] = time.thread_time_ns() - t0
            done.set()

    try:
        return await anyio.to_thread.run_sync(run, abandon_on_cancel=True)
    except anyio.get_cancelled_exc_class():
        # The caller was cancelled: ask the worker to stop at its next decode step and
        # wait (shielded) until it has, so the model is free and nothing runs on; a worker
        # that has not started never will.
        stop.set()
        with lock:
            state["cancelled"] = True
            started = state["started"]
        if started:
            with anyio.CancelScope(shield=True):
                while not done.is_set():
                    await anyio.sleep(0.001)
        raise
    finally:
        if done.is_set():
            charge_offloaded_cpu(spent[0])


class _NotStarted(Exception):
    """Raised in a worker thread whose caller was cancelled before it started."""


class BlockingCompletions:
    """``complete`` for a backend whose work is its blocking ``complete_sync``: run off the
    event loop through :func:`run_blocking` (inline in replay's virtual time). A backend
    that can stop mid-generation honours ``stop``; one that cannot makes a cancelled caller
    wait for the generation to end."""

    offload: Offload

    def complete_sync(
        self, prompt: str, *, n: int, max_new_tokens: int, mode: DecodeMode = "sample", temperature: float = 1.0,
        seed: int = 0, stop: threading.Event | None = None,
    ) -> list[Completion]:
        raise NotImplementedError

    async def complete(
        self, prompt: str, *, n: int, max_new_tokens: int, mode: DecodeMode = "sample", temperature: float = 1.0,
        seed: int = 0, on_text: Callable[[str], None] | None = None,
    ) -> list[Completion]:
        """``n`` completions of ``prompt`` (see ``complete_sync``); ``on_text``, when given,
        is passed on to a ``complete_sync`` that streams (the transformers backend's)."""
        extra = {} if on_text is None else {"on_text": on_text}

        def work(stop: threading.Event | None) -> list[Completion]:
            return self.complete_sync(prompt, n=n, max_new_tokens=max_new_tokens, mode=mode, temperature=temperature,
                                      seed=seed, stop=stop, **extra)

        return await run_blocking(work, self.offload)
