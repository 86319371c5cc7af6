"""CallsActionDrafter: tool calls whose arguments come from what the history showed (a
user's id in the task, a record's ids in a lookup's JSON result)."""

from __future__ import annotations

import json
import random

import anyio
import pytest
from aospec.drafters.calls import CallsActionDrafter, shape

from aospec.errors import ConfigError
from aospec.types import Action, History, Step, Trace


def shop_trace(i: int, rng: random.Random) -> Trace:
    """A function-calling agent of a small shop: it reads the customer the user names, then
    each of the customer's orders in the order the record lists them, then answers."""
    customer = f"{rng.choice(['ada', 'bo', 'cy', 'di'])}_{rng.choice(['lin', 'ng', 'ortiz'])}_{1000 + i}"
    orders = [f"O{rng.randrange(10**5, 10**6)}" for _ in range(rng.randint(2, 4))]
    task = f"Hi, I am {customer}. Where are my parcels?"
    steps = [
        Step(Action("respond", {"content": f"Sure, let me look {customer} up."}), "Thanks, quickly please.", 8),
        Step(
            Action("get_customer", {"customer_id": customer}),
            json.dumps({"name": customer.split("_")[0], "orders": orders, "tier": "gold"}),
            10,
        ),
    ]
    for o in orders:
        steps.append(
            Step(Action("get_order", {"order_id": o}), json.dumps({"order_id": o, "status": "shipped"}), 9)
        )
    steps.append(Step(Action("respond", {"content": f"All {len(orders)} orders of {customer} shipped."}), "ok bye", 12))
    return Trace(id=f"shop{i}", task=task, harness="shop", actor_model="m", source="test", steps=tuple(steps))


def traces(n: int, seed: int = 0) -> list[Trace]:
    rng = random.Random(seed)
    return [shop_trace(i, rng) for i in range(n)]


def proposals(d: CallsActionDrafter, h: History, width: int = 8) -> list[Action]:
    return [p.action for p in anyio.run(d.propose, h, width, 1)]


def test_shape_collapses_letter_and_digit_runs() -> None:
    assert shape("mia_li_3668") == "a_a_9"
    assert shape("HAT069") == "A9"
    assert shape("2024-05-20") == "9-9-9"


def test_it_passes_back_the_ids_the_history_showed_in_order() -> None:
    d = CallsActionDrafter()
    d.fit(traces(12))
    t = traces(1, seed=99)[0]
    # after the first reply: the customer the task names
    assert proposals(d, t.history(1))[0] == t.steps[1].action
    # after the lookup: the first order of the record, then (after it) the next one
    assert proposals(d, t.history(2))[0] == t.steps[2].action
    assert proposals(d, t.history(3))[0] == t.steps[3].action


def test_no_prediction_for_free_text_or_shell_histories() -> None:
    d = CallsActionDrafter()
    d.fit(traces(12))
    t = traces(1, seed=7)[0]
    drafts = anyio.run(d.propose, t.history(len(t.steps) - 1), 32, 1)
    # a reply's free text is never one value of the history: no reply is worth a slot
    assert all(p.action.tool != "respond" or p.probability < 0.01 for p in drafts)
    shell = History("fix the build").extend(Action.bash("make"), "error: x.c:3")
    assert proposals(d, shell) == []


def test_a_drafter_fit_on_shell_traces_only_proposes_nothing() -> None:
    d = CallsActionDrafter()
    bash = Trace(
        id="b", task="t", harness="h", actor_model="m", source="test",
        steps=(Step(Action.bash("ls"), "a.py", 3), Step(Action.bash("python a.py"), "ok", 4)),
    )
    d.fit([bash])
    assert proposals(d, traces(1)[0].history(2)) == []


def test_calls_with_nested_arguments_are_not_drafted() -> None:
    t = traces(8)
    nested = [
        Trace(
            id=f"n{i}", task=x.task, harness="shop", actor_model="m", source="test",
            steps=(*x.steps, Step(Action("refund", {"items": [{"order_id": "O1"}]}), "ok", 5)),
        )
        for i, x in enumerate(t)
    ]
    d = CallsActionDrafter()
    d.fit(nested)
    assert all(a.tool != "refund" for a in proposals(d, t[0].history(len(t[0].steps)), 32))


def test_an_integer_argument_takes_a_number_the_text_showed() -> None:
    def trace(i: int) -> Trace:
        n = 2 + i % 5
        return Trace(
            id=f"b{i}", task=f"add {n} bags", harness="h", actor_model="m", source="test",
            steps=(
                Step(Action("respond", {"content": "ok"}), f"yes, {n} bags please", 3),
                Step(Action("set_bags", {"count": n}), "done", 3),
            ),
        )

    d = CallsActionDrafter()
    d.fit([trace(i) for i in range(10)])
    h = History("add 4 bags").extend(Action("respond", {"content": "ok"}), "yes, 4 bags please")
    assert Action("set_bags", {"count": 4}) in proposals(d, h)


def test_bad_options_are_one_clear_error() -> None:
    with pytest.raises(ConfigError, match="calls drafter"):
        CallsActionDrafter(values=0)


