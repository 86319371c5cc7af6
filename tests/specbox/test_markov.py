"""Markov prefetch: Laplace probabilities, thresholds, backoff, online updates, and the
ActionDrafter protocol."""

from __future__ import annotations

import anyio
import pytest
from aospec.specbox.markov import START, MarkovPrefetcher, evaluate_markov, tool_costs_ms

from aospec.errors import ConfigError
from aospec.protocols import ActionDraft, ActionDrafter
from aospec.types import Action, History, Step, Trace


def _trace(tid: str, commands: list[str], durations: list[float] | None = None) -> Trace:
    durs = durations or [0.1] * len(commands)
    return Trace(
        id=tid,
        task=tid,
        harness="test",
        actor_model="m",
        source="test",
        steps=tuple(
            Step(action=Action.bash(c), observation="", output_tokens=1, tool_duration_s=d)
            for c, d in zip(commands, durs, strict=True)
        ),
    )


def test_laplace_probabilities() -> None:
    m = MarkovPrefetcher(alpha=1.0)
    m.fit([_trace("a", ["ls", "cat x", "ls", "cat y", "ls", "python3 t.py"])])
    # Vocabulary {ls, cat, python3}; after ls: cat twice, python3 once (3 transitions).
    dist = m.distribution(["ls"])
    assert dist == pytest.approx({"cat": (2 + 1) / (3 + 3), "python3": (1 + 1) / (3 + 3), "ls": (0 + 1) / (3 + 3)})
    assert sum(dist.values()) == pytest.approx(1.0)
    # The start state: ls once.
    assert m.distribution([]) == pytest.approx({"ls": 2 / 4, "cat": 1 / 4, "python3": 1 / 4})
    assert m.predict(["ls"], k=1) == [("cat", pytest.approx(0.5))]


def test_prefetch_thresholds_tau_lambda_and_budget() -> None:
    traces = [_trace(f"t{i}", ["ls", "cat x"], durations=[0.001, 0.5]) for i in range(8)]
    m = MarkovPrefetcher(alpha=1.0, tau=0.6, lam=5.0, budget=1)
    m.fit(traces)
    assert tool_costs_ms(traces) == pytest.approx({"ls": 1.0, "cat": 500.0})
    # After ls: cat 8/8 -> (8+1)/(8+2) = 0.9 >= tau, cost 500 ms >= lambda.
    assert m.prefetch(["ls"]) == [("cat", pytest.approx(0.9))]
    # From the start: ls 0.9 but costs 1 ms < lambda.
    assert m.prefetch([]) == []
    assert MarkovPrefetcher(tau=0.95, costs={"cat": 500.0}).prefetch(["ls"]) == []
    strict = MarkovPrefetcher(tau=0.95)
    strict.fit(traces)
    assert strict.prefetch(["ls"]) == []  # 0.9 < tau
    none = MarkovPrefetcher(budget=0)
    none.fit(traces)
    assert none.prefetch(["ls"]) == []


def test_online_observe_moves_the_context() -> None:
    m = MarkovPrefetcher()
    for tool in ["ls", "cat", "ls", "cat"]:
        m.observe(tool)
    assert m.totals[(START,)] == 1
    assert m.counts[("ls",)]["cat"] == 2
    assert m.predict(k=1)[0][0] == "ls"  # context is now 'cat': cat -> ls once
    m.reset()
    assert m.predict(k=1)[0][0] == "ls"


def test_higher_order_backs_off_to_shorter_contexts() -> None:
    m = MarkovPrefetcher(order=2, alpha=0.0)
    m.fit([_trace("a", ["ls", "cat a", "grep x f", "cat b", "python3 r.py"])])
    # (ls, cat) -> grep; (grep, cat) -> python3.
    assert m.predict(["ls", "cat"], k=1)[0][0] == "grep"
    assert m.predict(["grep", "cat"], k=1)[0][0] == "python3"
    # (python3, cat) never seen: back off to (cat,), which saw grep and python3 once each.
    assert {t for t, _ in m.predict(["python3", "cat"], k=2)} == {"grep", "python3"}


