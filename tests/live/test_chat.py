"""ChatFormat: parsing replies into actions (edge cases), rendering histories into chat
messages (bash blocks and tool calls), templates from files; the reply memo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aospec.live.chat import (
    ChatFormat,
    DeterminismReport,
    Reply,
    ReplyMemo,
    history_digests,
    history_key,
)

from aospec.errors import ConfigError
from aospec.types import Action, History

FMT = ChatFormat()
TOOLS = ChatFormat(action_format="tools")


def _reply(text: str, action: Action | None = None, calls: tuple = ()) -> Reply:
    return Reply(text, action or FMT.parse(text), 3, False, 10, 5, calls, "stop")


@pytest.mark.parametrize(
    ("text", "action"),
    [
        ("THOUGHT: look\n\n```bash\nls -la\n```", Action.bash("ls -la")),
        ("```bash\n  cd /x && make  \n```\ntrailing words after the block", Action.bash("cd /x && make")),
        ("```sh\necho hi\n```", Action.bash("echo hi")),
        ("```shell\necho hi\n```", Action.bash("echo hi")),
        ("```bash   \nmulti\nline\n```", Action.bash("multi\nline")),
        ("no block at all", Action.none()),
        ("", Action.none()),
        ("```bash\nls\n```\nand\n```bash\npwd\n```", Action.none()),  # two blocks
        ("```python\nprint(1)\n```", Action.none()),
        ("```bash ls```", Action.none()),  # not fenced on its own lines
        ("```bash\nunterminated", Action.none()),
    ],
)
def test_parse_bash_blocks(text: str, action: Action) -> None:
    assert FMT.parse(text) == action


def _call(name: str, args: str) -> dict:
    return {"id": "x", "type": "function", "function": {"name": name, "arguments": args}}


@pytest.mark.parametrize(
    ("calls", "action"),
    [
        ([_call("bash", '{"command": " ls "}')], Action.bash("ls")),
        ([_call("search", '{"q": "x", "n": 2}')], Action("search", {"q": "x", "n": 2})),
        ([_call("noop", "")], Action("noop")),
        ([], Action.none()),
        ([_call("bash", '{"command": "ls"}')] * 2, Action.none()),
        ([_call("bash", "{not json")], Action.none()),
        ([_call("bash", "[1]")], Action.none()),
        ([_call("", "{}")], Action.none()),
    ],
)
def test_parse_tool_calls(calls: list, action: Action) -> None:
    assert TOOLS.parse("```bash\nignored in the tools format\n```", calls) == action


def test_messages_render_known_replies_and_unknown_ones_canonically() -> None:
    h = History("fix the bug").extend(Action.bash("ls"), "<returncode>0</returncode>\n<output>\na\n</output>")
    h = h.extend(Action.none(), FMT.format_error).extend(Action.bash("cat a"), "obs 3")
    replies = [_reply("THOUGHT: first\n```bash\nls\n```"), None]
    msgs = FMT.messages(h, replies)
    assert [m["role"] for m in msgs] == ["system", "user"] + ["assistant", "user"] * 3
    assert msgs[0]["content"] == FMT.system_template and msgs[1]["content"] == "fix the bug"
    assert msgs[2]["content"] == replies[0].text
    assert msgs[3]["content"] == h.turns[0].observation  # verbatim
    assert msgs[4]["content"] == "" and msgs[5]["content"] == FMT.format_error
    assert msgs[6]["content"] == "```bash\ncat a\n```"
    # Unknown replies render as blocks that parse back to the action.
    assert FMT.parse(msgs[6]["content"]) == h.turns[2].action


def test_tool_messages_use_step_ids_and_the_models_arguments() -> None:
    h = History("t").extend(Action.bash("ls"), "out 1").extend(Action("search", {"q": "x"}), "out 2")
    h = h.extend(Action.none(), TOOLS.format_error)
    first = _reply("", Action.bash("ls"), (_call("bash", '{"command":"ls"}') | {"id": "server-random-id"},))
    msgs = TOOLS.messages(h, [first])
    assistant = [m for m in msgs if m["role"] == "assistant"]
    assert assistant[0]["tool_calls"] == [
        {"id": "call_0", "type": "function", "function": {"name": "bash", "arguments": '{"command":"ls"}'}}
    ]
    assert json.loads(assistant[1]["tool_calls"][0]["function"]["arguments"]) == {"q": "x"}
    assert assistant[1]["tool_calls"][0]["id"] == "call_1"
    assert "tool_calls" not in assistant[2]
    tools = [m for m in msgs if m["role"] == "tool"]
    assert [(m["tool_call_id"], m["content"]) for m in tools] == [("call_0", "out 1"), ("call_1", "out 2")]
    assert msgs[-1] == {"role": "user", "content": TOOLS.format_error}
    assert TOOLS.tool_request_bodies()["tools"][0]["function"]["name"] == "bash"
    assert FMT.tool_request_bodies() == {}


def test_templates_from_files(tmp_path: Path) -> None:
    (tmp_path / "sys.txt").write_text('You run {commands}: JSON like {"a": 1} stays.')
    (tmp_path / "inst.txt").write_text("<task>{task}</task>")
    fmt = ChatFormat.from_files(tmp_path / "sys.txt", str(tmp_path / "inst.txt"))
    msgs = fmt.messages(History("do {it}"))
    assert msgs[0]["content"] == 'You run {commands}: JSON like {"a": 1} stays.'
    assert msgs[1]["content"] == "<task>do {it}</task>"
    assert ChatFormat.from_files(None, None) == ChatFormat()
    (tmp_path / "bad.txt").write_text("no placeholder")
    with pytest.raises(ConfigError, match="placeholder"):
        ChatFormat.from_files(None, tmp_path / "bad.txt")
    with pytest.raises(ConfigError, match="action_format"):
        ChatFormat(action_format="xml")  # type: ignore[arg-type]


def test_history_digests_and_the_memo() -> None:
    h = History("t").extend(Action.bash("ls"), "a").extend(Action.bash("pwd"), "b")
    digests = list(history_digests(h))
    assert len(digests) == 3 and len(set(digests)) == 3 and digests[-1] == history_key(h)
    assert history_key(History("t").extend(Action.bash("ls"), "a ")) != digests[1]
    assert history_key(History("u")) != digests[0]
    memo = ReplyMemo()
    r1, r2 = _reply("```bash\nls\n```"), _reply("```bash\npwd\n```")
    assert memo.settle(History("t"), r1) is r1
    assert memo.settle(History("t"), r2) is r1  # the first reply of a history stays
    assert memo.replies_for(h) == [r1, None]
    assert memo.get(h) is None and len(memo) == 1


def test_determinism_report() -> None:
    a, b = _reply("```bash\nls\n```"), _reply("```bash\nls -l\n```")
    assert DeterminismReport.compare(a, a).identical
    report = DeterminismReport.compare(a, b)
    assert not report.identical and report.differs_at == len("```bash\nls")
    c = _reply("x", Action.none(), (_call("bash", "{}"),))
    d = _reply("x", Action.none(), (_call("bash", '{"command": "x"}'),))
    assert not DeterminismReport.compare(c, d).identical and DeterminismReport.compare(c, d).differs_at is None
