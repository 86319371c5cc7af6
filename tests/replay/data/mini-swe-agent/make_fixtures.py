"""Regenerate the mini-swe-agent trajectory fixtures by running the real package.

The agent runs with mini-swe-agent's own deterministic test models against its
LocalEnvironment in a temporary directory; the trajectory files it saves are the fixtures.

    # v2 layouts (text-based and tool-calling), with mini-swe-agent 2.x installed:
    python tests/replay/data/mini-swe-agent/make_fixtures.py v2
    # v1 layout, with mini-swe-agent 1.x importable, e.g.
    #   pip install --no-deps --target /tmp/msa1 'mini-swe-agent==1.17.5'
    PYTHONPATH=/tmp/msa1 python tests/replay/data/mini-swe-agent/make_fixtures.py v1

The scenario is the same in every layout: look around (in the tool-calling layout two
parallel calls), one reply without an action (a format error), a command that writes a
file, a command that times out, and the submission.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TASK = "Count the lines of data.txt and write the count to count.txt."
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
_SCRATCH: Path | None = None  # set in __main__; removed on exit

SYSTEM = "You are a helpful assistant that can interact with a computer shell."
INSTANCE = (
    "Your task: {{task}}. Reply with a THOUGHT and exactly one bash block. "
    "To finish, run `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`."
)
OBSERVATION_V1 = "<returncode>{{output.returncode}}</returncode>\n<output>\n{{output.output}}</output>"
OBSERVATION = (
    "{% if output.exception_info %}<exception>{{output.exception_info}}</exception>\n{% endif %}"
    "<returncode>{{output.returncode}}</returncode>\n<output>\n{{output.output}}</output>"
)
FORMAT_ERROR = "Please always provide EXACTLY ONE action in triple backticks, found {{actions|length}} actions."
ACTION_REGEX = r"```bash\s*\n(.*?)\n```"

REPLIES = [
    ("THOUGHT: Let me look at the files first.", "ls"),
    ("THOUGHT: I think I know what to do now, but I forgot the code block.", None),
    ("THOUGHT: Count the lines and write the number to count.txt.", "wc -l < data.txt > count.txt"),
    ("THOUGHT: Let me wait for the file system to settle.", "sleep 4"),
    ("THOUGHT: Done; submit.", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat count.txt"),
]


def _text(thought: str, command: str | None) -> str:
    return thought if command is None else f"{thought}\n\n```bash\n{command}\n```"


def _workdir() -> str:
    d = tempfile.mkdtemp(prefix="task-", dir=_SCRATCH)
    Path(d, "data.txt").write_text("one\ntwo\nthree\n")
    return d


def make_v1() -> None:
    from minisweagent import __version__
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.test_models import DeterministicModel
    from minisweagent.run.utils.save import save_traj

    assert __version__.startswith("1."), __version__
    model = DeterministicModel(outputs=[_text(t, c) for t, c in REPLIES], cost_per_call=0.01)
    env = LocalEnvironment(cwd=_workdir(), timeout=2)
    agent = DefaultAgent(
        model,
        env,
        system_template=SYSTEM,
        instance_template=INSTANCE,
        action_observation_template=OBSERVATION_V1,
        format_error_template=FORMAT_ERROR,
        action_regex=ACTION_REGEX,
    )
    exit_status, result = agent.run(TASK)
    save_traj(agent, HERE / "v1-count-lines.traj.json", exit_status=exit_status, result=result, print_path=False)


def _scripted(base: type, errors: dict[int, Exception], **kwargs):
    """A deterministic model that, like the real litellm models, raises FormatError
    (``errors[i]``) for an unparsable i-th reply and stamps each reply when it returns."""

    class Scripted(base):
        def query(self, messages, **kw):
            if self.current_index + 1 in errors:
                self.current_index += 1
                raise errors[self.current_index]
            time.sleep(0.05)  # a model takes a moment to answer
            message = copy.deepcopy(super().query(messages, **kw))
            message["extra"]["timestamp"] = time.time()
            return message

    return Scripted(**kwargs)


def make_v2_text() -> None:
    from minisweagent import __version__
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.exceptions import FormatError
    from minisweagent.models.test_models import DeterministicModel, make_output
    from minisweagent.models.utils.actions_text import parse_regex_actions

    assert __version__.startswith("2."), __version__
    outputs, errors = [], {}
    for n, (thought, command) in enumerate(REPLIES):
        content = _text(thought, command)
        try:
            actions = parse_regex_actions(content, action_regex=ACTION_REGEX, format_error_template=FORMAT_ERROR)
        except FormatError as exc:  # what the text-based litellm model raises for this reply
            exc.messages[0]["extra"]["cost"] = 0.01
            errors[n] = exc
            actions = []
        outputs.append(make_output(content, actions, cost=0.01))
    model = _scripted(DeterministicModel, errors, outputs=outputs, observation_template=OBSERVATION, cost_per_call=0.01)
    env = LocalEnvironment(cwd=_workdir(), timeout=2)
    path = HERE / "v2-text-count-lines.traj.json"
    agent = DefaultAgent(model, env, system_template=SYSTEM, instance_template=INSTANCE, output_path=path)
    agent.run(TASK)


def _response(content: str | None, tool_calls: list[dict] | None, completion_tokens: int) -> dict:
    """The shape of litellm's ``ModelResponse.model_dump()`` that LitellmModel stores."""
    return {
        "id": "chatcmpl-fixture",
        "created": 1760000000,
        "model": "deterministic_toolcall",
        "object": "chat.completion",
        "choices": [
            {
                "finish_reason": "tool_calls" if tool_calls else "stop",
                "index": 0,
                "message": {"content": content, "role": "assistant", "tool_calls": tool_calls},
            }
        ],
        "usage": {
            "completion_tokens": completion_tokens,
            "prompt_tokens": 100,
            "total_tokens": 100 + completion_tokens,
        },
    }


