"""Replay state models: recorded versions, the static effect classifier, the blind bracket.

The traces here are canonical traces *with* recorded versions, written with
``aospec.replay.io.write_jsonl`` and read back, as a live run records them:

- HIDDEN_WRITE: ``git status`` looks read-only to the classifier, but the recording shows
  it changed the filesystem (it refreshed ``.git/index``). Under ``effects`` the next
  step's fork, launched before ``git status`` ran, passes JASV; under ``recorded`` it must
  not.
- CONSERVATIVE: ``python3 -c 'print(1)'`` may write for the classifier, but the recording
  shows no change. Under ``recorded`` the next step's fork is reusable; under ``effects``
  it is not.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from aospec.replay import bundled_traces_path, load_traces
from aospec.replay.actor import VirtualClock
from aospec.replay.io import write_jsonl
from aospec.replay.metrics import summarize
from aospec.replay.policies import DrafterSet, parse_policies
from aospec.replay.sandbox import ReplayWorld, recorded_versions_problem, resolve_state_model, world_versions
from aospec.replay.sweep import replay_trace, run_sweep

from aospec.errors import ConfigError
from aospec.types import Action, Effect, Step, Trace, version_hash

V0, V1, V2 = (version_hash("test", str(k)) for k in range(3))
LONG_S = 10.0  # every tool call: long enough that hiding one shows in the latency
TOKENS = 10  # every reply: 10 tokens, 0.1 s at 10 ms/token
TPOT_MS = 10.0


def step(cmd: str, obs: str, before: str | None, after: str | None, **kw: object) -> Step:
    return Step(
        Action.bash(cmd),
        obs,
        TOKENS,
        tool_duration_s=LONG_S,
        version_before=before,
        version_after=after,
        **kw,  # type: ignore[arg-type]
    )


def trace(id: str, steps: list[Step], task: str = "state") -> Trace:
    return Trace(id, task, "aospec", "m", "tests", tuple(steps))


#: git status changed the index (V0 -> V1): the classifier calls it read-only.
HIDDEN_WRITE = trace(
    "hidden-write",
    [
        step("git status", "On branch main\n", V0, V1),
        step("cat notes.txt", "hello\n", V1, V1),
    ],
)
#: a script the classifier must assume writes, which changed nothing (V0 -> V0).
CONSERVATIVE = trace(
    "conservative",
    [
        step("python3 -c 'print(1)'", "1\n", V0, V0),
        step("cat notes.txt", "hello\n", V0, V0),
        step("echo done > out.txt", "", V0, V2),
    ],
)


@pytest.fixture
def recorded_file(tmp_path: Path) -> Path:
    """Both traces in one canonical JSONL file, as the live recorder writes them."""
    path = tmp_path / "recorded.jsonl"
    write_jsonl([HIDDEN_WRITE, CONSERVATIVE], path)
    return path


def load(path: Path) -> dict[str, Trace]:
    return {t.id: t for t in load_traces([path])}


def latency(t: Trace, state_model: str, policy: str = "ceiling") -> tuple[int, int, int]:
    """(latency, serial, forks reused) of ``policy`` on ``t`` at TPOT_MS under ``state_model``."""
    (r,) = replay_trace(t, parse_policies(policy), [TPOT_MS], DrafterSet([]), state_model=state_model)
    assert r.state_model == state_model
    return r.latency_ns, r.serial_ns, r.forks_reused


def test_versions_survive_the_canonical_format(recorded_file: Path) -> None:
    traces = load(recorded_file)
    assert traces["hidden-write"] == HIDDEN_WRITE and traces["conservative"] == CONSERVATIVE
    assert all(recorded_versions_problem(t) is None for t in traces.values())


def test_world_versions_under_each_state_model(recorded_file: Path) -> None:
    hidden = load(recorded_file)["hidden-write"]
    origin, before, after, effects = world_versions(hidden, "recorded")
    assert (origin, before, after) == (V0, [V0, V1], [V1, V1])
    assert effects == [Effect.MAY_CHANGE, Effect.READ_ONLY]
    # the classifier: git status and cat are read-only, so one version throughout
    origin, before, after, effects = world_versions(hidden, "effects")
    assert before == after == [origin, origin] and V0 not in before
    assert effects == [Effect.READ_ONLY, Effect.READ_ONLY]
    # CONSERVATIVE: the classifier moves the version at the python step and the write
    _, before, after, _ = world_versions(CONSERVATIVE, "effects")
    assert before[0] != before[1] == before[2] != after[2]
    _, before, after, _ = world_versions(CONSERVATIVE, "recorded")
    assert before == [V0, V0, V0] and after == [V0, V0, V2]
    origin, before, after, effects = world_versions(CONSERVATIVE, "blind")
    assert before == after == [origin] * 3 and set(effects) == {Effect.READ_ONLY}


def test_a_read_only_looking_command_that_changed_state_blocks_reuse_under_recorded(recorded_file: Path) -> None:
    hidden = load(recorded_file)["hidden-write"]
    rec, serial, rec_reused = latency(hidden, "recorded")
    eff, serial_eff, eff_reused = latency(hidden, "effects")
    blind, serial_blind, _ = latency(hidden, "blind")
    assert serial == serial_eff == serial_blind == 2 * (TOKENS * 10_000_000 + 10_000_000_000)
    # effects wrongly lets the cat fork (launched before git status ran) pass JASV
    assert eff_reused == rec_reused + 1 and eff <= serial - 9_000_000_000
    # the recording says git status changed the state: the fork cannot be reused
    assert rec >= serial - 200_000_000
    assert blind <= eff < rec <= serial


def test_a_conservatively_classified_command_that_changed_nothing_reuses_more_under_recorded(
    recorded_file: Path,
) -> None:
    cons = load(recorded_file)["conservative"]
    rec, serial, rec_reused = latency(cons, "recorded")
    eff, _, eff_reused = latency(cons, "effects")
    blind, _, _ = latency(cons, "blind")
    # recorded: python changed nothing, so cat and the echo (both from V0) run from the start
    assert rec_reused > eff_reused
    assert blind <= rec < eff <= serial
    assert rec <= serial - 2 * 9_000_000_000


@pytest.mark.parametrize("state_model", ["recorded", "effects", "blind"])
@pytest.mark.parametrize("policy", ["oracle-action", "oracle-action:depth=3", "ceiling:depth=3", "serial"])
def test_every_state_model_keeps_the_invariants(recorded_file: Path, state_model: str, policy: str) -> None:
    """replay_trace checks them: committed trajectory = recording, serial = sum(D + T),
    no policy beats its matching ceiling (replayed under the same state model)."""
    for t in load(recorded_file).values():
        (r,) = replay_trace(t, parse_policies(policy), [TPOT_MS], DrafterSet([]), state_model=state_model)
        assert r.ceiling_ns <= r.latency_ns <= r.serial_ns
        if policy == "serial":
            assert r.latency_ns == r.serial_ns


def test_blind_is_an_upper_bracket_for_practical_drafters_on_the_bundled_sample() -> None:
    """aospec (real drafters) on bundled tb1 traces: its latency under blind never exceeds
    its own ceiling's bound, and the blind ceiling is at least as fast as the effects one."""
    traces = load_traces([bundled_traces_path()])[:4]
    by_model = {}
    for model in ("effects", "blind"):
        results = run_sweep(
            traces, parse_policies("aospec,ceiling"), train_traces=load_traces([bundled_traces_path()])[4:],
            tpots_ms=[TPOT_MS], state_model=model,
        )
        assert {r.state_model for r in results} == {model}
        by_model[model] = {(r.trace_id, r.policy): r for r in results}
    for key, blind in by_model["blind"].items():
        effects = by_model["effects"][key]
        assert blind.ceiling_ns <= effects.ceiling_ns
        assert blind.ceiling_ns <= blind.latency_ns


