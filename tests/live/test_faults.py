"""Lossless, whatever fails: engine-level faults (docs/engine.md, Faults).

Every fault below the model endpoint, injected with the real stand-ins of
:mod:`aospec.testing` (``FaultySandbox``, ``FaultyActor``, ``FaultyObservationDrafter``,
``FaultyActionDrafter``) into a live engine run, on the in-memory sandbox and on a real
overlay sandbox (busybox base; skipped where overlayfs cannot run):

- a fault on a speculative path (a drafter, a provisional decode, a speculative fork, a
  discard) only costs speed: the run completes and its committed trajectory, version and
  files equal the fault-free serial run's; the failure is counted;
- a fault on the verified path (the step's decode, its fork or execution, its commit, the
  committed sandbox's version) ends the run with that one error (not a group), and the
  verified history and the committed sandbox still agree (the state after a prefix of the
  serial run); no fork, mount, process or state directory is left behind.

A property test draws random fault schedules (hypothesis, few examples). No timing is
asserted: hangs are shown harmless by runs that finish (pytest-timeout guards).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aospec.engine import Engine
from aospec.engine_config import EngineConfig
from aospec.errors import (
    AospecError,
    DrafterError,
    EngineError,
    FailedAfterCommitError,
    SandboxError,
    StateUnknownError,
)
from aospec.ledger import EventKind
from aospec.protocols import ActionDraft, ObservationDraft
from aospec.session import MAX_DRAFTS_PER_CALL
from aospec.testing import (
    Fault,
    FaultCall,
    FaultyActionDrafter,
    FaultyActor,
    FaultyObservationDrafter,
    FaultySandbox,
    InjectedFault,
    InMemorySandbox,
    ScriptedActionDrafter,
    ScriptedActor,
    ScriptedObservationDrafter,
)
from aospec.types import Action, History

TASK = "faults"
POOL = tuple(
    Action.bash(c)
    for c in ("echo a > x", "echo b >> x", "cat x", "ls", "rm x", "echo c > y", "cat y", "sleep 0.01 && cat x")
)
SEED = 3
STEPS = 7
OP_DELAY_S = 0.02  # in-memory command time, so speculation has something to hide
ACTOR_DELAY_S = 0.02
# admission off: faults are injected into wrong guesses, which the speculation controller
# would price out once it has seen them miss (its own faults: tests/aospec/test_admission.py)
CONFIG = EngineConfig(
    branch_budget=2, draft_candidates=3, obs_depth=2, fork_width=3, depth=2, max_live_forks=8, admission="off"
)
SERIAL = EngineConfig(branch_budget=0, fork_width=0)
#: each committed step in a fresh fork that is then committed, on every backend
FORK_STEPS = dataclasses.replace(CONFIG, steps_in_place=False)
IN_PLACE = ("memory-in-place", "overlay")


def make_actor() -> ScriptedActor:
    return ScriptedActor.hashing(POOL, seed=SEED, delay_s=ACTOR_DELAY_S)


# ---------------------------------------------------------------------------------- backends


def _overlay_reason() -> str | None:
    from aospec.runtime.host import host_support

    support, _ = host_support()
    problems = support.problems()
    return "; ".join(problems) if problems else None


@pytest.fixture(scope="module")
def overlay_dirs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A private base cache and state root for the module's overlay sandboxes; nothing may
    be mounted under the state root afterwards."""
    reason = _overlay_reason()
    if reason:
        pytest.skip(f"overlay backend cannot run here: {reason}")
    from aospec.runtime._fs import mounts_under

    cache, state = tmp_path_factory.mktemp("faults-cache"), tmp_path_factory.mktemp("faults-state")
    mp = pytest.MonkeyPatch()
    mp.setenv("AOSPEC_CACHE_DIR", str(cache))
    mp.setenv("AOSPEC_STATE_ROOT", str(state))
    yield state
    mp.undo()
    assert not mounts_under(str(state))


#: "memory-in-place": the in-memory sandbox with ``forks_during_execute``, whose steps the
#: engine runs on the committed sandbox itself, as it does the overlay backend's
@pytest.fixture(params=["memory", "memory-in-place", pytest.param("overlay", marks=pytest.mark.root)])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "overlay":
        request.getfixturevalue("overlay_dirs")
    return str(request.param)


@dataclass
class Box:
    """An open committed sandbox of one backend and how to read its state."""

    backend: str
    sandbox: Any

    async def state(self) -> tuple[str, Any]:
        if self.backend.startswith("memory"):
            return self.sandbox.version, self.sandbox.files
        from aospec.runtime.lossless import snapshot_sandbox

        return self.sandbox.version, await snapshot_sandbox(self.sandbox)

    def live_forks(self) -> int:
        if self.backend.startswith("memory"):
            return int(self.sandbox.live_forks)
        return len(self.sandbox.store.live) - 1  # the committed sandbox itself is live


