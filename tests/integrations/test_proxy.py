"""``aospec proxy`` (integrations/proxy.py) with the official ``openai`` SDK as the client
and ``aospec serve-trace`` as the upstream (real HTTP on loopback, servers in threads).

The harness loop here behaves like mini-swe-agent: it sends the growing messages list,
appends the reply, "runs" the command (the observation is the recorded one of that step,
a pure function of the step) and appends the observation, either as a ``tool`` message
answering the tool call or as a ``user`` message wrapped in a template.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from typing import Any

import httpx
import openai
import pytest
from aospec.integrations.proxy import SpeculatingProxy, proxy_app, speculable
from aospec.live.serve_trace import TraceServer, serve_trace_app, serving
from aospec.replay import bundled_traces_path, load_traces
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from aospec.protocols import ObservationDraft
from aospec.types import Action, History, Trace

#: The text harness's observation template. The bundled traces are mini-swe-agent's, whose
#: recorded observations already hold its ``<returncode>``/``<output>`` template, so
#: verbatim by default; ``test_learns_a_wrapper`` uses another one.
WRAP = "{obs}"


@pytest.fixture(scope="module")
def traces() -> list[Trace]:
    return load_traces(bundled_traces_path())


@pytest.fixture
def servers() -> Iterator[Callable[[Any], TraceServer]]:
    with ExitStack() as stack:
        yield lambda app: stack.enter_context(serving(app))


class TruthDrafter:
    """Drafts the recorded observation of the step (a stand-in for a perfect drafter), and
    a wrong one, so one speculation hits and one is cancelled."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace

    async def draft(self, history: History, action: Action, n: int) -> Sequence[ObservationDraft]:
        i = len(history)
        if i >= len(self.trace.steps):
            return []
        return [ObservationDraft("wrong guess", 0.9), ObservationDraft(self.trace.steps[i].observation, 0.8)][:n]


def run_harness(
    base_url: str,
    trace: Trace,
    *,
    tools: bool,
    stream: bool,
    steps: int,
    extra: dict[str, Any] | None = None,
    wrap: str = WRAP,
) -> list[Any]:
    """Drive ``steps`` turns with the openai SDK; returns what the harness saw per reply."""
    client = openai.OpenAI(base_url=base_url, api_key="sk-test", max_retries=0)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a shell agent."},
        {"role": "user", "content": trace.instruction or trace.task},
    ]
    kw: dict[str, Any] = {"model": "m", "temperature": 0, **(extra or {})}
    if tools:
        kw["tools"] = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    seen = []
    for i in range(steps):
        if stream:
            text, calls, usage = "", {}, None
            for chunk in client.chat.completions.create(
                messages=messages, stream=True, stream_options={"include_usage": True}, **kw
            ):
                usage = chunk.usage.model_dump() if chunk.usage else usage
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
            seen.append((text, tool_calls, usage))
        else:
            r = client.chat.completions.create(messages=messages, **kw)
            msg = r.choices[0].message
            text = msg.content or ""
            tool_calls = [tc.model_dump() for tc in msg.tool_calls or ()]
            seen.append((r.id, text, tool_calls, r.usage.model_dump(), r.choices[0].finish_reason))
        obs = trace.steps[i].observation
        if tool_calls:
            messages.append({"role": "assistant", "content": text, "tool_calls": tool_calls})
            messages.append({"role": "tool", "tool_call_id": tool_calls[0]["id"], "content": obs})
        else:
            messages.append({"role": "assistant", "content": text})
            messages.append({"role": "user", "content": wrap.replace("{obs}", obs)})
    return seen