def make_v2_toolcall() -> None:
    from minisweagent import __version__
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.exceptions import FormatError
    from minisweagent.models.test_models import DeterministicToolcallModel, make_toolcall_output
    from minisweagent.models.utils.actions_toolcall import parse_toolcall_actions

    assert __version__.startswith("2."), __version__
    outputs, errors = [], {}
    for n, (thought, command) in enumerate(REPLIES):
        commands = ["ls", "cat data.txt"] if n == 0 else [command] if command else []
        calls = [
            {
                "id": f"call_{n}_{k}",
                "type": "function",
                "function": {"name": "bash", "arguments": json.dumps({"command": c})},
            }
            for k, c in enumerate(commands)
        ]
        if not calls:
            try:
                parse_toolcall_actions([], format_error_template="{{ error }}")
            except FormatError as exc:  # what LitellmModel raises, with the response attached
                exc.messages[0]["extra"]["response"] = _response(thought, None, 17)
                exc.messages[0]["extra"]["cost"] = 0.01
                errors[n] = exc
            outputs.append(make_toolcall_output(thought, [], []))
            continue
        actions = [{"command": c, "tool_call_id": call["id"]} for c, call in zip(commands, calls, strict=True)]
        out = make_toolcall_output(thought, calls, actions)
        out["extra"]["response"] = _response(thought, calls, 20 + 7 * n)
        out["extra"]["cost"] = 0.01
        outputs.append(out)
    model = _scripted(
        DeterministicToolcallModel, errors, outputs=outputs, observation_template=OBSERVATION, cost_per_call=0.01
    )
    env = LocalEnvironment(cwd=_workdir(), timeout=2)
    path = HERE / "v2-toolcall-count-lines.traj.json"
    agent = DefaultAgent(model, env, system_template=SYSTEM, instance_template=INSTANCE, output_path=path)
    agent.run(TASK)


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "v2"
    with tempfile.TemporaryDirectory(prefix="mswea-fixtures-") as scratch:
        _SCRATCH = Path(scratch)
        os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", str(_SCRATCH / "config"))
        if which == "v1":
            make_v1()
        else:
            make_v2_text()
            make_v2_toolcall()