@asynccontextmanager
async def open_box(backend: str) -> AsyncIterator[Box]:
    if backend.startswith("memory"):
        yield Box(backend, InMemorySandbox(op_delay_s=OP_DELAY_S, forks_during_execute=backend == "memory-in-place"))
        return
    from aospec.runtime import SandboxConfig, open_sandbox
    from aospec.runtime._fs import mounts_under
    from aospec.runtime.processes import marked_processes

    async with open_sandbox(SandboxConfig(backend="overlay", base="busybox", timeout_s=20, formatter="mini-swe-agent")) as sb:
        store_id, path = sb.store.id, sb.store.path
        yield Box(backend, sb)
    # Nothing of the session is left: no mount, no sandbox process, no state directory.
    assert not mounts_under(str(path))
    assert not marked_processes(f"aospec-{store_id}-")
    assert not Path(path).exists()


# ---------------------------------------------------------------------------------- the reference


@dataclass
class Reference:
    """The fault-free serial run: its history and the committed state after each prefix."""

    history: History
    states: list[tuple[str, Any]]

    @property
    def pairs(self) -> set[tuple[str, str]]:
        """(version, action key) of every serial step: what the verified path executes."""
        return {(self.states[i][0], t.action.key) for i, t in enumerate(self.history.turns)}

    def prefix(self, history: History) -> int | None:
        """k when ``history`` is the serial run's first k turns, else None."""
        k = len(history)
        return k if k <= len(self.history) and history.turns == self.history.turns[:k] else None


_references: dict[str, Reference] = {}


def reference(backend: str) -> Reference:
    if backend not in _references:

        async def main() -> Reference:
            async with open_box(backend) as box:
                engine = Engine(make_actor(), box.sandbox, config=SERIAL)
                states = [await box.state()]
                async with engine.session(History(TASK)) as session:
                    for _ in range(STEPS):
                        await session.execute(await session.decode())
                        states.append(await box.state())
                return Reference(session.history, states)

        _references[backend] = anyio.run(main)
    return _references[backend]


def truth_drafters(ref: Reference, *, wrong: bool = True) -> tuple[ScriptedObservationDrafter, ScriptedActionDrafter]:
    """Drafters that know the serial run: the true observation and future actions, and
    (``wrong``) a wrong guess next to each."""

    def observe(history: History, action: Action) -> list[ObservationDraft]:
        k = ref.prefix(history)
        out = []
        if k is not None and k < len(ref.history) and ref.history.turns[k].action == action:
            out.append(ObservationDraft(ref.history.turns[k].observation, 0.6))
        if wrong:
            out.append(ObservationDraft(f"<returncode>0</returncode>\n<output>\nwrong {len(history)}\n</output>", 0.4))
        return out

    def propose(history: History) -> list[ActionDraft]:
        k = ref.prefix(history)
        out = []
        if k is not None:
            out += [ActionDraft(t.action, i, 0.8 - 0.1 * i) for i, t in enumerate(ref.history.turns[k : k + 2])]
        if wrong:
            out.append(ActionDraft(POOL[len(history) % len(POOL)], 0, 0.3))
        return out

    return ScriptedObservationDrafter(observe), ScriptedActionDrafter(propose)


# ---------------------------------------------------------------------------------- a run


@dataclass
class Outcome:
    history: History
    error: BaseException | None
    state: tuple[str, Any]
    live_forks: int
    failures: int
    events: list[Any] = field(default_factory=list)
    injected: list[tuple[Fault, FaultCall]] = field(default_factory=list)
    hanging: int = 0

    held: int = 0
    """Forks whose discard failed before taking effect: the backend holds them until its
    session closes (open_box checks the overlay session then leaves nothing behind)."""


def run(
    backend: str,
    *,
    faults: Sequence[Fault] = (),
    actor: Any = None,
    obs: Any = "truth",
    act: Any = "truth",
    config: EngineConfig = CONFIG,
    steps: int = STEPS,
) -> Outcome:
    """One engine run with faults; ``obs``/``act``: drafters (or "truth", or None)."""
    ref = reference(backend)
    true_obs, true_act = truth_drafters(ref)
    observation_drafters = [true_obs] if obs == "truth" else list(obs or [])
    action_drafters = [true_act] if act == "truth" else list(act or [])

    async def main() -> Outcome:
        async with open_box(backend) as box:
            sb = FaultySandbox(box.sandbox, faults)
            engine = Engine(
                actor or make_actor(),
                sb,
                observation_drafters=observation_drafters,
                action_drafters=action_drafters,
                config=config,
            )
            error: BaseException | None = None
            session = None
            try:
                async with engine.session(History(TASK)) as session:
                    for _ in range(steps):
                        await session.execute(await session.decode())
            except Exception as exc:
                error = exc
            assert session is not None
            stats = engine.statistics()
            return Outcome(
                history=session.history,
                error=error,
                state=await box.state(),
                live_forks=box.live_forks(),
                failures=stats.speculative_failures,
                events=list(engine.ledger.events),
                injected=sb.injected,
                hanging=sb.hanging,
                held=held(sb),
            )

    return anyio.run(main)


def held(sb: FaultySandbox) -> int:
    """Forks the backend still holds because their discard failed (a fork committed after
    all is not held)."""
    return len({id(x) for x in sb.undiscarded if not getattr(x, "_closed", False)})


def assert_lossless(backend: str, out: Outcome) -> None:
    """The run completed and equals the serial run; nothing is left open."""
    ref = reference(backend)
    assert out.error is None, f"{type(out.error).__name__}: {out.error}"
    assert out.history.turns == ref.history.turns
    assert out.state == ref.states[-1]
    assert out.live_forks == out.held
    assert out.hanging == 0


