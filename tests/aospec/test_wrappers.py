"""The one sandbox-wrapper base and capabilities found once: a wrapper has an optional
capability exactly when its inner sandbox has it (or it implements it itself), isinstance
sees that the way Python 3.12+ checks protocols too (class attributes, not ``__getattr__``),
a fork's capabilities are its own, and the engine reads them from the record it built when
the run started."""

from __future__ import annotations

import inspect

import anyio
import pytest
from trio.testing import MockClock

from aospec.engine import Engine
from aospec.protocols import (
    ActionDraft,
    CachingSandbox,
    Capabilities,
    MeteredSandbox,
    PausableSandbox,
    PrioritizedSandbox,
    ReadSetSandbox,
    RoutedActionDrafter,
    SandboxCapabilities,
    StreamingActor,
    StreamingObservationDrafter,
)
from aospec.testing import (
    FaultySandbox,
    InMemorySandbox,
    ScriptedActionDrafter,
    ScriptedActor,
    ScriptedObservationDrafter,
    ScriptedRoutedActionDrafter,
    StreamingScriptedActor,
)
from aospec.types import Action, History
from aospec.wrappers import CAPABILITIES, SandboxWrapper


def run_virtual(fn):
    return anyio.run(fn, backend="trio", backend_options={"clock": MockClock(autojump_threshold=0)})


class Passing(SandboxWrapper):
    """The smallest wrapper: everything is the inner sandbox's."""

    async def fork(self) -> Passing:
        return Passing(await self.inner.fork())


class Caching(SandboxWrapper):
    """A wrapper that implements the cache capability itself (it reports a fixed hit)."""

    @property
    def last_cache_hit_ns(self) -> int | None:
        return 5

    def cache_counts(self) -> dict[str, int]:
        return {"hits": 1}

    async def fork(self) -> Caching:
        return Caching(await self.inner.fork())


class Plain:
    """A sandbox without optional capabilities whose forks are in-memory forks (which have
    priority): a fork need not have its parent's capabilities (a pool is such a sandbox)."""

    def __init__(self, inner: InMemorySandbox) -> None:
        self.inner = inner
        self.forks: list[InMemorySandbox] = []

    @property
    def version(self) -> str:
        return self.inner.version

    async def execute(self, action: Action) -> str:
        return await self.inner.execute(action)

    async def fork(self) -> InMemorySandbox:
        child = await self.inner.fork()
        self.forks.append(child)
        return child

    async def commit(self, fork: InMemorySandbox) -> None:
        await self.inner.commit(fork)

    async def discard(self) -> None:
        await self.inner.discard()


def _static(obj: object, name: str) -> bool:
    """Whether ``name`` is found the way Python 3.12+ protocol checks look (no __getattr__)."""
    try:
        inspect.getattr_static(obj, name)
    except AttributeError:
        return False
    return True


def test_a_wrapper_has_exactly_the_capabilities_of_its_inner_sandbox():
    memory = Passing(InMemorySandbox())
    assert isinstance(memory, PrioritizedSandbox) and not isinstance(memory, CachingSandbox)
    assert _static(memory, "set_priority") and not _static(memory, "last_cache_hit_ns")
    assert not hasattr(memory, "last_cache_hit_ns") and not hasattr(memory, "cache_counts")

    bare = Passing(Plain(InMemorySandbox()))
    assert not isinstance(bare, PrioritizedSandbox) and not isinstance(bare, CachingSandbox)
    assert not hasattr(bare, "set_priority")

    cached = Passing(Caching(Plain(InMemorySandbox())))
    assert isinstance(cached, CachingSandbox) and not isinstance(cached, PrioritizedSandbox)
    assert _static(cached, "last_cache_hit_ns") and _static(cached, "cache_counts")
    assert (cached.last_cache_hit_ns, cached.cache_counts()) == (5, {"hits": 1})
    # every capability the base knows is covered
    assert set(CAPABILITIES) == {PrioritizedSandbox, PausableSandbox, MeteredSandbox, CachingSandbox, ReadSetSandbox}


def test_a_wrapper_that_implements_a_capability_has_it_whatever_its_inner_sandbox():
    assert isinstance(Caching(Plain(InMemorySandbox())), CachingSandbox)
    both = Caching(InMemorySandbox())
    assert isinstance(both, CachingSandbox) and isinstance(both, PrioritizedSandbox)
    assert both.last_cache_hit_ns == 5  # its own, not a forwarded one


