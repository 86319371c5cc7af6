"""Routed action drafting in replay: the replay actor streams the recorded reply while it
decodes (virtual time), a policy's ``router=`` routes it, and nothing changes without one."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import trio
import trio.testing
from aospec.replay import bundled_traces_path, load_traces
from aospec.replay._streams import step_stream, tool_label
from aospec.replay.actor import DIVERGED_TOOL, END_TOOL, ReplayActor, VirtualClock
from aospec.replay.policies import DrafterSet, load_router, parse_policies, parse_policy
from aospec.replay.sweep import replay_trace

from aospec.errors import ConfigError
from aospec.protocols import ActionDraft, StreamingActor
from aospec.types import Action, History, Step, Trace

specbox_routers = pytest.importorskip("aospec.specbox.routers")

PARSE = "aospec.specbox.routers.ParseRouter"
TAUBENCH = Path(__file__).parent / "data" / "taubench"
REPLY = "THOUGHT: count the lines of the file.\n\n```bash\nwc -l data.txt\n```"


@pytest.fixture(scope="module")
def bundled() -> list[Trace]:
    return load_traces([bundled_traces_path()])


@pytest.fixture(scope="module")
def mid(bundled) -> tuple[Trace, list[Trace]]:
    """A middling bundled trace (a quick replay) and the traces of the other tasks."""
    trace = sorted(bundled, key=len)[len(bundled) // 2]
    return trace, [t for t in bundled if t.task != trace.task]


def _trace() -> Trace:
    steps = (
        Step(Action.bash("wc -l data.txt"), "3 data.txt", 40, tool_duration_s=1.0, reply=REPLY),
        Step(Action.bash("cat data.txt"), "a\nb\nc", 10, tool_duration_s=2.0, reply="```bash\ncat data.txt\n```"),
    )
    return Trace(id="t", task="count", harness="h", actor_model="m", source="test", steps=steps)


def _run(fn):
    return trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


def test_the_recorded_stream_and_labels_are_specbox_routers_own(bundled):
    traces = bundled + load_traces([TAUBENCH])
    calls = 0
    for trace in traces:
        for step in trace.steps:
            ours = [d for delta in step_stream(step) for d in specbox_routers.parse_chunk(delta)]
            assert ours == specbox_routers.step_stream(step)
            assert tool_label(step.action) == specbox_routers.tool_label(step.action)
            calls += isinstance(ours[-1], specbox_routers.ToolCallDelta) if ours else 0
    assert calls > 0  # tau-bench's tool calls stream as chat-completions chunks


def test_decode_streaming_feeds_the_recorded_stream_across_the_decode_in_virtual_time():
    trace = _trace()

    async def main():
        clock = VirtualClock()
        actor = ReplayActor(trace, tpot_ns=1_000_000, clock=clock, prefill_ns_per_token=7_000)
        assert isinstance(actor, StreamingActor)
        stream = step_stream(trace.steps[0])
        prefill = (len(trace.task) + 3) // 4 * 7_000
        total = actor.decode_ns[0]
        assert total == 40 * 1_000_000 + prefill
        fed = []
        start = clock.now_ns()
        action = await actor.decode_streaming(trace.history(0), lambda d: fed.append((clock.now_ns() - start, d)))
        assert clock.now_ns() - start == total  # the same time as decode
        start = clock.now_ns()
        assert await actor.decode(trace.history(0)) == action == trace.steps[0].action
        assert clock.now_ns() - start == total
        n = len(stream)
        assert [d for _, d in fed] == stream and "".join(stream) == REPLY[: REPLY.index("data.txt") + 8]
        assert [t for t, _ in fed] == [prefill + round(k / n * (total - prefill)) for k in range(1, n + 1)]
        assert fed[-1][0] == total  # the command's last token arrives with the action

    _run(main)


def test_decode_streaming_feeds_nothing_off_the_recording_and_after_the_last_step():
    trace = _trace()

    async def main():
        clock = VirtualClock()
        actor = ReplayActor(trace, tpot_ns=1_000_000, clock=clock)
        diverged = History("count").extend(Action.bash("ls"), "x")
        fed = []
        start = clock.now_ns()
        action = await actor.decode_streaming(diverged, fed.append)
        assert action.tool == DIVERGED_TOOL and fed == []
        assert clock.now_ns() - start == actor.decode_ns[1]  # a diverged decode still takes D_i
        assert (await actor.decode_streaming(trace.history(2), fed.append)).tool == END_TOOL and fed == []

    _run(main)


def _counters(r):
    return r.routes_fired, r.routed_forks_launched, r.routed_forks_reused


def test_a_router_that_cannot_launch_changes_nothing_but_its_route_count(mid):
    """The streamed decode is a drop-in for decode: with routed drafting off (serial, or
    routed_width=0) every field of every row equals the unrouted policy's."""
    trace, train = mid
    specs = f"aospec,aospec:router={PARSE}:routed_width=0,serial,serial:router={PARSE}"
    rows = replay_trace(trace, parse_policies(specs), [10.0], DrafterSet(train))
    for plain, routed in zip(rows[0::2], rows[1::2], strict=True):
        assert routed.routes_fired > 0 and routed.routed_forks_launched == 0
        assert dataclasses.replace(routed, policy=plain.policy, routes_fired=0) == plain
        assert _counters(plain) == (0, 0, 0)