def _wait_idle(proxy: SpeculatingProxy, upstream: TraceServer, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and upstream.stats.active:
        time.sleep(0.01)


@pytest.mark.parametrize(("tools", "stream"), [(True, True), (False, True), (True, False), (False, False)])
def test_replies_identical_and_speculation_hits(servers, traces, tools, stream) -> None:
    trace = traces[1]  # grid-pattern-transform: 13 steps
    steps = 8
    up = servers(serve_trace_app([trace], 1.0))
    direct = run_harness(up.base_url, trace, tools=tools, stream=stream, steps=steps)
    proxy = proxy_app(up.base_url, drafters=[TruthDrafter(trace)], max_speculative=2)
    px = servers(proxy)
    via = run_harness(px.base_url, trace, tools=tools, stream=stream, steps=steps)
    assert via == direct
    s = proxy.stats
    assert s.learned
    # step 0 and 1 go upstream (nothing learned before request 1); from then on every
    # request is answered from a speculative request, and the wrong draft is closed
    assert s.hits == steps - 2, s
    assert s.speculated >= 2 * (steps - 2)
    assert s.cancelled + s.wasted >= steps - 2
    stats = httpx.get(f"{px.url}/aospec/stats").json()
    assert stats["hits"] == s.hits


def test_the_hosts_speculation_budget_holds_back_speculative_requests(servers, traces, tmp_path) -> None:
    """``--speculation-budget``: each speculative upstream request holds a slot of the host's
    budget while in flight. With the only slot held by another session of the host nothing
    is speculated (and the harness sees the same replies); once it is free, speculation
    resumes, and every slot is given back when the requests end."""
    from aospec.host import SpeculationBudget

    trace = traces[1]
    steps = 6
    up = servers(serve_trace_app([trace], 1.0))
    direct = run_harness(up.base_url, trace, tools=True, stream=True, steps=steps)
    budget = SpeculationBudget(1, directory=tmp_path, host_cores=8)
    other = SpeculationBudget(1, directory=tmp_path, host_cores=8).try_acquire()  # another session's guess
    assert other is not None
    proxy = proxy_app(up.base_url, drafters=[TruthDrafter(trace)], max_speculative=2, budget=budget)
    px = servers(proxy)
    assert run_harness(px.base_url, trace, tools=True, stream=True, steps=steps) == direct
    assert proxy.stats.speculated == 0 and proxy.stats.hits == 0
    assert proxy.stats.budget_refused >= steps - 2
    other.release()
    proxy2 = proxy_app(up.base_url, drafters=[TruthDrafter(trace)], max_speculative=2, budget=budget)
    px2 = servers(proxy2)
    assert run_harness(px2.base_url, trace, tools=True, stream=True, steps=steps) == direct
    # one slot: one speculative request in flight at a time, the right draft second
    assert proxy2.stats.speculated > 0 and proxy2.stats.budget_refused > 0
    _wait_idle(proxy2, up)
    deadline = time.monotonic() + 30
    while (lease := budget.try_acquire()) is None and time.monotonic() < deadline:
        time.sleep(0.05)  # the last speculative request's task gives its slot back as it ends
    assert lease is not None, "a slot of the budget was never given back"
    lease.release()


def test_default_drafters_stay_lossless(servers, traces) -> None:
    """The real drafters (patterns + cache, fit on the other traces): whatever they hit,
    the harness sees exactly what it sees without the proxy."""
    from aospec.integrations.proxy import default_drafters

    trace = traces[9]  # train-fasttext: repeated actions
    up = servers(serve_trace_app([trace], 0.0))
    direct = run_harness(up.base_url, trace, tools=True, stream=True, steps=20)
    proxy = proxy_app(up.base_url, drafters=default_drafters([t for t in traces if t is not trace]))
    px = servers(proxy)
    assert run_harness(px.base_url, trace, tools=True, stream=True, steps=20) == direct
    assert proxy.stats.speculated > 0
    assert proxy.stats.hits + proxy.stats.misses == proxy.stats.speculable


def test_raw_bytes_and_headers_pass_through(servers, traces) -> None:
    trace = traces[0]
    up = servers(serve_trace_app([trace], 0.0))
    px = servers(proxy_app(up.base_url))
    body = {"model": "m", "messages": [{"role": "user", "content": trace.instruction}], "stream": True}
    a = httpx.post(f"{up.base_url}/chat/completions", json=body)
    b = httpx.post(f"{px.base_url}/chat/completions", json=body)
    assert (a.status_code, a.content, a.headers["content-type"]) == (
        b.status_code,
        b.content,
        b.headers["content-type"],
    )
    assert httpx.get(f"{px.base_url}/models").content == httpx.get(f"{up.base_url}/models").content
    # errors come back unchanged: an unknown route, a bad body, an exhausted trace
    for path, payload in [("/nope", {}), ("/chat/completions", {"x": 1})]:
        a = httpx.post(up.base_url + path, json=payload)
        b = httpx.post(px.base_url + path, json=payload)
        assert (a.status_code, a.content) == (b.status_code, b.content)


@pytest.mark.parametrize(
    "extra",
    [{"temperature": 0.7}, {"n": 2}, {"extra_body": {"mystery_field": 1}}],
    ids=["temperature", "n", "unknown-field"],
)
def test_pass_through_when_not_lossless(servers, traces, extra) -> None:
    trace = traces[1]
    up = servers(serve_trace_app([trace], 0.0))
    proxy = proxy_app(up.base_url, drafters=[TruthDrafter(trace)])
    px = servers(proxy)
    seen = run_harness(px.base_url, trace, tools=True, stream=False, steps=4, extra=extra)  # overrides temperature 0
    assert len(seen) == 4
    assert proxy.stats.speculable == 0 and proxy.stats.speculated == 0 and proxy.stats.passthrough == 4


def test_speculable_rules() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert speculable({**base, "temperature": 0})
    assert speculable({**base, "temperature": 0.0, "n": 1})
    assert speculable({**base, "temperature": 1, "seed": 7})
    assert not speculable(base)  # default temperature is 1
    assert not speculable({**base, "temperature": 0, "n": 2})
    assert not speculable({**base, "temperature": 0, "foo": 1})
    assert not speculable({**base, "temperature": 0, "seed": True} | {"temperature": 0.5})


def test_upstream_500_and_unreachable(servers) -> None:
    async def boom(request: Any) -> Any:
        return JSONResponse({"error": {"message": "kaput", "type": "server_error"}}, status_code=500,
                            headers={"x-request-id": "req-1"})  # fmt: skip

    up = servers(Starlette(routes=[Route("/v1/chat/completions", boom, methods=["POST"])]))
    px = servers(proxy_app(up.base_url))
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 0}
    a = httpx.post(f"{up.base_url}/chat/completions", json=body)
    b = httpx.post(f"{px.base_url}/chat/completions", json=body)
    assert (b.status_code, b.content, b.headers["x-request-id"]) == (500, a.content, "req-1")
    client = openai.OpenAI(base_url=px.base_url, api_key="k", max_retries=0)
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(model="m", messages=body["messages"], temperature=0)
    assert "kaput" in str(err.value)

    dead = servers(proxy_app("http://127.0.0.1:9/v1"))
    r = httpx.post(f"{dead.base_url}/chat/completions", json=body)
    assert r.status_code == 502 and "127.0.0.1:9" in r.json()["error"]["message"]


