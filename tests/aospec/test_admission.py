"""The speculation controller (aospec/admission.py): what it learns, how it prices, and
the decisions it makes inside the engine, in virtual time (trio's MockClock), where every
decision is deterministic. Every run is also checked against serial execution: the
controller decides only what runs early, never what is committed."""

from __future__ import annotations

import json
import time

import anyio
import pytest
from trio.testing import MockClock

from aospec.admission import (
    BRANCH,
    MODEL_FORMAT,
    PROBE_EVERY,
    ROUND_CANDIDATES,
    ROUND_PROBE_EVERY,
    ROUND_WINDOW,
    SAMPLE_INTERVAL_S,
    TARGET,
    AdmissionModel,
    BetaHitModel,
    Candidate,
    CostModel,
    DraftRound,
    cpu_price,
    forks_to_run,
    host_config,
    step_cpu_s,
)
from aospec.engine import Engine
from aospec.engine_config import EngineConfig
from aospec.errors import ConfigError
from aospec.host import DecodeMeter, SpeculationBudget, StaticHostMonitor
from aospec.ledger import EventKind
from aospec.protocols import ActionDraft, HostSnapshot, ObservationDraft
from aospec.testing import (
    BusySandbox,
    InMemorySandbox,
    ScriptedActionDrafter,
    ScriptedActor,
    ScriptedObservationDrafter,
)
from aospec.types import Action, History, Step

QUIET = HostSnapshot(cores=8.0, busy_cores=0.0, cpu_pressure=0.0, memory_pressure=0.0, memory_available_bytes=8 << 30)
FULL = HostSnapshot(cores=2.0, busy_cores=2.0, cpu_pressure=0.5, memory_pressure=0.0, memory_available_bytes=8 << 30)


def run_virtual(fn):
    return anyio.run(fn, backend="trio", backend_options={"clock": MockClock(autojump_threshold=0)})


def actor_of(script, delay=1.0):
    return ScriptedActor(lambda h: script[len(h)] if len(h) < len(script) else Action.bash("true"), delay)


async def serial(script, sandbox_type=InMemorySandbox, files=None):
    sb = sandbox_type(files or {})
    history = await Engine(actor_of(script), sb).run(History("t"), steps=len(script))
    return history, sb


# ---------------------------------------------------------------------- what it learns


def test_p_hit_starts_at_the_score_and_follows_the_outcomes_of_its_cells():
    model = BetaHitModel()
    c = Candidate(TARGET, "drafter", "pytest", 0, 0.9)
    assert model.p_hit(c) == pytest.approx(0.9)
    for _ in range(40):
        model.observe(c, False)
    assert model.p_hit(c) < 0.05  # a confident drafter that is always wrong is priced as such
    # a new tool label (or distance) backs off to what its kind and score bin have shown
    other = Candidate(TARGET, "drafter", "make", 0, 0.9)
    assert model.p_hit(other) < 0.1
    assert model.p_hit(Candidate(TARGET, "drafter", "pytest", 1, 0.9)) < 0.1
    # ...but not across kinds or score bins
    assert model.p_hit(Candidate(BRANCH, "drafter", "pytest", 0, 0.9)) == pytest.approx(0.9)
    assert model.p_hit(Candidate(TARGET, "drafter", "pytest", 0, 0.4)) == pytest.approx(0.4)
    for _ in range(40):
        model.observe(other, True)
    assert model.p_hit(other) > 0.7 > model.p_hit(c)
    assert model.outcomes(other) == (40.0, 40.0)


def test_the_model_round_trips_through_json_and_a_bad_file_is_one_clear_error(tmp_path):
    model = AdmissionModel()
    c = Candidate(TARGET, "d", "ls", 1, 0.4)
    for hit in (True, False, False):
        model.hits.observe(c, hit)
    model.costs.executed(Action.bash("ls -la"), 0.5, 0.25)
    model.costs.decoded(Action.bash("ls -la"), 2.0)
    path = tmp_path / "calibration.json"
    model.save(path)
    loaded = AdmissionModel.load(path)
    assert loaded.hits.p_hit(c) == pytest.approx(model.hits.p_hit(c))
    assert loaded.costs.tool_s(Action.bash("ls -l"), "ls") == pytest.approx(0.5)
    assert loaded.costs.cpu_ratio("ls") == pytest.approx(0.5)
    assert json.loads(path.read_text())["format"] == MODEL_FORMAT

    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "aospec-admission", "version": 1, "hits": {"cells": [[["target", 0], 3, 1]]}}')
    with pytest.raises(ConfigError, match=r"bad.json: hits.cells\[0\]: more hits"):
        AdmissionModel.load(bad)
    bad.write_text("not json")
    with pytest.raises(ConfigError, match=r"bad\.json: not JSON"):
        AdmissionModel.load(bad)
    with pytest.raises(ConfigError, match="not an aospec admission model"):
        AdmissionModel.from_json({"format": "something else"})
    # a file aospec did not write is never overwritten
    with pytest.raises(ConfigError, match="not overwriting"):
        model.save(bad)
    assert bad.read_text() == "not json"


def test_costs_are_learned_per_action_then_per_tool_label_and_decode_time_by_length():
    costs = CostModel()
    assert costs.tool_s(Action.bash("make")) == 1.0  # the prior
    costs.executed(Action.bash("make all"), 30.0)
    costs.executed(Action.bash("make test"), 10.0)
    assert costs.tool_s(Action.bash("make all")) == 30.0  # its own last run
    assert costs.tool_s(Action.bash("make docs")) == pytest.approx(20.0)  # its label's mean
    assert costs.tool_s(Action.bash("ls")) == pytest.approx(20.0)  # every tool's
    assert costs.cpu_ratio("make") == 1.0  # unknown CPU: the whole tool time
    for n in (10, 100, 1000):
        costs.decoded(Action.bash("x" * n), 0.5 + 0.01 * n)
    assert costs.decode_s(Action.bash("x" * 500)) == pytest.approx(5.5, rel=0.05)
    assert costs.decode_s(Action.bash("ls")) < 1.0


def test_recorded_step_cpu_is_read_from_the_step_or_its_extra():
    step = Step(Action.bash("ls"), "", 1, tool_duration_s=2.0, extra={"cpu_s": 0.5})
    assert step_cpu_s(step) == 0.5
    assert step_cpu_s(Step(Action.bash("ls"), "", 1, extra={"cpu_s": "lots"})) is None
    assert step_cpu_s(Step(Action.bash("ls"), "", 1)) is None
    model = AdmissionModel()
    from aospec.types import Trace

    model.fit_costs([Trace("t", "t", "h", "m", "s", (step,))])
    assert model.costs.cpu_ratio("ls") == pytest.approx(0.25) and model.costs.tool_s(Action.bash("ls")) == 2.0