def _recorded_routed_drafter(trace: Trace):
    """A routed drafter stand-in that knows the recording: the recorded action when the
    router named its label (so every routed fork it launches is the real action)."""

    def routed(history: History, tool: str) -> list[ActionDraft]:
        i = len(history)
        if i < len(trace) and tool_label(trace.steps[i].action) == tool:
            return [ActionDraft(trace.steps[i].action, 0, 1.0)]
        return []

    return routed


def test_a_routed_policy_replays_losslessly_and_counts_its_routed_forks(mid):
    # replay_trace checks that the committed trajectory is the recording, decode and tool
    # times are exact, and no policy beats its ceiling (which has no router).
    trace, _ = mid
    name = "aospec.testing.ScriptedRoutedActionDrafter"
    options = {name: {"routed": _recorded_routed_drafter(trace)}}
    spec = f"action-only:action_drafter={name}"
    policies = parse_policies([spec, f"{spec}:router={PARSE}"])
    rows = replay_trace(trace, policies, [10.0], DrafterSet([], options))
    plain, routed = rows
    assert _counters(plain) == (0, 0, 0) and plain.forks_launched == 0
    assert routed.routes_fired >= routed.routed_forks_launched > 0
    assert routed.routed_forks_reused > 0 and routed.forks_reused == routed.routed_forks_reused
    assert routed.hidden_tool_ns > 0 and routed.latency_ns < plain.latency_ns
    assert routed.ceiling_ns == plain.ceiling_ns  # the twin drops the router
    assert policies[1].twin().key == policies[0].twin().key


def test_the_history_drafter_routes_on_the_bundled_sample(mid):
    from aospec.drafters.history import HistoryActionDrafter

    if not hasattr(HistoryActionDrafter, "propose_routed"):
        pytest.skip("the history drafter has no propose_routed yet")
    trace, train = mid
    drafters = DrafterSet(train)
    rows = replay_trace(trace, parse_policies(["aospec", f"aospec:router={PARSE}"]), [10.0], drafters)
    assert drafters.routed_action("history").label is tool_label
    assert _counters(rows[0]) == (0, 0, 0)
    assert rows[1].routes_fired > 0 and rows[1].routed_forks_launched > 0
    assert rows[1].drafter_failures == 0


def test_router_specs_are_dotted_paths_fit_on_the_training_traces(bundled):
    assert parse_policy(f"aospec:router={PARSE}").config.router_names == (PARSE,)
    assert parse_policy("aospec").config.router == ""
    with pytest.raises(ConfigError, match="dotted path"):
        load_router("parse")
    with pytest.raises(ConfigError, match="no attribute"):
        load_router("aospec.specbox.routers.NoSuchRouter")
    assert isinstance(load_router(PARSE), specbox_routers.ParseRouter)
    keyword = load_router("aospec.specbox.routers.KeywordRouter", bundled[:4])  # has fit(traces): fit
    assert isinstance(keyword, specbox_routers.KeywordRouter) and keyword.profiles
    union = load_router(f"aospec.specbox.routers.KeywordRouter+{PARSE}", bundled[:4])
    session = union.session()
    events = [e for d in step_stream(_trace().steps[0]) for e in session.feed(d)]
    assert [e.tool for e in events][-1:] == ["wc"]
    assert len({e.tool for e in events}) == len(events)


def test_the_label_reads_past_cd_and_matches_specbox_on_such_commands():
    for cmd in ("cd /work/proj && make test", "cd /x", "cd /x; export A=1 && pytest -q", "FOO=1 cd /x && ls"):
        action = Action.bash(cmd)
        assert tool_label(action) == specbox_routers.tool_label(action)
    assert tool_label(Action.bash("cd /work/proj && make test")) == "make"
    assert tool_label(Action.bash("cd /x")) == "cd"


class _Member:
    """A stream router that records the history its sessions were opened with."""

    name = "member"

    def __init__(self) -> None:
        self.opened: list[object] = []

    def session(self, history=None):
        self.opened.append(history)
        return specbox_routers.ParseRouter().session()


def test_the_union_passes_the_branch_history_to_its_members():
    from aospec.replay._streams import UnionRouter

    a, b = _Member(), _Member()
    union = UnionRouter([a, b])
    history = _trace().history(1)
    session = union.session(history)
    assert a.opened == b.opened == [history]
    assert [e.tool for d in step_stream(_trace().steps[1]) for e in session.feed(d)] == ["cat"]
    union.session()
    assert a.opened[-1] is None
    # specbox's routers take the history as their context (the labels of its actions).
    parse = UnionRouter([specbox_routers.ParseRouter()]).session(history)
    assert [e.tool for d in step_stream(_trace().steps[1]) for e in parse.feed(d)] == ["cat"]