def test_client_disconnect_cancels_upstream(servers, traces) -> None:
    trace = traces[0]
    up = servers(serve_trace_app([trace], 50.0))  # a reply takes seconds
    px = servers(proxy_app(up.base_url))
    body = {"model": "m", "messages": [{"role": "user", "content": trace.instruction}], "stream": True}
    with httpx.stream("POST", f"{px.base_url}/chat/completions", json=body) as r:
        for _ in r.iter_bytes():
            break  # the first chunk, then hang up
    deadline = time.monotonic() + 10
    while up.stats.disconnected == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert up.stats.disconnected == 1 and up.stats.completed == 0
    assert [o for *_, o in up.stats.log] == ["disconnected"]


def test_answered_mid_stream(servers, traces) -> None:
    """A slow upstream: the real request arrives while its speculative twin is still
    streaming; it gets what was received at once and the rest live, byte for byte."""
    trace = traces[1]
    up = servers(serve_trace_app([trace], 5.0))
    direct = run_harness(up.base_url, trace, tools=True, stream=True, steps=4)
    proxy = proxy_app(up.base_url, drafters=[TruthDrafter(trace)])
    px = servers(proxy)
    assert run_harness(px.base_url, trace, tools=True, stream=True, steps=4) == direct
    assert proxy.stats.hits == 2 and proxy.stats.midstream_hits >= 1
    _wait_idle(proxy, up)
    assert json.loads(httpx.get(f"{px.url}/aospec/stats").content)["hits"] == 2


