"""Routing: a stream router names the tool being decoded, mid-decode; route listeners hear
it, and routed action drafts run in ordinary speculative forks that JASV reuses only for the
same action from the same version. None of it changes what is committed, and none of its
failures costs more than a counted speculative failure."""

from __future__ import annotations

import random

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

from aospec.engine import Engine
from aospec.engine_config import EngineConfig
from aospec.ledger import EventKind
from aospec.protocols import ActionDraft, ObservationDraft, RoutedActionDrafter, StreamingActor, StreamRouter
from aospec.testing import (
    InMemorySandbox,
    ScriptedActionDrafter,
    ScriptedActor,
    ScriptedObservationDrafter,
    ScriptedRoutedActionDrafter,
    ScriptedRouter,
    StreamingScriptedActor,
)
from aospec.types import Action, History

SCRIPT = [
    Action.bash("echo a > x"),
    Action.bash("sleep 5 && cat x"),
    Action.bash("ls"),
    Action.bash("sleep 3 && echo b >> x"),
    Action.bash("cat x"),
]
FILES = {"x": "0\n"}


def run_virtual(fn):
    return anyio.run(fn, backend="trio", backend_options={"clock": MockClock(autojump_threshold=0)})


def choose(history: History) -> Action:
    return SCRIPT[len(history)] if len(history) < len(SCRIPT) else Action.none()


def streaming_actor(delay_s: float = 1.0) -> StreamingScriptedActor:
    return StreamingScriptedActor(choose, delay_s)


def program(action: Action) -> str:
    return action.command.split()[0]


def right_routed(history: History, tool: str) -> list[ActionDraft]:
    """The right next action when the router named its program, and a wrong one of that program."""
    i = len(history)
    wrong = f"sleep 1 && echo wrong {i} > w" if tool == "sleep" else f"{tool} wrong-{i}"
    out = [ActionDraft(Action.bash(wrong), 0, 0.4)]
    if i < len(SCRIPT) and program(SCRIPT[i]) == tool:
        out.append(ActionDraft(SCRIPT[i], 0, 0.9))
    return out


async def serial(actor=None) -> tuple[History, InMemorySandbox]:
    sb = InMemorySandbox(FILES, op_delay_s=0.01)
    history = await Engine(actor or ScriptedActor(choose, 1.0), sb).run(History("t"), steps=len(SCRIPT))
    return history, sb


def test_the_stand_ins_have_the_capabilities():
    assert isinstance(streaming_actor(), StreamingActor)
    assert isinstance(ScriptedRouter(), StreamRouter)
    assert isinstance(ScriptedRoutedActionDrafter(right_routed), RoutedActionDrafter)
    assert not isinstance(ScriptedActor(choose), StreamingActor)
    assert not isinstance(ScriptedActionDrafter(lambda h: []), RoutedActionDrafter)


def test_router_events_reach_the_listeners_while_the_actor_is_still_decoding():
    actor, router, heard = streaming_actor(), ScriptedRouter(), []

    def listener(event):
        heard.append((event.tool, event.router, actor.streaming, actor.deltas))

    async def main():
        engine = Engine(actor, InMemorySandbox(FILES), router=router, route_listeners=[listener])
        history = await engine.run(History("t"), steps=len(SCRIPT))
        return history, engine

    history, engine = run_virtual(main)
    assert history.actions == tuple(SCRIPT)
    assert [t for t, *_ in heard] == [program(a) for a in SCRIPT]
    assert all(r == "scripted" for _, r, _, _ in heard)
    # mid-decode: the decode that fired it was still streaming, and more pieces followed
    assert all(streaming == 1 for _, _, streaming, _ in heard)
    assert actor.deltas > max(d for *_, d in heard)
    stats = engine.statistics()
    assert stats.routes_fired == len(SCRIPT) and router.sessions == len(SCRIPT)
    routes = [e for e in engine.ledger.events if e.kind is EventKind.ROUTE]
    assert [e.step for e in routes] == list(range(len(SCRIPT)))
    assert all(e.detail.startswith(program(a)) for e, a in zip(routes, SCRIPT, strict=True))
    # no speculation configured: nothing else happened
    assert (stats.forks_launched, stats.routed_forks_launched, stats.speculative_failures) == (0, 0, 0)