@pytest.mark.anyio
async def test_forwarding_reaches_the_inner_sandbox_and_forks_get_their_own_capabilities():
    inner = InMemorySandbox({"a": "1\n"})
    w = Passing(inner)
    await w.set_priority(foreground=False)
    assert inner.foreground is False
    assert w.files == {"a": "1\n"} and w.live_forks == 0  # public attributes read through
    with pytest.raises(AttributeError):
        _ = w._files  # private ones never do
    assert await w.execute(Action.bash("cat a")) == inner_observation("1\n")
    fork = await w.fork()
    assert type(fork) is type(w) and isinstance(fork, Passing) and fork.inner is not inner
    await w.commit(fork)
    # a wrapper of a sandbox without priority whose forks have it
    plain = Passing(Plain(InMemorySandbox()))
    assert not isinstance(plain, PrioritizedSandbox)
    child = await plain.fork()
    assert isinstance(child, PrioritizedSandbox)
    await child.discard()


def inner_observation(output: str) -> str:
    return f"<returncode>0</returncode>\n<output>\n{output}</output>"


@pytest.mark.anyio
async def test_a_wrapper_must_define_fork():
    class NoFork(SandboxWrapper):
        pass

    with pytest.raises(NotImplementedError, match="NoFork must define fork"):
        await NoFork(InMemorySandbox()).fork()


def test_the_fault_injector_is_a_wrapper_of_the_same_rule():
    assert isinstance(FaultySandbox(InMemorySandbox()), PrioritizedSandbox)
    assert not isinstance(FaultySandbox(Plain(InMemorySandbox())), PrioritizedSandbox)
    assert isinstance(FaultySandbox(Caching(Plain(InMemorySandbox()))), CachingSandbox)


class _BrokenCache(Plain):
    @property
    def last_cache_hit_ns(self) -> int | None:
        raise RuntimeError("cache gone")

    def cache_counts(self) -> dict[str, int]:
        return {}


def test_capabilities_are_found_by_isinstance_and_a_failing_check_means_none():
    one_shot = ScriptedObservationDrafter(lambda h, a: [])

    class Streams:
        async def draft(self, history, action, n):
            return []

        async def draft_stream(self, history, action, n):
            yield []

    routed = ScriptedRoutedActionDrafter(lambda h, t: [])
    caps = Capabilities.of(
        actor=StreamingScriptedActor(lambda h: Action.none()),
        sandbox=Passing(InMemorySandbox()),
        observation_drafters=[one_shot, Streams()],
        action_drafters=[ScriptedActionDrafter(lambda h: []), routed],
    )
    assert isinstance(StreamingScriptedActor(lambda h: Action.none()), StreamingActor)
    assert isinstance(Streams(), StreamingObservationDrafter) and isinstance(routed, RoutedActionDrafter)
    assert caps.streaming_actor and not caps.router_takes_history
    assert caps.streaming_drafters == (False, True)
    assert caps.routed_drafters == (routed,)
    assert caps.sandbox == SandboxCapabilities(prioritized=True, caching=False)
    assert SandboxCapabilities.of(_BrokenCache(InMemorySandbox())) == SandboxCapabilities()
    assert not Capabilities.of(actor=ScriptedActor(lambda h: Action.none()), sandbox=Plain(InMemorySandbox())).streaming_actor


SCRIPT = [Action.bash(c) for c in ["echo a > x", "sleep 1 && cat x", "sleep 1 && ls", "cat x"]]


def _choose(history: History) -> Action:
    return SCRIPT[len(history)] if len(history) < len(SCRIPT) else Action.none()


def test_the_engine_puts_forks_in_the_background_by_their_own_capability():
    # The committed sandbox has no priority, its forks have: every speculative fork is
    # set to the background as soon as it is forked (and one JASV waits on to the front).
    plain = Plain(InMemorySandbox(op_delay_s=0.01))
    wrong = ScriptedActionDrafter(lambda h: [ActionDraft(Action.bash("sleep 5 && rm x"), 0, 0.9)])

    async def main():
        engine = Engine(ScriptedActor(_choose, 0.5), plain, action_drafters=[wrong])
        async with engine.session(History("t")) as session:
            assert session.capabilities.sandbox == SandboxCapabilities()
            for _ in SCRIPT:
                await session.execute(await session.decode())
        return engine.statistics()

    stats = run_virtual(main)
    assert stats.forks_launched >= 1 and stats.forks_reused == 0
    background = [f for f in plain.forks if not f.foreground]
    assert 1 <= len(background) <= stats.forks_launched  # speculative forks only
    assert len(plain.forks) - len(background) >= len(SCRIPT)  # the steps' own forks stay in front
