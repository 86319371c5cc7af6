"""One base for sandboxes that wrap another sandbox.

A wrapper changes part of what its ``inner`` sandbox does (serves results from a cache,
injects faults, answers a format error itself, runs a harness's commands) and is the inner
sandbox in everything else, by one rule:

- the Sandbox methods it does not define are the inner sandbox's (``version``, ``execute``,
  ``commit`` of a fork's ``inner``, ``discard``); ``fork`` it defines, to wrap the child;
- an optional capability (:data:`CAPABILITIES`: :class:`~aospec.protocols.PrioritizedSandbox`,
  :class:`~aospec.protocols.PausableSandbox`, :class:`~aospec.protocols.MeteredSandbox`,
  :class:`~aospec.protocols.CachingSandbox`, :class:`~aospec.protocols.ReadSetSandbox`) is the inner sandbox's: a wrapper has it when
  its inner sandbox has it (forwarded) or when it implements it itself, and never
  otherwise. ``isinstance`` sees exactly that, on every Python version: each wrapper is
  made an instance of its class plus one forwarding mixin per capability its inner sandbox
  has (a class attribute, which ``isinstance`` checks find; ``__getattr__`` forwarding is
  invisible to them from Python 3.12 on). Its own methods win over the forwarders;
- any other public attribute it does not define is read from the inner sandbox
  (``wrapper.files``); private names never pass through.

A fork of a wrapper is a wrapper of the inner sandbox's fork, so its capabilities are that
fork's (which need not be its parent's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Self, cast

from aospec.protocols import (
    CachingSandbox,
    MeteredSandbox,
    PausableSandbox,
    PrioritizedSandbox,
    ReadSetSandbox,
    Sandbox,
    SandboxCapabilities,
)
from aospec.readsets import ReadSet, WriteSet
from aospec.types import Action

__all__ = ["CAPABILITIES", "SandboxWrapper"]

#: The optional Sandbox capabilities a wrapper forwards when its inner sandbox has them, by
#: protocol: their members.
CAPABILITIES: dict[type, frozenset[str]] = {
    PrioritizedSandbox: frozenset({"set_priority"}),
    PausableSandbox: frozenset({"pause", "resume", "paused"}),
    MeteredSandbox: frozenset({"cpu_ns"}),
    CachingSandbox: frozenset({"last_cache_hit_ns", "cache_counts"}),
    ReadSetSandbox: frozenset({"trace_reads", "read_set", "write_set", "rebase"}),
}
_MEMBERS = frozenset().union(*CAPABILITIES.values())


class _ForwardsPriority:
    inner: Any

    async def set_priority(self, *, foreground: bool) -> None:
        await self.inner.set_priority(foreground=foreground)


class _ForwardsPause:
    inner: Any

    async def pause(self) -> None:
        await self.inner.pause()

    async def resume(self) -> None:
        await self.inner.resume()

    @property
    def paused(self) -> bool:
        return bool(self.inner.paused)


class _ForwardsCpu:
    inner: Any

    @property
    def cpu_ns(self) -> int:
        return int(self.inner.cpu_ns)


class _ForwardsCache:
    inner: Any
    _forwarded_cache_hit_ns: Callable[[], int | None]

    @property
    def last_cache_hit_ns(self) -> int | None:
        return self._forwarded_cache_hit_ns()

    def cache_counts(self) -> dict[str, int]:
        return self.inner.cache_counts()


class _ForwardsReadSets:
    inner: Any

    async def trace_reads(self) -> None:
        await self.inner.trace_reads()

    async def read_set(self) -> ReadSet | None:
        return await self.inner.read_set()

    async def write_set(self) -> WriteSet | None:
        return await self.inner.write_set()

    async def rebase(self, fork: Any) -> WriteSet:
        return await self.inner.rebase(fork.inner)


_VARIANTS: dict[tuple[type, SandboxCapabilities], type] = {}


def _variant(cls: type, caps: SandboxCapabilities) -> type:
    """``cls`` with the forwarding mixin of each capability in ``caps`` (made once)."""
    variant = _VARIANTS.get((cls, caps))
    if variant is None:
        mixins = [
            m
            for m, on in (
                (_ForwardsPriority, caps.prioritized),
                (_ForwardsPause, caps.pausable),
                (_ForwardsCpu, caps.metered),
                (_ForwardsCache, caps.caching),
                (_ForwardsReadSets, caps.read_sets),
            )
            if on
        ]
        namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "_wrapper_class": cls}
        variant = _VARIANTS[(cls, caps)] = type(cls.__name__, (cls, *mixins), namespace)
    return variant


class SandboxWrapper:
    """Base of sandboxes that wrap ``inner`` (the constructor's first argument); the module
    docstring says what passes through. A subclass calls ``super().__init__(inner)``,
    defines ``fork`` (wrapping ``await self.inner.fork()``) and whatever else it changes."""

    inner: Sandbox

    def __new__(cls, inner: Sandbox, *args: Any, **kwargs: Any) -> Self:
        declared: type = cls.__dict__.get("_wrapper_class", cls)
        caps = SandboxCapabilities.of(inner)
        return super().__new__(_variant(declared, caps) if caps != SandboxCapabilities() else declared)

    def __init__(self, inner: Sandbox) -> None:
        self.inner = inner

    @property
    def version(self) -> str:
        return self.inner.version

    async def execute(self, action: Action) -> str:
        return await self.inner.execute(action)

    async def fork(self) -> Self:
        raise NotImplementedError(f"{type(self).__name__} must define fork() to wrap its inner sandbox's fork")

    async def commit(self, fork: Self) -> None:
        await self.inner.commit(fork.inner)

    async def discard(self) -> None:
        await self.inner.discard()

    def _forwarded_cache_hit_ns(self) -> int | None:
        """The ``last_cache_hit_ns`` forwarded from a caching inner sandbox; a wrapper that
        answers some ``execute`` calls itself overrides it (None after those)."""
        return cast(CachingSandbox, self.inner).last_cache_hit_ns

    def __getattr__(self, name: str) -> Any:
        # Only reached for what the wrapper lacks: a capability it lacks, its inner sandbox
        # lacks too (else its class would forward it); private names and ``inner`` (not
        # set yet) are never looked up on the inner sandbox.
        if name.startswith("_") or name == "inner" or name in _MEMBERS:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.inner, name)
