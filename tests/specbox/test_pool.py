"""The prewarm pool (specbox/pool.py): policies, budget and idle eviction, cold-start cost,
handoffs to waiting acquires and what becomes of the starts they give up (dropped while
queued unless the floor needs them, stopped when up if their type has one idle),
unclaimed-only max_warm, bounded starts in flight,
no leaks after close, the router and prefetch adapters, and the pool-backed Sandbox (the
runtime conformance suite's protocol tests on PooledSandbox over InMemorySandbox and, as
root, overlay)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
from aospec.specbox.markov import MarkovPrefetcher, prefetch_task
from aospec.specbox.pool import (
    EnvironmentPool,
    EnvSpec,
    PooledSandbox,
    demo_tool_spec,
    host_cores,
    prefetch_adapter,
    process_rss_bytes,
    router_adapter,
)
from aospec.specbox.routers import ParseRouter

from aospec.errors import ConfigError
from aospec.protocols import Sandbox
from aospec.testing import InMemorySandbox
from aospec.types import Action

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Fake:
    """A fake environment kind that records starts and stops, and how many starts run at
    once; with ``gate`` set, a start finishes only once the gate is open."""

    def __init__(self, delay: float = 0.0, fail: bool = False, gate: anyio.Event | None = None) -> None:
        self.delay = delay
        self.fail = fail
        self.gate = gate
        self.live: set[int] = set()
        self.started = 0
        self.begun: list[str] = []
        self.running = 0
        self.peak_running = 0

    def spec(self, name: str, **kw: object) -> EnvSpec:
        async def start() -> int:
            self.begun.append(name)
            self.running += 1
            self.peak_running = max(self.peak_running, self.running)
            try:
                await anyio.sleep(self.delay)
                if self.gate is not None:
                    await self.gate.wait()
            finally:
                self.running -= 1
            if self.fail:
                raise RuntimeError("boom")
            self.started += 1
            self.live.add(self.started)
            return self.started

        async def stop(value: int) -> None:
            self.live.discard(value)

        return EnvSpec(name, start=start, stop=stop, **kw)  # type: ignore[arg-type]


async def test_reserved_keeps_n_warm_and_hits() -> None:
    fake = Fake()
    async with EnvironmentPool([fake.spec("t", policy="reserved", reserved=2)]) as pool:
        await pool.wait_until(lambda: pool.count("t", "idle") == 2)
        env = await pool.acquire("t")
        assert pool.stats.hits == 1 and pool.stats.cold_starts == 0
        await pool.wait_until(lambda: pool.count("t", "idle") == 2)  # refilled
        await pool.release(env)
        assert pool.count("t", "idle") == 3
    assert fake.live == set() and pool.count() == 0


async def test_reserved_counts_released_environments_as_warm_and_does_not_grow() -> None:
    fake = Fake()
    async with EnvironmentPool([fake.spec("t", policy="reserved", reserved=2)]) as pool:
        await pool.wait_until(lambda: pool.count("t", "idle") == 2)
        for _ in range(3):
            async with pool.lease("t"):
                pass
            await pool.wait_until(lambda: pool.count("t", "starting") == 0)
        assert pool.count("t") == 3 and fake.started == 3  # one refill, then the released one is reused


async def test_a_speculative_floor_is_kept_warm_refilled_and_spared_by_idle_eviction() -> None:
    fake = Fake()
    specs = [fake.spec("t", policy="speculative", floor=1, max_warm=2)]
    async with EnvironmentPool(specs, idle_timeout_s=0.02) as pool:
        await pool.wait_until(lambda: pool.count("t", "idle") == 1)  # started with the pool
        assert pool.stats.warm_ups == 0
        env = await pool.acquire("t")
        assert pool.stats.hits == 1
        await pool.wait_until(lambda: pool.count("t", "idle") == 1)  # refilled after the acquire
        assert await pool.warm("t")  # a warm-up comes on top of the floor, up to max_warm
        await pool.wait_until(lambda: pool.count("t", "idle") == 2)
        await pool.release(env)
        await pool.wait_until(lambda: pool.stats.idle_evictions >= 2)
        await pool.wait_until(lambda: pool.count("t", "idle") == 1)  # evicted down to the floor, not below
    assert fake.live == set()
    with pytest.raises(ConfigError, match="floor= is for the speculative policy"):
        fake.spec("r", policy="reserved", floor=1)


async def test_on_demand_cold_starts_every_call_and_stops_on_release() -> None:
    fake = Fake()
    async with EnvironmentPool([fake.spec("t", policy="on-demand")]) as pool:
        assert pool.count() == 0
        for _ in range(3):
            async with pool.lease("t") as env:
                assert env.state == "busy" and env.value in fake.live
        assert pool.stats.cold_starts == 3 and pool.stats.hits == 0
        assert fake.live == set()
        assert not await pool.warm("t")  # on-demand never warms


async def test_speculative_warms_on_a_router_event_and_the_call_hits() -> None:
    fake = Fake()
    async with EnvironmentPool([fake.spec("get_user_details", policy="speculative")]) as pool:
        session = ParseRouter().session()
        session.subscribe(router_adapter(pool))
        chunk = {
            "choices": [
                {"delta": {"tool_calls": [{"index": 0, "function": {"name": "get_user_details", "arguments": ""}}]}}
            ]
        }
        session.feed(chunk)
        await pool.wait_until(lambda: pool.count("get_user_details", "idle") == 1)
        assert pool.stats.warm_ups == 1
        async with pool.lease("get_user_details"):
            pass
        assert pool.stats.hits == 1 and pool.stats.cold_starts == 0 and pool.stats.wasted_warm_ups == 0


async def test_an_acquire_during_a_warm_up_waits_for_it_instead_of_cold_starting() -> None:
    fake = Fake(delay=0.05)
    async with EnvironmentPool([fake.spec("t", policy="speculative")]) as pool:
        assert await pool.warm("t")
        env = await pool.acquire("t")
        assert pool.stats.warm_waits == 1 and pool.stats.cold_starts == 0 and fake.started == 1
        await pool.release(env)


async def test_an_acquire_waiting_for_a_start_takes_an_environment_released_meanwhile() -> None:
    gate = anyio.Event()
    fake = Fake(gate=gate)
    async with EnvironmentPool([fake.spec("t", policy="speculative")]) as pool:
        gate.set()
        first = await pool.acquire("t")  # a cold start
        gate = fake.gate = anyio.Event()  # the next start hangs until opened
        got: list[object] = []

        async def second() -> None:
            got.append(await pool.acquire("t"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(second)
            await pool.wait_until(lambda: pool.count("t", "starting") == 1 and fake.running == 1)
            await pool.release(first)  # released while the second acquire waits for its start
        assert got == [first] and first.state == "busy"
        assert pool.stats.handoffs == 1 and pool.stats.unclaimed_starts == 1 and pool.stats.cold_starts == 1
        gate.set()  # the start it no longer waits for ends as an idle warm environment
        await pool.wait_until(lambda: pool.count("t", "idle") == 1)
        spare = pool.environments("t")[1]
        assert spare.speculative and not spare.claimed and not spare.used  # nothing else of t was idle
        assert pool.stats.unclaimed_stopped == 0 and pool.stats.starts_dropped == 0
        assert await pool.acquire("t") is spare and pool.stats.hits == 1
        assert fake.started == 2
    assert fake.live == set()


async def test_a_start_given_up_for_a_handoff_while_still_queued_is_dropped() -> None:
    blocker, fake = Fake(gate=anyio.Event()), Fake()
    specs = [blocker.spec("w", policy="speculative"), fake.spec("t", policy="speculative")]
    async with EnvironmentPool(specs, start_concurrency=1) as pool:
        first = await pool.acquire("t")
        assert await pool.warm("w")  # holds the only start slot
        await pool.wait_until(lambda: blocker.running == 1)
        got: list[object] = []

        async def second() -> None:
            got.append(await pool.acquire("t"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(second)
            await pool.wait_until(lambda: pool.count("t", "starting") == 1)  # queued behind w
            await pool.release(first)
        assert got == [first] and pool.stats.handoffs == 1 and pool.stats.unclaimed_starts == 1
        assert pool.stats.starts_dropped == 1 and pool.count("t") == 1  # never started
        assert blocker.gate is not None
        blocker.gate.set()
        await pool.wait_until(lambda: pool.count("w", "idle") == 1)
        assert fake.begun == ["t"] and pool.stats.start_failures == 0 and pool.stats.wasted_warm_ups == 0
    assert fake.live == set() and blocker.live == set()


async def test_a_queued_start_given_up_is_kept_while_the_floor_needs_it_and_dropped_once_a_release_restores_it() -> (
    None
):
    blocker, fake = Fake(gate=anyio.Event()), Fake()
    specs = [blocker.spec("w", policy="speculative"), fake.spec("t", policy="speculative", floor=1)]
    async with EnvironmentPool(specs, start_concurrency=1) as pool:
        await pool.wait_until(lambda: pool.count("t", "idle") == 1)  # the floor
        assert await pool.warm("w")  # holds the only start slot
        await pool.wait_until(lambda: blocker.running == 1)
        first = await pool.acquire("t")  # a hit; the floor's refill queues behind w
        assert pool.count("t", "starting") == 1
        got: list[object] = []

        async def second() -> None:
            got.append(await pool.acquire("t"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(second)
            await pool.wait_until(lambda: pool.environments("t")[1].claimed)  # waits for the refill
            await pool.release(first)
        assert got == [first] and pool.stats.handoffs == 1
        refill = pool.environments("t")[1]  # given up, but t has nothing else idle: kept, in its place
        assert refill.state == "starting" and refill.given_up and pool.stats.starts_dropped == 0
        await pool.release(first)  # the floor is idle again: the queued refill is not needed
        await pool.wait_until(lambda: pool.stats.starts_dropped == 1)
        assert pool.environments("t") == [first] and first.state == "idle"
        assert blocker.gate is not None
        blocker.gate.set()
        await pool.wait_until(lambda: pool.count("w", "idle") == 1)
        assert fake.begun == ["t"]  # only the floor's first start ever ran
    assert fake.live == set() and blocker.live == set()


async def test_a_begun_start_given_up_is_stopped_when_up_if_its_type_has_one_idle() -> None:
    gate = anyio.Event()
    fake = Fake(gate=gate)
    async with EnvironmentPool([fake.spec("t", policy="speculative")]) as pool:
        gate.set()
        first = await pool.acquire("t")
        gate = fake.gate = anyio.Event()
        got: list[object] = []

        async def second() -> None:
            got.append(await pool.acquire("t"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(second)
            await pool.wait_until(lambda: fake.running == 1)  # its start has begun
            await pool.release(first)
        assert got == [first] and pool.stats.starts_dropped == 0  # begun: not dropped
        await pool.release(first)  # t has an idle environment again
        gate.set()
        await pool.wait_until(lambda: pool.stats.unclaimed_stopped == 1)
        assert pool.environments("t") == [first] and fake.live == {first.value}
        assert fake.started == 2 and pool.stats.wasted_warm_ups == 1
    assert fake.live == set()


async def test_a_given_up_start_another_acquire_claims_is_that_acquires() -> None:
    gate = anyio.Event()
    fake = Fake(gate=gate)
    async with EnvironmentPool([fake.spec("t", policy="speculative")]) as pool:
        gate.set()
        first = await pool.acquire("t")
        gate = fake.gate = anyio.Event()
        got: list[object] = []

        async def take() -> None:
            got.append(await pool.acquire("t"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(take)
            await pool.wait_until(lambda: fake.running == 1)
            await pool.release(first)  # the first waiter takes it; the start is given up
            await pool.wait_until(lambda: got == [first])
            tg.start_soon(take)  # the next waiter claims the given-up start
            await pool.wait_until(lambda: pool.environments("t")[1].claimed)
            assert not pool.environments("t")[1].given_up
            gate.set()
        assert got[1] is pool.environments("t")[1] and got[1] is not first
        assert pool.stats.warm_waits == 1 and pool.stats.unclaimed_stopped == 0 and pool.stats.starts_dropped == 0
    assert fake.live == set()


async def test_on_demand_never_hands_off_and_a_given_up_start_is_stopped() -> None:
    gate = anyio.Event()
    fake = Fake(gate=gate)
    async with EnvironmentPool([fake.spec("t", policy="on-demand")]) as pool:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.acquire, "t")
            await pool.wait_until(lambda: fake.running == 1)
            tg.cancel_scope.cancel()  # the acquire, while its start is in flight
        assert pool.count() == 0 and pool.stats.start_failures == 1
        gate.set()
        async with pool.lease("t"):
            pass
        assert pool.stats.cold_starts == 1 and pool.stats.handoffs == 0 and pool.count() == 0
    assert fake.live == set()


async def test_starts_an_acquire_waits_for_do_not_count_against_max_warm() -> None:
    gate = anyio.Event()
    fake = Fake(gate=gate)
    async with EnvironmentPool([fake.spec("t", policy="speculative", max_warm=1)]) as pool:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.acquire, "t")
            await pool.wait_until(lambda: pool.count("t", "starting") == 1)
            assert pool.environments("t")[0].claimed
            assert await pool.warm("t")  # the claimed start is the acquire's, not a warm one
            assert not await pool.warm("t")  # max_warm=1 unclaimed: reached
            assert pool.count("t", "starting") == 2 and pool.stats.warm_ups == 1
            gate.set()
        assert pool.stats.cold_starts == 1
        await pool.wait_until(lambda: pool.count("t", "idle") == 1)
    assert fake.live == set()


async def test_never_more_starts_in_flight_than_the_start_concurrency() -> None:
    fake = Fake(delay=0.01)
    specs = [fake.spec(n, policy="speculative", max_warm=2) for n in "abcdef"]
    async with EnvironmentPool(specs, start_concurrency=2) as pool:
        for n in "abcdef":
            assert await pool.warm(n)
            assert await pool.warm(n)

        async def call(n: str) -> None:
            async with pool.lease(n):
                pass

        async with anyio.create_task_group() as tg:
            for n in "abcdefabc":
                tg.start_soon(call, n)
        await pool.wait_until(lambda: pool.count(state="starting") == 0)
        assert fake.started == len(fake.begun) >= 12
        assert fake.peak_running == 2 and pool.stats.peak_starts_in_flight == 2
        assert pool.stats.starts_in_flight == 0 and pool.stats.start_queue_s > 0
    assert fake.live == set()
    assert EnvironmentPool([]).start_concurrency == host_cores() >= 1
    with pytest.raises(ConfigError, match="start_concurrency"):
        EnvironmentPool([], start_concurrency=0)


async def test_a_start_an_acquire_waits_for_goes_ahead_of_queued_warm_ups() -> None:
    gate = anyio.Event()
    fake = Fake(gate=gate)
    specs = [fake.spec(n, policy="speculative") for n in "abc"]
    async with EnvironmentPool(specs, start_concurrency=1) as pool:
        for n in "abc":
            assert await pool.warm(n)
        await pool.wait_until(lambda: fake.begun == ["a"])  # b and c queued behind it
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.acquire, "c")
            await pool.wait_until(lambda: pool.environments("c")[0].claimed)
            gate.set()
        assert fake.begun[:2] == ["a", "c"] and pool.stats.warm_waits == 1
        await pool.wait_until(lambda: pool.count(state="starting") == 0)
        assert fake.begun == ["a", "c", "b"]
    assert fake.live == set()


async def test_a_cancelled_acquire_whose_start_is_still_queued_leaves_nothing() -> None:
    gate = anyio.Event()
    fake = Fake(gate=gate)
    specs = [fake.spec("w", policy="speculative"), fake.spec("t", policy="speculative")]
    async with EnvironmentPool(specs, start_concurrency=1) as pool:
        assert await pool.warm("w")
        await pool.wait_until(lambda: fake.running == 1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.acquire, "t")
            await pool.wait_until(lambda: pool.count("t", "starting") == 1)  # queued behind w's start
            tg.cancel_scope.cancel()
        assert pool.count("t") == 0 and fake.begun == ["w"] and pool.stats.start_failures == 0
        gate.set()
        await pool.wait_until(lambda: pool.count("w", "idle") == 1)
        assert fake.begun == ["w"]
    assert fake.live == set()


async def test_markov_prefetch_drives_the_pool() -> None:
    fake = Fake()
    model = MarkovPrefetcher(lam=0.0, tau=0.5)
    async with EnvironmentPool([fake.spec("b", policy="speculative")]) as pool:
        send, receive = anyio.create_memory_object_stream[tuple[str, object]](8)
        async with anyio.create_task_group() as tg:
            tg.start_soon(prefetch_task, model, receive, prefetch_adapter(pool))
            async with send:
                for tool in "ababa":
                    await send.send((tool, None))
        await pool.wait_until(lambda: pool.count("b", "idle") == 1)
    assert pool.stats.wasted_warm_ups == 1  # never used before close
    assert fake.live == set()


async def test_budget_evicts_idle_speculative_warm_ups_first_lru() -> None:
    fake = Fake()
    specs = [fake.spec(n, policy="speculative", memory_bytes=100) for n in "abc"]
    specs.append(fake.spec("r", policy="reserved", reserved=1, memory_bytes=100))
    async with EnvironmentPool(specs, memory_budget_bytes=300) as pool:
        await pool.wait_until(lambda: pool.count("r", "idle") == 1)
        assert await pool.warm("a")
        await pool.wait_until(lambda: pool.count("a", "idle") == 1)
        assert await pool.warm("b")
        await pool.wait_until(lambda: pool.count("b", "idle") == 1)
        assert await pool.warm("c")  # evicts a (least recently warmed), never r
        await pool.wait_until(lambda: pool.count("c", "idle") == 1)
        assert pool.count("a") == 0 and pool.count("r") == 1 and pool.count("b") == 1
        assert pool.stats.budget_evictions == 1 and pool.stats.wasted_warm_ups == 1
        assert pool.memory_bytes() <= 300
        # everything busy: a warm-up that cannot fit is skipped
        leases = [await pool.acquire(n) for n in ("b", "c", "r")]
        assert not await pool.warm("a") and pool.stats.warm_skipped == 1
        for env in leases:
            await pool.release(env)
    assert fake.live == set()


async def test_idle_environments_are_evicted_but_reserved_ones_stay() -> None:
    fake = Fake()
    specs = [fake.spec("s", policy="speculative"), fake.spec("r", policy="reserved", reserved=1)]
    async with EnvironmentPool(specs, idle_timeout_s=0.02) as pool:
        assert await pool.warm("s")
        await pool.wait_until(lambda: pool.stats.idle_evictions >= 1 and pool.count("s") == 0)
        assert pool.count("r", "idle") == 1 and pool.stats.wasted_warm_ups == 1
    assert fake.live == set()


async def test_cold_start_cost_is_an_ewma_of_measured_starts() -> None:
    fake = Fake(delay=0.02)
    async with EnvironmentPool([fake.spec("t")], ewma_alpha=0.5) as pool:
        assert pool.cold_start_cost("t") is None
        async with pool.lease("t") as env:
            first = env.start_s
        assert pool.cold_start_cost("t") == pytest.approx(first)
        async with pool.lease("t") as env:
            second = env.start_s
        assert pool.cold_start_cost("t") == pytest.approx(0.5 * first + 0.5 * second)
        assert first >= 0.02 and pool.stats.provisioning_s == pytest.approx(first + second)


async def test_failed_starts_are_counted_and_raised_on_acquire() -> None:
    fake = Fake(fail=True)
    async with EnvironmentPool([fake.spec("t", policy="speculative")]) as pool:
        assert await pool.warm("t")
        await pool.wait_until(lambda: pool.stats.start_failures == 1)
        with pytest.raises(RuntimeError):
            await pool.acquire("t")
        assert pool.count() == 0


async def test_no_leaked_processes_after_close_also_after_an_exception() -> None:
    spec = demo_tool_spec("demo", startup_s=0.05, policy="reserved", reserved=2)
    pids: list[int] = []
    with pytest.raises(ValueError):
        async with EnvironmentPool([spec, demo_tool_spec("spec", startup_s=0.05, policy="speculative")]) as pool:
            await pool.wait_until(lambda: pool.count("demo", "idle") == 2)
            await pool.warm("spec")
            env = await pool.acquire("demo")
            reply = await env.value.call("lookup", {"x": 1}, id=7)
            assert reply == {"id": 7, "result": {"tool": "lookup", "args": {"x": 1}}}
            assert pool.rss_bytes() > 0
            pids = [e.value.pid for e in pool.environments() if e.value is not None]
            raise ValueError("the body failed")
    assert len(pids) >= 2
    for pid in pids:
        assert process_rss_bytes(pid) == 0 and not os.path.exists(f"/proc/{pid}/cmdline")


async def test_a_demo_tools_cold_start_is_measured() -> None:
    async with EnvironmentPool([demo_tool_spec("demo", startup_s=0.1)]) as pool:
        async with pool.lease("demo"):
            pass
        cost = pool.cold_start_cost("demo")
        assert cost is not None and cost >= 0.1


async def test_close_while_a_warm_up_is_in_flight_stops_it() -> None:
    fake = Fake(delay=0.05)
    async with EnvironmentPool([fake.spec("t", policy="speculative")]) as pool:
        await pool.warm("t")
    assert fake.live == set() and pool.count() == 0


# ---------------------------------------------------------------------- PooledSandbox


async def test_a_stale_pre_made_fork_is_discarded_never_handed_out() -> None:
    inner = InMemorySandbox()
    async with PooledSandbox.open(inner, depth=2) as sb:
        fork = await sb.fork()  # a miss (queue empty at first) or a pre-made one
        await fork.discard()
        with anyio.fail_after(10):
            while sb.ready() < 2:
                await anyio.sleep(0.001)
        v0 = sb.version
        await sb.execute(Action.bash("echo 1 > /tmp/f1"))
        assert sb.version != v0
        fresh = await sb.fork()
        assert fresh.version == sb.version
        assert sb.stats.stale_discarded >= 2
        with anyio.fail_after(10):
            while sb.ready() < 2:
                await anyio.sleep(0.001)
        handed = await sb.fork()
        assert handed.version == sb.version and sb.stats.handed_out >= 1
        await sb.commit(handed)


def _conformance_tests() -> dict[str, object]:
    path = Path(__file__).parents[1] / "runtime" / "test_conformance.py"
    spec = importlib.util.spec_from_file_location("_aospec_conformance_for_pool", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    # the protocol-level part (every sandbox); the runtime part needs run()/read_file()
    names = [
        "test_every_sandbox_and_its_forks_satisfy_the_protocol",
        "test_a_change_moves_the_version_and_a_read_keeps_it",
        "test_a_forks_changes_are_invisible_to_its_parent_and_siblings",
        "test_the_same_action_from_the_same_version_gives_the_same_result",
        "test_commit_makes_the_forks_state_the_parents_and_consumes_the_fork",
        "test_a_fork_of_a_fork_can_be_committed",
        "test_discard_is_idempotent_and_leaves_the_parent_alone",
        "test_serial_and_forked_execution_of_actions_reach_the_same_version",
        "test_forks_and_commits_of_one_sandbox_may_overlap",
    ]
    return {name: getattr(mod, name) for name in names}


globals().update(_conformance_tests())


@pytest.fixture(scope="module")
def overlay_dirs(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from aospec.runtime.host import host_support

    problems = host_support()[0].problems()
    if problems:
        pytest.skip(f"overlay sandbox cannot run here: {'; '.join(problems)}")
    mp = pytest.MonkeyPatch()
    mp.setenv("AOSPEC_CACHE_DIR", str(tmp_path_factory.mktemp("pool-cache")))
    state = tmp_path_factory.mktemp("pool-state")
    mp.setenv("AOSPEC_STATE_ROOT", str(state))
    yield state
    mp.undo()
    from aospec.runtime._fs import mounts_under

    assert not mounts_under(str(state))


@pytest.fixture(params=["memory", pytest.param("overlay", marks=pytest.mark.root)])
def opener(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    if request.param == "overlay":
        request.getfixturevalue("overlay_dirs")

        @asynccontextmanager
        async def open_overlay() -> AsyncIterator[Sandbox]:
            from aospec.runtime import SandboxConfig, open_sandbox

            async with (
                open_sandbox(SandboxConfig(backend="overlay", timeout_s=20)) as inner,
                PooledSandbox.open(inner, depth=2) as sb,
            ):
                yield sb

        return open_overlay

    @asynccontextmanager
    async def open_memory() -> AsyncIterator[Sandbox]:
        async with PooledSandbox.open(InMemorySandbox(), depth=2) as sb:
            yield sb

    return open_memory


@pytest.fixture
async def any_sandbox(opener) -> AsyncIterator[Sandbox]:  # type: ignore[no-untyped-def]
    async with opener() as sb:
        yield sb


@pytest.mark.root
async def test_a_sandbox_store_is_a_pool_environment_and_is_closed_with_the_pool(overlay_dirs) -> None:  # type: ignore[no-untyped-def]
    from aospec.runtime import SandboxConfig
    from aospec.runtime._fs import mounts_under
    from aospec.specbox.pool import pooled_sandbox, sandbox_spec

    spec = sandbox_spec("sb", SandboxConfig(backend="overlay", timeout_s=20), policy="reserved", reserved=1)
    async with EnvironmentPool([spec]) as pool:
        await pool.wait_until(lambda: pool.count("sb", "idle") == 1, 120)
        async with pool.lease("sb") as env:
            assert "hi" in await env.value.fork.execute(Action.bash("echo hi"))
            async with PooledSandbox.open(env.value.sandbox, depth=1) as pooled:
                fork = await pooled.fork()
                assert fork.version == pooled.version
                await fork.discard()
        async with pooled_sandbox(pool, "sb") as engine_sandbox:  # the engine's committed sandbox
            fork = await engine_sandbox.fork()
            await fork.execute(Action.bash("echo 1 > /tmp/f"))
            await engine_sandbox.commit(fork)
            assert "1" in await engine_sandbox.execute(Action.bash("cat /tmp/f"))
        assert pool.count("sb", "busy") == 0  # changed: stopped, not handed on
        await pool.wait_until(lambda: pool.count("sb", "idle") == 1, 120)  # the reserve refilled
        async with pooled_sandbox(pool, "sb") as next_user:
            assert "No such file" in await next_user.execute(Action.bash("cat /tmp/f"))
        cost = pool.cold_start_cost("sb")
        assert cost is not None and cost > 0 and pool.stats.hits >= 2
    assert not mounts_under(str(overlay_dirs))


async def test_an_acquire_over_the_count_budget_waits_for_a_release() -> None:
    fake = Fake()
    async with EnvironmentPool(
        [fake.spec("a", policy="speculative"), fake.spec("b", policy="speculative")], max_envs=1
    ) as pool:
        held = await pool.acquire("a")
        got: list[object] = []

        async def take_b() -> None:
            got.append(await pool.acquire("b"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(take_b)
            await pool.wait_until(lambda: pool.count("a", "busy") == 1)
            assert got == []  # a is busy, b does not fit
            await pool.release(held)  # a is idle now: evicted to make room for b
        assert len(got) == 1 and pool.count("b", "busy") == 1 and pool.count("a") == 0
        assert pool.count() <= 1


async def test_a_cancelled_cold_start_leaves_no_process() -> None:
    spec = demo_tool_spec("demo", startup_s=5.0)
    async with EnvironmentPool([spec]) as pool:
        with anyio.move_on_after(0.5):
            await pool.acquire("demo")
        assert pool.count() == 0 and pool.stats.start_failures == 1
    import subprocess

    out = subprocess.run(["pgrep", "-f", "aospec.specbox._demo_tool --startup-s 5.0"], capture_output=True, text=True)
    assert out.stdout.strip() == ""
