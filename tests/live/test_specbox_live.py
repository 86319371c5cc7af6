"""The SpecBox layer under live runs (live/specbox_layer.py, ``aospec run --cache/--pool-depth/
--router/--markov``): streaming decodes over real HTTP (serve-trace and small fault servers),
router events during a live run's decodes, the result cache on real overlay sandboxes (a hit
on a repeated read at the same version, none after a write), serial and SpecBox runs that
commit the same trajectory, and the CLI's figures and usage errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from aospec.live.actors import OpenAIChatActor
from aospec.live.agent import OBSERVATION_FORMAT, Agent, FormatErrorSandbox, default_drafters
from aospec.live.chat import ChatFormat
from aospec.live.record import TraceRecorder
from aospec.live.specbox_layer import TRAINED_MIN_PRIOR, SpecBoxOptions, build_router, deterministic_reads, open_specbox
from aospec.runtime import open_sandbox
from aospec.runtime._fs import mounts_under
from aospec.runtime.host import host_support
from aospec.runtime.lossless import snapshot_sandbox
from aospec.specbox.cache import CachedSandbox
from aospec.specbox.pool import PooledSandbox
from aospec.specbox.routers import ParseRouter, tool_label
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from aospec.cli import main
from aospec.protocols import CachingSandbox, PrioritizedSandbox, StreamingActor
from aospec.testing import InMemorySandbox
from aospec.types import Action, History, Step, Trace

TASK = "Count the lines of /work/data.txt before and after appending one, then submit."
REPLIES = [
    "THOUGHT: Make the data file.\n\n```bash\nmkdir -p /work && printf 'a\\nb\\n' > /work/data.txt\n```",
    "THOUGHT: How many lines are there?\n\n```bash\nwc -l /work/data.txt\n```",
    "THOUGHT: Let me read it to be sure.\n\n```bash\ncat /work/data.txt\n```",
    "THOUGHT: Count again, the same way.\n\n```bash\nwc -l /work/data.txt\n```",
    "THOUGHT: Append a line.\n\n```bash\necho c >> /work/data.txt\n```",
    "THOUGHT: Count once more.\n\n```bash\nwc -l /work/data.txt\n```",
    "THOUGHT: Done.\n\n```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```",
]


def demo_trace() -> Trace:
    fmt = ChatFormat()
    steps = tuple(Step(action=fmt.parse(r), observation="", output_tokens=len(r) // 4, reply=r) for r in REPLIES)
    return Trace("wc-demo", "wc", "mini-swe-agent", "demo-model", "tests/live", steps, instruction=TASK)


@pytest.fixture
def overlay_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    support, _ = host_support()
    if support.problems():
        pytest.skip(f"overlay backend cannot run here: {'; '.join(support.problems())}")
    state = tmp_path_factory.mktemp("specbox-state")
    mp = pytest.MonkeyPatch()
    mp.setenv("AOSPEC_STATE_ROOT", str(state))
    yield state
    mp.undo()
    assert not mounts_under(str(state)), "mounts leaked"


# ----------------------------------------------------------------------------- streaming decodes


def _chunk(delta: dict, finish: str | None = None) -> str:
    return "data: " + json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n"


def _stream(pieces: list[str], *, finish: bool = True) -> StreamingResponse:
    parts = [_chunk({"content": p}) for p in pieces]
    if finish:
        parts += [_chunk({}, "stop"), "data: [DONE]\n\n"]

    async def gen():
        for p in parts:
            yield p

    return StreamingResponse(gen(), media_type="text/event-stream")


def _app(handler) -> Starlette:
    return Starlette(routes=[Route("/v1/chat/completions", handler, methods=["POST"])])


@pytest.mark.anyio
async def test_a_streaming_decode_feeds_the_reply_as_it_arrives_and_a_memo_hit_at_once(serve_traces) -> None:
    server = serve_traces([demo_trace()], tpot_ms=1.0, chunk_ms=1.0)
    async with OpenAIChatActor(server.base_url, "demo", retries=0) as actor:
        assert isinstance(actor, StreamingActor)
        deltas: list[object] = []
        action = await actor.decode_streaming(History(TASK), deltas.append)
        assert action == Action.bash("mkdir -p /work && printf 'a\\nb\\n' > /work/data.txt")
        assert len(deltas) > 10 and all(isinstance(d, str) for d in deltas)  # token by token
        assert "".join(deltas) == REPLIES[0]  # every piece once, in order
        again: list[object] = []
        assert await actor.decode_streaming(History(TASK), again.append) == action  # from the memo
        assert again == [REPLIES[0]]  # the whole reply at once: a router still fires
        assert actor.stats.memo_hits == 1 and actor.stats.requests == 1
        session = ParseRouter().session()
        assert [e.tool for d in again for e in session.feed(d)] == ["mkdir"]


@pytest.mark.anyio
async def test_tool_call_deltas_arrive_as_chunks_a_router_reads(trace_server, bundled_traces) -> None:
    trace = bundled_traces[0]
    async with OpenAIChatActor(trace_server.base_url, "m", chat_format=ChatFormat(action_format="tools")) as actor:
        deltas: list[object] = []
        action = await actor.decode_streaming(trace.history(0), deltas.append)
    assert action == trace.steps[0].action
    chunks = [d for d in deltas if isinstance(d, dict)]
    assert chunks and all(set(c) == {"choices"} and "tool_calls" in c["choices"][0]["delta"] for c in chunks)
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"]["tool_calls"]]
    assert [tc["function"]["name"] for tc in calls if tc["function"].get("name")] == ["bash"]
    assert json.loads("".join(tc["function"].get("arguments") or "" for tc in calls)) == {"command": action.command}
    session = ParseRouter().session()
    assert [e.tool for d in chunks for e in session.feed(d)] == ["bash"]  # the function's name


@pytest.mark.anyio
async def test_a_retried_request_feeds_each_piece_once(serve_app) -> None:
    # The first attempt streams half the reply and is cut; the retry streams all of it, in
    # other chunks.
    # What on_delta sees is the reply once: the retry's repeat of the fed prefix is skipped.
    pieces = ["THOUGHT: look\n\n", "```bash\nls", " -la /work\n", "```"]
    calls = 0

    async def handler(request: Request) -> StreamingResponse:
        nonlocal calls
        calls += 1
        return (
            _stream(pieces[:2], finish=False)
            if calls == 1
            else _stream(["THOUGHT: lo", "ok\n\n```ba", "sh\nls", *pieces[2:]])
        )

    server = serve_app(_app(handler))
    async with OpenAIChatActor(server.base_url, "m", backoff_s=0) as actor:
        deltas: list[object] = []
        action = await actor.decode_streaming(History("t"), deltas.append)
    assert action == Action.bash("ls -la /work") and actor.stats.retries == 1
    assert "".join(deltas) == "".join(pieces)
    assert deltas[:2] == pieces[:2]  # the first attempt, as it streamed
    session = ParseRouter().session()
    assert [e.tool for d in deltas for e in session.feed(d)] == ["ls"]  # fired once


@pytest.mark.anyio
async def test_a_retry_that_streams_another_reply_stops_the_feed(serve_app) -> None:
    # Not deterministic: the retried attempt differs from what was already fed. The router
    # keeps what it read (a bet) and reads nothing of the other reply.
    calls = 0

    async def handler(request: Request) -> StreamingResponse:
        nonlocal calls
        calls += 1
        if calls == 1:
            return _stream(["THOUGHT: A\n\n", "```bash\ncat x"], finish=False)
        return _stream(["THOUGHT: B\n\n", "```bash\nls\n```"])

    server = serve_app(_app(handler))
    async with OpenAIChatActor(server.base_url, "m", backoff_s=0) as actor:
        deltas: list[object] = []
        assert await actor.decode_streaming(History("t"), deltas.append) == Action.bash("ls")
    assert deltas == ["THOUGHT: A\n\n", "```bash\ncat x"]


# ----------------------------------------------------------------------------- the agent's sandbox wrapper


@pytest.mark.anyio
async def test_format_error_sandbox_forwards_only_the_capabilities_its_inner_has() -> None:
    plain = FormatErrorSandbox(InMemorySandbox(), "no")
    assert isinstance(plain, PrioritizedSandbox) and not isinstance(plain, CachingSandbox)
    assert not hasattr(plain, "last_cache_hit_ns") and not hasattr(plain, "cache_counts")
    async with PooledSandbox.open(InMemorySandbox(), depth=1) as pooled:
        assert not isinstance(FormatErrorSandbox(pooled, "no"), PrioritizedSandbox)  # the pool has none
        cached = FormatErrorSandbox(CachedSandbox(pooled, deterministic=deterministic_reads()), "no")
        assert isinstance(cached, CachingSandbox) and not isinstance(cached, PrioritizedSandbox)
        await cached.execute(Action.bash("ls /"))
        await cached.execute(Action.bash("ls /"))
        assert cached.last_cache_hit_ns is not None  # served by the cache
        assert await cached.execute(Action.none()) == "no"
        assert cached.last_cache_hit_ns is None  # answered here: neither run nor served
        fork = await cached.fork()
        assert isinstance(fork, FormatErrorSandbox) and isinstance(fork, CachingSandbox)
        assert isinstance(fork, PrioritizedSandbox)  # the pool's forks are InMemorySandbox forks
        assert cached.cache_counts()["hits"] == 1
        await fork.discard()


# ----------------------------------------------------------------------------- live runs


async def _run(
    base_url: str, *, speculate: bool, options: SpecBoxOptions, train: list[Trace], record: Path | None = None
) -> tuple:
    """One live run on a fresh overlay sandbox under ``options``: (result, files, layer
    summary, route events with the number of replies finished when each fired, actor)."""
    async with (
        OpenAIChatActor(base_url, "demo", retries=0) as actor,
        open_sandbox(backend="overlay", base="busybox", timeout_s=120, formatter=OBSERVATION_FORMAT) as sb,
        open_specbox(sb, options, train) as box,
    ):
        events: list[tuple[str, int]] = []
        rec = TraceRecorder(record, task=TASK, actor_model="demo") if record is not None else None

        def on_step(step, stats) -> None:
            box.observe(step.action)
            if rec is not None:
                rec.add(step, stats)

        drafters = box.with_drafters(default_drafters(train)) if speculate else None
        agent = Agent(
            actor,
            box.sandbox,
            speculate=speculate,
            drafters=drafters,
            on_step=on_step,
            router=box.router,
            route_listeners=[lambda e: events.append((e.tool, actor.stats.replies))],
        )
        result = await agent.run(TASK)
        if rec is not None:
            rec.finish(result)
        files = await snapshot_sandbox(sb)
        summary = box.summary()
        markov = box.markov
    return result, files, summary, events, markov


@pytest.mark.root
@pytest.mark.anyio
async def test_router_events_fire_during_the_decodes_of_a_live_run(overlay_state, serve_traces) -> None:
    server = serve_traces([demo_trace()], tpot_ms=1.0, chunk_ms=1.0)
    result, _, _, events, _ = await _run(
        server.base_url, speculate=False, options=SpecBoxOptions(router="parse"), train=[]
    )
    assert result.exit_reason == "submitted" and len(result.steps) == len(REPLIES)
    # Serial decodes run one after another: an event of step i that fires while step i
    # still decodes sees i replies finished (i + 1 once the decode is over).
    assert events == [(tool_label(s.action), i) for i, s in enumerate(result.steps)]
    assert result.summary()["routes_fired"] == len(REPLIES)


@pytest.mark.root
@pytest.mark.anyio
async def test_a_repeated_read_hits_the_cache_at_the_same_version_and_not_after_a_write(
    overlay_state, serve_traces
) -> None:
    server = serve_traces([demo_trace()], tpot_ms=0.0)
    plain, plain_files, _, _, _ = await _run(server.base_url, speculate=False, options=SpecBoxOptions(), train=[])
    cached, cached_files, _, _, _ = await _run(
        server.base_url, speculate=False, options=SpecBoxOptions(cache="reads"), train=[]
    )
    assert cached.history == plain.history and cached_files == plain_files
    assert cached.final_version == plain.final_version
    wc = [i for i, s in enumerate(cached.steps) if s.action == Action.bash("wc -l /work/data.txt")]
    assert wc == [1, 3, 5]
    assert cached.steps[1].version_after == cached.steps[3].version_before  # a read in between: same version
    assert cached.steps[3].version_before != cached.steps[5].version_before  # the append: a new version
    s = cached.summary()
    assert s["cache_hits"] == 1 and s["cache_saved_s"] > 0  # step 3 only: step 5 ran after the write
    assert s["cache"]["hits"] == 1 and s["cache"]["stale_avoided"] == 1  # step 5's lookup: cached elsewhere
    assert s["cache"]["misses"] == 3  # steps 1, 2 (cat), 5
    assert s["cache"]["bypasses"] == 3  # mkdir/printf, echo >>, echo (submit): not reads
    assert "<output>\n2 /work/data.txt\n</output>" in cached.history.turns[3].observation
    assert "<output>\n3 /work/data.txt\n</output>" in cached.history.turns[5].observation
    assert plain.summary()["cache"] is None and plain.summary()["cache_hits"] == 0


@pytest.mark.root
@pytest.mark.anyio
async def test_a_serial_run_and_a_specbox_speculative_run_commit_the_same(
    overlay_state, serve_traces, tmp_path
) -> None:
    from aospec.replay import read_jsonl

    server = serve_traces([demo_trace()], tpot_ms=2.0)
    serial, serial_files, _, _, _ = await _run(
        server.base_url, speculate=False, options=SpecBoxOptions(), train=[], record=tmp_path / "serial.jsonl"
    )
    train = read_jsonl(tmp_path / "serial.jsonl")
    options = SpecBoxOptions(cache="reads", pool_depth=2, router="parse", markov=True)
    spec, spec_files, summary, events, markov = await _run(
        server.base_url, speculate=True, options=options, train=train
    )
    assert spec.history == serial.history
    assert spec.final_version == serial.final_version and spec_files == serial_files
    assert [(s.version_before, s.version_after) for s in spec.steps] == [
        (s.version_before, s.version_after) for s in serial.steps
    ]
    s = spec.summary()
    assert s["routes_fired"] >= len(REPLIES) and events  # every verified decode was routed
    assert s["forks_launched"] > 0 and s["cache"]["hits"] + s["cache"]["misses"] > 0
    assert summary["pool"]["served"] > 0  # forks came from the pool's ready queue
    assert summary["markov"] and markov.actions["wc"][Action.bash("wc -l /work/data.txt")] >= 3 + 3  # + online


# ----------------------------------------------------------------------------- the CLI


@pytest.mark.root
def test_aospec_run_with_the_specbox_layer_prints_its_figures(overlay_state, serve_traces, capsys, tmp_path) -> None:
    server = serve_traces([demo_trace()], tpot_ms=1.0)
    rec = tmp_path / "run.jsonl"
    argv = ["run", TASK, "--model", server.base_url, "--cache", "reads", "--router", "parse", "--pool-depth", "2"]
    code = main([*argv, "--format", "json", "--record", str(rec)])
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(out)
    assert data["exit_reason"] == "submitted" and data["steps"] == len(REPLIES)
    for key in ("routes_fired", "routed_forks_launched", "routed_forks_reused", "cache_hits", "cache_saved_s"):
        assert isinstance(data[key], int | float), key
    assert data["routes_fired"] >= len(REPLIES)
    assert {"hits", "misses", "bypasses", "stale_avoided"} <= set(data["cache"])
    assert data["specbox"] == {
        "cache_mode": "reads",
        "pool_depth": 2,
        "router": "parse",
        "markov": False,
        "pool": data["specbox"]["pool"],
    }
    assert data["specbox"]["pool"]["served"] >= 0 and data["specbox"]["pool"]["made"] >= 2
    from aospec.replay import read_jsonl

    (trace,) = read_jsonl(rec)
    assert trace.meta["specbox"]["router"] == "parse" and trace.meta["result"]["routes_fired"] == data["routes_fired"]
    code = main([*argv, "--format", "table"])
    out, err = capsys.readouterr()
    assert code == 0, err
    for row in ("cache hits / misses / bypasses", "routes fired", "routed forks reused / launched", "pool forks"):
        assert row in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--no-speculate", "--router", "parse"], "--router parse needs speculation"),
        (["--no-speculate", "--pool-depth", "2"], "--pool-depth 2 needs speculation"),
        (["--no-speculate", "--markov"], "--markov is an action drafter"),
        (["--router", "trained"], "--router trained is fitted on --train-traces"),
        (["--markov"], "--markov is fitted on --train-traces"),
        (["--pool-depth", "-1"], "--pool-depth must be >= 0"),
    ],
)
def test_bad_specbox_options_are_one_line_and_exit_2(capsys, extra: list[str], message: str) -> None:
    code = main(["run", TASK, "--model", "http://127.0.0.1:9/v1", *extra])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("aospec: error: ") and message in err and err.count("\n") == 1


def test_the_trained_router_is_fitted_on_the_training_traces(bundled_traces) -> None:
    pytest.importorskip("sklearn")
    router = build_router("trained", bundled_traces)
    session = router.session()
    events = [e for d in ["THOUGHT: look.\n\n```bash\n", "ls", " -la\n```"] for e in session.feed(d)]
    assert "ls" in {e.tool for e in events}
    # the gated union+parse of `aospec routers eval`: learned guesses need the Markov prior
    assert router.prior is not None and router.min_prior == TRAINED_MIN_PRIOR > 0
    assert build_router("off") is None and type(build_router("parse")) is ParseRouter


@pytest.mark.parametrize(
    ("command", "cached"),
    [
        ("cat /work/a.py", True),
        ("wc -l /work/*.c | sort -n", True),
        ("ls -a /work", True),
        ("grep -rn TODO /work/src", True),
        ("head -5 /work/x 2>/dev/null", True),
        ("ls -la /work", False),  # mtimes: not part of a version
        ("ls -i /work", False),  # inode numbers
        ("diff -u a b", False),  # file times in the header
        ("sort -R /work/x", False),
        ("cat /proc/loadavg", False),  # outside every version
        ("cat proc/loadavg", False),  # relative to / (the sandbox's working directory)
        ("cd /work && cat ../proc/x", False),
        ("cat < /dev/urandom", False),
        ("grep -rn TODO", False),  # from /: would read /proc
        ("cat $HOME/x", False),
        ("cat a > b", False),
        ("python3 -m pytest", False),
    ],
)
def test_the_reads_cache_serves_only_outputs_that_a_version_determines(command: str, cached: bool) -> None:
    assert deterministic_reads()(Action.bash(command)) is cached


@pytest.mark.anyio
async def test_the_specbox_layer_orders_pool_inside_cache() -> None:
    options = SpecBoxOptions(cache="reads", pool_depth=2)
    async with open_specbox(InMemorySandbox(), options) as box:
        assert isinstance(box.sandbox, CachedSandbox) and isinstance(box.sandbox.inner, PooledSandbox)
        await box.sandbox.execute(Action.bash("ls /"))
        await anyio.sleep(0.05)  # let the pool fill (the figures below do not depend on it)
        fork = await box.sandbox.fork()
        assert isinstance(fork, CachedSandbox) and fork.cache is box.sandbox.cache
        await fork.execute(Action.bash("ls /"))
        assert fork.last_cache_hit_ns is not None
        await fork.discard()
        assert box.summary()["pool"]["served"] + box.summary()["pool"]["misses"] == 1
