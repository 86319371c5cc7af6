"""Faults of a live run change its speed, never its result: an endpoint that answers 500,
hangs past the actor's timeout or cuts its stream mid-way (real HTTP on loopback: small
ASGI apps in front of serve-trace), and drafters that raise or hang. The run either goes
on (retrying, or serially for that step) and commits exactly the serial run's trajectory,
or fails with one clear error and every committed step recorded.

Engine-level faults (a fork that crashes, sandbox backend errors) are tested in
tests/aospec and tests/live/test_faults*.py."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
from aospec.live.actors import OpenAIChatActor
from aospec.live.agent import OBSERVATION_FORMAT, Agent, Drafters, default_drafters
from aospec.live.chat import ChatFormat
from aospec.live.record import TraceRecorder
from aospec.live.serve_trace import serve_trace_app
from aospec.replay import read_jsonl
from aospec.runtime import open_sandbox
from aospec.runtime._fs import mounts_under
from aospec.runtime.host import host_support

from aospec.cli import main
from aospec.protocols import ActionDraft, ObservationDraft
from aospec.types import Action, History, Step, Trace

pytestmark = pytest.mark.root

TASK = "Make /work/notes.txt hold two lines, show it and submit."
REPLIES = [
    "THOUGHT: Look around first.\n\n```bash\nls /\n```",
    "THOUGHT: Write the first line.\n\n```bash\nmkdir -p /work && echo first > /work/notes.txt\n```",
    "THOUGHT: And the second.\n\n```bash\necho second >> /work/notes.txt\n```",
    "THOUGHT: Show it.\n\n```bash\ncat /work/notes.txt\n```",
    "THOUGHT: Done.\n\n```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```",
]


def demo_trace() -> Trace:
    fmt = ChatFormat()
    steps = tuple(Step(action=fmt.parse(r), observation="", output_tokens=len(r) // 4, reply=r) for r in REPLIES)
    return Trace("notes-demo", "notes", "mini-swe-agent", "demo-model", "tests/live", steps, instruction=TASK)


@pytest.fixture
def overlay_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    support, _ = host_support()
    if support.problems():
        pytest.skip(f"overlay backend cannot run here: {'; '.join(support.problems())}")
    state = tmp_path_factory.mktemp("fault-state")
    mp = pytest.MonkeyPatch()
    mp.setenv("AOSPEC_STATE_ROOT", str(state))
    yield state
    mp.undo()
    assert not mounts_under(str(state)), "mounts leaked"


# ----------------------------------------------------------------------------- a faulty endpoint


class FaultyEndpoint:
    """An ASGI app in front of ``inner`` (serve-trace) that breaks chat requests.

    ``fault``: ``500`` (an OpenAI-shaped server error), ``hang`` (never answers), ``cut``
    (starts a streamed reply and drops the connection mid-way). ``when``: ``first`` breaks
    the first attempt of every distinct request (a retry succeeds), ``from:K`` every request
    whose conversation already holds K replies (the run cannot get past step K).
    """

    def __init__(self, inner: Any, fault: str, when: str = "first") -> None:
        self.inner, self.fault, self.when = inner, fault, when
        self.attempts: Counter[str] = Counter()
        self.faults = 0

    def _breaks(self, body: bytes) -> bool:
        key = hashlib.sha256(body).hexdigest()
        self.attempts[key] += 1
        if self.when == "first":
            return self.attempts[key] == 1
        k = int(self.when.split(":")[1])
        return sum(m.get("role") == "assistant" for m in json.loads(body)["messages"]) >= k

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("/chat/completions"):
            await self.inner(scope, receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if self._breaks(body):
            self.faults += 1
            if self.fault == "500":
                payload = json.dumps({"error": {"message": "the model crashed", "type": "server_error"}}).encode()
                await send({"type": "http.response.start", "status": 500, "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": payload})
                return
            if self.fault == "hang":
                await anyio.sleep_forever()
            if self.fault == "cut":
                await send(
                    {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
                )
                chunk = {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "THOU"}}]}
                await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(), "more_body": True})
                raise RuntimeError("stream cut on purpose")  # uvicorn drops the connection mid-body
        sent = False

        async def replay_body() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.inner(scope, replay_body, send)


async def _run(
    base_url: str, *, speculate: bool, drafters: Drafters | None, record: Path, timeout_s: float = 30
) -> tuple[Any, OpenAIChatActor]:
    actor = OpenAIChatActor(base_url, "demo", timeout_s=timeout_s, retries=2, backoff_s=0.01)
    try:
        async with open_sandbox(backend="overlay", base="busybox", timeout_s=120, formatter=OBSERVATION_FORMAT) as sb:
            rec = TraceRecorder(record, task=TASK, actor_model="demo")
            agent = Agent(actor, sb, speculate=speculate, drafters=drafters, on_step=rec.add)
            result = await agent.run(TASK)
            rec.finish(result)
    finally:
        await actor.aclose()
    return result, actor


@pytest.fixture
def baseline(overlay_state, serve_traces, tmp_path) -> tuple[Any, Trace]:
    """The fault-free serial run and its recording."""
    server = serve_traces([demo_trace()], tpot_ms=1.0)
    result, _ = anyio.run(lambda: _run(server.base_url, speculate=False, drafters=None, record=tmp_path / "base.jsonl"))
    (trace,) = read_jsonl(tmp_path / "base.jsonl")
    assert result.exit_reason == "submitted"
    return result, trace


@pytest.mark.parametrize("fault", ["500", "hang", "cut"])
def test_transient_endpoint_faults_change_speed_not_results(baseline, serve_app, fault: str, tmp_path) -> None:
    base, base_trace = baseline
    app = FaultyEndpoint(serve_trace_app([demo_trace()], 1.0), fault, "first")
    server = serve_app(app)
    rec = tmp_path / "faulty.jsonl"
    drafters = default_drafters([base_trace])
    result, actor = anyio.run(
        lambda: _run(server.base_url, speculate=True, drafters=drafters, record=rec, timeout_s=0.5 if fault == "hang" else 30)
    )
    assert app.faults >= len(REPLIES) and actor.stats.retries >= len(REPLIES)
    assert result.history == base.history
    assert result.final_version == base.final_version
    (trace,) = read_jsonl(rec)
    assert [(s.action, s.observation, s.version_after) for s in trace.steps] == [
        (s.action, s.observation, s.version_after) for s in base_trace.steps
    ]


def test_a_persistent_endpoint_fault_fails_the_run_with_every_committed_step_recorded(
    overlay_state, baseline, serve_app, capsys, tmp_path
) -> None:
    _, base_trace = baseline
    server = serve_app(FaultyEndpoint(serve_trace_app([demo_trace()], 1.0), "500", "from:2"))
    rec = tmp_path / "r.jsonl"
    code = main(["run", TASK, "--model", server.base_url, "--retries", "1", "--record", str(rec), "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert err.startswith("aospec: error: ") and "HTTP 500" in err and "the model crashed" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    (trace,) = read_jsonl(rec)
    assert [(s.action, s.observation, s.version_after) for s in trace.steps] == [
        (s.action, s.observation, s.version_after) for s in base_trace.steps[:2]
    ]
    assert trace.meta["exit_reason"] == "error" and "HTTP 500" in trace.meta["error"]


class _Raising:
    def __init__(self) -> None:
        self.calls = 0

    async def draft(self, history: History, action: Action, n: int) -> Sequence[ObservationDraft]:
        self.calls += 1
        raise RuntimeError("observation drafter bug")

    async def propose(self, history: History, width: int, depth: int) -> Sequence[ActionDraft]:
        self.calls += 1
        raise ZeroDivisionError("action drafter bug")


class _Hanging:
    def __init__(self) -> None:
        self.calls = 0

    async def draft(self, history: History, action: Action, n: int) -> Sequence[ObservationDraft]:
        self.calls += 1
        await anyio.sleep_forever()
        raise AssertionError

    async def propose(self, history: History, width: int, depth: int) -> Sequence[ActionDraft]:
        self.calls += 1
        await anyio.sleep_forever()
        raise AssertionError


@pytest.mark.parametrize("kind", ["raises", "hangs"])
def test_a_faulty_drafter_costs_only_speed(baseline, serve_traces, kind: str, tmp_path) -> None:
    base, base_trace = baseline
    server = serve_traces([demo_trace()], tpot_ms=2.0)
    bad = _Raising() if kind == "raises" else _Hanging()
    good = default_drafters([base_trace])
    # The faulty drafter next to the working ones: their candidates still count.
    drafters = Drafters((bad, *good.observation), (bad, *good.action), good.evd, good.config)
    rec = tmp_path / f"{kind}.jsonl"
    result, _ = anyio.run(lambda: _run(server.base_url, speculate=True, drafters=drafters, record=rec))
    assert bad.calls > 0
    assert result.history == base.history and result.final_version == base.final_version
    if kind == "raises":
        assert result.statistics.speculative_failures >= bad.calls
    assert len(read_jsonl(rec)[0].steps) == len(REPLIES)