def test_learns_a_wrapper(servers, traces) -> None:
    """A text harness that wraps the tool output in its own template, and a drafter that
    drafts raw output: the proxy learns the template from two observations and wraps."""
    import re
    from dataclasses import replace

    recorded = traces[1]
    # the raw tool output: the recorded observation without mini-swe-agent's template
    raw = [re.sub(r"(?s)^<returncode>\d+</returncode>\n<output>\n(.*)</output>$", r"\1", s.observation)
           for s in recorded.steps]  # fmt: skip
    trace = replace(recorded, steps=tuple(replace(s, observation=o) for s, o in zip(recorded.steps, raw, strict=True)))
    wrap = "Observation:\n{obs}\n[end of output]"
    up = servers(serve_trace_app([trace], 0.0))
    direct = run_harness(up.base_url, trace, tools=False, stream=True, steps=7, wrap=wrap)
    proxy = proxy_app(up.base_url, drafters=[TruthDrafter(trace)], max_speculative=4)
    px = servers(proxy)
    assert run_harness(px.base_url, trace, tools=False, stream=True, steps=7, wrap=wrap) == direct
    assert proxy.stats.hits == 7 - 3, proxy.stats  # from the request after two observations


def test_learns_how_the_reply_is_appended() -> None:
    from aospec.integrations.proxy import apply_shape, learn_shape, reply_message

    reply = {"role": "assistant", "content": None, "refusal": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]}  # fmt: skip
    appended = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": {"name": "bash", "arguments": "{}"}}]}  # fmt: skip
    shape = learn_shape(reply, appended)
    assert apply_shape(shape, reply) == appended
    nxt = {**reply, "tool_calls": [{"id": "c2", "type": "function", "function": {"name": "bash", "arguments": "{\"a\":1}"}}]}  # fmt: skip
    assert apply_shape(shape, nxt)["tool_calls"] == [{"id": "c2", "function": {"name": "bash", "arguments": "{\"a\":1}"}}]  # fmt: skip
    sse = (
        b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":"Hi "}}]}\n\n'
        b'data: {"choices":[{"index":0,"delta":{"content":"there"}}]}\n\n'
        b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"x","type":"function",'
        b'"function":{"name":"bash","arguments":"{\\"command\\":"}}]}}]}\n\n'
        b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\\"ls\\"}"}}]}}]}\n\n'
        b"data: [DONE]\n\n"
    )
    assert reply_message(sse, True) == {
        "role": "assistant",
        "content": "Hi there",
        "tool_calls": [{"id": "x", "type": "function", "function": {"name": "bash", "arguments": '{"command":"ls"}'}}],
    }
    assert reply_message(sse.replace(b"data: [DONE]\n\n", b""), True) is None  # cut short: not a reply


