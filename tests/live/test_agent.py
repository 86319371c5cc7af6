"""The live agent (live/agent.py): mini-swe-agent's submit rule, format errors, the step
limit, and the lossless property of the harness-driven path on real overlay sandboxes:
speculative and serial runs commit the same trajectory, version and files."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from aospec.live.actors import OpenAIChatActor
from aospec.live.agent import (
    OBSERVATION_FORMAT,
    Agent,
    Drafters,
    ObservationFormatWarning,
    default_drafters,
    submission,
)
from aospec.live.chat import DEFAULT_FORMAT_ERROR, ChatFormat
from aospec.live.record import TraceRecorder, step_of
from aospec.runtime import MiniSweAgentFormatter, open_sandbox
from aospec.runtime._fs import mounts_under
from aospec.runtime.host import host_support
from aospec.runtime.lossless import snapshot_sandbox
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aospec.protocols import ActionDraft, ObservationDraft
from aospec.testing import InMemorySandbox, ScriptedActionDrafter, ScriptedActor, ScriptedObservationDrafter
from aospec.types import Action, History, Step, Trace
from aospec.wrappers import SandboxWrapper

# ----------------------------------------------------------------------------- fixtures


def _overlay_problem() -> str | None:
    support, _ = host_support()
    problems = support.problems()
    return "; ".join(problems) if problems else None


needs_overlay = pytest.mark.root


@pytest.fixture
def overlay_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Skip without overlay support; private state dirs under a fresh root, checked for
    leaked mounts afterwards."""
    reason = _overlay_problem()
    if reason:
        pytest.skip(f"overlay backend cannot run here: {reason}")
    state = tmp_path_factory.mktemp("live-state")
    mp = pytest.MonkeyPatch()
    mp.setenv("AOSPEC_STATE_ROOT", str(state))
    yield state
    mp.undo()
    assert not mounts_under(str(state)), "mounts leaked"


# ----------------------------------------------------------------------------- the submit rule


@pytest.mark.parametrize(
    ("observation", "expected"),
    [
        ("<returncode>0</returncode>\n<output>\nCOMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n</output>", ""),
        ("<returncode>0</returncode>\n<output>\nCOMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\ndiff --git a\n</output>", "diff --git a\n"),
        ("<returncode>0</returncode>\n<output>\n\n  COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT  \nx</output>", "x"),
        ("<returncode>0</returncode>\n<output>\nMINI_SWE_AGENT_FINAL_OUTPUT\n</output>", ""),  # 1.x marker
        ("<returncode>1</returncode>\n<output>\nCOMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n</output>", None),  # failed
        ("<returncode>0</returncode>\n<output>\nfoo\nCOMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n</output>", None),
        ("<returncode>0</returncode>\n<output>\nCOMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT_NOT\n</output>", None),
        ("The last command <command>x</command> timed out and has been killed.\n", None),
        (DEFAULT_FORMAT_ERROR, None),
        (
            "<returncode>0</returncode>\n<warning>\nThe output of your last command was too long.\n</warning>"
            "<output_head>\nCOMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\nabc\n</output_head>\n<elided_chars>\n3 characters"
            " elided\n</elided_chars>\n<output_tail>\nxyz\n</output_tail>",
            "abc",
        ),
    ],
)
def test_submission_follows_mini_swe_agent(observation: str, expected: str | None) -> None:
    assert submission(observation) == expected


# ----------------------------------------------------------------------------- format errors, limits

