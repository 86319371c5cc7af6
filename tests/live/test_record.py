"""The trace recorder (live/record.py): what a step records, a canonical file after every
committed step, and nothing committed lost when the process is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from aospec.live.agent import Agent, StepRecord
from aospec.live.chat import Reply
from aospec.live.record import TraceRecorder, step_of
from aospec.replay import read_jsonl, write_jsonl

from aospec.testing import InMemorySandbox, ScriptedActor
from aospec.types import Action, History

ROOT = Path(__file__).resolve().parents[2]


def _record(reply: Reply | None, before: str = "v0", after: str = "v1") -> StepRecord:
    return StepRecord(
        index=0,
        action=Action.bash("echo hi > f"),
        observation="<returncode>0</returncode>\n<output>\n</output>",
        reply=reply,
        version_before=before,
        version_after=after,
        boundary_ns=2_000_000_000,
        wait_actor_ns=300_000_000,
        wait_tool_ns=40_000_000,
        tool_ns=50_000_000,
        tool_hidden_ns=10_000_000,
        fork_reused=True,
        draft_hit=False,
    )


def test_a_step_records_the_reply_usage_latency_tool_time_and_versions() -> None:
    reply = Reply(
        text="THOUGHT: x\n\n```bash\necho hi > f\n```",
        action=Action.bash("echo hi > f"),
        output_tokens=17,
        tokens_estimated=False,
        latency_ns=250_000_000,
        first_token_ns=30_000_000,
        finish_reason="stop",
    )
    step = step_of(_record(reply))
    assert step.action == Action.bash("echo hi > f")
    assert step.reply == reply.text
    assert (step.output_tokens, step.output_tokens_estimated) == (17, False)
    assert step.model_latency_s == 0.25 and step.tool_duration_s == 0.05
    assert (step.version_before, step.version_after, step.state_changed) == ("v0", "v1", True)
    assert step.started_at_s == 2.0 and step.completed
    assert step.extra["first_token_s"] == 0.03 and step.extra["fork_reused"] is True
    assert step.extra["tool_hidden_s"] == 0.01 and step.extra["finish_reason"] == "stop"

    estimated = step_of(_record(Reply("```bash\nls\n```", Action.bash("ls"), 4, True, 1, None), "v1", "v1"))
    assert estimated.output_tokens_estimated and estimated.state_changed is False
    assert "first_token_s" not in estimated.extra

    scripted = step_of(_record(None))  # an actor that keeps no replies
    assert scripted.reply is None and scripted.output_tokens_estimated and scripted.model_latency_s is None


@pytest.mark.anyio
async def test_the_file_is_a_complete_trace_after_every_committed_step(tmp_path: Path) -> None:
    path = tmp_path / "out" / "run.jsonl"
    rec = TraceRecorder(path, task="count files", actor_model="scripted", meta={"k": 1})
    assert read_jsonl(path)[0].steps == ()  # the header is on disk before the first step
    seen: list[int] = []

    def on_step(step: StepRecord, stats: object) -> None:
        rec.add(step, stats)
        (trace,) = read_jsonl(path)
        seen.append(len(trace.steps))
        assert trace.steps[-1].version_after == step.version_after

    actor = ScriptedActor(lambda h: Action.bash(f"echo {len(h)} > f{len(h)}"), 0.001)
    result = await Agent(actor, InMemorySandbox(), step_limit=4, on_step=on_step).run("count files")
    rec.finish(result)
    assert seen == [1, 2, 3, 4]
    (trace,) = read_jsonl(path)
    assert trace.instruction == "count files" and trace.harness == "aospec-run"
    assert trace.meta["k"] == 1 and trace.meta["exit_reason"] == "step_limit"
    assert trace.meta["result"]["final_version"] == result.final_version == trace.steps[-1].version_after
    assert trace.steps[0].version_before == result.version_before
    assert [s.action for s in trace.steps] == list(result.history.actions)
    # canonical: rewriting what was read reproduces the file byte for byte
    write_jsonl([trace], tmp_path / "again.jsonl")
    assert (tmp_path / "again.jsonl").read_bytes() == path.read_bytes()
    assert [p.name for p in path.parent.iterdir()] == ["run.jsonl"]  # no temporary file left


def test_kill_9_loses_no_committed_step(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    script = textwrap.dedent(
        f"""
        import os, signal, anyio
        from aospec.testing import InMemorySandbox, ScriptedActor
        from aospec.types import Action
        from aospec.live.agent import Agent
        from aospec.live.record import TraceRecorder

        rec = TraceRecorder({str(path)!r}, task="t", actor_model="scripted")

        def on_step(step, stats):
            rec.add(step, stats)
            if step.index == 2:
                os.kill(os.getpid(), signal.SIGKILL)   # dies right after the third commit

        actor = ScriptedActor(lambda h: Action.bash(f"echo {{len(h)}} > f{{len(h)}}"))
        anyio.run(Agent(actor, InMemorySandbox(), step_limit=10, on_step=on_step).run, "t")
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    (trace,) = read_jsonl(path)
    assert [s.action.command for s in trace.steps] == ["echo 0 > f0", "echo 1 > f1", "echo 2 > f2"]
    assert trace.meta.get("exit_reason") is None  # it never finished
    assert not [p for p in os.listdir(tmp_path) if p != "run.jsonl"]


