"""``aospec proxy`` on the Responses API (``POST /v1/responses``): the official ``openai``
SDK's ``client.responses.create`` as the client, ``aospec serve-trace`` serving the trace's
replies as Responses output items as the upstream (real HTTP on loopback, servers in
threads).

The harness loop appends each reply's output items to ``input`` and answers a
``function_call`` with a ``function_call_output`` item holding the recorded observation
(a text reply with a user message), as SDK users and Codex do.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from typing import Any

import openai
import pytest
from aospec.integrations._proxy_actions import ResponsesActionWatcher
from aospec.integrations.proxy import proxy_app, response_output, speculable_response
from aospec.live.serve_trace import TraceServer, serve_trace_app, serving
from aospec.replay import bundled_traces_path, load_traces

from aospec.protocols import ObservationDraft
from aospec.types import Action, History, Trace, canonical_json

TOOLS = [{"type": "function", "name": "bash", "parameters": {"type": "object"}}]


@pytest.fixture(scope="module")
def traces() -> list[Trace]:
    return load_traces(bundled_traces_path())


@pytest.fixture
def servers() -> Iterator[Callable[[Any], TraceServer]]:
    with ExitStack() as stack:
        yield lambda app: stack.enter_context(serving(app))


class Recorder:
    """An ASGI wrapper that keeps every request's path and body bytes as they arrived."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.state = app.state
        self.requests: list[tuple[str, bytes]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body, more = b"", True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        self.requests.append((scope["path"], body))
        replayed = False

        async def again() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, again, send)