def test_the_default_policy_drafts_grounded_calls_in_replay() -> None:
    from aospec.replay.accuracy import action_accuracy
    from aospec.replay.policies import DrafterSet, parse_policy

    train, held = traces(12), traces(3, seed=5)
    ds = DrafterSet(train)
    with_calls = action_accuracy(held[0], parse_policy("aospec"), ds)
    without = action_accuracy(held[0], parse_policy("aospec:action_drafter=history+moves"), ds)
    # (boundaries, hits by width 1..32, ...): the lookups the history names are now hit
    assert with_calls[1][-1] > without[1][-1]
    assert with_calls[1][0] >= 2


def test_a_routed_tool_gets_its_own_calls_only() -> None:
    d = CallsActionDrafter()
    d.fit(traces(12))
    t = traces(1, seed=11)[0]
    h = t.history(2)  # after the customer lookup
    routed = [p.action for p in anyio.run(d.propose_routed, h, "get_order", 4)]
    assert routed and all(a.tool == "get_order" for a in routed)
    assert routed[0] == t.steps[2].action
    assert anyio.run(d.propose_routed, h, "no_such_tool", 4) == []


def test_odd_results_never_break_drafting() -> None:
    d = CallsActionDrafter()
    d.fit(traces(12))
    h = traces(1, seed=3)[0].history(1)
    for obs in ["[NaN, Infinity, -Infinity]", '{"orders": ["' + "x" * 5000 + '"]}', "{" * 5000, '{"a": ' * 50 + "1" + "}" * 50, "\x00\ud800"]:
        drafts = anyio.run(d.propose, h.extend(Action("get_customer", {"customer_id": "c"}), obs), 8, 1)
        assert all(len(p.action.key) < 2000 for p in drafts)


def _orders_trace(i: int, rng: random.Random, *, as_int: bool, top_level: bool) -> Trace:
    """A session that lists orders (a record, or a bare JSON list), then reads each."""
    orders: list[object] = [rng.randrange(10**5, 10**6) for _ in range(rng.randint(2, 4))]
    if not as_int:
        orders = [f"O{o}" for o in orders]
    listing = orders if top_level else {"orders": orders}
    steps = [Step(Action("list_orders", {}), json.dumps(listing), 5)]
    steps += [Step(Action("get_order", {"order_id": o}), json.dumps({"status": "ok"}), 5) for o in orders]
    return Trace(id=f"o{i}", task=f"session {i}", harness="h", actor_model="m", source="test", steps=tuple(steps))


@pytest.mark.parametrize(("as_int", "top_level"), [(True, False), (False, True), (True, True)])
def test_integer_ids_and_bare_lists_are_followed_in_order(as_int: bool, top_level: bool) -> None:
    rng = random.Random(1)
    d = CallsActionDrafter()
    d.fit([_orders_trace(i, rng, as_int=as_int, top_level=top_level) for i in range(10)])
    t = _orders_trace(99, rng, as_int=as_int, top_level=top_level)
    for i in range(1, len(t.steps)):
        # the next order not read yet comes first, also after earlier ones were read
        assert proposals(d, t.history(i))[0] == t.steps[i].action


def test_a_lone_surrogate_in_a_result_is_never_passed_back() -> None:
    rng = random.Random(2)
    d = CallsActionDrafter()
    d.fit([_orders_trace(i, rng, as_int=False, top_level=False) for i in range(10)])
    h = History("s").extend(Action("list_orders", {}), '{"orders": ["\\ud800A", "O77"]}')
    drafts = proposals(d, h, 32)
    assert Action("get_order", {"order_id": "O77"}) in drafts
    for a in drafts:
        json.dumps(a.to_json(), ensure_ascii=False).encode("utf-8")  # every draft can be sent


def test_many_arguments_are_ranked_without_trying_every_combination() -> None:
    # 24 scalar arguments with 3 candidates each: 3**24 combinations; a beam keeps it linear
    names = [f"a{j}" for j in range(24)]

    def trace(i: int) -> Trace:
        rec = {n: f"v{i}-{j}" for j, n in enumerate(names)}
        return Trace(
            id=f"w{i}", task="t", harness="h", actor_model="m", source="test",
            steps=(Step(Action("get_rec", {}), json.dumps(rec), 3), Step(Action("put_rec", rec), "ok", 3)),
        )

    d = CallsActionDrafter()
    d.fit([trace(i) for i in range(6)])
    t = trace(42)
    assert proposals(d, t.history(1), 4)[0] == t.steps[1].action


def test_the_same_drafts_in_every_process() -> None:
    code = (
        "import sys, anyio; sys.path.insert(0, 'tests/drafters'); from test_calls import traces, CallsActionDrafter; "
        "d = CallsActionDrafter(); d.fit(traces(12)); t = traces(1, seed=4)[0]; "
        "print([(p.action.key, round(p.probability, 12)) for i in range(len(t.steps)) "
        "for p in anyio.run(d.propose, t.history(i), 8, 1)])"
    )
    import os
    import subprocess
    import sys

    root = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True, timeout=300,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1 and "get_order" in next(iter(outs))


def test_a_failing_drafter_costs_only_its_own_guesses() -> None:
    from aospec.integrations._mcp_common import MergedDrafter

    class Broken:
        async def propose(self, history: History, width: int, depth: int) -> list[object]:
            raise RuntimeError("bug")

    d = CallsActionDrafter()
    d.fit(traces(12))
    t = traces(1, seed=9)[0]
    merged = MergedDrafter([Broken(), d])
    got = [p.action for p in anyio.run(merged.propose, t.history(2), 4, 1)]
    assert got[0] == t.steps[2].action and merged.failures == 1
