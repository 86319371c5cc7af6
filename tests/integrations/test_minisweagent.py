"""mini-swe-agent 2.x on aospec, end to end with the real package (no mocks).

One small real task, scripted for mini-swe-agent's own ``DeterministicModel`` (explore, read,
write a script, run it, submit; with a reply without a command, a reply with two commands,
and ``/sleep`` outputs standing for model latency), under mini-swe-agent's own default
configuration (``config/default.yaml``: templates, environment variables, observation
template), run three ways:

(a) ``DefaultAgent`` + mini-swe-agent's ``LocalEnvironment`` in a temporary directory;
(b) ``DefaultAgent`` + ``AospecEnvironment`` chosen by ``environment_class`` in the config;
(c) ``SpeculativeAgent`` + ``AospecEnvironment`` (drafters fitted on the bundled traces).

The three agents' messages are identical (timestamps aside), the final files are the same,
(b) and (c) end on the same sandbox version, and (c)'s trajectory equals (b)'s but for the
agent class. The saved trajectory opens in mini-swe-agent's inspector (headless) and reads
back through aospec's importer. Needs root and overlayfs (skips saying why elsewhere).
"""

from __future__ import annotations

import os

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml
from aospec.integrations.minisweagent import (
    AospecEnvironment,
    SpeculativeAgent,
    action_of,
    decode_outputs,
    encode_outputs,
)
from minisweagent.agents.default import DefaultAgent
from minisweagent.config import builtin_config_dir
from minisweagent.environments import get_environment
from minisweagent.environments.local import LocalEnvironment
from minisweagent.models.test_models import DeterministicModel, make_output
from pydantic import BaseModel

pytestmark = pytest.mark.root

CONFIG = yaml.safe_load((builtin_config_dir / "default.yaml").read_text())
TASK = "Write run.sh that greets its first argument, run it, and submit it."
README = "# greeter\nrun.sh NAME prints a greeting.\n"
TIMEOUT = 120  # the shared test machine can be very loaded; no command here takes long


def _reply(command: str) -> str:
    return f"THOUGHT: next step.\n\n```mswea_bash_command\n{command}\n```"


def script(latency_s: float) -> list[dict[str, Any]]:
    """The model's outputs: each real reply preceded by a ``/sleep`` (model latency)."""
    steps: list[tuple[str, list[str]]] = [
        (_reply("ls"), ["ls"]),
        (_reply("pwd && cat README.md"), ["pwd && cat README.md"]),
        ("THOUGHT: let me think before writing.", []),  # no command: nothing runs
        (_reply("printf 'echo hello, $1\\n' > run.sh"), ["printf 'echo hello, $1\\n' > run.sh"]),
        ("THOUGHT: two at once.", ["sh run.sh world", "ls"]),  # a reply with two commands
        (_reply("cat run.sh"), ["cat run.sh"]),
        (
            _reply("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat run.sh"),
            ["echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat run.sh"],
        ),
    ]
    out = []
    for text, commands in steps:
        if latency_s:
            out.append(make_output("", [{"command": f"/sleep {latency_s}"}], cost=0.0))
        out.append(make_output(text, [{"command": c} for c in commands]))
    return out


def model(outputs: list[dict[str, Any]]) -> DeterministicModel:
    return DeterministicModel(outputs=outputs, observation_template=CONFIG["model"]["observation_template"])


def agent_kwargs(path: Path) -> dict[str, Any]:
    return {**CONFIG["agent"], "step_limit": 20, "output_path": path}


def env_config(cwd: Path) -> dict[str, Any]:
    return {**CONFIG["environment"], "cwd": str(cwd), "timeout": TIMEOUT}


def strip_times(value: Any) -> Any:
    """``value`` without its ``timestamp`` fields (they record when, not what)."""
    if isinstance(value, dict):
        return {k: strip_times(v) for k, v in value.items() if k != "timestamp"}
    if isinstance(value, list):
        return [strip_times(v) for v in value]
    return value


def sandbox_files(env: AospecEnvironment, cwd: Path) -> dict[str, bytes]:
    names = env.execute({"command": "ls -A"})["output"].split()
    return {n: env.read_file(f"{cwd}/{n}") for n in names}


