"""Dataset building: prompts within budget, newest turns kept, oversampling, task split."""

from __future__ import annotations

import pytest
from aospec.drafters.prompts import ACTION_SEPARATOR, ELISION, PromptBudget, parse_action, render_action
from aospec.replay import bundled_traces_path, load_traces
from aospec.training.dataset import Example, build_examples, expand_weights, split_by_task

from aospec.errors import ConfigError
from aospec.types import Action, Step, Trace


def words(text: str) -> int:
    return len(text.split()) + 1


def make_trace(task: str, n: int, *, tid: str | None = None, long_every: int = 0, incomplete_last: bool = False) -> Trace:
    steps = []
    for i in range(n):
        last = i == n - 1
        steps.append(
            Step(
                action=Action.bash(f"echo step {i}"),
                observation="" if (incomplete_last and last) else f"out {i} " + "x " * (i % 3),
                output_tokens=5,
                tool_duration_s=None if (incomplete_last and last) else (2.0 if long_every and i % long_every == 0 else 0.01),
                completed=not (incomplete_last and last),
            )
        )
    return Trace(tid or f"{task}-t", task, "h", "m", "src", tuple(steps), instruction=f"do {task}")


@pytest.fixture(scope="module")
def bundled() -> list[Trace]:
    return load_traces([bundled_traces_path()])


def test_split_never_puts_a_task_on_both_sides(bundled: list[Trace]) -> None:
    for seed in range(5):
        train, evals, held = split_by_task(bundled, eval_fraction=0.3, seed=seed)
        assert {t.task for t in train}.isdisjoint({t.task for t in evals})
        assert {t.task for t in evals} == set(held)
        assert len(train) + len(evals) == len(bundled)
        assert train and evals


def test_split_is_deterministic_and_splits_examples_the_same_way() -> None:
    traces = [make_trace(f"task{i}", 3, tid=f"t{i}-{j}") for i in range(6) for j in range(2)]
    a = split_by_task(traces, eval_fraction=0.34, seed=7)
    b = split_by_task(traces, eval_fraction=0.34, seed=7)
    assert a == b
    assert len(a[2]) == 3
    ex = build_examples(traces, count=words)
    _, ev, held = split_by_task(ex, eval_fraction=0.34, seed=7)
    assert held == a[2]
    assert {e.task for e in ev} == set(held)


def test_split_with_named_tasks_and_bad_input() -> None:
    traces = [make_trace("a", 2), make_trace("b", 2), make_trace("c", 2)]
    _train, evals, held = split_by_task(traces, eval_tasks=["b"])
    assert held == ["b"] and [t.task for t in evals] == ["b"]
    with pytest.raises(ConfigError, match="not in the data"):
        split_by_task(traces, eval_tasks=["zzz"])
    with pytest.raises(ConfigError, match="at least 2 tasks"):
        split_by_task([make_trace("a", 2)])


def test_observation_examples_target_the_observation_and_skip_unfinished_steps() -> None:
    trace = make_trace("t", 5, incomplete_last=True)
    ex = build_examples([trace], count=words)
    assert [e.step for e in ex] == [0, 1, 2, 3]
    for e in ex:
        assert e.target == trace.steps[e.step].observation
        chat = e.chat()
        assert chat[0]["role"] == "system" and "do t" in chat[0]["content"]
        assert chat[-1] == {"role": "user", "content": f"echo step {e.step}"}
        assert len(chat) == 2 + 2 * e.step  # every earlier turn fits


def test_budget_keeps_the_task_and_the_newest_turns() -> None:
    trace = make_trace("t", 40)
    budget = PromptBudget(total=120, task=20, text=30)
    ex = build_examples([trace], count=words, budget=budget)
    last = ex[-1].chat()
    assert sum(words(m["content"]) + 6 for m in last) <= budget.total
    kept = [m["content"] for m in last[1:-1:2]]
    assert kept, "some history fits"
    assert kept[-1] == "echo step 38"  # the newest turn is kept
    numbers = [int(k.split()[-1]) for k in kept]
    assert numbers == list(range(39 - len(numbers), 39))  # a contiguous newest window


def test_long_texts_are_cut_in_the_middle() -> None:
    long = "head " + "filler " * 500 + "tail"
    trace = Trace("x", "t", "h", "m", "s", (Step(Action.bash("cat big"), long, 1, tool_duration_s=0.1),
                                             Step(Action.bash("ls"), "a", 1, tool_duration_s=0.1)), instruction="task")
    ex = build_examples([trace], count=words, budget=PromptBudget(total=400, task=50, text=60))
    turn_obs = ex[1].chat()[2]["content"]
    assert turn_obs.startswith("head ") and turn_obs.endswith("tail")
    assert ELISION.split("{n}")[0].strip() in turn_obs
    assert words(turn_obs) <= 60


def test_long_tool_steps_are_oversampled() -> None:
    trace = make_trace("t", 6, long_every=3)
    ex = build_examples([trace], count=words, oversample=4)
    assert [e.weight for e in ex] == [4, 1, 1, 4, 1, 1]
    pool = expand_weights(ex)
    assert pool.count(0) == 4 and pool.count(1) == 1 and len(pool) == 12


def test_action_examples_chain_the_next_actions() -> None:
    trace = make_trace("t", 5)
    ex = build_examples([trace], count=words, kind="action", depth=3)
    assert len(ex) == 5
    assert ex[0].target == ACTION_SEPARATOR.join(["echo step 0", "echo step 1", "echo step 2"])
    assert ex[4].target == "echo step 4"
    assert ex[2].chat()[-1] == {"role": "user", "content": trace.steps[1].observation}


def test_actions_round_trip_through_their_prompt_text() -> None:
    for action in [Action.bash("ls -la"), Action("search", {"q": "x", "n": 2}), Action.none(),
                   Action.bash("@weird but bash")]:
        assert parse_action(render_action(action)) == action
    assert parse_action("   ") is None


def test_bundled_traces_give_examples_within_budget(bundled: list[Trace]) -> None:
    budget = PromptBudget(total=300, task=60, text=100)
    ex = build_examples(bundled, count=words, budget=budget)
    assert len(ex) == sum(1 for t in bundled for s in t.steps if s.completed)
    assert all(sum(words(m["content"]) + 6 for m in e.chat()) <= budget.total for e in ex)


def test_frequency_baseline_proposes_the_most_frequent_training_targets() -> None:
    from aospec.training.trainer import frequency_baseline

    def ex(task: str, target: str) -> Example:
        return Example(task, f"{task}-t", 0, (), target, 1.0, 1)

    train = [ex("a", "empty")] * 5 + [ex("a", "ok")] * 3 + [ex("a", f"rare{i}") for i in range(6)]
    evals = [ex("b", "empty"), ex("b", "ok"), ex("b", "never seen"), ex("b", "empty")]
    assert frequency_baseline(train, evals) == (0.5, 0.75)
    assert frequency_baseline(train, []) == (None, None)
    actions = [ex("a", "ls" + ACTION_SEPARATOR + "pwd")] * 2 + [ex("a", "cat x")]
    assert frequency_baseline(actions, [ex("b", "ls" + ACTION_SEPARATOR + "whoami")], kind="action") == (1.0, 1.0)