def assert_clean_failure(backend: str, out: Outcome, error: type[BaseException]) -> int:
    """The run ended with exactly ``error`` (not a group, not wrapped); the verified history
    is a prefix of the serial run's and the committed state is that prefix's; no fork is
    left. Returns the prefix's length."""
    ref = reference(backend)
    assert out.error is not None, "the run should have failed"
    assert type(out.error) is error, f"{type(out.error).__name__}: {out.error}"
    assert not isinstance(out.error, BaseExceptionGroup)
    k = ref.prefix(out.history)
    assert k is not None, "the verified history is no prefix of the serial run"
    assert out.state == ref.states[k], "the committed state is not the verified history's"
    assert out.live_forks == out.held
    assert out.hanging == 0
    return k


def error_class(kind: str, seam: type[AospecError]) -> type[BaseException]:
    return InjectedFault if kind == "unexpected" else seam


# ---------------------------------------------------------------------------------- drafters


@pytest.mark.parametrize("kind", ["error", "unexpected"])
def test_an_observation_drafter_that_raises_only_costs_speed(backend: str, kind: str) -> None:
    true_obs, _ = truth_drafters(reference(backend))
    faulty = FaultyObservationDrafter(true_obs, kind, when=lambda h, a: len(h) % 2 == 0)
    out = run(backend, obs=[faulty])
    assert_lossless(backend, out)
    assert faulty.faults > 0 and out.failures >= faulty.faults


def test_an_observation_drafter_that_hangs_never_holds_up_the_verified_path(backend: str) -> None:
    true_obs, _ = truth_drafters(reference(backend))
    hung = FaultyObservationDrafter(None, "hang")
    out = run(backend, obs=[hung, true_obs], act=None)  # no forks done early: every step's observation is drafted
    assert_lossless(backend, out)
    # every hung call was cancelled (at its step's real observation, or when its branch or
    # the run ended), and the good drafter's drafts were used meanwhile
    assert hung.faults > 0 and hung.hanging == 0 and hung.cancelled == hung.faults
    assert any(e.kind is EventKind.DRAFT_HIT for e in out.events)


def test_a_lone_hung_observation_drafter_is_cancelled_at_each_step(backend: str) -> None:
    hung = FaultyObservationDrafter(None, "hang")
    out = run(backend, obs=[hung], act=None)
    assert_lossless(backend, out)
    assert hung.faults >= STEPS and hung.hanging == 0 and hung.cancelled == hung.faults
    lost = [e for e in out.events if e.kind is EventKind.DRAFT_CANCEL and e.detail == "drafting lost the race"]
    assert len(lost) >= STEPS


def test_each_step_commits_while_the_hung_drafter_is_still_hanging() -> None:
    # The step does not wait for drafting: when execute() returns, the hung call of that
    # step has only been told to stop (its cancellation is delivered afterwards).
    ref = reference("memory")
    hung = FaultyObservationDrafter(None, "hang")

    async def main() -> list[int]:
        engine = Engine(
            make_actor(), InMemorySandbox(op_delay_s=OP_DELAY_S), observation_drafters=[hung], config=CONFIG
        )
        hanging = []
        async with engine.session(History(TASK)) as session:
            for _ in range(STEPS):
                await session.execute(await session.decode())
                hanging.append(hung.hanging)
        assert session.history.turns == ref.history.turns
        return hanging

    hanging = anyio.run(main)
    assert all(n >= 1 for n in hanging), hanging
    assert hung.hanging == 0 and hung.cancelled == hung.faults


@pytest.mark.parametrize("kind", ["error", "unexpected", "hang"])
def test_an_action_drafter_that_raises_or_hangs_only_costs_speed(backend: str, kind: str) -> None:
    _, true_act = truth_drafters(reference(backend))
    faulty = FaultyActionDrafter(true_act, kind, when=lambda h: len(h) % 2 == 1)
    out = run(backend, act=[faulty])
    assert_lossless(backend, out)
    assert faulty.faults > 0 and faulty.hanging == 0
    if kind == "hang":
        assert faulty.cancelled == faulty.faults
    else:
        assert out.failures >= faulty.faults


def _obs(text: Any = "x", p: Any = 0.5) -> ObservationDraft:
    return ObservationDraft(text, p)


def _infinite(drafts: list[ObservationDraft]) -> Any:
    while True:
        yield from drafts or [_obs()]


#: Garbage an observation drafter may return, and whether the engine counts it as a
#: failure (well-formed drafts next to malformed ones are still used).
OBS_GARBAGE: dict[str, tuple[Callable[[list[ObservationDraft]], Any], bool]] = {
    "none": (lambda d: None, True),
    "a string": (lambda d: "<returncode>0</returncode>", True),
    "strings": (lambda d: [x.text for x in d], True),
    "dicts": (lambda d: [{"text": x.text, "probability": x.probability} for x in d], True),
    "text not str": (lambda d: [*d, _obs(b"bytes")], True),
    "probability nan": (lambda d: [*d, _obs(p=math.nan)], True),
    "probability negative": (lambda d: [*d, _obs(p=-0.5)], True),
    "probability above 1": (lambda d: [*d, _obs(p=1.5)], True),
    "probability not a number": (lambda d: [*d, _obs(p="0.5")], True),
    "probability infinite": (lambda d: [_obs(p=math.inf), *d], True),
    "template not str": (lambda d: [*d, ObservationDraft("t", 0.5, template=3)], True),  # type: ignore[arg-type]
    "empty text": (lambda d: [*d, _obs("")], False),  # a real observation may be empty: kept
    "huge": (lambda d: d + [_obs(f"x{i}", 0.1) for i in range(MAX_DRAFTS_PER_CALL * 3)], True),
    "endless": (_infinite, True),
}