@pytest.fixture(scope="module")
def aospec_dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    from aospec.runtime._fs import mounts_under
    from aospec.runtime.host import host_support

    support, _ = host_support()
    if support.problems():
        pytest.skip(f"overlay backend cannot run here: {'; '.join(support.problems())}")
    cache, state = tmp_path_factory.mktemp("mswea-cache"), tmp_path_factory.mktemp("mswea-state")
    mp = pytest.MonkeyPatch()
    mp.setenv("AOSPEC_CACHE_DIR", str(cache))
    mp.setenv("AOSPEC_STATE_ROOT", str(state))
    yield state
    mp.undo()
    assert not mounts_under(str(state)), "sandbox mounts leaked"


@pytest.fixture(scope="module")
def drafters() -> Any:
    from aospec.live.agent import default_drafters
    from aospec.replay import bundled_traces_path, load_traces

    return default_drafters(load_traces([bundled_traces_path()]))


def test_observation_encoding_round_trips() -> None:
    cases = [
        [{"output": "a\n</output>\nb", "returncode": 0, "exception_info": ""}],
        [{"output": "", "returncode": -1, "exception_info": "x", "extra": {"exception_type": "TimeoutExpired"}}],
        [{"output": "{not json", "returncode": 2, "exception_info": ""}],
    ]
    for outputs in cases:
        assert decode_outputs(encode_outputs(outputs)) == outputs
    two = cases[0] + cases[2]
    assert decode_outputs(encode_outputs(two, single=False)) == two
    assert decode_outputs("") == []
    # an ordinary output is the runtime's mini-swe-agent text, which observation drafters draft
    assert encode_outputs(cases[0][:1]) == "<returncode>0</returncode>\n<output>\na\n</output>\nb</output>"
    assert action_of({"extra": {"actions": []}}).is_none
    assert action_of({"extra": {"actions": [{"command": "ls"}]}}).command == "ls"


@pytest.mark.slow
def test_speculative_agent_is_lossless_against_mini_swe_agent(aospec_dirs: Path, drafters: Any, tmp_path: Path) -> None:
    cwd = tmp_path / "task"  # the same absolute path on the host (a) and in the sandboxes (b, c)
    cwd.mkdir()
    (cwd / "README.md").write_text(README)
    outputs = script(latency_s=0.2)
    runs: dict[str, dict[str, Any]] = {}

    # (a) mini-swe-agent as shipped
    local = LocalEnvironment(**env_config(cwd))
    a = DefaultAgent(model(outputs), local, **agent_kwargs(tmp_path / "a.traj.json"))
    t0 = time.monotonic()
    result_a = a.run(TASK)
    runs["a"] = {"wall_s": time.monotonic() - t0, "result": result_a}
    files_a = {p.name: p.read_bytes() for p in sorted(cwd.iterdir())}

    # (b) the same agent, AospecEnvironment picked by mini-swe-agent's own config key
    env_b = get_environment({**env_config(cwd), "environment_class": "aospec.integrations.minisweagent.AospecEnvironment"})
    assert isinstance(env_b, AospecEnvironment)
    # (c) the co-speculating agent
    env_c = AospecEnvironment(**env_config(cwd))
    try:
        for env in (env_b, env_c):
            env.execute({"command": f"printf %s {_quote(README)} > README.md"})
        assert env_b.version == env_c.version
        b = DefaultAgent(model(outputs), env_b, **agent_kwargs(tmp_path / "b.traj.json"))
        t0 = time.monotonic()
        result_b = b.run(TASK)
        runs["b"] = {"wall_s": time.monotonic() - t0, "result": result_b}

        model_c = model(outputs)
        c = SpeculativeAgent(model_c, env_c, drafters=drafters, **agent_kwargs(tmp_path / "c.traj.json"))
        t0 = time.monotonic()
        result_c = c.run(TASK)
        runs["c"] = {"wall_s": time.monotonic() - t0, "result": result_c}

        assert result_a == result_b == result_c == {"exit_status": "Submitted", "submission": "echo hello, $1\n"}
        # the same messages, in the same order, with the same contents and extras
        assert strip_times(a.messages) == strip_times(b.messages) == strip_times(c.messages)
        assert (
            len(c.messages) == 2 + 13 + 1
        )  # system, task; 7 replies; 6 outputs (2 from one reply, none from two); exit
        assert (a.n_calls, a.cost) == (b.n_calls, b.cost) == (c.n_calls, c.cost)
        assert model_c.current_index == len(outputs) - 1  # the model is left where DefaultAgent leaves it
        # the same final files; (b) and (c) on the same version, i.e. the same whole tree
        assert sandbox_files(env_b, cwd) == sandbox_files(env_c, cwd) == files_a
        assert env_b.version == env_c.version
        stats = c.statistics
        assert stats is not None and stats.steps == 7
        runs["c"]["statistics"] = {
            "forks_reused": stats.forks_reused,
            "drafts_hit": stats.drafts_hit,
            "tool_hidden_s": stats.tool_hidden_ns / 1e9,
            "decode_hidden_s": stats.decode_hidden_ns / 1e9,
        }
    finally:
        env_b.close()
        env_c.close()
    print("one small run:", json.dumps(runs, default=str))

    # the trajectories: (c) is what (b) saved, but for the agent class named in it
    traj_b = json.loads((tmp_path / "b.traj.json").read_text())
    traj_c = json.loads((tmp_path / "c.traj.json").read_text())
    assert traj_c["info"]["config"]["agent_type"] == "aospec.integrations.minisweagent.SpeculativeAgent"
    traj_c["info"]["config"]["agent_type"] = traj_b["info"]["config"]["agent_type"]
    traj_c["info"]["config"]["agent"]["output_path"] = traj_b["info"]["config"]["agent"]["output_path"]
    assert strip_times(traj_c) == strip_times(traj_b)
    assert traj_c["trajectory_format"] == "mini-swe-agent-1.1"
    assert traj_c["info"]["config"]["environment_type"] == "aospec.integrations.minisweagent.AospecEnvironment"

    check_inspector(tmp_path / "c.traj.json", traj_c)
    check_importer(tmp_path / "c.traj.json")