def test_request_headers_must_match(servers, traces) -> None:
    """A request whose headers differ from its speculative twin's (another API key) is
    not answered from it."""
    trace = traces[1]
    up = servers(serve_trace_app([trace], 0.0))
    proxy = proxy_app(up.base_url, drafters=[TruthDrafter(trace)])
    px = servers(proxy)
    run_harness(px.base_url, trace, tools=True, stream=False, steps=3)
    hits = proxy.stats.hits
    assert hits == 1
    # the same conversation from another key: the speculated next step is not used
    client = openai.OpenAI(base_url=px.base_url, api_key="sk-other", max_retries=0)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a shell agent."},
        {"role": "user", "content": trace.instruction or trace.task},
    ]
    client.chat.completions.create(model="m", messages=messages, temperature=0)
    assert proxy.stats.hits == hits


def test_compressing_upstream(servers) -> None:
    """An upstream that gzips what it can: chat replies are asked for uncompressed (the
    proxy reads them), other routes pass through compressed as the client accepts."""
    from starlette.middleware import Middleware
    from starlette.middleware.gzip import GZipMiddleware

    reply = {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
             "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi " * 400}, "finish_reason": "stop"}],
             "usage": {"prompt_tokens": 1, "completion_tokens": 400, "total_tokens": 401}}  # fmt: skip

    async def chat(request: Any) -> Any:
        return JSONResponse(reply)

    async def models(request: Any) -> Any:
        return JSONResponse({"object": "list", "data": [{"id": "m" * 2000}]})

    app = Starlette(
        routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/models", models)],
        middleware=[Middleware(GZipMiddleware, minimum_size=10)],
    )
    up = servers(app)
    px = servers(proxy_app(up.base_url))
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 0}
    r = httpx.post(f"{px.base_url}/chat/completions", json=body)
    assert r.json() == reply and "content-encoding" not in r.headers
    m = httpx.get(f"{px.base_url}/models")
    assert m.headers["content-encoding"] == "gzip" and m.json()["data"][0]["id"] == "m" * 2000
    client = openai.OpenAI(base_url=px.base_url, api_key="k", max_retries=0)
    assert client.chat.completions.create(model="m", messages=body["messages"], temperature=0).usage.total_tokens == 401


def test_local_tiny_model_upstream(servers) -> None:
    """A real generating upstream: the project's tiny model (random weights, greedy) behind
    a minimal OpenAI-compatible endpoint. Its replies hold no bash block, so the harness
    answers each with its format-error message, which the proxy drafts from the last one:
    the same replies with and without the proxy, and hits from the third request on."""
    pytest.importorskip("torch")
    import anyio
    from aospec.live.local import TransformersActor

    texts = ["```bash\nls -la\n```", "THOUGHT: list the files", "<returncode>0</returncode>\n<output>\nf\n</output>"]
    actor = TransformersActor("tiny", texts=texts * 20, vocab_size=400, max_new_tokens=12)
    lock = anyio.Lock()

    async def chat(request: Any) -> Any:
        body = await request.json()
        async with lock:  # one decode at a time on the CPU
            r = await actor._generate(body["messages"])
        return JSONResponse(
            {
                "id": "local",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": r.text}, "finish_reason": r.finish_reason}
                ],
                "usage": {"prompt_tokens": 0, "completion_tokens": r.output_tokens, "total_tokens": r.output_tokens},
            }
        )

    up = servers(Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])]))

    def harness(base_url: str) -> list[Any]:
        client = openai.OpenAI(base_url=base_url, api_key="k", max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "list the files"}]
        seen = []
        for _ in range(5):
            r = client.chat.completions.create(model="tiny", messages=messages, temperature=0)
            text = r.choices[0].message.content or ""
            seen.append((text, r.usage.model_dump()))
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": "Please always provide EXACTLY ONE action in triple backticks."}]  # fmt: skip
        return seen

    direct = harness(up.base_url)
    proxy = proxy_app(up.base_url, drafters=[TruthDrafter(Trace("t", "t", "h", "m", "s", ()))])
    px = servers(proxy)
    assert harness(px.base_url) == direct
    assert proxy.stats.hits == 3, proxy.stats
