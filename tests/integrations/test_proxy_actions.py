"""Action speculation of ``aospec proxy --mcp`` (integrations/_proxy_actions.py): the
``openai`` SDK as the client, ``serve-trace`` as the upstream, ``aospec mcp --http`` on
loopback executing each action, all over real HTTP. Needs root and overlayfs (the MCP
server's sandbox).

The harness loop asks for a reply, then executes its action through the MCP server's
``bash`` tool and appends the result as the observation. With ``--mcp`` the proxy starts
that call in a fork as soon as the reply holds it; the server serves the fork only under
JASV, so the harness sees the same replies, the same tool results and the same final
sandbox version either way.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest
from aospec.integrations._proxy_actions import ActionWatcher, map_call, opencode_tool_prefix, prefetch_url
from aospec.integrations.proxy import proxy_app
from aospec.live.serve_trace import TraceServer, serve_trace_app, serving

from aospec.types import Action, Step, Trace
from tests.integrations.conftest import AOSPEC

W = "/tmp/pa"
#: Commands that take time (so a fork started early is still running, or done, when the
#: harness's own call arrives), with writes between them.
COMMANDS = [
    f"mkdir -p {W} && echo one > {W}/a",
    f"sleep 0.3; cat {W}/a",
    f"sleep 0.3; ls {W}",
    f"echo two >> {W}/a",
    f"sleep 0.3; cat {W}/a",
    f"sleep 0.3; wc -l {W}/a",
    f"sleep 0.3; cat {W}/a",
]
#: Before executing the action of this step, the harness writes (another client, say):
#: the fork started for it is stale and must not be served.
INTERVENE = 6
WRITE = f"echo intruder >> {W}/a"
#: The MCP server's token (AOSPEC_TOKEN), which its clients and the proxy's prefetches send.
TOKEN = "test-mcp-token"


def _trace() -> Trace:
    steps = tuple(Step(Action.bash(c), "", 10) for c in COMMANDS)
    return Trace("pa", "run the commands", "test", "m", "test", steps, instruction="run the commands")


@pytest.fixture
def servers() -> Iterator[Callable[[Any], TraceServer]]:
    with ExitStack() as stack:
        yield lambda app: stack.enter_context(serving(app))


@asynccontextmanager
async def mcp_http(tmp_path: Path, state: Path, args: list[str]) -> AsyncIterator[str]:
    log = tmp_path / f"mcp-{os.urandom(4).hex()}.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [AOSPEC, "mcp", "--http", "0", "--command-timeout", "600", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**os.environ, "AOSPEC_STATE_ROOT": str(state), "AOSPEC_TOKEN": TOKEN},
        )
    try:
        url = None
        for _ in range(3000):  # bounded wait for the "listening on URL" line
            if "listening on " in log.read_text():
                url = log.read_text().split("listening on ", 1)[1].split()[0]
                break
            assert proc.poll() is None, log.read_text()
            await anyio.sleep(0.1)
        assert url, log.read_text()
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    assert proc.returncode == 0, log.read_text()


async def harness(base_url: str, mcp_url: str, *, tools: bool, stream: bool) -> tuple[list[Any], list[Any]]:
    """(what the harness saw: replies and tool results; the server's meta per action)."""
    import httpx2
    from aospec.live.chat import ChatFormat
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    client = openai.AsyncOpenAI(base_url=base_url, api_key="sk-test", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "run the commands"}]
    kw: dict[str, Any] = {"model": "m", "temperature": 0}
    if tools:
        kw["tools"] = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    seen: list[Any] = []
    metas: list[Any] = []
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=300) as http,
        streamable_http_client(mcp_url, http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        with anyio.fail_after(300):  # a hang guard, not a performance assertion
            await session.initialize()
        for i in range(len(COMMANDS)):
            if stream:
                text, calls = "", {}
                async for chunk in await client.chat.completions.create(messages=messages, stream=True, **kw):
                    for ch in chunk.choices:
                        text += ch.delta.content or ""
                        for tc in ch.delta.tool_calls or ():
                            c = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                            c["id"] = tc.id or c["id"]
                            c["name"] += (tc.function.name or "") if tc.function else ""
                            c["arguments"] += (tc.function.arguments or "") if tc.function else ""
                tool_calls = [
                    {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                    for _, c in sorted(calls.items())
                ]
            else:
                r = await client.chat.completions.create(messages=messages, **kw)
                text = r.choices[0].message.content or ""
                tool_calls = [tc.model_dump() for tc in r.choices[0].message.tool_calls or ()]
            action = ChatFormat(action_format="tools" if tools else "bash").parse(text, tool_calls)
            assert action.command is not None, (text, tool_calls)
            if i == INTERVENE:
                await session.call_tool("bash", {"command": WRITE}, read_timeout_seconds=300)
            command = json.loads(tool_calls[0]["function"]["arguments"])["command"] if tool_calls else action.command
            result = await session.call_tool("bash", {"command": command}, read_timeout_seconds=300)
            out = "".join(c.text for c in result.content)
            seen.append((text, tool_calls, out, result.is_error))
            metas.append(result.meta["aospec"])
            if tool_calls:
                messages.append({"role": "assistant", "content": text, "tool_calls": tool_calls})
                messages.append({"role": "tool", "tool_call_id": tool_calls[0]["id"], "content": out})
            else:
                messages.append({"role": "assistant", "content": text})
                messages.append({"role": "user", "content": out})
    await client.close()
    return seen, metas


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize(("tools", "stream"), [(True, True), (False, True), (False, False)])
async def test_action_speculation_is_lossless_and_hits(
    mcp_state_root: Path, servers: Any, tmp_path: Path, tools: bool, stream: bool
) -> None:
    up = servers(serve_trace_app([_trace()], 1.0))
    # --predict table without a table: the server speculates only what the proxy prefetches
    args = ["--predict", "table"]
    async with mcp_http(tmp_path, mcp_state_root, args) as mcp_url:
        plain = servers(proxy_app(up.base_url))
        base_seen, base_meta = await harness(plain.base_url, mcp_url, tools=tools, stream=stream)
    async with mcp_http(tmp_path, mcp_state_root, args) as mcp_url:
        proxy = proxy_app(up.base_url, mcp=mcp_url, mcp_token=TOKEN)
        px = servers(proxy)
        seen, metas = await harness(px.base_url, mcp_url, tools=tools, stream=stream)
    assert seen == base_seen
    assert metas[-1]["version"] == base_meta[-1]["version"]
    assert [m["version"] for m in metas] == [m["version"] for m in base_meta]
    assert not any(m["speculated"] for m in base_meta)
    assert proxy.stats.actions_prefetched == len(COMMANDS)
    assert proxy.stats.prefetch_errors == 0
    hits = sum(m["speculated"] for m in metas)
    assert hits > 0, (metas, proxy.stats)
    # the intervening write is seen: never a stale fork
    assert seen[INTERVENE][2] == "one\ntwo\nintruder\n"


def test_watcher_emits_each_action_once_when_complete() -> None:
    got: list[Any] = []
    w = ActionWatcher(True, ["shell"], lambda tool, args: got.append((tool, args)))
    w.feed(b'data: {"choices":[{"index":0,"delta":{"content":"THOUGHT\\n```bash\\nls -l\\n"}}]}\n\n')
    assert got == []
    w.feed(b'data: {"choices":[{"index":0,"delta":{"content":"```\\nmore ```bash\\nx\\n```"}}]}\n\n')
    assert got == [("bash", {"command": "ls -l"})]
    got.clear()
    w = ActionWatcher(True, ["shell"], lambda tool, args: got.append((tool, args)))
    w.feed(b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"name":"shell",')
    w.feed(b'"arguments":"{\\"command\\": \\"echo"}}]}}]}\n\n')
    w.feed(b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":" 1\\"}"}}]}}]}\n')
    assert got == []
    w.feed(b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"function":{"name":"read_file",')
    w.feed(b'"arguments":"{\\"path\\": \\"/x\\"}"}}]}}]}\n')
    assert got == [("bash", {"command": "echo 1"})]
    w.feed(b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}\n\ndata: [DONE]\n\n')
    w.close()
    assert got == [("bash", {"command": "echo 1"}), ("read_file", {"path": "/x"})]


def test_calls_are_mapped_to_the_mcp_tools() -> None:
    assert map_call("run", '{"command": "ls"}', ["run"]) == ("bash", {"command": "ls"})
    assert map_call("run", '{"command": "ls", "cwd": "/"}', ["run"]) is None
    assert map_call("bash", '{"command": "ls"}', []) == ("bash", {"command": "ls"})
    assert map_call("other", '{"command": "ls"}', []) is None
    assert map_call("bash", "not json", []) is None
    assert prefetch_url("http://127.0.0.1:9/mcp") == "http://127.0.0.1:9/aospec/prefetch"
    with pytest.raises(ValueError):
        prefetch_url("aospec mcp --stdio")


def test_prefixed_names_are_the_mcp_servers_tools_only_under_its_prefix() -> None:
    """opencode names an MCP server's tools SERVER_tool: with the --mcp server's prefix,
    exactly its sandbox tools map, never a bare name (opencode's own bash) nor another
    server's tool of the same name."""
    assert opencode_tool_prefix("aospec") == "aospec_"
    assert opencode_tool_prefix("my sandbox.v2") == "my_sandbox_v2_"
    p = "aospec_"
    assert map_call("aospec_bash", '{"command": "ls"}', [], p) == ("bash", {"command": "ls"})
    assert map_call("aospec_read_file", '{"path": "/a"}', [], p) == ("read_file", {"path": "/a"})
    assert map_call("aospec_edit_file", '{"path": "/a", "old_str": "x", "new_str": "y"}', [], p) == (
        "edit_file",
        {"path": "/a", "old_str": "x", "new_str": "y"},
    )
    assert map_call("aospec_write_file", '{"path": "/a", "content": ""}', [], p) == (
        "write_file",
        {"path": "/a", "content": ""},
    )
    assert map_call("bash", '{"command": "ls"}', [], p) is None  # the harness's own bash
    assert map_call("other_bash", '{"command": "ls"}', [], p) is None  # another server's
    assert map_call("other_read_file", '{"path": "/a"}', [], p) is None
    assert map_call("aospec_other", '{"command": "ls"}', [], p) is None  # not a sandbox tool
    assert map_call("aospec_bash", '{"command": "ls"}', []) is None  # without the prefix: unknown
    assert map_call("run", '{"command": "ls"}', ["run"], p) == ("bash", {"command": "ls"})  # command tools as named
    got: list[Any] = []
    w = ActionWatcher(True, [], lambda tool, args: got.append((tool, args)), tool_prefix=p)
    for i, name in enumerate(("other_bash", "aospec_read_file", "bash")):
        args = json.dumps(json.dumps({"path": "/x"} if "read" in name else {"command": "ls"}))
        w.feed(b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":%d,"function":{"name":"%s","arguments":%s}}]}}]}\n'
               % (i, name.encode(), args.encode()))  # fmt: skip
    w.feed(b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}\n\ndata: [DONE]\n\n')
    w.close()
    assert got == [("read_file", {"path": "/x"})]
    app = proxy_app("http://127.0.0.1:9/v1", mcp="http://127.0.0.1:9/mcp", mcp_tool_prefix=p)
    assert app.mcp_tool_prefix == p


def test_mcp_must_be_an_http_url() -> None:
    from aospec.errors import ConfigError

    with pytest.raises(ConfigError):
        proxy_app("http://127.0.0.1:9/v1", mcp="aospec mcp --stdio")
    assert proxy_app("http://127.0.0.1:9/v1", mcp="http://127.0.0.1:9/mcp", command_tools=["run"]).command_tools == (
        "run",
    )


def test_plain_replies_are_watched_whole() -> None:
    got: list[Any] = []
    w = ActionWatcher(False, [], lambda tool, args: got.append((tool, args)))
    msg = {"role": "assistant", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "/a"}'}}
    ]}  # fmt: skip
    w.feed(json.dumps({"choices": [{"index": 0, "message": msg}]}).encode())
    assert got == []
    w.close()
    assert got == [("read_file", {"path": "/a"})]