def _quote(text: str) -> str:
    import shlex

    return shlex.quote(text)


def check_inspector(path: Path, traj: dict[str, Any]) -> None:
    """mini-swe-agent's own inspector loads the file and pages through it (headless)."""
    from minisweagent.run.utilities.inspector import TrajectoryInspector

    app = TrajectoryInspector([path])
    assert app.messages == traj["messages"]
    assert app.n_steps == 1 + 7  # the task page, then one page per reply

    async def page_through() -> None:
        async with app.run_test() as pilot:
            for _ in range(app.n_steps):
                await pilot.press("l")
            assert app.i_step == app.n_steps - 1

    anyio.run(page_through)


def check_importer(path: Path) -> None:
    """aospec's importer reads the trajectory back: one step per executed command (plus
    one for the reply without a command)."""
    from aospec.replay import load_traces

    (trace,) = load_traces([path])
    commands = [s.action.command for s in trace.steps]
    assert commands == [
        "ls",
        "pwd && cat README.md",
        None,
        "printf 'echo hello, $1\\n' > run.sh",
        "sh run.sh world",
        "ls",
        "cat run.sh",
        "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat run.sh",
    ]
    assert trace.steps[4].observation.endswith("<output>\nhello, world\n</output>")


def _docker_skip_reason() -> str | None:
    from aospec.errors import SandboxUnavailableError

    try:
        from aospec.runtime.daemon import docker_client

        driver = docker_client().info().get("Driver")
    except SandboxUnavailableError as exc:
        return str(exc)
    return None if driver == "overlay2" else f"the Docker daemon uses storage driver {driver!r}, not overlay2"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["overlay", pytest.param("docker", marks=pytest.mark.docker)])
def test_environment_mirrors_the_local_environment(aospec_dirs: Path, tmp_path: Path, backend: str) -> None:
    """Output dicts equal LocalEnvironment's: exit codes, stderr, CRLF, timeouts, submission."""
    if backend == "docker" and (reason := _docker_skip_reason()):
        pytest.skip(f"docker backend cannot run here: {reason}")
    from minisweagent.exceptions import Submitted

    cwd = tmp_path / "w"
    cwd.mkdir()
    local = LocalEnvironment(cwd=str(cwd), timeout=8)
    commands = [
        "echo out; echo err >&2; exit 3",
        "printf 'a\\r\\nb\\rc'",
        "pwd",
        "echo partial; sleep 30",
    ]
    with AospecEnvironment(cwd=str(cwd), timeout=8, backend=backend) as env:
        for command in commands:
            assert env.execute({"command": command}) == local.execute({"command": command}), command
        for e in (env, local):
            with pytest.raises(Submitted) as info:
                e.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo done"})
            assert info.value.messages[0]["extra"] == {"exit_status": "Submitted", "submission": "done\n"}
        tv = env.get_template_vars()
        assert tv["system"] == os.uname().sysname and tv["cwd"] == str(cwd) and tv["HOME"] == "/root"
        assert env.serialize()["info"]["config"]["environment"]["backend"] == backend