@pytest.mark.parametrize("garbage", list(OBS_GARBAGE))
def test_an_observation_drafter_returning_garbage_only_costs_speed(garbage: str) -> None:
    backend = "memory"
    make, counted = OBS_GARBAGE[garbage]
    true_obs, _ = truth_drafters(reference(backend))
    faulty = FaultyObservationDrafter(true_obs, "garbage", garbage=make)
    out = run(backend, obs=[faulty])
    assert_lossless(backend, out)
    assert faulty.faults > 0
    if counted:
        assert out.failures >= faulty.faults
        assert any(e.kind is EventKind.FAIL and "observation drafter" in e.detail for e in out.events)
    else:
        assert out.failures == 0
    if garbage in ("text not str", "probability nan", "empty text", "huge"):
        # the well-formed drafts of a call are kept: the true one still hits
        assert any(e.kind is EventKind.DRAFT_HIT for e in out.events)


ACT_GARBAGE: dict[str, Callable[[list[ActionDraft]], Any]] = {
    "none": lambda d: None,
    "actions": lambda d: [x.action for x in d],
    "action not Action": lambda d: [*d, ActionDraft("ls", 0, 0.5)],  # type: ignore[arg-type]
    "negative offset": lambda d: [*d, ActionDraft(POOL[0], -1, 0.9)],
    "offset not int": lambda d: [*d, ActionDraft(POOL[0], 0.5, 0.9)],  # type: ignore[arg-type]
    "probability nan": lambda d: [*d, ActionDraft(POOL[1], 0, math.nan)],
    "probability above 1": lambda d: [ActionDraft(POOL[1], 0, 7.0), *d],
    "huge": lambda d: d + [ActionDraft(POOL[i % len(POOL)], 1, 0.01) for i in range(MAX_DRAFTS_PER_CALL + 5)],
}


@pytest.mark.parametrize("garbage", list(ACT_GARBAGE))
def test_an_action_drafter_returning_garbage_only_costs_speed(garbage: str) -> None:
    backend = "memory"
    _, true_act = truth_drafters(reference(backend))
    faulty = FaultyActionDrafter(true_act, "garbage", garbage=ACT_GARBAGE[garbage])
    out = run(backend, act=[faulty])
    assert_lossless(backend, out)
    assert faulty.faults > 0 and out.failures >= faulty.faults
    assert any(e.kind is EventKind.FAIL and "action drafter" in e.detail for e in out.events)


def test_a_streaming_drafter_that_fails_midway_keeps_its_earlier_batches() -> None:
    backend = "memory"
    ref = reference(backend)
    true_obs, _ = truth_drafters(ref, wrong=False)

    class Stream:
        def __init__(self) -> None:
            self.closed = 0

        async def draft(self, history: History, action: Action, n: int) -> list[ObservationDraft]:
            raise AssertionError("the engine prefers draft_stream")

        async def draft_stream(self, history: History, action: Action, n: int) -> Any:
            try:
                yield list(await true_obs.draft(history, action, n))
                yield [_obs(p=math.nan)]
                raise InjectedFault("stream cut")
            finally:
                self.closed += 1

    stream = Stream()
    out = run(backend, obs=[stream])
    assert_lossless(backend, out)
    assert out.failures > 0 and stream.closed > 0
    assert any(e.kind is EventKind.DRAFT_HIT for e in out.events)


class FaultyCanonicalizer:
    """Canonical forms with digits replaced, failing for texts ``fails(text)`` picks."""

    def __init__(self, fails: Callable[[str], bool]) -> None:
        self.fails = fails
        self.faults = 0

    def canonical(self, text: str) -> str:
        if self.fails(text):
            self.faults += 1
            raise InjectedFault("injected fault: canonical")
        return "".join("0" if ch.isdigit() else ch for ch in text)


@pytest.mark.parametrize("on", ["drafts", "real observations"])
def test_a_canonicalizer_that_raises_only_costs_speed(on: str) -> None:
    # On drafts: those drafts are not continued. On the real observation (no byte-identical
    # draft matched): no continuation is adopted under canonical acceptance; the step
    # decodes afresh from H.
    backend = "memory"
    ref = reference(backend)
    real = {t.observation for t in ref.history.turns}
    fails = (lambda t: "wrong" in t) if on == "drafts" else (lambda t: t in real)
    canon = FaultyCanonicalizer(fails)

    async def main() -> tuple[History, int]:
        sb = InMemorySandbox(op_delay_s=OP_DELAY_S)
        wrong = ScriptedObservationDrafter(
            lambda h, a: [ObservationDraft(f"<returncode>0</returncode>\n<output>\nwrong {len(h)}\n</output>", 0.5)]
        )
        engine = Engine(
            make_actor(),
            sb,
            observation_drafters=[wrong],
            config=EngineConfig(branch_budget=2, fork_width=0, accept="canonical"),
            canonicalizer=canon,
        )
        history = await engine.run(History(TASK), steps=STEPS)
        assert sb.version == ref.states[-1][0] and sb.live_forks == 0
        return history, engine.statistics().speculative_failures

    history, failures = anyio.run(main)
    assert history.turns == ref.history.turns
    assert canon.faults > 0 and failures >= canon.faults