def test_world_auto_and_missing_versions() -> None:
    no_versions = Trace("plain", "t", "h", "m", "s", (Step(Action.bash("ls"), "", 1, tool_duration_s=0.1),))
    assert ReplayWorld(no_versions, VirtualClock()).state_model == "effects"
    assert ReplayWorld(HIDDEN_WRITE, VirtualClock()).state_model == "recorded"
    with pytest.raises(ConfigError, match=r"trace 'plain' step 1 \('ls'\) has no recorded version_before or"):
        ReplayWorld(no_versions, VirtualClock(), "recorded")
    # replay_trace's default (auto) uses the recorded versions of a trace that has them
    (auto,) = replay_trace(HIDDEN_WRITE, parse_policies("ceiling"), [TPOT_MS], DrafterSet([]))
    assert auto.state_model == "recorded" and auto.latency_ns == latency(HIDDEN_WRITE, "recorded")[0]


def test_steps_that_need_no_versions_and_changes_between_steps() -> None:
    no_tool = Step(Action.none(), "format error", TOKENS)  # ran nothing: keeps the version
    cut = Step(Action.bash("sleep 100"), "", TOKENS, completed=False, version_before=V2)  # cut off at the end
    known = Step(Action.bash("make"), "", TOKENS, tool_duration_s=1.0, state_changed=False)  # state_changed only
    t = trace("mixed", [step("ls", "", V0, V0), no_tool, known, step("cat x", "", V1, V1), cut])
    assert recorded_versions_problem(t) is None
    origin, before, after, effects = world_versions(t, "recorded")
    assert origin == V0
    # ls, the tool-less step and make keep V0; the file changed before cat (V0 -> V1),
    # attributed to the step before it; the cut-off step's effect is unknown
    assert before == [V0, V0, V0, V1, V2]
    assert after[:4] == [V0, V0, V1, V2] and after[4] not in (V0, V1, V2)
    assert effects == [Effect.READ_ONLY, Effect.READ_ONLY, Effect.MAY_CHANGE, Effect.MAY_CHANGE, Effect.MAY_CHANGE]
    (r,) = replay_trace(t, parse_policies("ceiling"), [TPOT_MS], DrafterSet([]), state_model="recorded")
    assert r.latency_ns <= r.serial_ns
    # a step with only one version, or a completed tool step with none, is not enough
    half = trace("half", [step("ls", "", V0, V0), step("cat x", "", V0, None)])
    with pytest.raises(ConfigError, match=r"trace 'half' \(file /data/half.jsonl\) step 2 \('cat x'\) has no recorded version_after: "):
        resolve_state_model([HIDDEN_WRITE, half], "recorded", {"half": "/data/half.jsonl"})