CLI_CONFIG = """\
agent:
  agent_class: aospec.integrations.minisweagent.SpeculativeAgent
  train: [bundled]
environment:
  environment_class: aospec.integrations.minisweagent.AospecEnvironment
  cwd: /work
model:
  model_class: deterministic
  model_name: deterministic
  outputs:
    - {role: assistant, content: "THOUGHT: write it", extra: {actions: [{command: "echo 'echo hi' > hi.sh"}]}}
    - {role: assistant, content: "THOUGHT: run it", extra: {actions: [{command: "sh hi.sh"}]}}
    - {role: assistant, content: "THOUGHT: done", extra: {actions: [{command: "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; cat hi.sh"}]}}
"""


def test_mini_cli_runs_the_speculative_agent_from_its_own_config(aospec_dirs: Path, tmp_path: Path) -> None:
    """``mini`` itself, configured by YAML only: agent_class, environment_class."""
    import sys

    (tmp_path / "aospec.yaml").write_text(CLI_CONFIG)
    out = tmp_path / "run.traj.json"
    env = {**os.environ, "MSWEA_CONFIGURED": "1", "MSWEA_SILENT_STARTUP": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "minisweagent.run.mini",
            "-c",
            "mini.yaml",
            "-c",
            str(tmp_path / "aospec.yaml"),
            "-t",
            "write hi.sh and run it",
            "-y",
            "--exit-immediately",
            "-o",
            str(out),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    traj = json.loads(out.read_text())
    info = traj["info"]
    assert (info["exit_status"], info["submission"]) == ("Submitted", "echo hi\n")
    assert info["config"]["agent_type"] == "aospec.integrations.minisweagent.SpeculativeAgent"
    assert info["config"]["environment_type"] == "aospec.integrations.minisweagent.AospecEnvironment"
    assert "hi" in traj["messages"][5]["content"] and traj["messages"][5]["extra"]["raw_output"] == "hi\n"


class ScriptedTextModel:
    """A deterministic text model: its reply depends only on its messages (on how many
    replies they hold), and is parsed by mini-swe-agent's own regex parser, so a reply
    without exactly one ``mswea_bash_command`` block raises mini-swe-agent's FormatError."""

    class Config(BaseModel):
        replies: list[str]
        action_regex: str = r"```mswea_bash_command\s*\n(.*?)\n```"
        format_error_template: str = "Format error: {{error}}"
        observation_template: str = (
            "<returncode>{{output.returncode}}</returncode>\n<output>\n{{output.output}}</output>"
        )

    def __init__(self, **kwargs: Any) -> None:
        self.config = self.Config(**kwargs)

    def query(self, messages: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        from minisweagent.models.utils.actions_text import parse_regex_actions

        k = sum(
            m["role"] == "assistant" or (m.get("extra") or {}).get("interrupt_type") == "FormatError" for m in messages
        )
        text = self.config.replies[k]
        actions = parse_regex_actions(
            text, action_regex=self.config.action_regex, format_error_template=self.config.format_error_template
        )
        return {"role": "assistant", "content": text, "extra": {"actions": actions, "cost": 0.5}}

    def format_message(self, **kwargs: Any) -> dict[str, Any]:
        return kwargs

    def format_observation_messages(
        self, message: dict, outputs: list[dict], template_vars: dict | None = None
    ) -> list[dict]:
        from minisweagent.models.utils.actions_text import format_observation_messages

        return format_observation_messages(
            outputs, observation_template=self.config.observation_template, template_vars=template_vars
        )

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return self.config.model_dump()

    def serialize(self) -> dict:
        return {"info": {"config": {"model": self.config.model_dump(mode="json")}}}


def test_format_errors_go_through_the_session_as_in_default_agent(aospec_dirs: Path, tmp_path: Path) -> None:
    """A reply mini-swe-agent rejects (two blocks) is a FormatError message in both runs."""
    replies = [
        _reply("echo one > one.txt"),
        _reply("ls") + "\n" + _reply("pwd"),  # two actions: FormatError
        "no block at all",  # FormatError again
        _reply("cat one.txt"),
        _reply("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat one.txt"),
    ]
    runs = []
    for agent_class in (DefaultAgent, SpeculativeAgent):
        with AospecEnvironment(cwd="/w", timeout=TIMEOUT) as env:
            agent = agent_class(
                ScriptedTextModel(replies=replies), env, **CONFIG["agent"], max_consecutive_format_errors=3
            )
            result = agent.run("make one.txt")
            runs.append((result, strip_times(agent.messages), agent.n_calls, agent.cost, env.version))
    assert runs[0] == runs[1]
    result, messages = runs[0][0], runs[0][1]
    assert result == {"exit_status": "Submitted", "submission": "one\n"}
    assert [m["extra"]["interrupt_type"] for m in messages if "interrupt_type" in m.get("extra", {})] == [
        "FormatError",
        "FormatError",
    ]


def test_a_second_run_of_the_same_agent_continues_the_scripted_model(aospec_dirs: Path) -> None:
    """DefaultAgent keeps its model (and n_calls) across runs; so does SpeculativeAgent."""
    commands = [
        "echo a > a",
        "cat a",
        "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT",
        "ls",
        "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT",
    ]
    outputs = [make_output(_reply(c), [{"command": c}]) for c in commands]
    runs = []
    for agent_class in (DefaultAgent, SpeculativeAgent):
        with AospecEnvironment(cwd="/w", timeout=TIMEOUT) as env:
            agent = agent_class(model(outputs), env, **CONFIG["agent"])
            first = (agent.run("one"), strip_times(agent.messages))
            second = (agent.run("two"), strip_times(agent.messages))
            runs.append((first, second, agent.n_calls, agent.model.current_index, env.version))
    assert runs[0] == runs[1]
    assert runs[0][1][1][-3]["extra"]["raw_output"] == "a\n"  # the second run's `ls`


@pytest.mark.slow
def test_repeated_test_runs_overlap_with_the_model(aospec_dirs: Path, drafters: Any) -> None:
    """A task that runs its (1 s) tests three times, with a 0.4 s model: the speculative run
    reuses forks and drafts and stays lossless. Wall times are printed, not asserted (the
    test machine is shared); one run here measured 7.0 s serial, 5.6 s speculative."""
    commands = [
        "ls",
        "cat README.md",
        "printf 'sleep 1; echo tests passed\\n' > test.sh",
        "sh test.sh",
        "cat test.sh",
        "sh test.sh",
        "ls",
        "sh test.sh",
        "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT",
    ]
    outputs = []
    for c in commands:
        outputs += [make_output("", [{"command": "/sleep 0.4"}], cost=0.0), make_output(_reply(c), [{"command": c}])]
    runs, walls = [], {}
    for agent_class, kw in ((DefaultAgent, {}), (SpeculativeAgent, {"drafters": drafters})):
        with AospecEnvironment(cwd="/w", timeout=TIMEOUT) as env:
            env.execute({"command": "echo hi > README.md"})
            agent = agent_class(model(outputs), env, **CONFIG["agent"], **kw)
            t0 = time.monotonic()
            result = agent.run("run the tests")
            walls[agent_class.__name__] = round(time.monotonic() - t0, 3)
            runs.append((result, strip_times(agent.messages), env.version))
    assert runs[0] == runs[1]
    stats = agent.statistics
    assert stats is not None and stats.forks_reused + stats.drafts_hit > 0
    print("one small run, wall s:", walls, "forks reused", stats.forks_reused, "drafts hit", stats.drafts_hit)


def test_tool_call_models_with_parallel_calls(aospec_dirs: Path) -> None:
    """mini-swe-agent's tool-call test model, one reply with two tool calls: lossless."""
    from minisweagent.models.test_models import DeterministicToolcallModel, make_toolcall_output

    def call(k: int, command: str) -> tuple[dict[str, Any], dict[str, Any]]:
        cid = f"call_{k}"
        tool_call = {
            "id": cid,
            "type": "function",
            "function": {"name": "bash", "arguments": json.dumps({"command": command})},
        }
        return tool_call, {"command": command, "tool_call_id": cid}

    replies = [["echo x > x.txt"], ["cat x.txt", "ls"], ["echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", "echo never"]]
    outputs, k = [], 0
    for commands in replies:
        calls = []
        for c in commands:
            calls.append(call(k, c))
            k += 1
        outputs.append(make_toolcall_output(None, [t for t, _ in calls], [a for _, a in calls]))
    runs = []
    for agent_class in (DefaultAgent, SpeculativeAgent):
        with AospecEnvironment(cwd="/w", timeout=TIMEOUT) as env:
            agent = agent_class(DeterministicToolcallModel(outputs=outputs), env, **CONFIG["agent"])
            runs.append((agent.run("x"), strip_times(agent.messages), env.version))
    assert runs[0] == runs[1]
    assert [m["role"] for m in runs[0][1][2:]] == [
        "assistant",
        "tool",
        "assistant",
        "tool",
        "tool",
        "assistant",
        "exit",
    ]