# ---------------------------------------------------------------------- the host's price


def test_a_cpu_second_costs_more_on_a_busy_host_and_guesses_yield_to_a_cpu_bound_command():
    assert cpu_price(0.2, None) == cpu_price(0.2, QUIET) == 0.2
    assert cpu_price(0.2, FULL) == pytest.approx(1.7)  # a whole core taken from others, half the time stalled
    # the command the agent waits on blocks: every guess runs
    assert forks_to_run(0.1, FULL, [1.0, 1.0], 2.0) == 2
    # CPU-bound on a host with no room: none runs; with no host information: none either
    assert forks_to_run(1.0, HostSnapshot(cores=2.0, busy_cores=2.0), [1.0], 1.0) == 0
    assert forks_to_run(1.0, None, [1.0], 1.0) == 0
    # CPU-bound, but cores to spare beside it: as many as fit, best first
    assert forks_to_run(1.0, HostSnapshot(cores=4.0, busy_cores=1.0), [1.0, 1.0, 1.0], 0.0) == 2
    # a busy host: one fork per free core and lookahead 1; a quiet one keeps the defaults
    assert host_config(EngineConfig(), FULL).fork_width == 1 and host_config(EngineConfig(), FULL).depth == 1
    quiet = host_config(EngineConfig(), QUIET)
    assert (quiet.fork_width, quiet.depth, quiet.max_live_forks) == (8, 2, 32)