def _ask_then_get(key: str, i: int) -> Trace:
    """A function-calling session on the demo key-value server: the agent asks the user
    which key, the user names it, the agent reads it (the key is only in the user's words,
    never in a tool call or result before)."""
    steps = (
        Step(Action("respond", {"content": "Which key should I read?"}), key, 8),
        Step(Action("get", {"key": key}), "v", 40),
    )
    return Trace(
        f"ask{i}",
        "Read the key the user names.",
        "test",
        "m",
        "test",
        steps,
        instruction="Read the key the user names.",
    )


class _BrokenDrafter:
    """An action drafter that fails every other time, and otherwise proposes a call with
    nested arguments of a tool the server does not trust (refused there)."""

    def __init__(self) -> None:
        self.calls = 0

    async def propose(self, history: Any, width: int, depth: int) -> list[Any]:
        from aospec.protocols import ActionDraft

        self.calls += 1
        if self.calls % 2:
            raise RuntimeError("drafter bug")
        return [ActionDraft(Action("put", {"key": {"nested": ["x"]}}), 0, 0.5)]


@pytest.mark.anyio
@pytest.mark.parametrize("predict", [0, 2, "broken"])
async def test_the_proxy_prefetches_a_call_drafted_on_the_conversation_before_the_reply(
    servers: Any, tmp_path: Path, predict: Any
) -> None:
    """``aospec proxy --mcp --mcp-any-tool --train`` in front of ``aospec mcp --upstream``:
    when the request after the user's answer arrives, the calls drafter (fitted on earlier
    sessions) completes ``get`` with the key the user named and the proxy prefetches it,
    so the upstream has run it while the reply is still streaming; with ``predict_calls``
    0 only the call the reply holds is prefetched, once it is complete. Either way the
    harness's own call is answered with the same result."""
    import random

    import httpx2
    from aospec.integrations.proxy import action_drafter
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    from tests.integrations.test_mcp_proxy import DEMO, RO_CLOSED, _trust

    rng = random.Random(5)
    train = [_ask_then_get(f"{rng.choice(['cfg', 'env', 'job'])}-{rng.randrange(10, 99)}", i) for i in range(8)]
    live = _ask_then_get("zed-7", 99)
    # the get reply: its first token after 1 s, then 40 tokens in 0.4 s
    up = servers(serve_trace_app([live], 10.0, ttft_ms=1000))
    trust = _trust(tmp_path, {"get": RO_CLOSED, "calls": RO_CLOSED})
    args = ["--upstream", DEMO, "--trust", trust, "--predict", "table"]
    async with mcp_http(tmp_path, tmp_path / "state", args) as mcp_url:
        proxy = proxy_app(
            up.base_url,
            mcp=mcp_url,
            mcp_token=TOKEN,
            mcp_any_tool=True,
            action_drafter=_BrokenDrafter() if predict == "broken" else action_drafter(train),
            predict_calls=2 if predict == "broken" else predict,
        )
        px = servers(proxy)
        client = openai.AsyncOpenAI(base_url=px.base_url, api_key="sk-test", max_retries=0)
        tools = [
            {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("respond", "get")
        ]
        async with (
            httpx2.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=300) as http,
            streamable_http_client(mcp_url, http_client=http) as (read, write),
            ClientSession(read, write) as session,
        ):
            with anyio.fail_after(300):  # a hang guard, not a performance assertion
                await session.initialize()
                await session.call_tool("put", {"key": "zed-7", "value": "v"})
                messages: list[dict[str, Any]] = [{"role": "user", "content": live.task}]
                r = await client.chat.completions.create(model="m", messages=messages, tools=tools, temperature=0)
                call = r.choices[0].message.tool_calls[0]
                assert call.function.name == "respond"
                messages.append({"role": "assistant", "content": None, "tool_calls": [call.model_dump()]})
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "zed-7"})
                stream = await client.chat.completions.create(
                    model="m", messages=messages, tools=tools, temperature=0, stream=True
                )
                # the reply's headers are in, its first token is not: half a second later,
                # has the upstream run get already?
                await anyio.sleep(0.5)
                counts = await session.call_tool("calls", {})
                ran_before_reply = json.loads(counts.content[0].text).get("get", 0)
                async for _chunk in stream:
                    pass
                got = await session.call_tool("get", {"key": "zed-7"})
    await client.close()
    assert got.content[0].text == "v" and not got.is_error
    if predict == "broken":  # the harness never notices: the drafter only loses its guesses
        assert ran_before_reply == 0 and proxy.stats.drafter_errors >= 1
        assert proxy.stats.calls_predicted >= 1 and proxy.stats.prefetch_refused >= 1  # the put
        assert "put" in proxy._prefetcher.refused_tools  # never sent again (nor respond, the reply's)
    elif predict:
        # get(zed-7) and whatever else the drafter ranked next (at most 2 a request)
        assert ran_before_reply >= 1 and proxy.stats.calls_predicted >= 1
        assert got.meta["aospec"]["speculated"] is True
    else:
        assert ran_before_reply == 0 and proxy.stats.calls_predicted == 0
    assert proxy.stats.prefetch_errors == 0