# ---------------------------------------------------------------------------------- the actor


@pytest.mark.parametrize("kind", ["error", "unexpected", "hang"])
def test_a_provisional_decode_that_fails_only_costs_speed(backend: str, kind: str) -> None:
    ref = reference(backend)
    # only decodes of histories that never happen (continuations on wrong drafts)
    actor = FaultyActor(make_actor(), kind, when=lambda h: ref.prefix(h) is None)
    out = run(backend, actor=actor)
    assert_lossless(backend, out)
    assert actor.faults > 0 and actor.hanging == 0
    if kind != "hang":
        assert out.failures >= actor.faults


@pytest.mark.parametrize("kind", ["error", "unexpected"])
def test_an_adopted_continuation_whose_decode_failed_is_decoded_again(backend: str, kind: str) -> None:
    ref = reference(backend)
    seen: set[int] = set()

    def first_decode(history: History) -> bool:
        # A transient fault: the first decode of each verified history after the first
        # step, i.e. the continuation on the true draft (drafted while the step ran).
        k = ref.prefix(history)
        if k is None or k == 0 or k in seen:
            return False
        seen.add(k)
        return True

    true_obs, _ = truth_drafters(ref, wrong=False)
    actor = FaultyActor(make_actor(), kind, when=first_decode)
    # no forks done early: every step's observation is drafted while the step runs
    out = run(backend, actor=actor, obs=[true_obs], act=None)
    assert_lossless(backend, out)
    assert actor.faults >= STEPS - 1  # (and the decode after the last step)
    assert out.failures >= actor.faults


@pytest.mark.parametrize("kind", ["error", "unexpected"])
def test_a_verified_decode_that_fails_ends_the_run_cleanly(backend: str, kind: str) -> None:
    ref = reference(backend)
    actor = FaultyActor(make_actor(), kind, when=lambda h: ref.prefix(h) == 3)
    out = run(backend, actor=actor)
    assert assert_clean_failure(backend, out, error_class(kind, DrafterError)) == 3
    assert "injected fault" in str(out.error)


# ---------------------------------------------------------------------------------- forks


def _wrong_guess(ref: Reference) -> Callable[[FaultCall], bool]:
    return lambda c: c.action is not None and (c.origin, c.action.key) not in ref.pairs


def _first_try(ref: Reference) -> Callable[[FaultCall], bool]:
    seen: set[tuple[str, str]] = set()

    def when(c: FaultCall) -> bool:
        assert c.action is not None
        key = (c.origin, c.action.key)
        if key not in ref.pairs or key in seen:
            return False
        seen.add(key)
        return True

    return when


@pytest.mark.parametrize("kind", ["error", "unexpected", "late", "hang"])
def test_a_speculative_fork_that_fails_on_a_wrong_guess_only_costs_speed(backend: str, kind: str) -> None:
    ref = reference(backend)
    out = run(backend, faults=[Fault("execute", kind, on="fork", when=_wrong_guess(ref))])
    assert_lossless(backend, out)
    assert out.injected
    if kind in ("error", "unexpected"):
        assert out.failures >= len(out.injected)
    # (a late fault strikes after the command ran: a wrong guess is usually pruned by then,
    # so whether any is counted depends on timing; the count of late faults is asserted in
    # test_a_fork_of_the_emitted_action_that_fails_once_is_run_again)


@pytest.mark.parametrize("kind", ["error", "unexpected", "late"])
def test_a_fork_of_the_emitted_action_that_fails_once_is_run_again(backend: str, kind: str) -> None:
    # The first execution of each serial step (its speculative fork, launched at the
    # boundary before the actor emits it) fails; JASV finds it failed and runs the step.
    ref = reference(backend)
    _, true_act = truth_drafters(ref, wrong=False)
    out = run(backend, faults=[Fault("execute", kind, on="fork", when=_first_try(ref))], obs=None, act=[true_act])
    assert_lossless(backend, out)
    assert len(out.injected) >= STEPS - 1 and out.failures >= len(out.injected)


@pytest.mark.parametrize("kind", ["error", "unexpected", "late", "hang"])
def test_forking_that_fails_for_a_speculative_target_only_costs_speed(backend: str, kind: str) -> None:
    # The first fork of the run is a target's (the actor still decodes the first action),
    # and a wrong one: a hung fork of the emitted action would be waited on, as the step's own.
    # A hung one holds the queue of guesses' forks: the emitted action's fork queued behind
    # it is released by JASV (not forked yet), and the step forks on its own.
    ref = reference(backend)

    def wrong(history: History) -> list[ActionDraft]:
        k = ref.prefix(history)
        true = ref.history.turns[k].action if k is not None and k < len(ref.history) else None
        return [ActionDraft(next(a for a in POOL if a != true), 0, 0.5)]

    faults = [Fault("fork", kind, on="committed", when=lambda c: c.n == 0)]
    out = run(backend, faults=faults, act=[ScriptedActionDrafter(wrong)])
    assert_lossless(backend, out)
    assert len(out.injected) == 1
    if kind != "hang":
        assert out.failures >= 1


