"""``--state-model readsets``: live recordings with per-step read and write sets replay
between ``effects`` (and ``recorded``) and ``blind``, with the replay's invariants kept."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from aospec.replay import load_traces
from aospec.replay.actor import VirtualClock
from aospec.replay.io import write_jsonl
from aospec.replay.policies import DrafterSet, parse_policies
from aospec.replay.readsets import ReadSetWorld, recorded_access
from aospec.replay.sandbox import resolve_state_model
from aospec.replay.sweep import replay_trace

from aospec.errors import ConfigError
from aospec.readsets import ReadSet, WriteSet
from aospec.types import Action, Step, Trace, version_hash

ROOT = Path(__file__).resolve().parents[2]
V = [version_hash("rs", str(k)) for k in range(4)]
TPOT_MS = 10.0


def step(cmd: str, before: str, after: str, reads: ReadSet | None, writes: WriteSet | None) -> Step:
    extra = {}
    if reads is not None:
        extra["read_set"] = reads.to_json()
    if writes is not None:
        extra["write_set"] = writes.to_json()
    return Step(Action.bash(cmd), f"out of {cmd}\n", 10, tool_duration_s=5.0, version_before=before,
                version_after=after, extra=extra)  # fmt: skip


def reads(*nodes: str) -> ReadSet:
    return ReadSet(nodes=frozenset(nodes))


def wrote(*paths: str) -> WriteSet:
    return WriteSet(frozenset(paths), frozenset(paths), frozenset())


NONE = WriteSet()
#: a log line (V0 -> V1), then the test run that never reads the log, then an edit it reads
TRACE = Trace(
    "readsets",
    "t",
    "aospec-run",
    "m",
    "tests",
    (
        step("cat README", V[0], V[0], reads("README"), NONE),
        step("echo run >> log", V[0], V[1], reads("log"), wrote("log")),
        step("./run_tests.sh", V[1], V[1], reads("src/a.py", "tests/t.py"), NONE),
        step("sed -i s/x/y/ src/a.py", V[1], V[2], reads("src/a.py"), wrote("src/a.py")),
        step("./run_tests.sh", V[2], V[2], reads("src/a.py", "tests/t.py"), NONE),
        step("echo done", V[2], V[2], ReadSet(), NONE),
    ),
)


def latency(t: Trace, state_model: str, policy: str = "ceiling:depth=4") -> tuple[int, int]:
    (r,) = replay_trace(t, parse_policies(policy), [TPOT_MS], DrafterSet([]), state_model=state_model)
    assert r.state_model == state_model and r.ceiling_ns <= r.latency_ns <= r.serial_ns
    return r.latency_ns, r.forks_reused


def test_readsets_lies_between_effects_and_blind() -> None:
    eff, _ = latency(TRACE, "effects")
    rec, rec_reused = latency(TRACE, "recorded")
    rs, rs_reused = latency(TRACE, "readsets")
    blind, _ = latency(TRACE, "blind")
    assert blind <= rs < rec <= eff and rs_reused > rec_reused
    # with forks launched from the committed state, blind reuses the test run launched
    # before the edit of src/a.py it reads; read sets must not
    eff, rec, rs, blind = (
        latency(TRACE, m, "oracle-action:depth=3")[0] for m in ("effects", "recorded", "readsets", "blind")
    )
    assert blind < rs < rec <= eff


def test_a_fork_is_revalidated_only_when_nothing_it_read_changed() -> None:
    world = ReadSetWorld(TRACE, VirtualClock())
    assert world.reuse_ok(0, 2)  # the test run across the log line
    assert not world.reuse_ok(2, 4)  # ... but not across the edit of src/a.py
    assert world.reuse_ok(0, 5)  # echo done reads nothing the steps before it wrote
    assert world.reuse_ok(2, 2)  # same version: plain JASV


def test_steps_without_sets_are_never_revalidated_and_break_the_chain() -> None:
    steps = list(TRACE.steps)
    steps[1] = step("echo run >> log", V[0], V[1], reads("log"), None)  # its writes unknown
    t = Trace("broken", "t", "aospec-run", "m", "tests", tuple(steps))
    world = ReadSetWorld(t, VirtualClock())
    assert not world.reuse_ok(0, 2) and world.reuse_ok(2, 2)
    assert latency(t, "readsets")[0] <= latency(t, "recorded")[0]


def test_policies_with_real_drafters_keep_the_invariants() -> None:
    for policy in ("aospec", "oracle-action:depth=3", "serial"):
        latency(TRACE, "readsets", policy)


def test_readsets_needs_versions_and_sets(tmp_path: Path) -> None:
    bare = Trace("bare", "t", "h", "m", "s", (Step(Action.bash("ls"), "", 1, tool_duration_s=0.1),))
    with pytest.raises(ConfigError, match="--state-model readsets: trace 'bare'"):
        resolve_state_model([bare], "readsets")
    versions_only = Trace("v", "t", "h", "m", "s", (Step(Action.bash("ls"), "", 1, 0.1, None, None, None, V[0], V[0]),))
    with pytest.raises(ConfigError, match=r"records no read or write sets.*--record-read-sets"):
        resolve_state_model([versions_only], "readsets")
    assert resolve_state_model([TRACE], "readsets") == ("readsets", "as requested")
    assert resolve_state_model([TRACE], "auto")[0] == "recorded"  # auto never picks it


def test_the_sets_survive_the_canonical_format_and_the_cli(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    write_jsonl([TRACE], path)
    (back,) = load_traces([path])
    assert [recorded_access(s.extra) for s in back.steps] == [recorded_access(s.extra) for s in TRACE.steps]
    assert recorded_access(back.steps[1].extra) == (reads("log"), wrote("log"))
    proc = subprocess.run(
        [sys.executable, "-m", "aospec", "replay", str(path), "--state-model", "readsets", "--tpot-ms", "10",
         "--policies", "serial,ceiling:depth=3", "--format", "json"],
        capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "state model: readsets" in proc.stderr
    rows = json.loads(proc.stdout)
    assert {r["state_model"] for r in (rows if isinstance(rows, list) else rows["results"])} == {"readsets"}
