"""``aospec mcp --upstream``: the speculating MCP proxy in front of real MCP servers (the
demo key-value server shipped in the package, run over stdio; the aospec sandbox server
over streamable HTTP), driven by the official SDK client (issue 12 section 3)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

AOSPEC = str(Path(sys.executable).with_name("aospec"))
pytestmark = pytest.mark.anyio

DEMO = f"{shlex.quote(sys.executable)} -m aospec.integrations.mcp_demo_server"
RO_CLOSED = {"readOnly": True, "openWorld": False}


def _trust(tmp_path: Path, tools: dict[str, Any]) -> str:
    path = tmp_path / "trust.json"
    path.write_text(json.dumps({"tools": tools}))
    return str(path)


async def _call(session: Any, name: str, args: dict[str, Any]) -> tuple[str, bool, dict[str, Any]]:
    r = await session.call_tool(name, args, read_timeout_seconds=300)
    return r.content[0].text, r.is_error, (r.meta or {}).get("aospec", {})


@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_no_stale_result_after_a_write_through_the_upstream(
    mcp_connect: Any, transport: str, tmp_path: Path
) -> None:
    trust = _trust(tmp_path, {"get": RO_CLOSED, "list_keys": RO_CLOSED})
    table = tmp_path / "table.json"
    get = {"tool": "get", "args": {"key": "k"}}
    table.write_text(json.dumps([{"after": get, "next": [get]}]))
    args = ["--upstream", DEMO, "--trust", trust, "--predict", "table", "--predict-file", str(table)]
    async with mcp_connect(args, transport) as session:
        tools = {t.name: t for t in (await session.list_tools()).tools}
        assert set(tools) == {"get", "list_keys", "put", "calls"}
        assert tools["get"].annotations.read_only_hint is True  # forwarded as the upstream says
        assert (await _call(session, "put", {"key": "k", "value": "1"}))[:2] == ("ok k", False)
        text, _, m = await _call(session, "get", {"key": "k"})  # speculates get(k) again
        assert (text, m["speculated"]) == ("1", False)
        text, _, m = await _call(session, "get", {"key": "k"})
        assert (text, m["speculated"]) == ("1", True)  # same call, same epoch: served
        epoch = m["epoch"]
        await _call(session, "put", {"key": "k", "value": "2"})  # untrusted: the epoch moves
        text, _, m = await _call(session, "get", {"key": "k"})
        assert text == "2" and m["speculated"] is False and m["epoch"] > epoch
        text, is_error, m = await _call(session, "get", {"key": "missing"})
        assert is_error and "no key" in text
        calls = json.loads((await _call(session, "calls", {}))[0])
    # the upstream ran get(k) four times: three real calls, one speculation served, two
    # speculations discarded or unused (the one in flight across the put, the last one)
    assert calls["put"] == 2 and calls["get"] >= 4


def _kv_traces(path: Path, n: int = 8) -> None:
    """Recorded sessions of an agent on the demo server: it stores three keys, lists them,
    then reads each in the order the listing gives (the keys differ from session to
    session; their shape, a word, a dash and a number, does not)."""
    import random

    from aospec.replay.io import write_jsonl

    from aospec.types import Action, Step, Trace

    rng = random.Random(3)
    traces = []
    for i in range(n):
        keys = [f"{rng.choice(['cfg', 'env', 'job', 'run'])}-{rng.randrange(10, 99)}" for _ in range(3)]
        keys = list(dict.fromkeys(keys))
        steps = [Step(Action("put", {"key": k, "value": f"v{j}"}), f"ok {k}", 12) for j, k in enumerate(keys)]
        steps.append(Step(Action("list_keys", {}), "\n".join(sorted(keys)), 6))
        steps += [Step(Action("get", {"key": k}), f"v{keys.index(k)}", 8) for k in sorted(keys)]
        traces.append(
            Trace(id=f"kv{i}", task=f"session {i}", harness="mcp", actor_model="m", source="test", steps=tuple(steps))
        )
    write_jsonl(traces, path)


async def test_train_traces_speculate_the_keys_a_listing_just_showed(mcp_connect: Any, tmp_path: Path) -> None:
    """With ``--train-traces``, the calls drafter passes back what a result showed: after
    list_keys it reads the first key listed, then the next, and both are served from
    speculation (the keys never occurred in training)."""
    trust = _trust(tmp_path, {"get": RO_CLOSED, "list_keys": RO_CLOSED})
    _kv_traces(tmp_path / "kv.jsonl")
    args = ["--upstream", DEMO, "--trust", trust, "--predict", "table", "--train-traces", str(tmp_path / "kv.jsonl")]
    async with mcp_connect(args) as session:
        for j, k in enumerate(["zed-7", "amy-41", "max-13"]):
            await _call(session, "put", {"key": k, "value": f"v{j}"})
        text, _, m = await _call(session, "list_keys", {})
        assert text.split() == ["amy-41", "max-13", "zed-7"]
        text, _, m = await _call(session, "get", {"key": "amy-41"})
        assert (text, m["speculated"]) == ("v1", True)
        text, _, m = await _call(session, "get", {"key": "max-13"})
        assert (text, m["speculated"]) == ("v2", True)
        assert m["stats"]["served_speculated"] >= 2


async def test_the_upstreams_own_annotations_never_suffice(mcp_connect: Any, tmp_path: Path) -> None:
    # the demo server annotates get read-only and closed-world; without a trust entry it is
    # never speculated (and calls, read-only but trusted open-world, is not either)
    trust = _trust(tmp_path, {"calls": {"readOnly": True, "openWorld": True}})
    async with mcp_connect(["--upstream", DEMO, "--trust", trust, "--predict", "repeat"]) as session:
        await _call(session, "put", {"key": "k", "value": "v"})
        for _ in range(3):
            text, _, m = await _call(session, "get", {"key": "k"})
            assert text == "v" and m["speculated"] is False
        assert m["stats"]["launched"] == 0
        assert json.loads((await _call(session, "calls", {}))[0])["get"] == 3


async def test_colliding_tool_names_are_namespaced(mcp_connect: Any, tmp_path: Path) -> None:
    trust = _trust(tmp_path, {"a__get": RO_CLOSED, "b__get": RO_CLOSED})
    args = ["--upstream", f"{DEMO} --name a", "--upstream", f"{DEMO} --name b", "--trust", trust]
    async with mcp_connect(args) as session:
        names = {t.name for t in (await session.list_tools()).tools}
        assert names == {f"{s}__{t}" for s in "ab" for t in ("get", "list_keys", "put", "calls")}
        await _call(session, "a__put", {"key": "k", "value": "in a"})
        assert (await _call(session, "a__get", {"key": "k"}))[:2] == ("in a", False)
        assert (await _call(session, "b__get", {"key": "k"}))[1] is True  # b has its own store
        text, is_error, _ = await _call(session, "get", {"key": "k"})
        assert is_error and "unknown tool" in text


@pytest.mark.slow
async def test_proxy_of_the_sandbox_server_over_http(mcp_state_root: Path, mcp_connect: Any, tmp_path: Path) -> None:
    """The proxy (stdio) in front of ``aospec mcp --http`` (streamable HTTP on loopback):
    read_file is trusted, bash is not; a write through bash is never answered stale."""
    # the upstream's token (AOSPEC_TOKEN), which the proxy sends it (AOSPEC_UPSTREAM_TOKEN)
    env = {"AOSPEC_STATE_ROOT": str(mcp_state_root), "AOSPEC_TOKEN": "upstream-token"}
    trust = _trust(tmp_path, {"read_file": RO_CLOSED})
    log = tmp_path / "upstream.log"
    with open(log, "wb") as err:
        up = subprocess.Popen(
            [AOSPEC, "mcp", "--http", "0", "--no-speculate", "--command-timeout", "600"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**os.environ, **env},
        )
    try:
        url = None
        for _ in range(3000):
            if "listening on " in log.read_text():
                url = log.read_text().split("listening on ", 1)[1].split()[0]
                break
            assert up.poll() is None, log.read_text()
            await anyio.sleep(0.1)
        assert url
        proxy_env = {"AOSPEC_UPSTREAM_TOKEN": "upstream-token"}
        async with mcp_connect(["--upstream", url, "--trust", trust, "--predict", "repeat"], env=proxy_env) as session:
            names = {t.name for t in (await session.list_tools()).tools}
            assert names == {"bash", "read_file", "write_file", "edit_file"}
            await _call(session, "bash", {"command": "echo 1 > /tmp/x"})
            assert (await _call(session, "read_file", {"path": "/tmp/x"}))[0] == "1\n"
            text, _, m = await _call(session, "read_file", {"path": "/tmp/x"})
            assert text == "1\n" and m["speculated"] is True
            await _call(session, "bash", {"command": "echo 2 > /tmp/x"})
            text, _, m = await _call(session, "read_file", {"path": "/tmp/x"})
            assert text == "2\n"
    finally:
        up.terminate()
        up.wait(timeout=120)
    assert up.returncode == 0, log.read_text()


def test_trust_needs_both_explicit_marks(tmp_path: Path) -> None:
    from aospec.integrations._mcp_common import load_trust

    f = tmp_path / "t.json"
    f.write_text(
        json.dumps(
            {
                "tools": {
                    "a": RO_CLOSED,
                    "b": {"readOnly": True},
                    "c": {"openWorld": False},
                    "d": {"readOnly": True, "openWorld": True},
                }
            }
        )
    )
    assert load_trust(f) == {"a"}
    f.write_text(json.dumps({"tools": {"a": {"readOnlyHint": True}}}))
    with pytest.raises(ValueError, match="allowed keys"):
        load_trust(f)
    f.write_text(json.dumps({"tools": {"a": {"readOnly": "yes"}}}))
    with pytest.raises(ValueError, match="true or false"):
        load_trust(f)


def test_an_unreachable_upstream_is_one_error_line() -> None:
    out = subprocess.run(
        [AOSPEC, "mcp", "--upstream", "http://127.0.0.1:1/mcp"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1
    assert "check that every --upstream is reachable" in out.stderr and "Traceback" not in out.stderr


async def test_drafting_happens_after_the_reply_and_a_failing_predictor_loses_only_its_guesses() -> None:
    """The proxy answers a call before its predictor has drafted the next ones (drafting is
    CPU time the agent would otherwise wait for); the next call still finds what the
    drafting launched; a predictor that raises costs only its guesses, never a call."""
    import contextlib

    from aospec.integrations._mcp_proxy import ProxyBackend, connect_upstream

    from aospec.types import Action

    release = anyio.Event()
    asked: list[str] = []

    async def slow(last: Action | None, observation: str) -> list[Action]:
        asked.append(last.tool if last else "")
        if last is not None and last.tool == "list_keys":
            await release.wait()
            return [Action("get", {"key": "k"})]
        return []

    def broken(last: Action | None, observation: str) -> list[Action]:
        raise RuntimeError("drafter bug")

    async with contextlib.AsyncExitStack() as stack:
        up = await connect_upstream(stack, DEMO, 0)
        async with anyio.create_task_group() as tg:
            proxy = ProxyBackend([up], frozenset({"get", "list_keys"}), tg, predictor=slow)
            assert (await proxy.call("put", {"key": "k", "value": "1"})).content[0].text == "ok k"
            with anyio.fail_after(30):  # the reply comes while the drafting still waits
                first = await proxy.call("list_keys", {})
            with anyio.fail_after(10):  # the drafting after list_keys has begun, and waits
                while len(asked) < 2:
                    await anyio.sleep(0.001)
            assert first.content[0].text == "k" and asked == ["put", "list_keys"] and proxy.stats["launched"] == 0
            release.set()  # the drafting after list_keys runs before get(k) is forwarded
            got = await proxy.call("get", {"key": "k"})
            assert got.content[0].text == "1" and got.meta["aospec"]["speculated"] is True
            with anyio.fail_after(10):
                while len(asked) < 3:
                    await anyio.sleep(0.001)
            assert asked == ["put", "list_keys", "get"]

            proxy.predictor = broken
            for _ in range(3):
                r = await proxy.call("get", {"key": "k"})
                assert r.content[0].text == "1" and not r.is_error
            await proxy.call("list_keys", {})  # waits for the third get's drafting
            assert proxy.stats["draft_failures"] == 3

            # POST /aospec/prefetch (aospec proxy --mcp): trusted tools only, served like
            # a predicted call; a write moves the epoch and discards it
            # a tool it never prefetches says so ("tool"), so that a client stops sending it
            assert await proxy.prefetch("put", {"key": "k", "value": "2"}) == "tool"
            assert await proxy.prefetch("nope", {}) == "tool"
            assert await proxy.prefetch("get", {"key": "k"}) is True and proxy.stats["prefetched"] == 1
            got = await proxy.call("get", {"key": "k"})
            assert got.content[0].text == "1" and got.meta["aospec"]["speculated"] is True
            assert await proxy.prefetch("get", {"key": "k"})
            await proxy.call("put", {"key": "k", "value": "2"})
            got = await proxy.call("get", {"key": "k"})
            assert got.content[0].text == "2" and got.meta["aospec"]["speculated"] is False
            for key in ("a", "b", "c"):  # prefetches hold at most half of max_inflight
                assert await proxy.prefetch("get", {"key": key})
            assert [a.args["key"] for a in (sp.action for sp in proxy._specs.values() if sp.prefetched)] == ["b", "c"]
            tg.cancel_scope.cancel()


async def test_a_drafter_that_never_yields_starts_after_the_reply_is_written() -> None:
    """Real drafters are CPU work that never awaits anything: the proxy must not start one
    before the transport has written the reply (here a writer task that takes a few
    scheduling rounds, as the SDK's does), or the agent waits for the drafting."""
    import contextlib

    from aospec.integrations._mcp_proxy import ProxyBackend, connect_upstream

    from aospec.types import Action

    written: list[str] = []
    seen_at_drafting: list[list[str]] = []

    def cpu_bound(last: Action | None, observation: str) -> list[Action]:
        seen_at_drafting.append(list(written))
        return []

    async with contextlib.AsyncExitStack() as stack:
        up = await connect_upstream(stack, DEMO, 0)
        async with anyio.create_task_group() as tg:
            send, receive = anyio.create_memory_object_stream[str](0)

            async def writer() -> None:
                async for text in receive:
                    for _ in range(5):  # encoding, framing, the stream's own hops
                        await anyio.sleep(0)
                    written.append(text)

            tg.start_soon(writer)
            proxy = ProxyBackend([up], frozenset({"get"}), tg, predictor=cpu_bound)
            for value in ("1", "2"):
                r = await proxy.call("put", {"key": "k", "value": value})
                await send.send(r.content[0].text)
            await proxy.call("get", {"key": "k"})  # waits for the second put's drafting
            assert seen_at_drafting == [["ok k"], ["ok k", "ok k"]]
            tg.cancel_scope.cancel()
