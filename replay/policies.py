"""Replay policies: every baseline is an engine configuration plus a choice of drafters.

A policy is written ``NAME`` or ``NAME:key=value:key=value``; keys are fields of
:class:`aospec.engine_config.EngineConfig` or :class:`PolicyConfig` (unknown keys raise
ConfigError), values are JSON (``5``, ``true``, ``"x"``) or bare strings. See
docs/replay.md for the exact definition of each policy.

Drafters are named through the registries of :mod:`drafters` (``drafters.resolve``), so
any registered or dotted-path drafter plugs in: ``aospec:obs_drafter=lm``. Several
drafters are joined with ``+``; ``oracle`` is the recorded truth (ceilings only).

``aospec:accept=canonical`` accepts drafts equal to the real observation once
canonicalised (``:canonicalizer=all`` or ``=pids+times`` picks the fields, see
:func:`load_canonicalizer`); the replay actor then treats canonically equal histories as the
recorded one (docs/replay.md).

A drafter's configuration is checked before a sweep starts (:func:`check_drafters`); a
drafting call that fails during a run loses only that drafter's candidates and is counted
(:class:`DrafterFailures`). Drafting costs virtual time per drafter
(:class:`ChargedObservationDrafter`): a cheap drafter's candidates are continued when it is
done, not when the slowest drafter of the policy is.

``aospec:router=aospec.specbox.routers.ParseRouter`` routes: the replay actor streams each decode
(:meth:`aospec.replay.actor.ReplayActor.decode_streaming`), the router names the tool mid-decode
and the action drafters that have ``propose_routed`` launch targets for it, charged like
any drafting call (:class:`ChargedRoutedActionDrafter`). A router is a dotted path (replay
names no package above it): a class or function with ``fit(traces)`` is fit on the
fold's training traces, anything else is called without arguments; several joined with
``+`` are read side by side (:class:`aospec.replay._streams.UnionRouter`).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aospec.replay._streams import UnionRouter, tool_label
from aospec.replay.actor import ReplayActor, VirtualClock, ms_to_ns
from aospec.replay.sandbox import ReplayWorld

from aospec._lazy import import_object
from aospec.config import from_mapping
from aospec.engine_config import EngineConfig
from aospec.errors import AospecError, ConfigError
from aospec.evd import EVDEstimator
from aospec.protocols import ActionDraft, ActionDrafter, ObservationCanonicalizer, ObservationDraft, ObservationDrafter
from aospec.types import Action, History, Trace

__all__ = [
    "BASE_POLICIES",
    "CANONICALIZERS",
    "DEFAULT_POLICIES",
    "UNBOUNDED",
    "ChargedActionDrafter",
    "ChargedObservationDrafter",
    "ChargedRoutedActionDrafter",
    "DrafterFailures",
    "DrafterSet",
    "OracleActionDrafter",
    "OracleObservationDrafter",
    "Policy",
    "PolicyConfig",
    "check_drafter_names",
    "check_drafters",
    "load_canonicalizer",
    "load_router",
    "parse_policies",
    "parse_policy",
]


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Drafter choices and the drafting cost model of a replay policy.

    ``obs_drafter`` / ``action_drafter``: registry names joined by ``+`` ("" = none,
    ``oracle`` = the recorded truth at no cost). ``kernel``: the EVD kernel's registry
    name. Drafting is charged in virtual time: each call costs ``draft_call_ms`` plus
    ``draft_tpot_ms`` per token of its longest candidate (non-generative drafters report 0
    tokens, so they cost the fixed call latency only). ``canonicalizer``: the canonicaliser
    of ``accept=canonical`` (:func:`load_canonicalizer`). ``router``: a stream router's
    dotted path (several joined by ``+``; "" = no routing, :func:`load_router`).
    ``calibrate_actions``: the action drafters' targets carry probabilities calibrated on
    the training traces (cross-fit per drafter, :func:`aospec.drafters.calibration.fit_action_calibration`),
    so that targets of several drafters are ranked on one scale; on in ``aospec`` and
    ``action-only``, off in the baselines (their drafters rank as published).
    """

    obs_drafter: str = ""
    action_drafter: str = ""
    kernel: str = "pattern"
    draft_call_ms: float = 2.0
    draft_tpot_ms: float = 5.0
    canonicalizer: str = "default"
    router: str = ""
    calibrate_actions: bool = False

    def __post_init__(self) -> None:
        if self.draft_call_ms < 0 or self.draft_tpot_ms < 0:
            raise ConfigError("policy: draft_call_ms and draft_tpot_ms must be >= 0")
        if not self.canonicalizer:
            raise ConfigError("policy: canonicalizer must name a canonicaliser (e.g. 'default')")

    @property
    def obs_names(self) -> tuple[str, ...]:
        return tuple(n for n in self.obs_drafter.split("+") if n and n != "none")

    @property
    def action_names(self) -> tuple[str, ...]:
        return tuple(n for n in self.action_drafter.split("+") if n and n != "none")

    @property
    def router_names(self) -> tuple[str, ...]:
        return tuple(n for n in self.router.split("+") if n and n != "none")