def test_engine_config_checks_the_controller_knobs():
    for bad in (
        {"admission": "maybe"},
        {"cpu_price": -1.0},
        {"cpu_price": float("nan")},
        {"guard_window": -1},
        {"stream_cores": -0.1},
        {"stream_cores": float("inf")},
        {"stream_cores": True},
    ):
        with pytest.raises(ConfigError):
            EngineConfig(**bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- decisions in the engine

LONG = [Action.bash(c) for c in ("sleep 5 && cat a", "sleep 5 && cat a", "sleep 5 && ls", "sleep 5 && cat a")] * 3


def right(script, p=0.9):
    return ScriptedActionDrafter(lambda h: [ActionDraft(script[len(h)], 0, p)] if len(h) < len(script) else [])


def wrong(p=0.9, seconds=20):
    return ScriptedActionDrafter(lambda h: [ActionDraft(Action.bash(f"sleep {seconds} && echo {len(h)} > w"), 0, p)])


async def _run(script, drafters, config=None, sandbox=None, **engine_kwargs):
    sb = sandbox if sandbox is not None else InMemorySandbox({"a": "A\n"})
    engine = Engine(actor_of(script), sb, action_drafters=drafters, config=config or EngineConfig(), **engine_kwargs)
    history = await engine.run(History("t"), steps=len(script))
    return history, sb, engine


def test_a_guess_that_pays_is_launched_and_one_that_never_hits_is_priced_out():
    async def main():
        ref, _ = await serial(LONG, files={"a": "A\n"})
        good = await _run(LONG, [right(LONG)])
        bad = await _run(LONG, [wrong()])
        bad_off = await _run(LONG, [wrong()], EngineConfig(admission="off"))
        return ref, good, bad, bad_off

    ref, good, bad, bad_off = run_virtual(main)
    for history, sb, _ in (good, bad, bad_off):
        assert history == ref and sb.live_forks == 0
    g = good[2].statistics()
    assert g.forks_reused == len(LONG) and g.refused == 0 and g.efficiency is None
    b, off = bad[2].statistics(), bad_off[2].statistics()
    assert off.forks_launched == len(LONG) and off.refused == 0 and off.admitted == len(LONG)
    # the controller saw the confident drafter miss (at its step, then for LATE_STEPS more
    # steps: a fork of an unchanged state may still be emitted later), and stopped paying
    assert b.refused_price >= len(LONG) // 2 and b.forks_launched <= len(LONG) // 2
    assert b.wasted_tool_ns < off.wasted_tool_ns * 0.6
    assert b.wasted_cpu_ns == b.wasted_tool_ns  # nothing metered: the tool time stands in for CPU


def test_refused_guesses_are_learned_from_so_an_unlucky_start_is_not_the_end():
    # the drafter is right every time but says p = 0.02: priced out at first; each refused
    # guess that the actor then emits from the same state teaches the model otherwise
    async def main():
        ref, _ = await serial(LONG, files={"a": "A\n"})
        return ref, await _run(LONG, [right(LONG, p=0.02)])

    ref, (history, _, engine) = run_virtual(main)
    assert history == ref
    stats = engine.statistics()
    assert stats.refused_price >= 1 and stats.forks_reused >= len(LONG) // 2
    refused_then_reused = stats.refused_price + stats.forks_reused
    assert refused_then_reused == len(LONG) and stats.forks_wasted == 0


def test_a_guess_that_can_hide_nothing_is_not_launched():
    # instant commands: nothing to hide, so even a certain guess is not worth its overhead
    script = [Action.bash(c) for c in ("ls", "cat a", "ls", "cat a")] * 2

    async def main():
        return await _run(script, [right(script, p=0.99)])

    _, _, engine = run_virtual(main)
    stats = engine.statistics()
    assert stats.forks_launched <= 1 and stats.refused_price >= len(script) - 1


class AlwaysSure:
    """A pluggable p(hit) source that is always sure: only the guard stops a bad drafter."""

    def __init__(self):
        self.observed = []

    def p_hit(self, candidate):
        return 0.99

    def observe(self, candidate, hit):
        self.observed.append(hit)


@pytest.mark.parametrize("window", [4, 0])
def test_the_guard_falls_back_to_probes_when_speculation_does_not_pay(window):
    script = [Action.bash("sleep 5 && cat a")] * 30
    sure = AlwaysSure()

    async def main():
        ref, _ = await serial(script, files={"a": "A\n"})
        config = EngineConfig(guard_window=window)
        return ref, await _run(script, [wrong(seconds=5)], config, admission_model=AdmissionModel(hits=sure))

    ref, (history, _, engine) = run_virtual(main)
    assert history == ref
    stats = engine.statistics()
    assert sure.observed and not any(sure.observed)  # the hit model heard every outcome
    if window:
        assert stats.guarded_steps > len(script) // 2
        assert stats.refused_guard > len(script) // 2
        assert 1 <= stats.probes <= len(script) // PROBE_EVERY + 1
        assert stats.forks_launched <= window + stats.probes + 1
    else:
        assert stats.refused_guard == stats.guarded_steps == stats.probes == 0
        assert stats.forks_launched == len(script)


def test_the_guard_spans_an_engines_runs_and_a_saved_model(tmp_path):
    """Tasks shorter than the window: one run alone never fills it, the Engine's runs
    together do, and a model saved after them starts the next Engine guarded."""
    task = [Action.bash("sleep 5 && cat a")] * 5
    config = EngineConfig(guard_window=8)

    async def main():
        engine = Engine(
            actor_of(task), InMemorySandbox({"a": "A\n"}), action_drafters=[wrong(seconds=5)], config=config,
            admission_model=AdmissionModel(hits=AlwaysSure()),
        )
        per_run = []
        for _ in range(4):
            await engine.run(History("t"), steps=len(task))
            st = engine.statistics()
            per_run.append((st.guarded_steps, st.refused_guard, st.forks_launched))
        return engine, per_run

    engine, per_run = run_virtual(main)
    assert per_run[0] == (0, 0, len(task))  # 5 steps: the window of 8 is not full yet
    assert all(g > 0 and r > 0 for g, r, _ in per_run[2:])  # held back from the second run on
    assert per_run[3][2] <= 1  # at most a probe
    path = tmp_path / "calibration.json"
    engine.admission_model.hits = BetaHitModel()  # (AlwaysSure cannot be saved)
    engine.admission_model.save(path)
    saved = json.loads(path.read_text())["guard"]
    assert saved["guarded"] is True and len(saved["window"]) == 20
    loaded = AdmissionModel.load(path)
    loaded.hits = AlwaysSure()

    async def again():
        ref, _ = await serial(task, files={"a": "A\n"})
        engine = Engine(
            actor_of(task), InMemorySandbox({"a": "A\n"}), action_drafters=[wrong(seconds=5)], config=config,
            admission_model=loaded,
        )
        return ref, await engine.run(History("t"), steps=len(task)), engine.statistics()

    ref, history, st = run_virtual(again)
    assert history == ref
    assert st.guarded_steps == len(task) and st.refused_guard >= len(task) - 1
    for bad, where in (
        ({"window": [[1.0]]}, r"guard\.window\[0\]: expected \[benefit, cost\]"),
        ({"window": [[1.0, -2.0]]}, r"guard\.window\[0\]: expected a finite number >= 0"),
        ({"guarded": "yes"}, r"guard\.guarded: expected true or false"),
    ):
        with pytest.raises(ConfigError, match=where):
            AdmissionModel.from_json({"format": MODEL_FORMAT, "version": 1, "guard": bad})


def test_the_guard_lets_speculation_back_once_a_probe_pays():
    # the first 12 guesses are wrong, then the drafter gets it right
    script = [Action.bash("sleep 5 && cat a")] * 40

    def propose(h):
        if len(h) < 12:
            return [ActionDraft(Action.bash(f"sleep 5 && echo {len(h)} > w"), 0, 0.9)]
        return [ActionDraft(script[len(h)], 0, 0.9)] if len(h) < len(script) else []

    async def main():
        cfg = EngineConfig(guard_window=4)
        return await _run(
            script, [ScriptedActionDrafter(propose)], cfg, admission_model=AdmissionModel(hits=AlwaysSure())
        )

    _, _, engine = run_virtual(main)
    stats = engine.statistics()
    assert stats.guarded_steps > 0 and stats.probes >= 1
    assert stats.forks_reused > 20  # out of the guard again


def test_observation_branches_are_priced_and_the_refused_ones_still_teach_the_model():
    # drafts that are always wrong: the model learns it from started and refused ones alike
    script = [Action.bash("sleep 3 && cat a")] * 12
    drafter = ScriptedObservationDrafter(lambda h, a: [ObservationDraft(f"nope {len(h)}", 0.5)])

    async def main():
        ref, _ = await serial(script, files={"a": "A\n"})
        sb = InMemorySandbox({"a": "A\n"})
        cfg = EngineConfig(fork_width=0, decode_price=0.5, branch_budget=1)
        engine = Engine(actor_of(script), sb, observation_drafters=[drafter], config=cfg)
        return ref, await engine.run(History("t"), steps=len(script)), engine

    ref, history, engine = run_virtual(main)
    assert history == ref
    stats = engine.statistics()
    assert stats.drafts_started >= 1 and stats.refused_price >= len(script) // 2
    assert stats.drafts_started + stats.refused_price == len(script)


def test_a_host_budget_slot_per_running_guess_shared_by_every_session(tmp_path):
    script = [Action.bash("sleep 5 && cat a")] * 4
    three = ScriptedActionDrafter(
        lambda h: (
            [ActionDraft(Action.bash(f"sleep 4 && echo {k} > w{k}"), 0, 0.6) for k in range(3)]
            + ([ActionDraft(script[len(h)], 0, 0.9)] if len(h) < len(script) else [])
        )
    )
    model = AdmissionModel(hits=AlwaysSure())

    async def main(budget):
        return await _run(script, [three], EngineConfig(guard_window=0), admission_model=model, budget=budget)

    one = SpeculationBudget(1, directory=tmp_path, host_cores=8)
    _, _, engine = run_virtual(lambda: main(one))
    stats = engine.statistics()
    assert stats.forks_reused == len(script)  # the best guess (p 0.9) comes first and gets the slot
    assert stats.refused_budget >= len(script) * 3 - 1
    assert one.held() == 0  # every slot is given back

    # another session of the host holds the only slot: no fork runs here
    other = SpeculationBudget(1, directory=tmp_path, host_cores=8)
    lease = other.try_acquire()
    assert lease is not None
    _, _, engine = run_virtual(lambda: main(one))
    stats = engine.statistics()
    assert stats.forks_launched == 0 and stats.refused_budget == len(script) * 4
    lease.release()
    assert one.held() == 0


class ScriptedHost:
    """A host monitor whose snapshot a test changes as it goes."""

    def __init__(self, snapshot):
        self.now = snapshot

    def snapshot(self):
        return self.now


def test_memory_pressure_refuses_guesses_and_drops_the_lowest_value_fork():
    script = [Action.bash("sleep 5 && cat a"), Action.bash("echo x > b"), Action.bash("sleep 5 && cat a")]
    host = ScriptedHost(QUIET)

    class Squeezing:
        """Boundary 0: a good and a poor guess; boundary 1: memory gets scarce."""

        async def propose(self, history, width, depth):
            if len(history) == 0:
                return [ActionDraft(script[0], 0, 0.9), ActionDraft(Action.bash("sleep 30 && ls"), 0, 0.3)]
            host.now = HostSnapshot(cores=8.0, busy_cores=0.0, memory_pressure=0.5, memory_available_bytes=1 << 28)
            return [ActionDraft(script[len(history)], 0, 0.9)] if len(history) < len(script) else []

    async def main():
        ref, _ = await serial(script, files={"a": "A\n"})
        return ref, await _run(script, [Squeezing()], host=host)

    ref, (history, sb, engine) = run_virtual(main)
    assert history == ref and sb.live_forks == 0
    stats = engine.statistics()
    assert stats.forks_dropped == 1 and stats.refused_memory >= 1
    dropped = [e.detail for e in engine.ledger.events if e.kind is EventKind.DROP]
    assert dropped == [Action.bash("sleep 30 && ls").key]  # the lowest value went first


# ---------------------------------------------------------------------- yielding the CPU

BURN = [Action.bash("burn 2"), Action.bash("burn 3"), Action.bash("sleep 1 && cat a")]


def burn_targets(offsets=(0, 1)):
    """At the first boundary: step 0's action and step 1's (read-only both: JASV keeps them)."""
    return ScriptedActionDrafter(
        lambda h: (
            [ActionDraft(BURN[len(h) + k], k, 0.9) for k in offsets if len(h) + k < len(BURN)] if len(h) == 0 else []
        )
    )


@pytest.mark.parametrize(
    ("host", "paused"),
    [
        (StaticHostMonitor(HostSnapshot(cores=2.0, busy_cores=2.0)), True),
        (None, True),
        (StaticHostMonitor(QUIET), False),
    ],
)
def test_guesses_pause_while_the_command_the_agent_waits_on_is_cpu_bound(host, paused):
    async def main():
        ref, ref_sb = await serial(BURN, BusySandbox, files={"a": "A\n"})
        sb = BusySandbox({"a": "A\n"})
        t0 = anyio.current_time()
        out = await _run(BURN, [burn_targets()], EngineConfig(branch_budget=0), sandbox=sb, host=host)
        return ref, ref_sb, out, anyio.current_time() - t0

    ref, ref_sb, (history, sb, engine), took = run_virtual(main)
    assert history == ref and sb.files == ref_sb.files and sb.version == ref_sb.version and sb.live_forks == 0
    stats = engine.statistics()
    assert stats.forks_reused == 2
    if paused:
        # the fork of "burn 3" waited while "burn 2" (the step the agent waited on) burned,
        # then ran on: still reused, its paused time counted
        assert stats.forks_paused >= 1 and stats.paused_ns > 0
        kinds = [e.kind for e in engine.ledger.events]
        assert kinds.count(EventKind.PAUSE) == stats.forks_paused == kinds.count(EventKind.RESUME)
    else:
        assert stats.forks_paused == 0 and stats.paused_ns == 0
        assert took < 1 + 2 + 1 + 1 + 1 + 0.5  # both burns ran side by side, nothing waited


class CountingBusySandbox(BusySandbox):
    """A BusySandbox that counts the reads of its CPU meter (forks share the count)."""

    def __init__(self, *args, reads=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.reads = reads if reads is not None else [0]

    @property
    def cpu_ns(self):
        self.reads[0] += 1
        return super().cpu_ns

    async def fork(self):
        child = await super().fork()  # (of this class: InMemorySandbox.fork keeps the type)
        child.reads = self.reads
        return child


def test_the_command_the_agent_waits_on_is_not_sampled_while_no_guess_could_yield_to_it():
    # Beside a CPU-bound command on a busy host, sampling it every 20 ms costs the command
    # CPU. A guess that already ended (a quick wrong one, kept for JASV) cannot yield: while
    # "burn 2" and "burn 3" run, nothing is sampled; a guess still running is sampled for.
    quick = ScriptedActionDrafter(lambda h: [ActionDraft(Action.bash("cat a"), 0, 0.9)] if len(h) == 0 else [])

    async def main():
        ref, ref_sb = await serial(BURN, BusySandbox, files={"a": "A\n"})
        ended = CountingBusySandbox({"a": "A\n"})
        out = await _run(BURN, [quick], EngineConfig(branch_budget=0), sandbox=ended)
        running = CountingBusySandbox({"a": "A\n"})
        with_forks = await _run(BURN, [burn_targets()], EngineConfig(branch_budget=0), sandbox=running)
        return ref, ref_sb, out, with_forks

    ref, ref_sb, (history, sb, engine), (history2, sb2, engine2) = run_virtual(main)
    assert history == ref == history2 and sb.files == ref_sb.files == sb2.files
    # 5 s of burning sampled every 20 ms would be ~250 reads; each step reads it a few times
    assert engine.statistics().forks_launched == 1 and sb.reads[0] <= 3 * len(BURN)
    # with guesses to yield to the burning step, it is sampled (and they are paused), and a
    # guess running as the step's command starts is paused at the first sample
    assert engine2.statistics().forks_paused >= 1 and sb2.reads[0] > 50
    events = engine2.ledger.events
    started = next(e.t_ns for e in events if e.kind is EventKind.REUSE)  # "burn 2": its fork is the step
    paused = next(e.t_ns for e in events if e.kind is EventKind.PAUSE)
    assert (paused - started) * 1e-9 == pytest.approx(SAMPLE_INTERVAL_S, abs=1e-3)


def test_the_yield_loop_sleeps_while_there_is_no_guess_at_all(monkeypatch):
    # It used to wake every 20 ms through every committed command to find no guess (4,000
    # wake-ups in two 8-session runs at 1 ms); now it waits until one is launched. Counted
    # by the registry's checks: 6 s of commands sampled every 20 ms would be ~300.
    from aospec.forks import ForkRegistry

    checks = [0]
    length = ForkRegistry.__len__

    def counted(self):
        checks[0] += 1
        return length(self)

    monkeypatch.setattr(ForkRegistry, "__len__", counted)

    async def main():
        ref, ref_sb = await serial(BURN, BusySandbox, files={"a": "A\n"})
        checks[0] = 0
        sb = BusySandbox({"a": "A\n"})
        silent = ScriptedActionDrafter(lambda h: [])  # forks are on; it never guesses
        return ref, ref_sb, await _run(BURN, [silent], EngineConfig(branch_budget=0), sandbox=sb)

    ref, ref_sb, (history, sb, engine) = run_virtual(main)
    assert history == ref and sb.files == ref_sb.files
    assert engine.statistics().forks_launched == 0
    assert checks[0] < 10 * len(BURN)


def test_a_fork_that_cannot_pause_costs_one_counted_failure_and_runs_on():
    async def main():
        ref, _ = await serial(BURN, BusySandbox, files={"a": "A\n"})
        sb = BusySandbox({"a": "A\n"}, fail_pause=True)
        return ref, await _run(BURN, [burn_targets()], EngineConfig(branch_budget=0), sandbox=sb)

    ref, (history, sb, engine) = run_virtual(main)
    assert history == ref and sb.live_forks == 0
    stats = engine.statistics()
    assert stats.forks_paused == 0 and stats.forks_reused == 2
    fails = [e.detail for e in engine.ledger.events if e.kind is EventKind.FAIL]
    assert len(fails) == 1 and "pausing a speculative fork" in fails[0]  # not tried again


@pytest.mark.parametrize("decode_s", [0.01, 0.0])
def test_a_paused_fork_the_agent_emits_is_resumed_and_reused(decode_s):
    # step 1's fork is launched at boundary 0 and paused while "burn 2" burns. The actor
    # emits "burn 3" once step 0 is committed: after a decode, the fork was resumed when
    # "burn 2" ended; with an instant decode, JASV takes the still-paused fork and
    # resumes it itself. Either way it runs on and is reused.
    async def main():
        ref, _ = await serial(BURN, BusySandbox, files={"a": "A\n"})
        sb = BusySandbox({"a": "A\n"})
        actor = ScriptedActor(lambda h: BURN[len(h)] if len(h) < len(BURN) else Action.bash("true"), decode_s)
        engine = Engine(actor, sb, action_drafters=[burn_targets((1,))], config=EngineConfig(branch_budget=0))
        history = await engine.run(History("t"), steps=len(BURN))
        return ref, history, sb, engine

    ref, history, sb, engine = run_virtual(main)
    assert history == ref and sb.live_forks == 0
    stats = engine.statistics()
    assert stats.forks_paused == 1 and stats.forks_reused == 1 and stats.paused_ns > 0
    order = [e.kind for e in engine.ledger.events if e.detail == BURN[1].key and e.kind is not EventKind.FORK]
    if decode_s:
        assert order[:3] == [EventKind.PAUSE, EventKind.RESUME, EventKind.REUSE]
    else:
        assert order[:3] == [EventKind.PAUSE, EventKind.REUSE, EventKind.RESUME]


def test_a_pool_prices_its_forks_through_the_same_controller(tmp_path):
    # what aospec.specbox.pool would call: a fork warmed for a tool, priced at this host's
    # price, counted with the run's decisions, its outcome learned, its budget slot held
    budget = SpeculationBudget(1, directory=tmp_path, host_cores=8)

    async def main():
        engine = Engine(actor_of(LONG[:2]), InMemorySandbox({"a": "A\n"}), host=StaticHostMonitor(FULL), budget=budget)
        async with engine.session(History("t")) as session:
            admission = session.admission
            cheap = admission.pool("pytest", probability=0.8, hide_s=2.0, cpu_s=0.5)
            dear = admission.pool("pytest", probability=0.8, hide_s=2.0, cpu_s=20.0)
            second = admission.pool("make", probability=0.9, hide_s=5.0, cpu_s=0.1)
            assert cheap.launch and cheap.lease is not None
            assert not dear.launch and dear.reason == "price"  # 20 CPU-s on a saturated host
            assert not second.launch and second.reason == "budget"  # the only slot is held
            admission.outcome(cheap, True)
            cheap.lease.release()
        return engine

    engine = run_virtual(main)
    stats = engine.statistics()
    assert (stats.admitted, stats.refused_price, stats.refused_budget) == (1, 1, 1)
    assert engine.admission_model.hits.outcomes(Candidate("pool", "pool", "pytest", 0, 0.8)) == (1.0, 1.0)
    assert budget.held() == 0


def test_a_steps_recorded_cpu_time_is_read_from_tool_cpu_s_then_extra() -> None:
    from aospec.admission import step_cpu_s
    from aospec.types import Action, Step

    assert step_cpu_s(Step(Action.bash("make"), "", 1, tool_duration_s=1.0, tool_cpu_s=0.5)) == 0.5
    assert step_cpu_s(Step(Action.bash("make"), "", 1, tool_duration_s=1.0, extra={"cpu_s": 0.25})) == 0.25
    assert step_cpu_s(Step(Action.bash("ls"), "", 1, tool_duration_s=1.0, extra={"cpu_s": "lots"})) is None


class MeteredHost:
    """A host monitor with a decode meter (as aospec.host.ProcHostMonitor has) whose
    process CPU is ``cores_per_stream`` of every stream-second, in virtual time."""

    def __init__(self, snapshot: HostSnapshot, cores_per_stream: float) -> None:
        import trio

        self._snapshot = snapshot
        self.cores = snapshot.cores
        self.decodes = DecodeMeter(
            clock=lambda: int(trio.current_time() * 1e9),
            cpu=lambda: int(cores_per_stream * self.decodes._stream_ns),
        )

    def snapshot(self) -> HostSnapshot:
        return self._snapshot


@pytest.mark.parametrize(
    ("host", "launched"), [(None, True), ("full", False), ("quiet", True), ("fixed", False), ("fixed-free", True)]
)
def test_a_branch_pays_for_its_streams_cpu_at_the_hosts_price(host, launched):
    """An observation branch right one time in four: free where its stream costs this host
    nothing much (no meter: the prior; a quiet host), priced out where each stream takes
    half a core of a host that has none to spare (measured, or fixed by ``stream_cores``
    on a host without a meter); ``stream_cores=0`` on the full host: free again, the meter
    unread; serial's result either way."""
    script = [Action.bash("sleep 3 && cat a")] * 16
    observation = {}

    def drafts(h, a):
        right = len(h) % 4 == 0 and "real" in observation
        return [ObservationDraft(observation["real"] if right else f"nope {len(h)}", 0.5)]

    async def main():
        ref, _ = await serial(script, files={"a": "A\n"})
        observation["real"] = await InMemorySandbox({"a": "A\n"}).execute(script[0])
        if host in ("fixed", "fixed-free"):
            monitor = MeteredHost(FULL, 0.5) if host == "fixed-free" else StaticHostMonitor(FULL)
            cfg = EngineConfig(fork_width=0, branch_budget=1, stream_cores=0.5 if host == "fixed" else 0.0)
        else:
            monitor = None if host is None else MeteredHost(FULL if host == "full" else QUIET, 0.5)
            cfg = EngineConfig(fork_width=0, branch_budget=1)
        engine = Engine(
            actor_of(script),
            InMemorySandbox({"a": "A\n"}),
            observation_drafters=[ScriptedObservationDrafter(drafts)],
            config=cfg,
            host=monitor,
        )
        history = await engine.run(History("t"), steps=len(script))
        meter = getattr(monitor, "decodes", None)
        return ref, history, engine, meter, meter.sample() if meter is not None else None

    ref, history, engine, meter, sample = run_virtual(main)
    assert history == ref
    stats = engine.statistics()
    late = script[8:]  # once the stream's cores are measured and p(hit) learned
    assert stats.drafts_started + stats.refused_price >= len(script)  # a branch priced per step at least
    if launched:
        assert stats.refused_price <= 1 and stats.drafts_hit >= 3
    else:
        assert stats.refused_price >= len(late)
    costs = engine.admission_model.costs
    if host in ("full", "quiet"):
        assert costs.stream_cores() == pytest.approx(0.5)
        assert CostModel.from_json(json.loads(json.dumps(costs.to_json()))).stream_cores() == pytest.approx(0.5)
        assert meter.open == 0
    else:
        assert costs.stream.n == 0  # nothing measured: no meter, or a fixed figure
    if host == "fixed-free":
        assert sample[1] == 0  # the session did not count its streams


# ---------------------------------------------------------------------- drafting priced like a guess


class CpuHost:
    """A host monitor whose drafting CPU clock (as aospec.host.ProcHostMonitor's: the engine
    thread's CPU time) runs with virtual time, as if the thread were busy all along, plus
    what :meth:`burn` adds: a round must be charged only what its own steps burn, not the
    virtual seconds other tasks (or the drafter itself) spend waiting meanwhile."""

    def __init__(self, snapshot: HostSnapshot) -> None:
        self._snapshot = snapshot
        self.burned = 0
        self.readings = 0

    def snapshot(self) -> HostSnapshot:
        return self._snapshot

    def burn(self, seconds: float) -> None:
        self.burned += round(seconds * 1e9)

    def drafting_cpu(self) -> int:
        import trio

        self.readings += 1
        return int(trio.current_time() * 1e9) + self.burned


def counted(drafter):
    """``drafter`` (a ScriptedActionDrafter or ScriptedObservationDrafter) with a count of
    the histories it was called for."""
    calls = []
    if isinstance(drafter, ScriptedActionDrafter):
        inner = drafter.propose_fn

        def propose(h):
            calls.append(len(h))
            return inner(h)

        drafter.propose_fn = propose
    else:
        inner_draft = drafter.propose

        def draft(h, a):
            calls.append(len(h))
            return inner_draft(h, a)

        drafter.propose = draft
    return drafter, calls


@pytest.mark.parametrize(
    ("host", "drafting_cpu_s", "skips"),
    [("full", 0.05, True), ("quiet", 0.05, True), (None, 0.05, True), ("full", None, False), ("full", 0.0, False)],
)
def test_a_drafting_round_is_skipped_while_rounds_are_not_worth_their_cpu(host, drafting_cpu_s, skips):
    """A drafter whose every target is wrong: once the controller has learned that its
    targets are never worth launching, a round of drafting that costs CPU (0.05 s here, at
    the host's price) is not worth running either, so most rounds are skipped but for one
    probe in ROUND_PROBE_EVERY. Unmeasured (None without a drafting CPU clock: replay) or
    free (0), drafting always runs. The result is serial's every time."""
    script = [Action.bash("sleep 5 && cat a")] * 40
    drafter, calls = counted(wrong(p=0.9))

    async def main():
        ref, _ = await serial(script, files={"a": "A\n"})
        monitor = {"full": StaticHostMonitor(FULL), "quiet": StaticHostMonitor(QUIET), None: None}[host]
        cfg = EngineConfig(drafting_cpu_s=drafting_cpu_s, guard_window=0)
        return ref, await _run(script, [drafter], cfg, host=monitor)

    ref, (history, sb, engine) = run_virtual(main)
    assert history == ref and sb.live_forks == 0
    stats = engine.statistics()
    drafted = len(calls)
    assert drafted + stats.drafting_skipped == len(script)  # a round per boundary
    if skips:
        # once the last rounds that launched something have left the window, 1 in ROUND_PROBE_EVERY
        late = [n for n in calls if n >= len(script) // 2]
        assert len(late) <= len(script) // 2 // ROUND_PROBE_EVERY + 1
        assert stats.drafting_probes >= 2 and stats.drafting_skipped >= len(script) // 2
    else:
        assert stats.drafting_skipped == stats.drafting_probes == 0 and drafted == len(script)


def test_drafting_resumes_once_the_host_is_quiet_again():
    """Rounds skipped on a full host are priced at the host's price now: when the host quiets
    down, the same remembered rounds are worth their (now cheap) CPU again, and drafting
    resumes at once, not at the next probe."""
    script = [Action.bash("sleep 5 && cat a")] * 40
    drafter, calls = counted(right(script, p=0.3))
    snapshots = {"now": FULL}

    class Switching:
        def snapshot(self):
            return snapshots["now"]

    async def main():
        ref, _ = await serial(script, files={"a": "A\n"})
        engine = Engine(
            actor_of(script),
            InMemorySandbox({"a": "A\n"}),
            action_drafters=[drafter],
            config=EngineConfig(drafting_cpu_s=2.0, guard_window=0, cpu_price=0.0),
            host=Switching(),
        )
        history = await engine.run(History("t"), steps=20)
        skipped_full = engine.statistics().drafting_skipped
        snapshots["now"] = QUIET
        n = len(calls)
        history = await engine.run(history, steps=len(script) - 20)
        return ref, history, engine, skipped_full, calls[n:]

    ref, history, engine, skipped_full, quiet_calls = run_virtual(main)
    assert history == ref
    assert skipped_full >= 5  # 2 CPU-seconds a round at the full host's price: not worth it
    # quiet (price 0): every round drafts again, the first one included
    assert quiet_calls[0] == 20 and len(quiet_calls) == len(script) - 20
    assert engine.statistics().drafting_skipped == 0  # (this run's statistics)


def test_observation_drafting_is_priced_like_a_guess_too():
    """An observation drafter whose drafts never match, with branches whose streams take
    this host's CPU: once the branches are priced out, so is drafting them, on a full host."""
    script = [Action.bash("sleep 3 && cat a")] * 40
    drafter, calls = counted(ScriptedObservationDrafter(lambda h, a: [ObservationDraft(f"nope {len(h)}", 0.9)]))

    async def main():
        ref, _ = await serial(script, files={"a": "A\n"})
        cfg = EngineConfig(fork_width=0, branch_budget=1, stream_cores=1.0, drafting_cpu_s=0.05, guard_window=0)
        engine = Engine(
            actor_of(script),
            InMemorySandbox({"a": "A\n"}),
            observation_drafters=[drafter],
            config=cfg,
            host=StaticHostMonitor(FULL),
        )
        return ref, await engine.run(History("t"), steps=len(script)), engine

    ref, history, engine = run_virtual(main)
    assert history == ref
    stats = engine.statistics()
    assert stats.drafting_skipped >= len(script) // 2
    assert len(calls) + stats.drafting_skipped == len(script)  # a round per step


def test_a_rounds_cpu_is_measured_live_and_kept_with_the_model():
    """Where the host monitor has a drafting CPU clock, each round is charged the CPU of
    its drafter's own steps and of pricing its drafts: here 3 ms burned by the drafter, and
    none of the half second it waits (other tasks run then); learned per kind and kept in
    the model's JSON. A fixed ``drafting_cpu_s`` is never measured, and a clock that fails
    is one counted failure, then not read again."""
    script = [Action.bash("sleep 5 && cat a")] * 6

    async def main(fixed, fail=False, delay_s=0.5):
        host = CpuHost(QUIET)
        inner = right(script)

        def propose(h):
            host.burn(0.003)
            return inner.propose_fn(h)

        if fail:
            host.drafting_cpu = lambda: 1 // 0  # type: ignore[method-assign]
        engine = Engine(
            actor_of(script),
            InMemorySandbox({"a": "A\n"}),
            action_drafters=[ScriptedActionDrafter(propose, delay_s=delay_s)],
            config=EngineConfig(drafting_cpu_s=fixed),
            host=host,
        )
        history = await engine.run(History("t"), steps=len(script))
        return engine, host, history

    engine, host, _ = run_virtual(lambda: main(None))
    costs = engine.admission_model.costs
    assert costs.drafting[TARGET].n == len(script)
    assert costs.drafting_cpu_s(TARGET) == pytest.approx(0.003)  # not the 0.5 s waited
    assert costs.drafting_cpu_s(BRANCH) == 0.0
    model = AdmissionModel.from_json(json.loads(json.dumps(engine.admission_model.to_json())))
    assert model.costs.drafting_cpu_s(TARGET) == pytest.approx(0.003)
    assert [r.figures for r in model.drafting.rounds[TARGET]] == [
        r.figures for r in engine.admission_model.drafting.rounds[TARGET]
    ]
    engine, host, _ = run_virtual(lambda: main(0.01))
    assert host.readings == 0 and not engine.admission_model.costs.drafting
    engine, host, history = run_virtual(lambda: main(None, fail=True))
    stats = engine.statistics()
    assert len(history) == len(script) and stats.forks_reused == len(script)
    assert stats.speculative_failures == 1 and not engine.admission_model.costs.drafting
    # a drafter still waiting when its boundary passes is cancelled through the timing: its
    # rounds are cut short, remembered as worth nothing, with the CPU they took (none: it
    # only waited)
    engine, host, history = run_virtual(lambda: main(None, delay_s=30.0))
    assert len(history) == len(script) and engine.statistics().forks_launched == 0
    rounds = engine.admission_model.drafting.rounds[TARGET]
    assert len(rounds) == min(len(script), ROUND_WINDOW) and not any(r.figures for r in rounds)
    assert engine.admission_model.costs.drafting[TARGET].n == len(script)
    assert engine.admission_model.costs.drafting_cpu_s(TARGET) == 0.0


def test_a_measured_round_cost_skips_rounds_and_a_model_measured_elsewhere_does_not_in_replay():
    """The round's cost measured live (a drafter burning 50 ms a call, its targets never
    right, on a full host) skips rounds as a fixed one does; the same model, measured
    there, given to a run without a drafting CPU clock (replay's simulated host) skips
    none: drafting costs nothing in virtual time."""
    script = [Action.bash("sleep 5 && cat a")] * 40

    async def main(measured):
        host = CpuHost(FULL) if measured else StaticHostMonitor(FULL)
        inner = wrong(p=0.9)

        def propose(h):
            if measured:
                host.burn(0.05)
            return inner.propose_fn(h)

        drafter, calls = counted(ScriptedActionDrafter(propose))
        engine = Engine(
            actor_of(script),
            InMemorySandbox({"a": "A\n"}),
            action_drafters=[drafter],
            config=EngineConfig(guard_window=0),
            host=host,
            admission_model=model,
        )
        await engine.run(History("t"), steps=len(script))
        return engine, calls

    model = AdmissionModel()
    live, live_calls = run_virtual(lambda: main(True))
    assert len(live_calls) + live.statistics().drafting_skipped == len(script)
    assert model.costs.drafting_cpu_s(TARGET) == pytest.approx(0.05)
    assert live.statistics().drafting_skipped >= len(script) // 2
    replayed, replay_calls = run_virtual(lambda: main(False))
    assert replayed.statistics().drafting_skipped == 0 and len(replay_calls) == len(script)


def test_routed_drafting_is_priced_like_a_guess_too():
    """A routed drafter whose targets are never right, on a full host: its rounds are
    skipped once they are not worth their CPU; the run is serial's."""
    from aospec.testing import ScriptedRoutedActionDrafter, ScriptedRouter, StreamingScriptedActor

    script = [Action.bash("sleep 5 && cat a")] * 40
    calls = []

    def routed(h, tool):
        calls.append(len(h))
        return [ActionDraft(Action.bash(f"sleep 20 && echo {len(h)} > w"), 0, 0.9)]

    def choose(h):
        return script[len(h)] if len(h) < len(script) else Action.bash("true")

    async def main():
        ref, _ = await serial(script, files={"a": "A\n"})
        engine = Engine(
            StreamingScriptedActor(choose, 1.0),
            InMemorySandbox({"a": "A\n"}),
            action_drafters=[ScriptedRoutedActionDrafter(routed)],
            router=ScriptedRouter(),
            config=EngineConfig(drafting_cpu_s=0.05, guard_window=0),
            host=StaticHostMonitor(FULL),
        )
        return ref, await engine.run(History("t"), steps=len(script)), engine

    ref, history, engine = run_virtual(main)
    assert history == ref
    stats = engine.statistics()
    assert stats.routes_fired >= len(script) and stats.drafting_skipped >= len(script) // 2
    assert len([n for n in calls if n >= len(script) // 2]) <= len(script) // 2 // ROUND_PROBE_EVERY + 1


def test_a_rounds_value_follows_the_price_and_keeps_its_best_candidates():
    r = DraftRound(TARGET)
    r.add((1.0, 0.5, 1.0, 0.0))  # worth 1 s, half of it wasted CPU: 1 - 0.5 * price
    r.add((0.2, 0.9, 0.0, 0.1))  # no CPU: worth 0.2 - 0.09 at any price
    r.add((-0.1, 0.0, 0.0, 0.0))  # worth nothing even free: not kept
    assert len(r.figures) == 2
    assert r.value_s(0.0) == pytest.approx(1.0 + 0.11)
    assert r.value_s(4.0) == pytest.approx(0.11)  # the first is worth nothing at 4 s per CPU-s
    for i in range(ROUND_CANDIDATES + 5):
        r.add((0.01 * (i + 1), 1.0, 1.0, 0.0))
    kept = r.kept()
    assert len(kept.figures) == ROUND_CANDIDATES and kept.figures[0][0] == 1.0


@pytest.mark.parametrize(
    ("drafting", "message"),
    [
        ({"nope": []}, "unknown kind of round 'nope'"),
        ({"target": {}}, "drafting.target: expected a list of rounds"),
        ({"target": [[[1, 2, 3]]]}, r"drafting.target\[0\]\[0\]: expected \[net benefit"),
        ({"target": [[[1, -2, 3, 4]]]}, r"drafting.target\[0\]\[0\]: expected a finite number >= 0"),
    ],
)
def test_a_bad_drafting_state_in_a_saved_model_is_one_clear_error(tmp_path, drafting, message):
    obj = AdmissionModel().to_json()
    obj["drafting"] = drafting
    path = tmp_path / "model.json"
    path.write_text(json.dumps(obj))
    with pytest.raises(ConfigError, match=message):
        AdmissionModel.load(path)
    # a model saved before rounds were kept (no "drafting") loads with none
    del obj["drafting"]
    path.write_text(json.dumps(obj))
    assert not any(AdmissionModel.load(path).drafting.rounds.values())


class LiveHost:
    """A quiet host whose drafting CPU clock is the engine thread's real one (as
    aospec.host.ProcHostMonitor's)."""

    drafting_cpu = staticmethod(time.thread_time_ns)

    def snapshot(self):
        return QUIET


def burn(seconds, result=None):
    """Blocking work for aospec.drafters.backends.run_blocking: ``seconds`` of its thread's
    CPU, then ``result``."""

    def work(stop):
        t0 = time.thread_time()
        while time.thread_time() - t0 < seconds:
            pass
        return result

    return work


def run_live(actor, observation_drafters, steps):
    """An engine run in real time on a quiet live host, observation branches only."""

    async def main():
        engine = Engine(
            actor,
            InMemorySandbox({"a": "A\n"}),
            observation_drafters=observation_drafters,
            config=EngineConfig(fork_width=0, branch_budget=1),
            host=LiveHost(),
        )
        return engine, await engine.run(History("t"), steps=steps)

    return anyio.run(main, backend="trio")


def test_a_drafters_work_on_another_thread_is_charged_to_its_round():
    """Live (real time, a worker thread): an observation drafter that hands 30 ms of CPU to
    a thread through aospec.drafters.backends.run_blocking (as the LM drafters do) has its
    round charged that CPU, though the engine's own thread spent almost none of it; the
    drafter's waiting is not charged."""
    from aospec.drafters.backends import run_blocking

    class ThreadedDrafter:
        async def draft(self, history, action, n):
            return await run_blocking(burn(0.03, [ObservationDraft("nope", 0.5)]), offload="thread")

    script = [Action.bash("sleep 0.2 && cat a")] * 3
    engine, history = run_live(actor_of(script, delay=0.01), [ThreadedDrafter()], len(script))
    assert len(history) == len(script)
    costs = engine.admission_model.costs
    assert costs.drafting[BRANCH].n >= 1
    assert 0.03 <= costs.drafting_cpu_s(BRANCH) < 1.0


def test_a_continuations_decode_on_a_thread_is_not_charged_to_the_round_that_started_it():
    """Live: an in-process actor whose decodes burn 50 ms of CPU on a worker thread (as a
    model served in this process does), and an observation drafter that drafts the right
    observation, so a continuation starts from the round's drafts while a slower drafter
    keeps the round open: the continuation's decode is a branch's stream (priced by
    ``stream_cores``), not the round's drafting, so the round is charged only its drafters'
    own work."""
    from aospec.drafters.backends import run_blocking

    script = [Action.bash("sleep 0.5 && cat a")] * 3

    class ThreadActor:
        async def decode(self, history):
            action = script[len(history)] if len(history) < len(script) else Action.bash("true")
            return await run_blocking(burn(0.05, action), offload="thread")

    observation = anyio.run(InMemorySandbox({"a": "A\n"}).execute, script[0])
    drafters = [
        ScriptedObservationDrafter(lambda h, a: [ObservationDraft(observation, 0.9)]),
        # a second drafter, slower than the decode: the round stays open meanwhile
        ScriptedObservationDrafter(lambda h, a: [], delay_s=0.2),
    ]
    engine, history = run_live(ThreadActor(), drafters, len(script))
    assert len(history) == len(script)
    assert engine.statistics().drafts_started >= 1  # continuations decoded (50 ms of thread CPU each)
    assert engine.admission_model.costs.drafting_cpu_s(BRANCH) < 0.02