def test_a_routed_fork_launched_mid_decode_is_reused_and_the_run_equals_serial():
    drafter = ScriptedRoutedActionDrafter(right_routed)

    async def main():
        ref, ref_sb = await serial()
        sb = InMemorySandbox(FILES, op_delay_s=0.01)
        engine = Engine(
            streaming_actor(),
            sb,
            action_drafters=[drafter],
            router=ScriptedRouter(),
            config=EngineConfig(routed_width=2),
        )
        history = await engine.run(History("t"), steps=len(SCRIPT))
        return ref, ref_sb, history, sb, engine

    ref, ref_sb, history, sb, engine = run_virtual(main)
    assert history == ref
    assert sb.files == ref_sb.files and sb.version == ref_sb.version
    assert sb.live_forks == 0
    stats = engine.statistics()
    assert stats.routed_forks_reused == stats.forks_reused == len(SCRIPT)  # every step's right guess
    # the right and the wrong one were proposed; the controller launched the right ones and
    # priced the wrong ones (0.4, and they never hit) out once it had seen them miss
    assert stats.routed_forks_launched == stats.forks_launched == stats.admitted
    assert stats.forks_launched + stats.refused_price == 2 * len(SCRIPT)
    assert stats.forks_wasted == stats.forks_launched - len(SCRIPT)
    assert stats.tool_hidden_ns > 0  # the forks ran while the actor still decoded
    assert drafter.routed_calls == [(i, program(a)) for i, a in enumerate(SCRIPT)]
    # each reused fork was launched before its action was emitted
    events = engine.ledger.events
    for a in SCRIPT:
        fork = next(e for e in events if e.kind is EventKind.FORK and e.detail == a.key)
        reuse = next(e for e in events if e.kind is EventKind.REUSE and e.detail == a.key)
        assert fork.t_ns < reuse.t_ns and fork.step == reuse.step


def test_routed_width_zero_or_no_fork_width_launches_nothing():
    for config in (EngineConfig(routed_width=0), EngineConfig(fork_width=0)):
        drafter = ScriptedRoutedActionDrafter(right_routed)

        async def main(config=config, drafter=drafter):
            engine = Engine(
                streaming_actor(),
                InMemorySandbox(FILES),
                action_drafters=[drafter],
                router=ScriptedRouter(),
                config=config,
            )
            history = await engine.run(History("t"), steps=len(SCRIPT))
            return history, engine.statistics()

        history, stats = run_virtual(main)
        assert history.actions == tuple(SCRIPT)
        assert drafter.routed_calls == []
        assert stats.routes_fired == len(SCRIPT)
        assert (stats.forks_launched, stats.routed_forks_launched, stats.routed_forks_reused) == (0, 0, 0)


def test_without_a_streaming_actor_or_a_router_nothing_changes():
    async def one(actor, router):
        engine = Engine(
            actor,
            InMemorySandbox(FILES, op_delay_s=0.01),
            action_drafters=[ScriptedRoutedActionDrafter(right_routed, lambda h: [ActionDraft(choose(h), 0, 0.5)])],
            router=router,
        )
        history = await engine.run(History("t"), steps=len(SCRIPT))
        return history, engine.statistics(), [(e.kind, e.t_ns, e.step, e.detail, e.ns) for e in engine.ledger.events]

    router, actor = ScriptedRouter(), streaming_actor()
    plain = run_virtual(lambda: one(ScriptedActor(choose, 1.0), None))
    not_streaming = run_virtual(lambda: one(ScriptedActor(choose, 1.0), router))
    no_router = run_virtual(lambda: one(actor, None))
    sessions, deltas = router.sessions, actor.deltas
    assert plain == not_streaming  # a router is used only with a streaming actor
    assert sessions == 0
    assert no_router[0] == plain[0] and deltas == 0  # without a router the actor's decode() runs
    assert plain[1].routes_fired == plain[1].routed_forks_launched == plain[1].cache_hits == 0


class _RaisingRouter:
    def __init__(self, where: str):
        self.where = where
        self.feeds = 0

    def session(self):
        if self.where == "session":
            raise RuntimeError("router session broke")
        return self

    def feed(self, delta):
        self.feeds += 1
        if self.where == "feed":
            raise RuntimeError("router feed broke")
        if self.where == "event":

            class Bad:
                tool = None

            return [Bad()]
        return []