#: Lookahead, fork width and live forks of a ceiling: in effect unlimited.
UNBOUNDED = 1 << 20

#: Base policies: (engine overrides, policy overrides); see docs/replay.md.
BASE_POLICIES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "serial": ({"branch_budget": 0, "fork_width": 0, "provisional_targets": False}, {}),
    "oracle-action": ({"branch_budget": 0, "depth": 1, "provisional_targets": False}, {"action_drafter": "oracle"}),
    "ceiling": (
        {"depth": UNBOUNDED, "fork_width": UNBOUNDED, "max_live_forks": UNBOUNDED, "admission": "off"},
        {"obs_drafter": "oracle", "action_drafter": "oracle"},
    ),
    "spec-actions": ({"branch_budget": 0, "depth": 1, "provisional_targets": False}, {"action_drafter": "history"}),
    "spechop-cache": ({"fork_width": 0, "provisional_targets": False}, {"obs_drafter": "cache"}),
    "aospec": (
        {},
        {"obs_drafter": "patterns+cache+trajectory", "action_drafter": "history+moves+calls", "calibrate_actions": True},
    ),
    "obs-only": ({"fork_width": 0, "provisional_targets": False}, {"obs_drafter": "patterns+cache+trajectory"}),
    "action-only": (
        {"branch_budget": 0, "provisional_targets": False},
        {"action_drafter": "history+moves+calls", "calibrate_actions": True},
    ),
}

#: Policies of a default sweep (the two rank variants give the paper's comparison of
#: ranking rules: time hidden per trial for EVD against likelihood and tool time).
DEFAULT_POLICIES = (
    "serial",
    "oracle-action",
    "ceiling",
    "spec-actions",
    "spechop-cache",
    "aospec",
    "obs-only",
    "action-only",
    "aospec:rank=likelihood",
    "aospec:rank=tooltime",
)

#: name -> "module:attr" of zero-argument canonicaliser factories (``accept=canonical``).
CANONICALIZERS: dict[str, str] = {
    "default": "aospec.drafters.canonicalize:Canonicalizer",
    "all": "aospec.drafters.canonicalize:all_fields",
}


def load_canonicalizer(spec: str) -> ObservationCanonicalizer:
    """The canonicaliser ``spec`` names: a name of :data:`CANONICALIZERS`, field names
    joined by ``+`` or ``,`` (``pids+times``; see drafters/canonicalize.py), or a dotted
    path ``module:attr`` of a zero-argument factory. Anything else raises ConfigError."""
    if spec in CANONICALIZERS or ":" in spec or "." in spec:
        factory = import_object(spec, CANONICALIZERS, "canonicaliser")
        try:
            obj = factory()
        except TypeError as exc:
            raise ConfigError(f"policy: canonicalizer {spec!r} cannot be built without arguments: {exc}") from None
    else:
        from aospec.drafters.canonicalize import canonicalizer

        try:
            obj = canonicalizer(spec)
        except ConfigError as exc:
            names = ", ".join(CANONICALIZERS)
            raise ConfigError(
                f"policy: canonicalizer {spec!r} is neither a name ({names}), a dotted path nor a field list: {exc}"
            ) from None
    if not callable(getattr(obj, "canonical", None)):
        raise ConfigError(f"policy: canonicalizer {spec!r} has no canonical(text) method")
    return obj


def _router_factory(name: str) -> Any:
    """The object a router's dotted path names (ConfigError when it names nothing)."""
    if ":" not in name and "." not in name:
        raise ConfigError(
            f"policy: router {name!r} is not a dotted path (e.g. aospec.specbox.routers.ParseRouter; "
            "replay knows routers only by path)"
        )
    obj = import_object(name, {}, "router")
    if not callable(obj) and not callable(getattr(obj, "session", None)):
        raise ConfigError(f"policy: router {name!r} is neither a router nor a factory of one")
    return obj


def load_router(spec: str, train: Sequence[Trace] = ()) -> Any:
    """The stream router ``spec`` names: dotted paths joined by ``+`` (read side by side,
    :class:`aospec.replay._streams.UnionRouter`). Each is fit on ``train`` when it has
    ``fit(traces)`` (``aospec.specbox.routers.KeywordRouter``, ``TfidfRouter``), else called
    without arguments (``ParseRouter``), or used as is when it is a router already."""
    names = [n for n in spec.split("+") if n and n != "none"]
    if not names:
        raise ConfigError(f"policy: router {spec!r} names no router")
    members = []
    for name in names:
        obj = _router_factory(name)
        fit = getattr(obj, "fit", None)
        if callable(getattr(obj, "session", None)) and not isinstance(obj, type):
            router = obj
        elif callable(fit):
            router = fit(list(train))
        else:
            try:
                router = obj()
            except TypeError as exc:
                raise ConfigError(f"policy: router {name!r} cannot be built without arguments: {exc}") from None
        if not callable(getattr(router, "session", None)):
            raise ConfigError(f"policy: router {name!r} built {type(router).__name__}, which has no session()")
        members.append(router)
    return members[0] if len(members) == 1 else UnionRouter(members)


_ENGINE_KEYS = {f.name for f in dataclasses.fields(EngineConfig)}
_POLICY_KEYS = {f.name for f in dataclasses.fields(PolicyConfig)}


@dataclass(frozen=True, slots=True)
class Policy:
    """A named engine configuration with its drafters."""

    name: str
    base: str
    engine: EngineConfig
    config: PolicyConfig

    @property
    def is_oracle(self) -> bool:
        names = self.config.obs_names + self.config.action_names
        return bool(names) and all(n == "oracle" for n in names)

    @property
    def speculates(self) -> bool:
        c = self.config
        return bool((c.obs_names and self.engine.branch_budget > 0) or (c.action_names and self.engine.fork_width > 0))

    def twin(self) -> Policy:
        """The matching ceiling: the same engine configuration with every drafter replaced
        by the free oracle, and action lookahead, fork width and live forks unbounded, and
        every guess launched (``admission="off"``: a bound is not priced).

        Unbounded, because JASV keeps forks valid across read-only steps: a practical
        drafter that launches a later step's action early gets it for free, so only an
        oracle that launches every step still reachable from the committed state bounds
        it. A policy can never beat its twin.
        """
        if not self.config.obs_names and not self.config.action_names:
            return self  # nothing speculates: the policy is its own ceiling
        # No router: routed targets are action drafting, which the oracle already does at
        # every boundary for every step the committed version reaches.
        cfg = dataclasses.replace(
            self.config,
            obs_drafter="oracle" if self.config.obs_names else "",
            action_drafter="oracle" if self.config.action_names else "",
            router="",
            calibrate_actions=False,  # (the oracle's probabilities are 1: nothing to calibrate)
        )
        # The oracle drafts one observation with probability 1: every ranking rule continues
        # it, so the rank does not change the ceiling (and rank variants share one). A
        # ceiling is a bound: its guesses are not priced (admission off).
        engine = dataclasses.replace(
            self.engine,
            depth=UNBOUNDED,
            fork_width=UNBOUNDED,
            max_live_forks=UNBOUNDED,
            rank="evd",
            admission="off",
        )
        return Policy(f"ceiling-of({self.name})", self.base, engine, cfg)

    @property
    def key(self) -> tuple[EngineConfig, PolicyConfig]:
        """What determines the policy's behaviour (for de-duplication)."""
        return (self.engine, self.config)


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_policy(spec: str) -> Policy:
    """``NAME[:key=value...]`` -> Policy (ConfigError on unknown names, keys or values)."""
    spec = spec.strip()
    name, *opts = spec.split(":")
    if name not in BASE_POLICIES:
        raise ConfigError(f"unknown policy {name!r}; known: {', '.join(BASE_POLICIES)}")
    engine_over, policy_over = BASE_POLICIES[name]
    engine_map, policy_map = dict(engine_over), dict(policy_over)
    given: set[str] = set()
    for opt in opts:
        key, eq, raw = opt.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ConfigError(f"policy {spec!r}: expected key=value, got {opt!r}")
        if key in _ENGINE_KEYS:
            engine_map[key] = _value(raw)
        elif key in _POLICY_KEYS:
            strings = ("obs_drafter", "action_drafter", "kernel", "canonicalizer", "router")
            policy_map[key] = raw if key in strings else _value(raw)
        else:
            known = ", ".join(sorted(_ENGINE_KEYS | _POLICY_KEYS))
            raise ConfigError(f"policy {spec!r}: unknown key {key!r}; known keys: {known}")
        given.add(key)
    if name == "ceiling" and "depth" in given and "obs_depth" not in given:
        engine_map["obs_depth"] = engine_map["depth"]  # the k-step joint ceiling
    engine = from_mapping(EngineConfig, engine_map, where=f"policy {spec!r}")
    config = from_mapping(PolicyConfig, policy_map, where=f"policy {spec!r}")
    return Policy(spec, name, engine, config)


def check_drafter_names(policies: Sequence[Policy]) -> None:
    """Resolve every drafter and kernel name now (ConfigError naming an unknown one), so a
    sweep fails before any work starts rather than inside a worker."""
    from aospec.drafters import resolve

    for p in policies:
        for name in p.config.obs_names:
            if name != "oracle":
                resolve("observation drafter", name)
        for name in p.config.action_names:
            if name != "oracle":
                resolve("action drafter", name)
        if p.config.obs_names and p.engine.rank != "likelihood":
            resolve("EVD kernel", p.config.kernel)
        if p.engine.accept == "canonical":
            load_canonicalizer(p.config.canonicalizer)
        for name in p.config.router_names:
            _router_factory(name)


def _drafter_names(policies: Sequence[Policy]) -> list[tuple[str, str]]:
    """(kind, name) of every drafter and kernel the policies build, oracle excluded."""
    out: dict[tuple[str, str], None] = {}
    for p in policies:
        for name in p.config.obs_names:
            if name != "oracle":
                out[("observation drafter", name)] = None
        for name in p.config.action_names:
            if name != "oracle":
                out[("action drafter", name)] = None
        if p.config.obs_names and p.engine.rank != "likelihood":
            out[("EVD kernel", p.config.kernel)] = None
    return list(out)


def check_drafters(policies: Sequence[Policy], options: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """Build every drafter and kernel the policies use once with its ``options`` (not fit)
    and run its ``check_config()`` if it has one, so that a configuration error (bad
    options, a model that does not exist, a missing package) stops a sweep before it
    starts instead of failing every drafting call."""
    check_drafter_names(policies)
    probe = DrafterSet((), options)
    for kind, name in _drafter_names(policies):
        drafter = probe.construct(kind, name)
        check = getattr(drafter, "check_config", None)
        if callable(check):
            check()


def parse_policies(text: str | Sequence[str]) -> list[Policy]:
    """Comma-separated policy specs (or a sequence of them); names must be unique."""
    specs = [s for s in (text.split(",") if isinstance(text, str) else text) if s.strip()]
    if not specs:
        raise ConfigError("no policies given")
    out = [parse_policy(s) for s in specs]
    names = [p.name for p in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ConfigError(f"policy listed twice: {', '.join(sorted(dup))}")
    return out


class OracleObservationDrafter:
    """The recorded observation, with probability 1, when history and action are on the
    recording (ceilings only)."""

    def __init__(self, trace: Trace, actor: ReplayActor) -> None:
        self._steps = trace.steps
        self._actor = actor

    async def draft(self, history: History, action: Action, n: int) -> Sequence[ObservationDraft]:
        i = len(history)
        if n <= 0 or i >= len(self._steps) or self._steps[i].action != action or not self._actor.matches(history):
            return []
        return [ObservationDraft(self._steps[i].observation, 1.0)]


class OracleActionDrafter:
    """The recorded actions of the next ``depth`` steps that a fork from the current
    filesystem version could be reused for (``ReplayWorld.reuse_ok``: the same version, or
    under ``readsets`` a valid read set; a fork for any later step could never pass), with
    probability 1, at most ``width`` (ceilings only)."""

    def __init__(self, trace: Trace, actor: ReplayActor, world: ReplayWorld) -> None:
        self._actions = [s.action for s in trace.steps]
        self._world = world
        self._actor = actor

    async def propose(self, history: History, width: int, depth: int) -> Sequence[ActionDraft]:
        i = len(history)
        n = len(self._actions)
        if i >= n or not self._actor.matches(history):
            return []
        out = []
        k = 0
        while k < depth and len(out) < width and i + k < n and self._world.reuse_ok(i, i + k):
            out.append(ActionDraft(self._actions[i + k], k, 1.0))
            k += 1
        return out


class DrafterFailures:
    """Drafting calls that failed in one run (an AospecError from a drafter: its candidates
    are dropped, the run goes on) and the first such error."""

    __slots__ = ("count", "first")

    def __init__(self) -> None:
        self.count = 0
        self.first = ""

    def record(self, drafter: object, exc: AospecError) -> None:
        self.count += 1
        if not self.first:
            self.first = f"{type(getattr(drafter, 'inner', drafter)).__name__}: {exc}"


class ChargedObservationDrafter:
    """Consults ``inners`` (one or more drafters, merged) and charges each one's cost in
    virtual time: ``call_ns + max tokens * tpot_ns`` of its own candidates, the drafters
    running side by side from the same start.

    ``draft_stream`` (what the engine uses) yields the candidates of each drafter when its
    cost has elapsed, those of drafters with equal cost as one batch (ranked together), so a
    cheap drafter's candidates never wait for a slow one's. ``draft`` returns them all once
    the slowest is done. A drafter that fails loses only its own candidates; the failure is
    counted in ``failures``.
    """

    __slots__ = ("call_ns", "clock", "failures", "inners", "tpot_ns")

    def __init__(
        self,
        inners: Sequence[ObservationDrafter],
        clock: VirtualClock,
        call_ns: int,
        tpot_ns: int,
        failures: DrafterFailures | None = None,
    ) -> None:
        self.inners, self.clock, self.call_ns, self.tpot_ns = tuple(inners), clock, call_ns, tpot_ns
        self.failures = failures if failures is not None else DrafterFailures()

    async def _costed(self, history: History, action: Action, n: int) -> list[tuple[int, list[ObservationDraft]]]:
        """(cost in ns, drafts) of each drafter that did not fail, in the drafters' order."""
        out = []
        for inner in self.inners:
            try:
                drafts = list(await inner.draft(history, action, n))
            except AospecError as exc:
                self.failures.record(inner, exc)
                continue
            out.append((self.call_ns + max((d.tokens for d in drafts), default=0) * self.tpot_ns, drafts))
        return out

    async def draft_stream(self, history: History, action: Action, n: int) -> AsyncIterator[Sequence[ObservationDraft]]:
        by_cost: dict[int, list[ObservationDraft]] = {}
        for cost, drafts in await self._costed(history, action, n):
            by_cost.setdefault(cost, []).extend(drafts)
        elapsed = 0
        for cost, drafts in sorted(by_cost.items()) or [(self.call_ns, [])]:
            await self.clock.sleep_ns(cost - elapsed)
            elapsed = cost
            yield drafts

    async def draft(self, history: History, action: Action, n: int) -> Sequence[ObservationDraft]:
        costed = await self._costed(history, action, n)
        await self.clock.sleep_ns(max((cost for cost, _ in costed), default=self.call_ns))
        return [d for _, drafts in costed for d in drafts]


class ChargedActionDrafter:
    """Like :class:`ChargedObservationDrafter`, for action drafters."""

    __slots__ = ("call_ns", "clock", "failures", "inners", "tpot_ns")

    def __init__(
        self,
        inners: Sequence[ActionDrafter],
        clock: VirtualClock,
        call_ns: int,
        tpot_ns: int,
        failures: DrafterFailures | None = None,
    ) -> None:
        self.inners, self.clock, self.call_ns, self.tpot_ns = tuple(inners), clock, call_ns, tpot_ns
        self.failures = failures if failures is not None else DrafterFailures()

    async def propose(self, history: History, width: int, depth: int) -> Sequence[ActionDraft]:
        return await self._charged(lambda inner: inner.propose(history, width, depth))

    async def _charged(self, call: Callable[[Any], Awaitable[Sequence[ActionDraft]] | None]) -> list[ActionDraft]:
        """The drafts of ``call(inner)`` over the inners (an inner it gives None for is
        skipped, one that fails is recorded), after sleeping what one call with them costs."""
        drafts: list[ActionDraft] = []
        for inner in self.inners:
            try:
                pending = call(inner)
                if pending is None:
                    continue
                drafts.extend(await pending)
            except AospecError as exc:
                self.failures.record(inner, exc)
        await self.clock.sleep_ns(self.call_ns + max((d.tokens for d in drafts), default=0) * self.tpot_ns)
        return drafts


class ChargedRoutedActionDrafter(ChargedActionDrafter):
    """A :class:`ChargedActionDrafter` that is also a
    :class:`aospec.protocols.RoutedActionDrafter`: ``propose_routed`` asks the inners that
    have it and costs what a ``propose`` call with those candidates costs."""

    __slots__ = ()

    async def propose_routed(self, history: History, tool: str, width: int) -> Sequence[ActionDraft]:
        def call(inner: Any) -> Awaitable[Sequence[ActionDraft]] | None:
            routed = getattr(inner, "propose_routed", None)
            return None if routed is None else routed(history, tool, width)

        return await self._charged(call)


#: Calls a memoised drafter remembers (then it forgets them all and starts again).
MEMO_SIZE = 8192


class MemoizedObservationDrafter:
    """``inner`` with its drafts remembered by (history, action, n).

    A fitted drafter is a function of its arguments (the LM drafters seed by prompt), and
    the replays of one trace under every policy and TPOT ask it about the same verified
    histories: each is drafted once. ``inner`` is the drafter itself."""

    __slots__ = ("_memo", "inner")

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._memo: dict[tuple[Any, ...], Sequence[ObservationDraft]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)  # the drafter's own attributes (label, options, ...)

    async def draft(self, history: History, action: Action, n: int) -> Sequence[ObservationDraft]:
        key = (history.task, history.turns, action, n)
        found = self._memo.get(key)
        if found is None:
            found = tuple(await self.inner.draft(history, action, n))
            if len(self._memo) >= MEMO_SIZE:
                self._memo.clear()
            self._memo[key] = found
        return found


class MemoizedActionDrafter:
    """An action drafter with its targets remembered (as :class:`MemoizedObservationDrafter`)."""

    __slots__ = ("_memo", "inner")

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._memo: dict[tuple[Any, ...], Sequence[ActionDraft]] = {}

    def __getattr__(self, name: str) -> Any:
        if name == "propose_routed":
            raise AttributeError(name)  # only MemoizedRoutedActionDrafter routes (memoised)
        return getattr(self.inner, name)

    async def _remember(self, key: tuple[Any, ...], call: Callable[[], Awaitable[Sequence[ActionDraft]]]) -> Sequence[ActionDraft]:
        found = self._memo.get(key)
        if found is None:
            found = tuple(await call())
            if len(self._memo) >= MEMO_SIZE:
                self._memo.clear()
            self._memo[key] = found
        return found

    async def propose(self, history: History, width: int, depth: int) -> Sequence[ActionDraft]:
        return await self._remember(
            ("p", history.task, history.turns, width, depth), lambda: self.inner.propose(history, width, depth)
        )


class MemoizedRoutedActionDrafter(MemoizedActionDrafter):
    """:class:`MemoizedActionDrafter` of a drafter that has ``propose_routed``."""

    __slots__ = ()

    async def propose_routed(self, history: History, tool: str, width: int) -> Sequence[ActionDraft]:
        return await self._remember(
            ("r", history.task, history.turns, tool, width), lambda: self.inner.propose_routed(history, tool, width)
        )


class DrafterSet:
    """Drafters and EVD estimators built by name and fit on one fold's training traces.

    ``options`` maps a drafter or kernel name to keyword arguments for its class. Each
    object is built (and fit, if it has ``fit``) once, on first use. Routing policies
    get their own action drafters, built with ``label=`` (:func:`aospec.replay._streams.tool_label`,
    the routers' labels) when their class takes it, and their routers fit on ``train``.
    ``calibrated=True`` action drafters rank by probabilities calibrated on ``train``
    (:meth:`calibration`).
    """

    def __init__(self, train: Sequence[Trace], options: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.train = list(train)
        self.options = dict(options or {})
        self._obs: dict[str, ObservationDrafter] = {}
        self._act: dict[tuple[str, bool], ActionDrafter] = {}
        self._routed_act: dict[tuple[str, bool], ActionDrafter] = {}
        self._calibrations: dict[str, Any] = {}
        self._routers: dict[str, Any] = {}
        self._evd: dict[str, EVDEstimator] = {}
        self._canon: dict[str, ObservationCanonicalizer] = {}

    def construct(self, kind: str, name: str, *, labelled: bool = False) -> Any:
        """A new ``kind`` (a registry kind of :mod:`drafters`) named ``name``, built with its
        options and not fit; ``labelled``: with ``label=tool_label`` too when it takes one."""
        from aospec.drafters import resolve

        cls = resolve(kind, name)
        opts = self.options.get(name, {})
        if not isinstance(opts, Mapping):
            raise ConfigError(f"drafter options for {name!r} must be an object, got {type(opts).__name__}")
        if labelled and "label" not in opts and _takes_label(cls):
            opts = {**opts, "label": tool_label}
        try:
            return cls(**opts)
        except TypeError as exc:
            raise ConfigError(f"{kind} {name!r}: bad options {dict(opts)!r}: {exc}") from None

    def _build(self, kind: str, name: str, *, labelled: bool = False, calibrated: bool = False) -> Any:
        obj = self.construct(kind, name, labelled=labelled)
        fit = getattr(obj, "fit", None)
        if callable(fit) and kind != "EVD kernel":
            fit(self.train)
        if kind == "observation drafter":
            return MemoizedObservationDrafter(obj)
        if kind == "action drafter":
            if calibrated:
                from aospec.drafters.calibration import calibrated as calibrate

                obj = calibrate(obj, name, self.calibration(name))
            routed = callable(getattr(obj, "propose_routed", None))
            return (MemoizedRoutedActionDrafter if routed else MemoizedActionDrafter)(obj)
        return obj

    def observation(self, name: str) -> ObservationDrafter:
        if name not in self._obs:
            self._obs[name] = self._build("observation drafter", name)
        return self._obs[name]

    def action(self, name: str, *, calibrated: bool = False) -> ActionDrafter:
        key = (name, calibrated)
        if key not in self._act:
            self._act[key] = self._build("action drafter", name, calibrated=calibrated)
        return self._act[key]

    def routed_action(self, name: str, *, calibrated: bool = False) -> ActionDrafter:
        """The action drafter ``name`` of routing policies (built with ``label=``)."""
        key = (name, calibrated)
        if key not in self._routed_act:
            self._routed_act[key] = self._build("action drafter", name, labelled=True, calibrated=calibrated)
        return self._routed_act[key]

    def calibration(self, name: str) -> Any:
        """Action drafter ``name``'s calibration for ranking, cross-fit on the training
        traces once (:func:`aospec.drafters.calibration.fit_action_calibration`); None when
        they hold fewer than two tasks."""
        if name not in self._calibrations:
            from aospec.drafters.calibration import fit_action_calibration

            self._calibrations[name] = fit_action_calibration(
                name, lambda: self.construct("action drafter", name), self.train
            )
        return self._calibrations[name]

    def router(self, spec: str) -> Any:
        """The stream router ``spec`` names, fit on the training traces (:func:`load_router`)."""
        if spec not in self._routers:
            self._routers[spec] = load_router(spec, self.train)
        return self._routers[spec]

    def evd(self, kernel: str) -> EVDEstimator:
        if kernel not in self._evd:
            est = EVDEstimator(self._build("EVD kernel", kernel))
            est.fit(self.train)
            self._evd[kernel] = est
        return self._evd[kernel]

    def canonicalizer(self, spec: str) -> ObservationCanonicalizer:
        """The canonicaliser ``spec`` names (built once)."""
        if spec not in self._canon:
            self._canon[spec] = load_canonicalizer(spec)
        return self._canon[spec]

    def charged(
        self,
        policy: Policy,
        clock: VirtualClock,
        trace: Trace,
        actor: ReplayActor,
        world: ReplayWorld,
        failures: DrafterFailures | None = None,
    ) -> tuple[list[Any], list[Any]]:
        """The policy's observation and action drafters for one run, costs charged, failed
        calls counted in ``failures``."""
        failures = failures if failures is not None else DrafterFailures()
        c = policy.config
        call_ns, tpot_ns = ms_to_ns(c.draft_call_ms), ms_to_ns(c.draft_tpot_ms)
        obs: list[Any] = []
        act: list[Any] = []
        if policy.engine.branch_budget > 0 and c.obs_names:
            if "oracle" in c.obs_names:
                obs.append(OracleObservationDrafter(trace, actor))
            real = [self.observation(n) for n in c.obs_names if n != "oracle"]
            if real:
                obs.append(ChargedObservationDrafter(real, clock, call_ns, tpot_ns, failures))
        if policy.engine.fork_width > 0 and c.action_names:
            if "oracle" in c.action_names:
                act.append(OracleActionDrafter(trace, actor, world))
            cal = c.calibrate_actions
            if c.router_names:
                real_a = [self.routed_action(n, calibrated=cal) for n in c.action_names if n != "oracle"]
            else:
                real_a = [self.action(n, calibrated=cal) for n in c.action_names if n != "oracle"]
            if real_a:
                routed = c.router_names and any(callable(getattr(a, "propose_routed", None)) for a in real_a)
                charged = ChargedRoutedActionDrafter if routed else ChargedActionDrafter
                act.append(charged(real_a, clock, call_ns, tpot_ns, failures))
        return obs, act


def _takes_label(cls: Any) -> bool:
    try:
        return "label" in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False