class TruthDrafter:
    """Drafts the recorded observation of the step, and a wrong one first."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace

    async def draft(self, history: History, action: Action, n: int) -> Sequence[ObservationDraft]:
        i = len(history)
        if i >= len(self.trace.steps):
            return []
        return [ObservationDraft("wrong guess", 0.9), ObservationDraft(self.trace.steps[i].observation, 0.8)][:n]


def run_harness(
    base_url: str, trace: Trace, *, tools: bool, stream: bool, steps: int, extra: dict[str, Any] | None = None
) -> list[Any]:
    """Drive ``steps`` turns with ``client.responses.create``; returns what the harness saw
    per reply (every streamed event, or the whole response)."""
    client = openai.OpenAI(base_url=base_url, api_key="sk-test", max_retries=0)
    items: list[Any] = [{"role": "user", "content": trace.instruction or trace.task}]
    kw: dict[str, Any] = {"model": "m", "instructions": "You are a shell agent.", "temperature": 0, "store": False}
    kw.update(extra or {})
    if tools:
        kw["tools"] = TOOLS
    seen = []
    for i in range(steps):
        if stream:
            events = list(client.responses.create(input=items, stream=True, **kw))
            seen.append([e.model_dump() for e in events])
            output = next(e.response.output for e in events if e.type == "response.completed")
        else:
            r = client.responses.create(input=items, **kw)
            seen.append(r.model_dump())
            output = r.output
        items += output
        obs = trace.steps[i].observation
        calls = [o for o in output if o.type == "function_call"]
        if calls:
            items.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": obs})
        else:
            items.append({"role": "user", "content": obs})
    return seen


@pytest.mark.parametrize(("tools", "stream"), [(True, True), (False, True), (True, False), (False, False)])
def test_replies_identical_and_speculation_hits(servers, traces, tools, stream) -> None:
    trace = traces[1]  # grid-pattern-transform: 13 steps
    steps = 7
    direct_up = Recorder(serve_trace_app([trace], 1.0))
    up = servers(direct_up)
    direct = run_harness(up.base_url, trace, tools=tools, stream=stream, steps=steps)
    proxied_up = Recorder(serve_trace_app([trace], 1.0))
    up2 = servers(proxied_up)
    proxy = proxy_app(up2.base_url, drafters=[TruthDrafter(trace)], max_speculative=2)
    px = servers(proxy)
    assert run_harness(px.base_url, trace, tools=tools, stream=stream, steps=steps) == direct
    s = proxy.stats
    assert s.learned and s.speculable == steps
    # requests 0 and 1 go upstream as sent (nothing learned before request 1); from then
    # on each is answered from a speculative request, a tool call's output drafted
    assert s.hits == steps - 2, s
    assert s.speculated >= 2 * (steps - 2)
    # every request the harness sent reached the upstream: its own bytes for the first two,
    # then a speculative request with an equal body
    sent = [b for _, b in direct_up.requests]
    upstream = [b for _, b in proxied_up.requests]
    assert upstream[:2] == sent[:2]
    canon = {canonical_json(json.loads(b)) for b in upstream}
    assert all(canonical_json(json.loads(b)) in canon for b in sent)
    assert {p for p, _ in proxied_up.requests} == {"/v1/responses"}


@pytest.mark.parametrize(
    "extra",
    [{"temperature": 0.7}, {"store": True}, {"extra_body": {"previous_response_id": None, "mystery": 1}}],
    ids=["temperature", "store", "unknown-field"],
)
def test_non_deterministic_passes_through_byte_for_byte(servers, traces, extra) -> None:
    """Sampling, a stored response or an unknown field: nothing is speculated and the
    upstream receives exactly the harness's bytes, the harness exactly the upstream's."""
    trace = traces[1]
    direct_up = Recorder(serve_trace_app([trace], 0.0))
    direct = run_harness(servers(direct_up).base_url, trace, tools=True, stream=True, steps=4, extra=extra)
    proxied_up = Recorder(serve_trace_app([trace], 0.0))
    proxy = proxy_app(servers(proxied_up).base_url, drafters=[TruthDrafter(trace)])
    px = servers(proxy)
    assert run_harness(px.base_url, trace, tools=True, stream=True, steps=4, extra=extra) == direct
    assert proxied_up.requests == direct_up.requests
    assert proxy.stats.speculable == 0 and proxy.stats.speculated == 0 and proxy.stats.passthrough == 4


def test_raw_bytes_pass_through(servers, traces) -> None:
    import httpx

    trace = traces[0]
    up = servers(serve_trace_app([trace], 0.0))
    px = servers(proxy_app(up.base_url))
    for body in (
        {"model": "m", "input": trace.instruction, "stream": True},
        {"model": "m", "input": [{"role": "user", "content": trace.instruction}], "tools": TOOLS},
        {"model": "m", "input": 7},  # serve-trace's 400, unchanged
    ):
        a = httpx.post(f"{up.base_url}/responses", json=body)
        b = httpx.post(f"{px.base_url}/responses", json=body)
        assert (a.status_code, a.content, a.headers["content-type"]) == (
            b.status_code,
            b.content,
            b.headers["content-type"],
        )


def test_speculable_rules() -> None:
    base = {"model": "m", "input": [{"role": "user", "content": "x"}], "store": False}
    assert speculable_response({**base, "temperature": 0})
    assert speculable_response({**base, "temperature": 1, "seed": 3})
    assert not speculable_response({**base, "temperature": 1})
    assert not speculable_response({k: v for k, v in base.items() if k != "store"} | {"temperature": 0})
    assert not speculable_response({**base, "temperature": 0, "input": "x"})  # a string input
    assert not speculable_response({**base, "temperature": 0, "previous_response_id": "resp_1"})


def test_reply_and_actions_of_a_stream(servers, traces) -> None:
    """The output items of a streamed reply, and the action a watcher finds in it as soon
    as its function_call item is done."""
    import httpx

    trace = traces[1]
    up = servers(serve_trace_app([trace], 0.0))
    body = {"model": "m", "input": [{"role": "user", "content": trace.instruction}], "tools": TOOLS, "stream": True}
    raw = httpx.post(f"{up.base_url}/responses", json=body).content
    output = response_output(raw, stream=True)
    assert output is not None and [i["type"] for i in output][-1] == "function_call"
    assert json.loads(output[-1]["arguments"]) == dict(trace.steps[0].action.args)
    seen: list[tuple[str, dict[str, Any]]] = []
    w = ResponsesActionWatcher(True, (), lambda tool, args: seen.append((tool, args)))
    events = raw.split(b"\n\n")
    done_at = next(i for i, e in enumerate(events) if b'"response.output_item.done"' in e and b"function_call" in e)
    for e in events[: done_at + 1]:
        w.feed(e + b"\n\n")
    assert seen == [("bash", dict(trace.steps[0].action.args))]  # before response.completed
    assert response_output(raw[: raw.rfind(b"event: response.completed")], stream=True) is None