def test_resolve_state_model_names_the_file_step_and_fix() -> None:
    plain = load_traces([bundled_traces_path()])
    assert resolve_state_model([HIDDEN_WRITE, CONSERVATIVE], "auto") == (
        "recorded",
        "auto: every step has recorded versions",
    )
    model, why = resolve_state_model([HIDDEN_WRITE, *plain], "auto")
    assert model == "effects" and f"trace {plain[0].id!r} step 1" in why
    for model in ("effects", "blind"):
        assert resolve_state_model(plain, model)[0] == model
    with pytest.raises(ConfigError) as err:
        resolve_state_model([HIDDEN_WRITE, *plain], "recorded", {plain[0].id: "/x/trial.jsonl"})
    msg = str(err.value)
    assert f"trace {plain[0].id!r} (file /x/trial.jsonl) step 1 (" in msg
    assert "--state-model effects" in msg and "\n" not in msg
    with pytest.raises(ConfigError, match="unknown state model 'exact'; choose from auto, recorded, effects, blind"):
        resolve_state_model(plain, "exact")


def test_summaries_never_mix_state_models() -> None:
    a = replay_trace(HIDDEN_WRITE, parse_policies("serial"), [TPOT_MS], DrafterSet([]), state_model="recorded")
    b = replay_trace(HIDDEN_WRITE, parse_policies("serial"), [TPOT_MS], DrafterSet([]), state_model="blind")
    assert summarize(a)[0].state_model == "recorded"
    with pytest.raises(ConfigError, match="different state models"):
        summarize(a + b)


def aospec_cli(*args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("aospec")
    return subprocess.run([str(exe), *args], capture_output=True, text=True)


@pytest.mark.parametrize(("flag", "expected"), [(None, "recorded"), ("blind", "blind"), ("effects", "effects")])
def test_sweep_reports_its_state_model(recorded_file: Path, tmp_path: Path, flag: str | None, expected: str) -> None:
    out = tmp_path / "out"
    args = ["sweep", str(recorded_file), "--policies", "serial,ceiling", "--tpot-ms", "10", "--jobs", "1",
            "--no-progress", "--out", str(out)]
    if flag:
        args += ["--state-model", flag]
    done = aospec_cli(*args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"aospec: state model: {expected} (" in done.stderr
    assert f"(state model: {expected})" in done.stdout  # the table's title
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    summary = [json.loads(line) for line in (out / "summary.jsonl").read_text().splitlines()]
    assert {r["state_model"] for r in results} == {s["state_model"] for s in summary} == {expected}
    md = (out / "summary.md").read_text()
    assert f"- state model: {expected} (" in md and f"(state model: {expected})" in md


def test_recorded_on_traces_without_versions_is_one_clear_error(tmp_path: Path) -> None:
    done = aospec_cli("sweep", "--bundled", "--state-model", "recorded", "--policies", "serial", "--tpot-ms", "10",
                      "--no-progress", "--out", str(tmp_path / "o"))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "--state-model recorded: trace '" in lines[0] and "step 1 (" in lines[0]
    assert str(bundled_traces_path()) in lines[0] and ".jsonl" in lines[0]
    assert "--state-model effects" in lines[0]
    assert not (tmp_path / "o").exists()


def test_an_unknown_state_model_is_an_argparse_error_listing_the_choices() -> None:
    done = aospec_cli("replay", "--bundled", "--state-model", "exact")
    assert done.returncode == 2
    assert "invalid choice: 'exact' (choose from 'auto', 'recorded', 'effects', 'blind', 'readsets')" in done.stderr