@pytest.mark.parametrize("kind", ["error", "unexpected", "late"])
def test_a_discard_that_fails_only_costs_speed(backend: str, kind: str) -> None:
    # Every discard fails: of forks of wrong guesses, of pruned and evicted ones, at the end.
    ref = reference(backend)

    async def main() -> tuple[Outcome, int]:
        async with open_box(backend) as box:
            sb = FaultySandbox(box.sandbox, [Fault("discard", kind, on="fork")])
            true_obs, true_act = truth_drafters(ref)
            engine = Engine(
                make_actor(), sb, observation_drafters=[true_obs], action_drafters=[true_act], config=CONFIG
            )
            history = await engine.run(History(TASK), steps=STEPS)
            out = Outcome(history, None, await box.state(), 0, engine.statistics().speculative_failures)
            out.injected = sb.injected
            return out, box.live_forks()

    out, left = anyio.run(main)
    assert out.error is None and out.history.turns == ref.history.turns and out.state == ref.states[-1]
    assert out.injected and out.failures >= len(out.injected)
    if kind == "late":
        assert left == 0  # the discards took effect before the errors
    # else the backend holds those forks until its session closes (open_box checks the
    # overlay session then leaves no mount, process or state directory)


# ---------------------------------------------------------------------------------- the verified path


@pytest.mark.parametrize("kind", ["error", "unexpected", "late"])
def test_a_step_whose_execution_fails_ends_the_run_cleanly(backend: str, kind: str) -> None:
    # The step runs in a fork (FORK_STEPS): whatever the failed command did is discarded with it.
    ref = reference(backend)
    k = 4
    step = (ref.states[k][0], ref.history.turns[k].action.key)
    fault = Fault("execute", kind, on="fork", when=lambda c: c.action is not None and (c.origin, c.action.key) == step)
    out = run(backend, faults=[fault], config=FORK_STEPS)
    assert assert_clean_failure(backend, out, error_class(kind, SandboxError)) == k
    assert any(f"step {k}" in note for note in out.error.__notes__)  # type: ignore[union-attr]


@pytest.mark.parametrize("kind", ["error", "unexpected", "late"])
def test_a_step_run_in_place_that_fails_ends_the_run_and_says_what_the_sandbox_holds(backend: str, kind: str) -> None:
    # With speculation on, the step runs on the committed sandbox itself (steps_in_place),
    # as serial execution runs it, while guesses keep forking it: a failure is what serial
    # execution's would be, and no guess is left behind.
    if backend not in IN_PLACE:
        pytest.skip("this sandbox cannot be forked while a command runs: its steps run in forks")
    ref = reference(backend)
    k = next(i for i in range(2, STEPS) if ref.states[i + 1][0] != ref.states[i][0])  # a step that changes the state
    step = (ref.states[k][0], ref.history.turns[k].action.key)
    fault = Fault(
        "execute", kind, on="committed", when=lambda c: c.action is not None and (c.origin, c.action.key) == step
    )

    def wrong(history: History) -> list[ActionDraft]:  # guesses that keep forking, none of them right
        return [ActionDraft(Action.bash(f"cat guess-{len(history)}"), 0, 0.5)]

    out = run(backend, faults=[fault], obs=None, act=[ScriptedActionDrafter(wrong)])
    assert out.failures == 0 and any(e.kind is EventKind.FORK for e in out.events), "no guess was forked"
    assert out.injected, "the step did not run on the committed sandbox"
    assert ref.prefix(out.history) == k
    assert out.live_forks == out.held and out.hanging == 0
    if kind == "late":
        # the command ran, then the backend failed: its changes are in the committed
        # sandbox but not in the history, and the error says so
        assert type(out.error) is StateUnknownError
        assert out.state == ref.states[k + 1]
        assert "holds changes the verified history does not" in str(out.error)
    else:
        assert type(out.error) is error_class(kind, SandboxError)
        assert out.state == ref.states[k]


@pytest.mark.parametrize("kind", ["error", "unexpected", "late"])
def test_serial_execution_that_fails_ends_the_run_and_says_what_the_sandbox_holds(backend: str, kind: str) -> None:
    # Without forks the step runs on the committed sandbox itself, as serial execution does.
    ref = reference(backend)
    k = 2
    step = (ref.states[k][0], ref.history.turns[k].action.key)
    fault = Fault("execute", kind, when=lambda c: c.action is not None and (c.origin, c.action.key) == step)
    out = run(backend, faults=[fault], obs=None, act=None, config=SERIAL)
    changed = ref.states[k + 1][0] != ref.states[k][0]
    diverged = kind == "late" and changed
    assert type(out.error) is (StateUnknownError if diverged else error_class(kind, SandboxError))
    assert ref.prefix(out.history) == k
    if diverged:
        # the command ran, then the backend failed: its changes are in the committed
        # sandbox but not in the history, and the error says so
        assert out.state == ref.states[k + 1]
        assert "holds changes the verified history does not" in str(out.error)
        assert type(out.error.__cause__) is SandboxError
    else:
        assert out.state == ref.states[k]


