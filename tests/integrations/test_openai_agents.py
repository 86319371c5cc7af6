"""The OpenAI Agents SDK through aospec (issue 26 #2): the SDK itself, configured only by its
own settings -- chat-completions mode, tracing off, an ``OpenAIChatCompletionsModel`` on an
``AsyncOpenAI`` client pointed at ``aospec serve-trace`` (the scripted task's replies as
tool calls), one function tool of its own -- with ``aospec mcp`` as its MCP server: serial
(``--no-speculate``, over stdio with the SDK's ``MCPServerStdio``) and speculating
(``--train-traces``, over streamable HTTP with its ``MCPServerStreamableHttp``). The runs
must give the same final files, the same tool outputs and the same requests upstream, and
the speculating one must have served calls from forks (its metrics say so). Needs root and
overlayfs."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integrations.conftest import mcp_http_server
from tests.integrations.test_metrics import _value, samples

pytest.importorskip("agents", reason="the OpenAI Agents SDK is not installed: pip install openai-agents")
pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import bench_harnesses as bh  # noqa: E402  (the harness driver the bench measures)

TPOT_MS = 2.0
TOKEN = "t0ken-for-the-agents-sdk"


async def test_the_agents_sdk_gets_the_same_result_through_aospec(mcp_state_root: Path, tmp_path: Path) -> None:
    from aospec.live.serve_trace import serve_trace_app, serving

    env = {**os.environ, "AOSPEC_STATE_ROOT": str(mcp_state_root)}
    modes = bh.mcp_modes(tmp_path)
    runs: dict[str, tuple[dict[str, Any], list[Any]]] = {}

    recorder = bh.RecordRequests(serve_trace_app([bh.agents_trace()], TPOT_MS))
    with serving(recorder) as server:
        runs["serial"] = (await bh.run_agents_sdk(server.base_url, modes["serial"], env), recorder.bodies)

    recorder = bh.RecordRequests(serve_trace_app([bh.agents_trace()], TPOT_MS))
    with serving(recorder) as server:
        async with mcp_http_server(modes["aospec"], tmp_path / "mcp.log", {**env, "AOSPEC_TOKEN": TOKEN}) as (_, url, _):
            runs["aospec"] = (await bh.run_agents_sdk(server.base_url, mcp_url=url, token=TOKEN), recorder.bodies)
            auth = {"Authorization": f"Bearer {TOKEN}"}
            metrics = samples(httpx.get(url.removesuffix("/mcp") + "/metrics", headers=auth, timeout=60).text)

    (serial, serial_bodies), (spec, spec_bodies) = runs["serial"], runs["aospec"]
    assert serial["final_output"] == spec["final_output"] == "Done: x is 10."
    assert serial["tool_outputs"] == spec["tool_outputs"]
    assert spec["tool_outputs"][-1] == {"type": "text", "text": bh.FINAL_FILES}  # the final files, as cat prints them
    assert "2" in spec["tool_outputs"]  # the SDK's own function tool ran in process
    assert len(serial_bodies) == len(bh.agents_calls()) + 1  # one request per reply
    assert spec_bodies == serial_bodies  # byte for byte what the upstream saw
    last = json.loads(spec_bodies[-1])
    assert last["messages"][-1]["content"] == [{"type": "text", "text": bh.FINAL_FILES}]  # what the model read last
    mcp_calls = sum(1 for name, _ in bh.agents_calls() if name != "count_words")
    assert _value(metrics, "aospec_requests_total") == mcp_calls
    assert _value(metrics, "aospec_speculations_hit_total", kind="action") >= 1  # served from forks
