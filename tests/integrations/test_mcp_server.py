"""``aospec mcp``: the sandbox tool server, driven by the official MCP SDK client over stdio
and streamable HTTP on loopback (issue 12 section 3). Needs root and overlayfs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest

pytestmark = pytest.mark.anyio

TRANSPORTS = ["stdio", "http"]
#: A bash timeout far above any command here, so a loaded test machine cannot change results.
SLOW_OK = ["--command-timeout", "600"]

W = "/tmp/w"
#: A scripted session: setup, repeated reads, edits, writes, errors, a failing command.
SCRIPT: list[tuple[str, dict[str, Any]]] = [
    ("bash", {"command": f"mkdir -p {W} && printf 'a=1\\nb=2\\n' > {W}/conf"}),
    ("read_file", {"path": f"{W}/conf"}),
    ("bash", {"command": f"cat {W}/conf"}),
    ("edit_file", {"path": f"{W}/conf", "old_str": "a=1", "new_str": "a=10"}),
    ("read_file", {"path": f"{W}/conf"}),
    ("bash", {"command": f"cat {W}/conf"}),
    ("write_file", {"path": f"{W}/notes", "content": "hello\n"}),
    ("write_file", {"path": f"{W}/notes", "content": "hello again\n"}),
    ("read_file", {"path": f"{W}/notes"}),
    ("bash", {"command": f"cat {W}/conf"}),
    ("edit_file", {"path": f"{W}/conf", "old_str": "=", "new_str": ":"}),  # twice: a tool error
    ("read_file", {"path": f"{W}/missing"}),  # a tool error
    ("write_file", {"path": f"{W}/no/such/dir/f", "content": "x"}),  # a tool error
    ("bash", {"command": f"cd {W} && ls && exit 3"}),
    ("bash", {"command": f"cat {W}/conf {W}/notes | wc -c"}),
    ("read_file", {"path": "conf"}),  # relative to the working directory /: missing
]

#: A transition table that also speculates writing calls, so forks of writes get committed.
TABLE = [
    {
        "after": {"tool": "read_file", "args": {"path": f"{W}/conf"}},
        "next": [
            {"tool": "bash", "args": {"command": f"cat {W}/conf"}},
            {"tool": "edit_file", "args": {"path": f"{W}/conf", "old_str": "a=1", "new_str": "a=10"}},
        ],
    },
    {
        "after": {"tool": "write_file", "args": {"path": f"{W}/notes", "content": "hello\n"}},
        "next": [{"tool": "write_file", "args": {"path": f"{W}/notes", "content": "hello again\n"}}],
    },
]
SNAPSHOT = ("bash", {"command": f'cd {W} && for f in $(find . -type f | sort); do echo "$f"; md5sum < "$f"; done'})


def _meta(result: Any) -> dict[str, Any]:
    return result.meta["aospec"]


async def _run_script(
    session: Any, script: list[tuple[str, dict[str, Any]]], *, decode_s: float = 0.0
) -> tuple[list[Any], list[Any]]:
    """(what the client sees: text and isError per call; aospec's meta per call).
    ``decode_s``: a pause before each call, as an agent's model decodes between calls."""
    seen, metas = [], []
    for name, args in script:
        await anyio.sleep(decode_s)
        result = await session.call_tool(name, args, read_timeout_seconds=300)
        seen.append((name, [c.text for c in result.content], result.is_error))
        metas.append(_meta(result))
    return seen, metas


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_tools_list_has_the_sandbox_tools_with_annotations(
    mcp_state_root: Path, mcp_connect: Any, transport: str
) -> None:
    async with mcp_connect(SLOW_OK, transport, env={"AOSPEC_STATE_ROOT": str(mcp_state_root)}) as session:
        tools = {t.name: t for t in (await session.list_tools()).tools}
    assert set(tools) == {"bash", "read_file", "write_file", "edit_file"}
    ann = {n: t.annotations.model_dump(by_alias=True, exclude_none=True) for n, t in tools.items()}
    assert ann["read_file"] == {
        "readOnlyHint": True,
        "destructiveHint": False,
        "idempotentHint": True,
        "openWorldHint": False,
    }
    assert ann["bash"] == {
        "readOnlyHint": False,
        "destructiveHint": True,
        "idempotentHint": False,
        "openWorldHint": False,
    }
    assert ann["write_file"]["readOnlyHint"] is False and ann["write_file"]["idempotentHint"] is True
    assert ann["edit_file"]["readOnlyHint"] is False and ann["edit_file"]["idempotentHint"] is False
    assert tools["bash"].input_schema["required"] == ["command"]
    assert tools["edit_file"].input_schema["required"] == ["path", "old_str", "new_str"]


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_speculation_is_lossless(mcp_state_root: Path, mcp_connect: Any, transport: str, tmp_path: Path) -> None:
    table = tmp_path / "table.json"
    table.write_text(json.dumps(TABLE))
    env = {"AOSPEC_STATE_ROOT": str(mcp_state_root)}
    runs = {}
    for mode, args in {
        "serial": [*SLOW_OK, "--no-speculate"],
        "speculative": [*SLOW_OK, "--predict", "both", "--predict-file", str(table), "--speculate", "3"],
    }.items():
        # Why the pause: a guess that has not forked when its call arrives is not waited for
        # (running the call then is as fast), so without one, a call right after the reply
        # is served from a fork only if the host forks fast enough.
        async with mcp_connect(args, transport, env=env) as session:
            seen, metas = await _run_script(session, [*SCRIPT, SNAPSHOT], decode_s=0.25)
        runs[mode] = (seen, [m["version"] for m in metas], metas)
    serial, spec = runs["serial"], runs["speculative"]
    assert spec[0] == serial[0]  # every result, errors included, and the final files
    assert spec[1] == serial[1]  # the sandbox version after every call
    assert not any(m["speculated"] for m in serial[2])
    served = [name for (name, _, _), m in zip(spec[0], spec[2], strict=True) if m["speculated"]]
    assert "read_file" in served and "bash" in served
    assert "edit_file" in served and "write_file" in served  # writes committed from their forks
    errors = [name for name, _, is_error in serial[0] if is_error]
    assert errors == ["edit_file", "read_file", "write_file", "read_file"]
    texts = {name: text for name, text, _ in serial[0][10:14]}
    assert "occurs 2 times" in texts["edit_file"][0]
    assert serial[0][13][1] == ["conf\nnotes\n[exit status 3]"]


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_fork_with_a_stale_origin_is_never_served(
    mcp_state_root: Path, mcp_connect: Any, transport: str, tmp_path: Path
) -> None:
    write_old = ("write_file", {"path": "/tmp/f", "content": "old\n"})
    # reading records every run that reaches the committed state in /tmp/runs
    read = ("bash", {"command": "cat /tmp/f; echo run >> /tmp/runs"})
    table = tmp_path / "table.json"
    table.write_text(
        json.dumps(
            [{"after": {"tool": write_old[0], "args": write_old[1]}, "next": [{"tool": read[0], "args": read[1]}]}]
        )
    )
    env = {"AOSPEC_STATE_ROOT": str(mcp_state_root)}
    async with mcp_connect(
        [*SLOW_OK, "--predict", "table", "--predict-file", str(table)], transport, env=env
    ) as session:

        async def call(name: str, args: dict[str, Any]) -> tuple[str, dict[str, Any]]:
            r = await session.call_tool(name, args, read_timeout_seconds=300)
            assert not r.is_error, r.content
            return r.content[0].text, _meta(r)

        _, m0 = await call(*write_old)  # speculates `read` in a fork at this version
        _, m1 = await call("bash", {"command": "echo new > /tmp/f"})  # moves the version on
        assert m1["version"] != m0["version"] and m1["stats"]["launched"] == 1
        text, m2 = await call(*read)  # its fork is stale: JASV refuses it, the server re-runs it
        assert text == "new\n"
        assert m2["speculated"] is False and m2["origin"] == m1["version"]
        assert m2["stats"]["stale_discarded"] >= 1
        _, m3 = await call(*write_old)
        text, m4 = await call(*read)  # origin matches: served from the fork, and committed
        assert text == "old\n"
        assert m4["speculated"] is True and m4["origin"] == m3["version"]
        text, _ = await call("read_file", {"path": "/tmp/runs"})
        assert text == "run\nrun\n"  # exactly the two committed runs; discarded forks left nothing


async def test_concurrent_calls_run_one_at_a_time_in_arrival_order(mcp_state_root: Path, mcp_connect: Any) -> None:
    import anyio

    env = {"AOSPEC_STATE_ROOT": str(mcp_state_root)}
    async with mcp_connect([*SLOW_OK, "--no-speculate"], env=env) as session:
        sent = []

        async def call(command: str) -> None:
            sent.append(command)
            await session.call_tool("bash", {"command": command}, read_timeout_seconds=300)

        async with anyio.create_task_group() as tg:
            tg.start_soon(call, "sleep 1; echo a >> /tmp/o")
            await anyio.sleep(0)  # let the first request go out first
            tg.start_soon(call, "echo b >> /tmp/o")
        result = await session.call_tool("read_file", {"path": "/tmp/o"})
    assert result.content[0].text == "a\nb\n"  # b waited for a, though a sleeps and b does not


def test_transition_table_from_actions_and_files(tmp_path: Path) -> None:
    from aospec.integrations._mcp_common import TransitionPredictor, load_transitions

    from aospec.types import Action

    a, b, c = Action.bash("ls"), Action("read_file", {"path": "x"}), Action.bash("pytest")
    p = TransitionPredictor.fit([[a, b, c], [a, b], [a, c]], k=2)
    assert p(a) == [b, c] and p(b) == [c] and p(c) == [] and p(None) == []
    f = tmp_path / "t.json"
    f.write_text(json.dumps([{"after": a.to_json(), "next": [c.to_json()]}]))
    assert load_transitions(f, 2)(a) == [c]
    f.write_text(json.dumps([{"after": a.to_json()}]))
    with pytest.raises(ValueError, match="exactly 'after' and 'next'"):
        load_transitions(f, 2)


def test_tool_arguments_are_checked() -> None:
    from aospec.integrations.mcp_server import ToolArgumentError, check_args, read_only

    from aospec.types import Action

    check_args("edit_file", {"path": "p", "old_str": "a", "new_str": "b"})
    for tool, args, message in [
        ("bash", {}, "missing argument"),
        ("bash", {"command": "ls", "cwd": "/"}, "unknown argument"),
        ("read_file", {"path": 3}, "must be a string"),
        ("rm", {}, "unknown tool"),
    ]:
        with pytest.raises(ToolArgumentError, match=message):
            check_args(tool, args)
    assert read_only(Action("read_file", {"path": "x"})) and read_only(Action.bash("cat x | wc -l"))
    assert not read_only(Action.bash("echo x > y")) and not read_only(
        Action("write_file", {"path": "x", "content": ""})
    )


async def test_train_traces_fits_aospecs_history_action_drafter(tmp_path: Path) -> None:
    from aospec.integrations._mcp_common import drafter_from_traces
    from aospec.replay.io import write_jsonl

    from aospec.types import Action, Step, Trace

    acts = [
        Action("read_file", {"path": "/w/conf"}),
        Action.bash("cat /w/conf"),
        Action("edit_file", {"path": "/w/conf", "old_str": "a", "new_str": "b"}),
    ]
    steps = tuple(Step(action=a, observation="x", output_tokens=5) for a in acts)
    traces = [
        Trace(id=f"t{i}", task=f"task {i}", harness="mcp", actor_model="m", source="test", steps=steps)
        for i in range(3)
    ]
    write_jsonl(traces, tmp_path / "traces.jsonl")
    predict = drafter_from_traces([str(tmp_path / "traces.jsonl")], 2)
    await predict(None, "")
    await predict(acts[0], "x")
    assert (await predict(acts[1], "x"))[0] == acts[2]  # a writing call: forked, committed if it comes


async def test_a_host_budget_of_no_cores_starts_no_speculative_call(mcp_state_root: Path, mcp_connect: Any) -> None:
    env = {"AOSPEC_STATE_ROOT": str(mcp_state_root)}
    async with mcp_connect([*SLOW_OK, "--no-speculate"], "stdio", env=env) as session:
        serial, _ = await _run_script(session, SCRIPT[:6])
    async with mcp_connect([*SLOW_OK, "--speculation-budget", "0"], "stdio", env=env) as session:
        seen, metas = await _run_script(session, SCRIPT[:6])
    assert seen == serial
    assert not any(m["speculated"] for m in metas)
    assert metas[-1]["stats"]["launched"] == 0 and metas[-1]["stats"]["budget_refused"] > 0


async def test_by_default_the_host_budget_holds_one_call_per_two_cores(
    mcp_state_root: Path, mcp_connect: Any, tmp_path: Path
) -> None:
    """No --speculation-budget: auto (aospec.host.host_budget), shared by every aospec process
    of the host; none turns it off. Three calls predicted at once after the first read."""
    from aospec.host import auto_budget_cores

    slots = int(auto_budget_cores())
    if slots >= 3:
        pytest.skip(f"the default gives this host {slots} slots: three guesses at once are never refused")
    table = tmp_path / "table.json"
    table.write_text(json.dumps(TABLE))
    predict = ["--predict", "both", "--predict-file", str(table), "--speculate", "3"]
    env = {"AOSPEC_STATE_ROOT": str(mcp_state_root)}
    stats = {}
    for budget in ("", "none"):  # "": the variable unset, so the default applies
        async with mcp_connect([*SLOW_OK, *predict], "stdio", env={**env, "AOSPEC_SPECULATION_BUDGET": budget}) as s:
            seen, metas = await _run_script(s, SCRIPT[:6], decode_s=0.25)
        stats[budget or "default"] = (seen, metas[-1]["stats"])
    assert stats["default"][0] == stats["none"][0]  # the same results either way
    assert stats["default"][1]["budget_refused"] > 0 and stats["default"][1]["launched"] > 0
    assert stats["none"][1]["budget_refused"] == 0