@pytest.mark.parametrize("kind", ["error", "unexpected", "late"])
def test_a_commit_that_fails_ends_the_run_with_nothing_committed_lost(backend: str, kind: str) -> None:
    ref = reference(backend)
    # the first step that changes the state, from the third on
    k = next(i for i in range(2, STEPS) if ref.states[i + 1][0] != ref.states[i][0])
    step = (ref.states[k][0], ref.history.turns[k].action.key)
    fault = Fault("commit", kind, when=lambda c: c.action is not None and (c.origin, c.action.key) == step)
    out = run(backend, faults=[fault])
    # before: the commit did not happen, the step is not in H; late: it took effect, it is,
    # and the error says so by its type (the backend's error is its cause)
    got = assert_clean_failure(backend, out, FailedAfterCommitError if kind == "late" else error_class(kind, SandboxError))
    assert got == (k + 1 if kind == "late" else k)
    if kind == "late":
        assert isinstance(out.error, FailedAfterCommitError) and out.error.step == k
        assert type(out.error.__cause__) is SandboxError


@pytest.mark.parametrize("kind", ["error", "unexpected", "late"])
def test_forking_the_committed_sandbox_that_always_fails_ends_the_run_cleanly(backend: str, kind: str) -> None:
    # Each step needs a fork of the committed sandbox (FORK_STEPS): the run cannot go on.
    out = run(backend, faults=[Fault("fork", kind, on="committed", when=lambda c: c.n >= 3)], config=FORK_STEPS)
    k = assert_clean_failure(backend, out, error_class(kind, SandboxError))
    assert k < STEPS


@pytest.mark.parametrize("kind", ["error", "unexpected", "late"])
def test_forking_that_always_fails_only_costs_speed_when_steps_run_in_place(backend: str, kind: str) -> None:
    # Steps run on the committed sandbox itself: only the guesses need forks.
    if backend not in IN_PLACE:
        pytest.skip("this sandbox cannot be forked while a command runs: its steps run in forks")
    out = run(backend, faults=[Fault("fork", kind, on="committed", when=lambda c: c.n >= 3)])
    assert_lossless(backend, out)
    assert len(out.injected) > 3 and out.failures >= len(out.injected)


@pytest.mark.parametrize("kind", ["error", "unexpected"])
def test_a_committed_version_that_cannot_be_read_ends_the_run_cleanly(backend: str, kind: str) -> None:
    out = run(backend, faults=[Fault("version", kind, on="committed", when=lambda c: c.n >= 20)])
    k = assert_clean_failure(backend, out, error_class(kind, SandboxError))
    assert k < STEPS


def test_a_failed_step_can_be_retried_by_a_harness() -> None:
    # A transient failure of the step's execution: the session stays consistent and the
    # harness calls execute() again; the trajectory is the serial one.
    backend = "memory"
    ref = reference(backend)
    step = (ref.states[3][0], ref.history.turns[3].action.key)
    fault = Fault("execute", "error", when=lambda c: c.action is not None and (c.origin, c.action.key) == step, limit=1)

    async def main() -> tuple[History, int]:
        sb = FaultySandbox(InMemorySandbox(op_delay_s=OP_DELAY_S), [fault])
        true_obs, _ = truth_drafters(ref)
        engine = Engine(make_actor(), sb, observation_drafters=[true_obs], config=CONFIG)
        retries = 0
        async with engine.session(History(TASK)) as session:
            for _ in range(STEPS):
                action = await session.decode()
                while True:
                    try:
                        await session.execute(action)
                        break
                    except SandboxError:
                        retries += 1
        assert sb.version == ref.states[-1][0] and sb.inner.live_forks == 0
        return session.history, retries

    history, retries = anyio.run(main)
    assert retries == 1 and history.turns == ref.history.turns


def test_faults_outside_any_run_leave_the_engine_reusable() -> None:
    # After a run that failed, the same Engine runs again (nothing of the run lingers).
    backend = "memory"
    ref = reference(backend)

    async def main() -> History:
        sb = InMemorySandbox(op_delay_s=OP_DELAY_S)
        actor = FaultyActor(make_actor(), "unexpected", when=lambda h: ref.prefix(h) == 2)
        true_obs, true_act = truth_drafters(ref)
        engine = Engine(actor, sb, observation_drafters=[true_obs], action_drafters=[true_act], config=CONFIG)
        with pytest.raises(InjectedFault):
            await engine.run(History(TASK), steps=STEPS)
        assert sb.live_forks == 0 and sb.version == ref.states[2][0]
        actor.when = lambda h: False
        return await engine.run(History(TASK), steps=1)

    history = anyio.run(main)
    assert len(history) == 1


# ---------------------------------------------------------------------------------- the property


@dataclass(frozen=True)
class Planned:
    """One scheduled fault of the property test and whether the verified path hits it."""

    what: str
    kind: str
    index: int  # the serial step it is keyed on, or a hash bucket