def test_a_history_with_format_errors_records_them(tmp_path: Path) -> None:
    import anyio

    actor = ScriptedActor(lambda h: Action.none() if len(h) == 0 else Action.bash("echo done > d"))
    rec = TraceRecorder(tmp_path / "r.jsonl", task="t", actor_model="m", trace_id="fixed")
    anyio.run(Agent(actor, InMemorySandbox(), step_limit=2, on_step=rec.add).run, "t")
    (trace,) = read_jsonl(tmp_path / "r.jsonl")
    assert trace.id == "fixed"
    assert trace.steps[0].action.is_none and trace.steps[0].observation.startswith("Please always provide")
    assert trace.steps[0].tool_duration_s is not None and trace.steps[0].state_changed is False
    assert History("t").extend(trace.steps[0].action, trace.steps[0].observation).turns[0] == trace.history().turns[0]


@pytest.mark.parametrize("speculate", [False, True])
def test_a_metered_sandbox_records_each_steps_cpu_time(tmp_path: Path, speculate: bool) -> None:
    """The contended replay sandbox is a real MeteredSandbox: a run on it records each
    committed command's CPU time, serially and when the step ran in a fork."""
    import anyio
    from aospec.replay.actor import VirtualClock
    from aospec.replay.contention import HostModel, SimulatedHost
    from aospec.replay.sandbox import ReplayWorld
    from trio.testing import MockClock

    from aospec.types import Step, Trace

    # Microseconds: the agent's engine reads trio's clock as seconds, replay's as nanoseconds,
    # so its recorded tool times are 1e9 times the replayed ones; CPU comes from the sandbox.
    cpu = [0.25e-6, 1.5e-6, 0.0]
    steps = tuple(
        Step(Action.bash(f"make {i}"), f"built {i}\n", 5, tool_duration_s=1e-6, tool_cpu_s=c) for i, c in enumerate(cpu)
    )
    trace = Trace(id="t", task="t", harness="h", actor_model="m", source="test", steps=steps)
    rec = TraceRecorder(tmp_path / "r.jsonl", task="t", actor_model="m")

    async def main() -> None:
        clock = VirtualClock()
        sandbox = ReplayWorld(trace, clock, host=SimulatedHost(HostModel(4), clock)).sandbox()
        actor = ScriptedActor(lambda h: steps[len(h)].action if len(h) < len(steps) else Action.none())
        await Agent(actor, sandbox, speculate=speculate, step_limit=4, on_step=rec.add).run("t")

    anyio.run(main, backend="trio", backend_options={"clock": MockClock(autojump_threshold=0)})
    (recorded,) = read_jsonl(tmp_path / "r.jsonl")
    assert [s.tool_cpu_s for s in recorded.steps] == [*cpu, 0.0]  # the last: a format error, nothing ran


def test_a_sandbox_that_does_not_meter_records_no_cpu_time(tmp_path: Path) -> None:
    import anyio

    rec = TraceRecorder(tmp_path / "r.jsonl", task="t", actor_model="m")
    anyio.run(Agent(ScriptedActor(lambda h: Action.bash("ls")), InMemorySandbox(), step_limit=2, on_step=rec.add).run, "t")
    (trace,) = read_jsonl(tmp_path / "r.jsonl")
    assert [s.tool_cpu_s for s in trace.steps] == [None, None]
    assert '"schema":1' in (tmp_path / "r.jsonl").read_text().splitlines()[0]  # as before schema 2