SCRIPT = ["echo one > a", "THOUGHT: no block", "TOOL python", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT > s", "cat s"]


def _scripted(history: History) -> Action:
    cmd = SCRIPT[min(len(history), len(SCRIPT) - 1)]
    if cmd.startswith("TOOL"):
        return Action("python", {"code": "print(1)"})  # a tool the sandbox does not have
    return Action.none() if cmd.startswith("THOUGHT") else Action.bash(cmd)


class _FormattedActor(ScriptedActor):
    chat_format = ChatFormat(format_error="exactly one bash block, please")


@pytest.mark.anyio
async def test_a_reply_without_an_action_is_answered_with_the_format_error() -> None:
    # A drafter that guesses the format error for a none action and forks for every step:
    # the speculative run must see exactly what the serial run sees.
    guess = ScriptedObservationDrafter(
        lambda h, a: [ObservationDraft("exactly one bash block, please", 0.9)] if a.is_none else []
    )
    ahead = ScriptedActionDrafter(lambda h: [ActionDraft(_scripted(h), 0, 0.9)])
    results = []
    for speculate in (False, True):
        drafters = Drafters(observation=(guess,), action=(ahead,))
        agent = Agent(_FormattedActor(_scripted, 0.01), InMemorySandbox(op_delay_s=0.01), speculate=speculate, drafters=drafters)
        result = await agent.run("t")
        assert result.exit_reason == "submitted"
        assert result.history.turns[1].observation == "exactly one bash block, please"
        assert result.history.turns[2].observation == "exactly one bash block, please"
        assert result.steps[1].action.is_none
        assert result.steps[1].version_before == result.steps[1].version_after
        results.append(result)
    serial, spec = results
    assert spec.history == serial.history and spec.final_version == serial.final_version
    assert spec.statistics.forks_launched > 0


@pytest.mark.anyio
async def test_the_step_limit_ends_the_run_and_versions_chain() -> None:
    actor = ScriptedActor(lambda h: Action.bash(f"echo {len(h)} > f{len(h)}"))
    result = await Agent(actor, InMemorySandbox(), step_limit=3).run("t")
    assert result.exit_reason == "step_limit" and len(result.steps) == 3
    for a, b in zip(result.steps, result.steps[1:], strict=False):
        assert a.version_after == b.version_before
    assert result.final_version == result.steps[-1].version_after != result.version_before
    assert all(s.version_before != s.version_after for s in result.steps)


# ----------------------------------------------------------------------------- lossless, live actor


DEMO_TASK = "Write /work/hello.sh that prints a greeting, run it, save its output and submit."
DEMO_REPLIES = [
    "THOUGHT: Let me see what the filesystem holds.\n\n```bash\nls /\n```",
    "THOUGHT: I will create a working directory and the script.\n\n```bash\nmkdir -p /work && printf 'echo hello, world\\n' > /work/hello.sh\n```",
    "THOUGHT: I forgot the code block this time.",
    "THOUGHT: Let me check the script.\n\n```bash\ncat /work/hello.sh\n```",
    "THOUGHT: Run it and keep the output.\n\n```bash\nsh /work/hello.sh > /work/out.txt && cat /work/out.txt\n```",
    "THOUGHT: It works. Submitting.\n\n```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```",
]


def demo_trace() -> Trace:
    """A short recorded trajectory whose replies serve-trace serves (observations unused)."""
    fmt = ChatFormat()
    steps = tuple(Step(action=fmt.parse(r), observation="", output_tokens=len(r) // 4, reply=r) for r in DEMO_REPLIES)
    return Trace("demo", "hello", "mini-swe-agent", "demo-model", "tests/live", steps, instruction=DEMO_TASK)


async def _live_run(base_url: str, speculate: bool, train: list[Trace], record: Path) -> tuple:
    actor = OpenAIChatActor(base_url, "demo", retries=0)
    try:
        async with open_sandbox(backend="overlay", base="busybox", timeout_s=120, formatter=OBSERVATION_FORMAT) as sb:
            rec = TraceRecorder(record, task=DEMO_TASK, actor_model="demo")
            agent = Agent(actor, sb, speculate=speculate, drafters=default_drafters(train), on_step=rec.add)
            result = await agent.run(DEMO_TASK)
            rec.finish(result)
            files = await snapshot_sandbox(sb)
            out = await sb.read_file("/work/out.txt") if "work/out.txt" in files else None
    finally:
        await actor.aclose()
    return result, files, out


@needs_overlay
@pytest.mark.anyio
async def test_live_agent_speculative_equals_serial(overlay_state, serve_traces, tmp_path) -> None:
    server = serve_traces([demo_trace()], tpot_ms=2.0)
    serial, serial_files, serial_out = await _live_run(server.base_url, False, [], tmp_path / "serial.jsonl")
    assert serial.exit_reason == "submitted" and len(serial.steps) == len(DEMO_REPLIES), serial.history
    assert serial.history.turns[2].observation == ChatFormat().format_error
    assert serial_out == b"hello, world\n"
    from aospec.replay import read_jsonl

    (recorded,) = read_jsonl(tmp_path / "serial.jsonl")
    spec, spec_files, spec_out = await _live_run(server.base_url, True, [recorded], tmp_path / "spec.jsonl")
    assert spec.history == serial.history
    assert spec.final_version == serial.final_version
    assert spec_files == serial_files and spec_out == serial_out
    assert spec.statistics.forks_launched + spec.statistics.drafts_started > 0  # it did speculate
    assert serial.statistics.forks_launched == serial.statistics.drafts_started == 0
    (again,) = read_jsonl(tmp_path / "spec.jsonl")
    assert [(s.action, s.observation, s.version_before, s.version_after) for s in again.steps] == [
        (s.action, s.observation, s.version_before, s.version_after) for s in recorded.steps
    ]
    assert [s.reply for s in again.steps] == DEMO_REPLIES
    assert all(not s.output_tokens_estimated for s in again.steps)  # serve-trace sends usage


# ----------------------------------------------------------------------------- lossless, randomized

POOL = [
    "echo x >> /tmp/a",
    "cat /tmp/a",
    "ls /tmp",
    "mkdir -p /tmp/d && echo y > /tmp/d/f",
    "rm -f /tmp/a",
    "wc -l /tmp/a",
    "sleep 0.05; echo done",
    "cp /tmp/d/f /tmp/g",
    "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT",
]


async def _scripted_run(seed: int, speculate: bool, train: list[Trace], record: Path) -> tuple:
    actor = ScriptedActor.hashing([Action.bash(c) for c in POOL], seed=seed, delay_s=0.03)
    async with open_sandbox(backend="overlay", base="busybox", timeout_s=120, formatter=OBSERVATION_FORMAT) as sb:
        rec = TraceRecorder(record, task=f"random {seed}", actor_model="scripted", trace_id=f"r{seed}-{speculate}")
        agent = Agent(actor, sb, speculate=speculate, drafters=default_drafters(train), step_limit=7, on_step=rec.add)
        result = await agent.run(f"random {seed}")
        files = await snapshot_sandbox(sb)
    return result, files, rec.trace


@needs_overlay
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), train_on_self=st.booleans())
def test_lossless_on_random_tasks(overlay_state, tmp_path, seed: int, train_on_self: bool) -> None:
    serial, serial_files, serial_trace = anyio.run(_scripted_run, seed, False, [], tmp_path / f"s{seed}.jsonl")
    # Drafters fitted on the serial run itself (good drafts) or on nothing (few).
    train = [serial_trace] if train_on_self else []
    spec, spec_files, _ = anyio.run(_scripted_run, seed, True, train, tmp_path / f"p{seed}.jsonl")
    assert spec.history == serial.history
    assert spec.final_version == serial.final_version
    assert spec_files == serial_files
    assert [step_of(s).version_after for s in spec.steps] == [step_of(s).version_after for s in serial.steps]


class _RawText(SandboxWrapper):
    """A sandbox in another harness's format: the output alone (the runtime's default)."""

    async def execute(self, action: Action) -> str:
        text = await self.inner.execute(action)
        result = MiniSweAgentFormatter.parse(text)
        return text if result is None else result.output

    async def fork(self) -> _RawText:
        return _RawText(await self.inner.fork())


@pytest.mark.anyio
async def test_a_sandbox_in_another_format_is_named_once_not_silently_run_to_the_limit() -> None:
    actor = _FormattedActor(_scripted, 0.0)
    with pytest.warns(ObservationFormatWarning, match="formatter='mini-swe-agent'") as caught:
        result = await Agent(actor, _RawText(InMemorySandbox()), speculate=False, step_limit=len(SCRIPT) + 2).run("t")
    assert result.exit_reason == "step_limit"  # the submission is not seen in raw text
    assert len([w for w in caught if w.category is ObservationFormatWarning]) == 1
    # the format error (the agent's own answer) is not another format
    with warnings.catch_warnings():
        warnings.simplefilter("error", ObservationFormatWarning)
        assert (await Agent(actor, InMemorySandbox(), speculate=False).run("t")).exit_reason == "submitted"