def schedule(ref: Reference, plan: Sequence[Planned]) -> tuple[list[Fault], Any, Any, Any, bool]:
    """Faults, actor, drafters for ``plan``, and whether a verified-path fault is scheduled."""
    true_obs, true_act = truth_drafters(ref)
    faults: list[Fault] = []
    actor_when: list[Callable[[History], bool]] = []
    obs: Any = true_obs
    act: Any = true_act
    verified = False
    steps = [(ref.states[i][0], t.action.key) for i, t in enumerate(ref.history.turns)]
    for p in plan:
        j = p.index % STEPS
        if p.what == "execute wrong guess":
            faults.append(Fault("execute", p.kind, on="fork", when=_wrong_guess(ref)))
        elif p.what == "execute step":
            faults.append(
                Fault("execute", p.kind, on="fork", when=lambda c, s=steps[j]: (c.origin, c.action.key) == s)  # type: ignore[union-attr]
            )
            verified = True
        elif p.what == "commit step":
            faults.append(Fault("commit", p.kind, when=lambda c, s=steps[j]: (c.origin, c.action.key) == s))  # type: ignore[union-attr]
            verified = True
        elif p.what == "fork at step":
            faults.append(Fault("fork", p.kind, on="committed", when=lambda c, v=steps[j][0]: c.origin == v))
            verified = True
        elif p.what == "discard":
            faults.append(Fault("discard", p.kind, on="fork", when=lambda c, m=p.index % 3: c.n % 3 == m))
        elif p.what == "observation drafter":
            obs = FaultyObservationDrafter(
                true_obs,
                p.kind,
                when=lambda h, a, m=p.index % 2: len(h) % 2 == m,
                garbage=(lambda d: [*d, _obs(p=math.nan), None]) if p.kind == "garbage" else None,
            )
        elif p.what == "action drafter":
            act = FaultyActionDrafter(
                true_act,
                p.kind,
                when=lambda h, m=p.index % 2: len(h) % 2 == m,
                garbage=(lambda d: [*d, ActionDraft(POOL[0], -1, 2.0)]) if p.kind == "garbage" else None,
            )
        elif p.what == "provisional decode":
            actor_when.append(lambda h: ref.prefix(h) is None)
        elif p.what == "verified decode":
            actor_when.append(lambda h, j=j: ref.prefix(h) == j)
            verified = True
    actor: Any = make_actor()
    if actor_when:
        kinds = [p.kind for p in plan if p.what.endswith("decode")]
        actor = FaultyActor(actor, kinds[0], when=lambda h: any(w(h) for w in actor_when))
    return faults, actor, [obs], [act], verified


SANDBOX_KINDS = st.sampled_from(["error", "unexpected", "late"])
PLANNED = st.one_of(
    st.builds(
        Planned, st.just("execute wrong guess"), st.sampled_from(["error", "unexpected", "late", "hang"]), st.just(0)
    ),
    st.builds(
        Planned, st.sampled_from(["execute step", "commit step", "fork at step"]), SANDBOX_KINDS, st.integers(0, 20)
    ),
    st.builds(Planned, st.just("discard"), SANDBOX_KINDS, st.integers(0, 2)),
    st.builds(
        Planned,
        st.sampled_from(["observation drafter", "action drafter"]),
        st.sampled_from(["error", "unexpected", "hang", "garbage"]),
        st.integers(0, 1),
    ),
    st.builds(Planned, st.just("provisional decode"), st.sampled_from(["error", "unexpected"]), st.just(0)),
    st.builds(Planned, st.just("verified decode"), st.sampled_from(["error", "unexpected"]), st.integers(0, 20)),
)


def check_schedule(backend: str, plan: Sequence[Planned]) -> None:
    ref = reference(backend)
    faults, actor, obs, act, verified = schedule(ref, plan)
    out = run(backend, faults=faults, actor=actor, obs=obs, act=act)
    if out.error is None:
        assert_lossless(backend, out)
        return
    assert verified, f"the run failed although no verified-path fault was scheduled: {out.error!r}"
    assert "injected fault" in str(out.error) or isinstance(out.error, EngineError), repr(out.error)
    assert_clean_failure(backend, out, type(out.error))


@settings(
    max_examples=int(os.environ.get("AOSPEC_FAULT_EXAMPLES", "25")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(plan=st.lists(PLANNED, min_size=1, max_size=4))
def test_random_fault_schedules_never_change_what_is_committed(plan: list[Planned]) -> None:
    """Completed runs equal the fault-free serial run; a run completes whenever no
    verified-path fault is scheduled; a failed run fails cleanly on a prefix."""
    check_schedule("memory", plan)


@pytest.mark.root
def test_random_fault_schedules_on_overlay(overlay_dirs: Path) -> None:
    """A few fixed schedules of the property on a real overlay sandbox."""
    for plan in (
        [Planned("execute wrong guess", "unexpected", 0), Planned("observation drafter", "hang", 0)],
        [
            Planned("discard", "error", 1),
            Planned("action drafter", "garbage", 1),
            Planned("provisional decode", "error", 0),
        ],
        [Planned("commit step", "late", 5), Planned("execute wrong guess", "hang", 0)],
        [Planned("fork at step", "error", 3), Planned("observation drafter", "unexpected", 1)],
    ):
        check_schedule("overlay", plan)