@pytest.mark.parametrize("fault", ["router session", "router feed", "router event", "listener", "propose_routed"])
def test_a_failing_router_listener_or_routed_drafter_costs_only_a_counted_failure(fault):
    where = fault.split()[-1]
    router = _RaisingRouter(where) if fault.startswith("router") else ScriptedRouter()

    def listener(event):
        if fault == "listener":
            raise ValueError("listener broke")

    def routed(history, tool):
        if fault == "propose_routed":
            raise RuntimeError("routed drafter broke")
        return right_routed(history, tool)

    async def main():
        ref, ref_sb = await serial()
        sb = InMemorySandbox(FILES, op_delay_s=0.01)
        engine = Engine(
            streaming_actor(),
            sb,
            action_drafters=[ScriptedRoutedActionDrafter(routed)],
            router=router,
            route_listeners=[listener],
        )
        history = await engine.run(History("t"), steps=len(SCRIPT))
        return ref, ref_sb, history, sb, engine

    ref, ref_sb, history, sb, engine = run_virtual(main)
    assert history == ref
    assert sb.files == ref_sb.files and sb.version == ref_sb.version and sb.live_forks == 0
    stats = engine.statistics()
    fails = [e.detail for e in engine.ledger.events if e.kind is EventKind.FAIL]
    assert stats.speculative_failures == len(fails) == len(SCRIPT)  # once per decode (or event)
    assert all(("broke" in d or "names no tool" in d) for d in fails)
    if fault in ("router feed", "router event"):
        assert router.feeds == len(SCRIPT)  # a router that failed is not fed again in that decode
    if fault == "listener":
        assert stats.routed_forks_reused == len(SCRIPT)  # the listener's failure stops nothing else
    if fault.startswith("router") or fault == "propose_routed":
        assert stats.routed_forks_launched == 0


def test_routed_proposals_that_arrive_after_the_action_was_emitted_are_dropped():
    drafter = ScriptedRoutedActionDrafter(right_routed, delay_s=5.0)  # slower than the 1 s decode

    async def main():
        engine = Engine(streaming_actor(), InMemorySandbox(FILES), action_drafters=[drafter], router=ScriptedRouter())
        history = await engine.run(History("t"), steps=len(SCRIPT))
        return history, engine.statistics()

    history, stats = run_virtual(main)
    assert history.actions == tuple(SCRIPT)
    assert len(drafter.routed_calls) == len(SCRIPT)
    assert stats.routed_forks_launched == stats.forks_launched == 0


def test_a_routed_target_equal_to_a_live_fork_is_not_launched_again():
    # the boundary drafter already launched the right action; the routed one proposes it too
    drafter = ScriptedRoutedActionDrafter(right_routed, lambda h: [ActionDraft(choose(h), 0, 0.5)])

    async def main():
        engine = Engine(
            streaming_actor(),
            InMemorySandbox(FILES, op_delay_s=0.01),
            action_drafters=[drafter],
            router=ScriptedRouter(),
            config=EngineConfig(routed_width=1, admission="off"),  # the wrong target launched whatever it costs
        )
        history = await engine.run(History("t"), steps=len(SCRIPT))
        return history, engine.statistics()

    history, stats = run_virtual(main)
    assert history.actions == tuple(SCRIPT)
    assert stats.forks_reused == len(SCRIPT) and stats.routed_forks_reused == 0
    # the right routed target is a duplicate, skipped; routed_width 1 then takes the wrong one
    assert stats.routed_forks_launched == len(SCRIPT)
    assert stats.forks_launched == 2 * len(SCRIPT)


@pytest.mark.parametrize("provisional_targets", [False, True])
def test_provisional_decodes_route_and_launch_routed_forks_only_under_provisional_targets(provisional_targets):
    # Every draft is right, so each step's decode is a continuation started during the
    # previous step's tool: it is routed while provisional (level 1).
    drafter = ScriptedRoutedActionDrafter(right_routed)

    async def main():
        ref, ref_sb = await serial()
        rights = ScriptedObservationDrafter(lambda h, a: [ObservationDraft(ref.turns[len(h)].observation, 0.9)])
        sb = InMemorySandbox(FILES, op_delay_s=0.01)
        engine = Engine(
            streaming_actor(),
            sb,
            observation_drafters=[rights],
            action_drafters=[drafter],
            router=ScriptedRouter(),
            config=EngineConfig(provisional_targets=provisional_targets),
        )
        history = await engine.run(History("t"), steps=len(SCRIPT))
        return ref, ref_sb, history, sb, engine.statistics()

    ref, ref_sb, history, sb, stats = run_virtual(main)
    assert history == ref
    assert sb.files == ref_sb.files and sb.version == ref_sb.version and sb.live_forks == 0
    assert stats.drafts_hit >= 3
    assert stats.routes_fired == len(SCRIPT)  # (the continuation after the last step emits no call)
    routed_at = [n for n, _ in drafter.routed_calls]
    if provisional_targets:
        assert routed_at == [0, 1, 2, 3, 4]
        # step 2 ("ls") was routed during step 1's read-only tool: that fork stays valid
        assert stats.routed_forks_reused == 4
    else:
        # steps 2 and 4 were decoded while steps 1 and 3 ran (5 s, 3 s): provisional when
        # routed; the others were adopted within 0.01 s, so routed as the verified decode
        assert routed_at == [0, 1, 3]
        assert stats.routed_forks_reused == 3