def test_invalid_parameters_are_config_errors() -> None:
    for kw in ({"tau": 1.5}, {"alpha": -1}, {"budget": -1}, {"order": 0}):
        with pytest.raises(ConfigError):
            MarkovPrefetcher(**kw)  # type: ignore[arg-type]


def test_is_an_action_drafter_proposing_p_tool_times_p_action() -> None:
    m = MarkovPrefetcher(alpha=1.0)
    m.fit([_trace("a", ["ls", "cat x", "ls", "cat x", "ls", "cat y"])])
    assert isinstance(m, ActionDrafter)
    history = History("task").extend(Action.bash("ls"), "out")
    drafts = anyio.run(m.propose, history, 2, 1)
    # After ls: cat 3/3 -> (3+1)/(3+2) = 0.8; 'cat x' is 2/3 of cat's actions.
    assert drafts[0] == ActionDraft(Action.bash("cat x"), 0, pytest.approx(0.8 * 2 / 3))
    assert drafts[1] == ActionDraft(Action.bash("cat y"), 0, pytest.approx(0.8 * 1 / 3))
    deeper = anyio.run(m.propose, history, 50, 2)
    assert {d.offset for d in deeper} == {0, 1}
    assert all(0 < d.probability <= 1 for d in deeper)
    assert anyio.run(m.propose, history, 0, 1) == []
    assert anyio.run(MarkovPrefetcher().propose, history, 3, 1) == []  # not fitted


def test_routed_proposals_are_the_labels_recorded_actions_with_p_action_given_tool() -> None:
    m = MarkovPrefetcher(alpha=1.0)
    m.fit([_trace("a", ["ls", "cat x", "ls", "cat x", "ls -la", "cat y", "make test"])])
    history = History("task").extend(Action.bash("ls"), "out")
    drafts = anyio.run(m.propose_routed, history, "cat", 5)
    assert drafts == [
        ActionDraft(Action.bash("cat x"), 0, pytest.approx(2 / 3)),
        ActionDraft(Action.bash("cat y"), 0, pytest.approx(1 / 3)),
    ]
    assert anyio.run(m.propose_routed, history, "cat", 1) == drafts[:1]
    # Only that label, whatever the transition model says comes next.
    assert [d.action for d in anyio.run(m.propose_routed, history, "make", 3)] == [Action.bash("make test")]
    assert anyio.run(m.propose_routed, history, "pytest", 3) == []  # never recorded
    assert anyio.run(m.propose_routed, history, "none", 3) == []  # not a call
    assert anyio.run(m.propose_routed, history, "cat", 0) == []
    for _ in range(3):
        m.observe("cat", Action.bash("cat z"))  # online: the recorded actions grow
    assert anyio.run(m.propose_routed, history, "cat", 1)[0].action == Action.bash("cat z")


def test_evaluate_markov_on_held_out_traces() -> None:
    m = MarkovPrefetcher()
    m.fit([_trace("a", ["ls", "cat x", "ls", "cat y"])])
    score = evaluate_markov(m, [_trace("b", ["ls", "cat z", "gcc q.c"])]).to_json()
    # ls from start: right; cat after ls: right; gcc (unseen) wrong.
    assert score["steps"] == 3 and score["top1"] == pytest.approx(2 / 3, abs=1e-4)
    assert "gcc" not in m.vocab  # evaluation never updates the model


def test_background_task_observes_and_prefetches() -> None:
    from aospec.specbox.markov import prefetch_task

    m = MarkovPrefetcher(tau=0.6, lam=5.0, costs={"cat": 100.0, "ls": 100.0})
    m.fit([_trace(f"t{i}", ["ls", "cat x"]) for i in range(8)])
    m.costs = {"cat": 100.0, "ls": 100.0}
    got: list[list[tuple[str, float]]] = []

    async def main() -> None:
        send, receive = anyio.create_memory_object_stream[tuple[str, Action | None]](4)
        async with anyio.create_task_group() as tg:
            tg.start_soon(prefetch_task, m, receive, got.append)
            async with send:
                await send.send(("ls", Action.bash("ls")))

    anyio.run(main)
    assert [[t for t, _ in g] for g in got] == [["cat"]]
    assert m.counts[(START,)]["ls"] == 9  # the observation was counted online
