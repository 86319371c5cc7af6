"""How often a policy's drafters are exactly right, step by step, on the recorded history.

The replay's hit rates (``obs_hit_rate``, ``action_hit_rate``) count what the engine
used; these count what the drafters *could* give, the way the paper reports drafters:

- **observation exact hits by call length**: a step's recorded observation is among the
  ``branch_budget`` drafts the policy would continue (its observation drafters on the true
  history, ranked by the policy's rule: EVD with the fold's estimator, likelihood or tool
  time), counted per recorded tool-time bucket (:data:`CALL_BUCKETS`: < 1 s, 1-10 s,
  10-60 s, > 60 s);
- **action accuracy by width and distance**: the recorded next action is among the policy's
  action drafters' ``width`` most probable targets when asked for the next action only
  (depth 1; :data:`WIDTHS`), and the
  action ``d`` steps ahead among the 8 most probable targets at offset ``d - 1``
  (:data:`DISTANCES`), at every boundary of the recorded history.

:func:`observation_accuracy` and :func:`action_accuracy` compute one trace's counts for a
policy (free oracles and policies without drafters give zeros); replay/sweep.py computes
them once per trace for each distinct :func:`observation_key` / :func:`action_key` and puts
them on every result of the policy (they do not depend on the TPOT); replay/metrics.py
sums them.
"""

from __future__ import annotations

import bisect
from typing import Any

from aospec.replay.policies import DrafterSet, Policy

from aospec.errors import AospecError
from aospec.evd import rank_drafts
from aospec.types import Trace

__all__ = [
    "CALL_BUCKETS",
    "CALL_BUCKET_LABELS",
    "DISTANCES",
    "WIDTHS",
    "action_accuracy",
    "action_key",
    "observation_accuracy",
    "observation_key",
]

#: Upper edges (seconds) of the call-length buckets: < 1 s, 1-10 s, 10-60 s, the rest.
CALL_BUCKETS = (1.0, 10.0, 60.0)
#: Labels of the call-length buckets.
CALL_BUCKET_LABELS = ("< 1 s", "1-10 s", "10-60 s", "> 60 s")
#: Widths of the next-action accuracy.
WIDTHS = (1, 2, 4, 8, 16, 32)
#: Lookahead distances of the action accuracy (top 8 at each).
DISTANCES = tuple(range(1, 11))
_TOP_AT_DISTANCE = 8


def observation_accuracy(trace: Trace, policy: Policy, drafters: DrafterSet) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(steps, exact hits) per call-length bucket of ``policy``'s observation drafters on
    ``trace`` (module doc); zeros without real observation drafters."""
    from aospec.drafters.calibration import call_sync

    c, e = policy.config, policy.engine
    names = [n for n in c.obs_names if n != "oracle"]
    calls, hits = [0, 0, 0, 0], [0, 0, 0, 0]
    if not names or e.branch_budget <= 0:
        return tuple(calls), tuple(hits)
    obs = [drafters.observation(n) for n in names]
    evd = drafters.evd(c.kernel).session() if e.rank != "likelihood" else None
    n = max(e.draft_candidates, e.branch_budget)
    for i, step in enumerate(trace.steps):
        if step.action.is_none or not step.completed:
            continue
        history = trace.history(i)
        drafts = [d for drafter in obs for d in _drafts(call_sync, drafter.draft, history, step.action, n)]
        ranked = rank_drafts(drafts, e.rank, e.branch_budget, evd, min_probability=e.min_draft_probability)
        b = bisect.bisect_right(CALL_BUCKETS, step.tool_duration_s or 0.0)
        calls[b] += 1
        hits[b] += any(d.text == step.observation for d in ranked)
        if evd is not None and step.tool_duration_s is not None:
            evd.observe(step.action, step.observation, step.tool_duration_s)
    return tuple(calls), tuple(hits)


def action_accuracy(
    trace: Trace, policy: Policy, drafters: DrafterSet
) -> tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(boundaries, hits by width, targets by distance, hits by distance) of ``policy``'s
    action drafters on ``trace`` (module doc); zeros without real action drafters."""
    from aospec.drafters.calibration import call_sync

    names = [n for n in policy.config.action_names if n != "oracle"]
    if not names or policy.engine.fork_width <= 0:
        return 0, (), (), ()
    act = [drafters.action(n, calibrated=policy.config.calibrate_actions) for n in names]
    actions = [s.action for s in trace.steps]
    by_width = [0] * len(WIDTHS)
    targets = [0] * len(DISTANCES)
    by_distance = [0] * len(DISTANCES)
    for i in range(len(actions)):
        history = trace.history(i)
        # width: the drafters asked for the next action only (depth 1), as the engine asks
        # when it forks one step ahead; asked for 10 steps they may spend slots on deeper ones
        first = _targets(call_sync, act, history, max(WIDTHS), 1).get(0, [])
        at = _targets(call_sync, act, history, max(WIDTHS), max(DISTANCES))
        for k, w in enumerate(WIDTHS):
            by_width[k] += actions[i] in first[:w]
        for k, dist in enumerate(DISTANCES):
            if i + dist - 1 < len(actions):
                targets[k] += 1
                by_distance[k] += actions[i + dist - 1] in at.get(dist - 1, [])[:_TOP_AT_DISTANCE]
    return len(actions), tuple(by_width), tuple(targets), tuple(by_distance)


def _targets(call: Any, drafters: list[Any], history: Any, width: int, depth: int) -> dict[int, list[object]]:
    """The drafters' distinct target actions per offset, most probable first."""
    proposals = [d for drafter in drafters for d in _drafts(call, drafter.propose, history, width, depth)]
    proposals.sort(key=lambda d: -d.probability)
    at: dict[int, list[object]] = {}
    for d in proposals:
        lst = at.setdefault(d.offset, [])
        if d.action not in lst:
            lst.append(d.action)
    return at


def _drafts(call: Any, fn: Any, *args: Any) -> list[Any]:
    """A drafting call's drafts; none when it fails (as in replay, a failed call only loses
    its candidates)."""
    try:
        return list(call(fn, *args))
    except AospecError:
        return []


def observation_key(policy: Policy) -> tuple[object, ...]:
    """What decides a policy's observation counts (policies with equal keys share them)."""
    e, c = policy.engine, policy.config
    return (c.obs_names, c.kernel, e.rank, e.branch_budget, e.draft_candidates, e.min_draft_probability)


def action_key(policy: Policy) -> tuple[object, ...]:
    """What decides a policy's action counts."""
    return (policy.config.action_names, policy.config.calibrate_actions, policy.engine.fork_width > 0)