POOL = [
    Action.bash(c)
    for c in ("ls", "cat a", "cat b", "echo one > a", "echo two >> a", "rm b", "sleep 0.004 && cat a", "echo 3 > b")
]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    actor_seed=st.integers(0, 10_000),
    steps=st.integers(3, 7),
    q_obs=st.floats(0.0, 1.0),
    q_route=st.floats(0.0, 1.0),
    seed=st.integers(0, 10_000),
    provisional_targets=st.booleans(),
)
def test_live_engine_with_a_router_is_lossless_under_random_routed_drafter_quality(
    backend, actor_seed, steps, q_obs, q_route, seed, provisional_targets
):
    rng = random.Random(seed)
    base = ScriptedActor.hashing(POOL, seed=actor_seed)
    actor = StreamingScriptedActor(base.choose, 0.002, chunk_chars=3)

    async def main():
        ref_sb = InMemorySandbox({"a": "zero\n"}, op_delay_s=0.001)
        ref = await Engine(actor, ref_sb).run(History("live"), steps=steps)

        def observations(h, a):
            out = [ObservationDraft(f"<returncode>0</returncode>\n<output>\n{rng.random()}\n</output>", 0.3)]
            if len(h) < len(ref) and rng.random() < q_obs:
                out.append(ObservationDraft(ref.turns[len(h)].observation, rng.random()))
            return out

        def routed(h, tool):
            out = [ActionDraft(rng.choice(POOL), 0, rng.random())]
            i = len(h)
            if i < len(ref) and rng.random() < q_route:
                out.append(ActionDraft(ref.turns[i].action, 0, rng.random()))
            return out

        sb = InMemorySandbox({"a": "zero\n"}, op_delay_s=0.001)
        engine = Engine(
            actor,
            sb,
            observation_drafters=[ScriptedObservationDrafter(observations, delay_s=0.0005)],
            action_drafters=[ScriptedRoutedActionDrafter(routed, delay_s=0.0002)],
            router=ScriptedRouter(),
            config=EngineConfig(branch_budget=2, fork_width=4, provisional_targets=provisional_targets),
        )
        history = await engine.run(History("live"), steps=steps)
        return ref, ref_sb, history, sb, engine.statistics()

    ref, ref_sb, history, sb, stats = anyio.run(main, backend=backend)
    assert history == ref
    assert sb.files == ref_sb.files and sb.version == ref_sb.version
    assert sb.live_forks == 0
    assert stats.steps == steps and stats.routes_fired >= steps


def test_the_router_session_is_opened_with_the_history_the_decode_starts_from():
    """``session(history)``: the verified decode's session gets the verified history (so a
    router can condition on earlier steps); a router whose ``session()`` takes nothing is
    still opened and fed."""

    class NoArgRouter:
        def __init__(self) -> None:
            self.inner = ScriptedRouter()

        def session(self):  # an older router: no history parameter
            return self.inner.session()

    async def main() -> tuple[list, int, int]:
        router = ScriptedRouter()
        sb = InMemorySandbox(FILES, op_delay_s=0.01)
        engine = Engine(streaming_actor(), sb, router=router, config=EngineConfig(branch_budget=0, fork_width=0))
        await engine.run(History("t"), steps=3)
        old = NoArgRouter()
        engine2 = Engine(streaming_actor(), InMemorySandbox(FILES), router=old, config=EngineConfig(fork_width=0))
        await engine2.run(History("t"), steps=3)
        return router.histories, engine.statistics().routes_fired, engine2.statistics().routes_fired

    histories, fired, fired_old = run_virtual(main)
    assert [len(h) for h in histories] == [0, 1, 2]
    assert all(isinstance(h, History) for h in histories)
    assert histories[2].actions == tuple(SCRIPT[:2])
    assert fired == 3 and fired_old == 3
