"""Contention in replay (``--cores``): processor sharing in virtual time, the contended
replay sandbox, the replay HostMonitor, and that replay without a host is unchanged."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import anyio
import pytest
from aospec.replay import bundled_traces_path, load_traces
from aospec.replay.actor import VirtualClock
from aospec.replay.contention import IDLE_WEIGHT, HostedCommand, HostModel, SimulatedHost, shares
from aospec.replay.policies import DrafterSet, parse_policies
from aospec.replay.sandbox import ContendedReplaySandbox, ReplaySandbox, ReplayWorld
from aospec.replay.sweep import replay_together, replay_trace, run_sweep
from trio.testing import MockClock

from aospec.cli import main as cli_main
from aospec.errors import ConfigError
from aospec.protocols import HostMonitor, SandboxCapabilities
from aospec.types import Action, Step, Trace

S = 1_000_000_000  # one second in virtual nanoseconds
DATA = Path(__file__).parent / "data"


def run_virtual(fn):
    return anyio.run(fn, backend="trio", backend_options={"clock": MockClock(autojump_threshold=0)})


def cpu_trace(steps: list[tuple[str, float, float | None]], id: str = "cpu", tokens: int = 10) -> Trace:
    """A trace of ``(command, tool seconds, CPU seconds or None)`` steps."""
    return Trace(
        id=id,
        task=id,
        harness="h",
        actor_model="m",
        source="test",
        steps=tuple(
            Step(Action.bash(cmd), f"{cmd} done\n", tokens, tool_duration_s=t, tool_cpu_s=cpu) for cmd, t, cpu in steps
        ),
    )


async def finish_times(host: SimulatedHost, commands: list[HostedCommand]) -> list[int]:
    """Run ``commands`` on ``host`` at once; when each finished (ns from the start)."""
    t0 = host.clock.now_ns()
    out = [0] * len(commands)

    async def one(k: int) -> None:
        await host.run(commands[k])
        out[k] = host.clock.now_ns() - t0

    async with anyio.create_task_group() as tg:
        for k in range(len(commands)):
            tg.start_soon(one, k)
    return out


def on_host(model: HostModel, commands: list[tuple[int, int]], weights: list[float] | None = None) -> list[int]:
    async def main() -> list[int]:
        host = SimulatedHost(model, VirtualClock())
        ws = weights or [1.0] * len(commands)
        return await finish_times(host, [HostedCommand(w, c, weight=x) for (w, c), x in zip(commands, ws, strict=True)])

    return run_virtual(main)


# ---------------------------------------------------------------- processor sharing


def test_two_cpu_bound_commands_on_one_core_take_twice_as_long() -> None:
    assert on_host(HostModel(1), [(S, S)]) == [S]
    assert on_host(HostModel(1), [(S, S), (S, S)]) == [2 * S, 2 * S]
    assert on_host(HostModel(2), [(S, S), (S, S)]) == [S, S]
    # the shorter one finishes first, and the other then runs alone: 2 x 0.5 s, then 0.5 s
    assert on_host(HostModel(1), [(S // 2, S // 2), (S, S)]) == [S, 3 * S // 2]


@pytest.mark.parametrize(("cores", "load", "factor"), [(1, 0, 1.0), (1, 2, 3.0), (2, 1, 1.0), (2, 3, 2.0), (4, 7, 2.0)])
def test_background_load_slows_a_cpu_bound_step_by_max_1_and_load_plus_1_over_cores(cores, load, factor) -> None:
    model = HostModel(cores, load)
    assert model.slowdown() == factor
    assert on_host(model, [(S, S)]) == [round(factor * S)]


def test_only_the_cpu_part_of_a_command_contends() -> None:
    # waits half its time: on one core beside one background process it gets s with
    # s + 0.5 s / (0.5 + 0.5 s) = 1, i.e. s = (sqrt 5 - 1) / 2, and takes 0.5/s + 0.5 of its time
    s = (5**0.5 - 1) / 2
    (t,) = on_host(HostModel(1, 1), [(S, S // 2)])
    assert abs(t - (0.5 / s + 0.5) * S) <= 1
    assert on_host(HostModel(1, 4), [(S, 0)]) == [S]  # waits all its time: never slowed


def test_a_multithreaded_command_uses_several_cores() -> None:
    # 2 s of CPU in 1 s: two threads; alone on 2 cores it keeps its time, on 1 core it doubles
    assert on_host(HostModel(2), [(S, 2 * S)]) == [S]
    assert on_host(HostModel(1), [(S, 2 * S)]) == [2 * S]
    # beside one background process on 2 cores: 3 threads share them, 2/3 each
    assert on_host(HostModel(2, 1), [(S, 2 * S)]) == [3 * S // 2]


def test_a_background_priority_command_barely_slows_the_foreground_one() -> None:
    fg, idle = on_host(HostModel(1), [(S, S), (S, S)], weights=[1.0, IDLE_WEIGHT])
    # shares 1024/1027 and 3/1027 until the foreground one ends, then the idle one runs alone
    assert abs(fg - S * (1 + IDLE_WEIGHT)) <= 1
    assert abs(idle - 2 * S) <= 1


def test_shares_fill_the_cores_and_never_exceed_one() -> None:
    assert shares(4, [(1, 1.0, 1.0), (1, 0.5, 1.0)]) == [1.0, 1.0]
    got = shares(1, [(1, 1.0, 1.0), (3, 1.0, 1.0)])
    assert got == pytest.approx([0.25, 0.25])
    groups = [(1, 1.0, 1.0), (1, 1.0, IDLE_WEIGHT), (2, 1.0, 1.0)]
    got = shares(2, groups)
    assert sum(n * s for (n, _, _), s in zip(groups, got, strict=True)) == pytest.approx(2)
    assert got[0] == got[2] < 1 and got[1] == pytest.approx(got[0] * IDLE_WEIGHT)


def test_bad_host_models_are_config_errors() -> None:
    for kw, flag in (
        ({"cores": 0}, "--cores"),
        ({"cores": float("nan")}, "--cores"),
        ({"cores": 2, "background_load": -1}, "--background-load"),
        ({"cores": 2, "background_load": 1.5}, "--background-load"),
        ({"cores": 2, "unrecorded_cpu": 1.5}, "--unrecorded-cpu"),
    ):
        with pytest.raises(ConfigError, match=flag):
            HostModel(**kw)


# ---------------------------------------------------------------- the contended replay sandbox


def test_contended_sandboxes_are_pausable_metered_and_prioritised_plain_ones_are_not() -> None:
    trace = cpu_trace([("make", 1.0, 1.0)])

    async def main():
        plain = ReplayWorld(trace, VirtualClock()).sandbox()
        world = ReplayWorld(trace, VirtualClock(), host=SimulatedHost(HostModel(2), VirtualClock()))
        contended = world.sandbox()
        return plain, contended, await contended.fork()

    plain, contended, fork = run_virtual(main)
    assert type(plain) is ReplaySandbox and SandboxCapabilities.of(plain) == SandboxCapabilities()
    assert isinstance(contended, ContendedReplaySandbox) and isinstance(fork, ContendedReplaySandbox)
    assert SandboxCapabilities.of(fork) == SandboxCapabilities(prioritized=True, pausable=True, metered=True)


def test_a_paused_fork_takes_no_cpu_and_makes_no_progress_until_resumed() -> None:
    trace = cpu_trace([("make", 1.0, 1.0)])

    async def main():
        clock = VirtualClock()
        world = ReplayWorld(trace, clock, host=SimulatedHost(HostModel(1), clock))
        root = world.sandbox()
        a, b = await root.fork(), await root.fork()
        done: dict[str, int] = {}
        seen: dict[str, object] = {}

        async def run(name: str, sb: ContendedReplaySandbox) -> None:
            await sb.execute(trace.steps[0].action)
            done[name] = clock.now_ns()

        async with anyio.create_task_group() as tg:
            await a.pause()  # a command started while paused starts frozen
            tg.start_soon(run, "a", a)
            tg.start_soon(run, "b", b)
            await clock.sleep_ns(S // 2)
            seen["half"] = (a.cpu_ns, b.cpu_ns, a.paused)
            await clock.sleep_ns(S)  # b is long done: it had the core to itself
            seen["later"] = (a.cpu_ns, b.cpu_ns)
            await a.resume()
            await clock.sleep_ns(S // 4)
            await a.pause()  # paused mid-run: its CPU stops where it is
            seen["paused"] = a.cpu_ns
            await clock.sleep_ns(10 * S)
            seen["still"] = a.cpu_ns
            await a.resume()
        return done, seen

    done, seen = run_virtual(main)
    assert seen["half"] == (0, S // 2, True)
    assert seen["later"] == (0, S)
    assert done["b"] == S
    assert seen["paused"] == seen["still"] == S // 4
    # a ran 1.5 s frozen, 0.25 s, 10 s frozen, then its last 0.75 s
    assert done["a"] == S // 2 + S + S // 4 + 10 * S + 3 * S // 4


def test_metered_cpu_is_the_recorded_one_without_contention_and_a_fork_starts_from_zero() -> None:
    trace = cpu_trace([("make", 2.0, 1.5), ("make test", 1.0, None)])

    async def main():
        clock = VirtualClock()
        world = ReplayWorld(trace, clock, host=SimulatedHost(HostModel(8, unrecorded_cpu=0.25), clock))
        root = world.sandbox()
        await root.execute(trace.steps[0].action)
        after_first = root.cpu_ns
        fork = await root.fork()
        await fork.execute(trace.steps[1].action)
        return after_first, root.cpu_ns, fork.cpu_ns, world.cpu_ns

    first, root_cpu, fork_cpu, steps = run_virtual(main)
    assert first == root_cpu == 3 * S // 2
    assert fork_cpu == S // 4  # no recorded CPU: --unrecorded-cpu 0.25 of its 1 s
    assert steps == [3 * S // 2, S // 4]


def test_the_replay_host_monitor_reads_the_simulated_host() -> None:
    trace = cpu_trace([("make", 1.0, 1.0)])

    async def main():
        clock = VirtualClock()
        host = SimulatedHost(HostModel(1, 2), clock)
        idle = host.host_monitor.snapshot()
        sb = ReplayWorld(trace, clock, host=host).sandbox()
        seen = {}
        async with anyio.create_task_group() as tg:
            tg.start_soon(sb.execute, trace.steps[0].action)
            await clock.sleep_ns(S // 10)
            seen["busy"] = host.snapshot()
            await sb.pause()
            seen["paused"] = host.snapshot()
            await sb.resume()
        return host, idle, seen

    host, idle, seen = run_virtual(main)
    assert isinstance(host.host_monitor, HostMonitor)
    assert (idle.cores, idle.busy_cores, idle.cpu_pressure) == (1.0, 1.0, pytest.approx(0.5))  # 2 threads, 1 core
    busy = seen["busy"]
    assert busy.busy_cores == pytest.approx(1.0) and busy.free_cores == pytest.approx(0.0)
    assert busy.cpu_pressure == pytest.approx(2 / 3)  # 3 runnable threads, 1 core
    assert seen["paused"].cpu_pressure == pytest.approx(0.5)


# ---------------------------------------------------------------- contended replays


@pytest.fixture(scope="module")
def bundled() -> list[Trace]:
    return load_traces([bundled_traces_path()])


def test_ample_cores_replay_exactly_as_without_a_host(bundled) -> None:
    policies = parse_policies("serial,aospec,spec-actions")
    ds = DrafterSet(bundled[2:])
    for trace in bundled[:2]:
        plain = replay_trace(trace, policies, [10.0, 1.0], ds)
        hosted = replay_trace(trace, policies, [10.0, 1.0], ds, host=HostModel(1000))
        assert [r.to_json() for r in hosted] == [r.to_json() for r in plain]


@pytest.mark.parametrize(("cores", "load", "factor"), [(1, 2, 3), (2, 3, 2), (4, 1, 1)])
def test_a_serial_replay_of_cpu_bound_steps_is_slowed_by_the_documented_factor(cores, load, factor) -> None:
    trace = cpu_trace([("make", 1.0, 1.0), ("make test", 0.5, 0.5), ("ls", 0.25, None)])
    (plain,) = replay_trace(trace, parse_policies("serial"), [10.0], DrafterSet([]))
    (r,) = replay_trace(trace, parse_policies("serial"), [10.0], DrafterSet([]), host=HostModel(cores, load))
    assert r.decode_ns == plain.decode_ns == 30 * 10_000_000
    assert r.tool_ns == factor * plain.tool_ns
    assert r.latency_ns == r.serial_ns == r.decode_ns + r.tool_ns
    assert r.saving == 0.0


def test_recorded_cpu_decides_what_contends(bundled) -> None:
    waits = cpu_trace([("curl example.org", 1.0, 0.0), ("sleep 1", 1.0, None)])
    policy = parse_policies("serial")
    (r,) = replay_trace(waits, policy, [10.0], DrafterSet([]), host=HostModel(1, 3, unrecorded_cpu=0.0))
    assert r.tool_ns == 2 * S  # nothing of it is CPU: the load does not slow it
    (r,) = replay_trace(waits, policy, [10.0], DrafterSet([]), host=HostModel(1, 3))
    assert r.tool_ns == S + 4 * S  # the unrecorded step counts as CPU-bound by default


def test_a_contended_speculative_replay_stays_lossless_and_is_measured_against_serial_on_the_host(bundled) -> None:
    ds = DrafterSet(bundled[3:])
    policies = parse_policies("serial,aospec")
    for trace in bundled[:3]:
        serial, spec = replay_trace(trace, policies, [10.0], ds, host=HostModel(2, 2))  # lossless, else it raises
        assert spec.serial_ns == serial.serial_ns == serial.latency_ns
        assert spec.tool_ns >= sum(round(s.tool_duration_s * S) for s in trace.steps)
        assert spec.ceiling_ns > 0


def test_wasted_cpu_is_what_discarded_forks_used_on_the_host_not_their_wall_time(bundled) -> None:
    """Without a host a fork is taken to use a core for its whole tool time; on a busy one
    its background share and its pauses keep its CPU far below the wall time it held."""
    ds = DrafterSet(bundled[3:])
    policies = parse_policies("aospec:admission=off")
    trace = bundled[0]
    (plain,) = replay_trace(trace, policies, [10.0], ds, check_ceilings=False)
    assert plain.wasted_tool_ns > 0 and plain.wasted_cpu_ns == plain.wasted_tool_ns
    (busy,) = replay_trace(trace, policies, [10.0], ds, host=HostModel(2, 2), check_ceilings=False)
    assert 0 < busy.wasted_cpu_ns < busy.wasted_tool_ns / 10
    assert busy.to_json()["wasted_cpu_ns"] == busy.wasted_cpu_ns


def test_a_contended_sweep_is_the_same_on_every_worker_count(bundled) -> None:
    policies = parse_policies("serial,aospec")
    runs = [
        run_sweep(bundled[:3], policies, tpots_ms=[10.0], jobs=jobs, host=HostModel(1, 1), check_ceilings=False)
        for jobs in (1, 2)
    ]
    assert [r.to_json() for r in runs[0]] == [r.to_json() for r in runs[1]]


def test_sessions_replayed_together_share_the_host() -> None:
    trace = cpu_trace([("make", 1.0, 1.0), ("make test", 2.0, 2.0)])
    ds = DrafterSet([])
    decode = 2 * 10 * 10_000_000
    for cores, expected_tool in ((1, 6 * S), (2, 3 * S)):
        (results,) = replay_together(
            [trace, replace(trace, id="cpu-2")], parse_policies("serial"), 10.0, ds, HostModel(cores)
        )
        assert [r.trace_id for r in results] == ["cpu", "cpu-2"]
        assert [r.latency_ns for r in results] == [decode + expected_tool] * 2
        assert all(r.serial_ns == r.latency_ns for r in results)


# ---------------------------------------------------------------- the command line


def test_without_cores_replay_output_is_byte_identical_to_the_saved_bundled_sweep(tmp_path: Path, capsys) -> None:
    """tests/replay/data/bundled-sweep/ holds what ``aospec sweep --bundled --jobs 1 --tpots 10,1 --policies
    serial,aospec`` wrote before contention existed; a change that is meant to change replay results
    regenerates it with that command (``--out tests/replay/data/bundled-sweep``, keeping the two jsonl files)."""
    out = tmp_path / "out"
    args = ["sweep", "--bundled", "--jobs", "1", "--tpot-ms", "10,1", "--policies", "serial,aospec"]
    assert cli_main([*args, "--no-progress", "--out", str(out)]) == 0
    for name in ("results.jsonl", "summary.jsonl"):
        assert (out / name).read_bytes() == (DATA / "bundled-sweep" / name).read_bytes(), name
    assert "host model" not in (out / "summary.md").read_text()


def test_sweep_with_cores_names_its_host_in_the_summary(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    args = ["sweep", "--bundled", "--jobs", "1", "--tpot-ms", "10", "--policies", "serial,aospec"]
    assert cli_main([*args, "--cores", "2", "--background-load", "2", "--no-progress", "--out", str(out)]) == 0
    md = (out / "summary.md").read_text()
    assert "- host model: 2 cores, 2 background processes;" in md
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    serial = {r["trace_id"]: r["latency_ns"] for r in rows if r["policy"] == "serial"}
    assert all(r["serial_ns"] == serial[r["trace_id"]] for r in rows)


def aospec_cli(*args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("aospec")
    return subprocess.run([str(exe), *args], capture_output=True, text=True)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--background-load", "2"], "--background-load needs --cores C"),
        (["--unrecorded-cpu", "0.5"], "--unrecorded-cpu needs --cores C"),
        (["--cores", "0"], "--cores must be a positive number, got 0"),
        (["--cores", "2", "--background-load", "-1"], "--background-load must be >= 0"),
        (["--cores", "2", "--unrecorded-cpu", "2"], "--unrecorded-cpu must be a share of tool time between 0 and 1"),
    ],
)
def test_bad_host_flags_are_one_clear_line(flags: list[str], message: str, tmp_path: Path) -> None:
    done = aospec_cli("replay", "--bundled", "--policies", "serial", *flags)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr
