"""Replaying traces under policies across model speeds (TPOT sweeps).

:func:`replay_trace` runs one trace under several policies at several TPOTs in virtual
time and checks the invariants on every run:

- the committed trajectory equals the recorded one (every action and observation);
- every committed step's decode time is ``D_i`` and its tool time ``T_i`` exactly, and a
  policy that speculates nothing takes exactly ``sum(D_i + T_i)`` (integer nanoseconds);
- no policy beats its matching ceiling (the same engine configuration with free oracle
  drafters, :meth:`aospec.replay.policies.Policy.twin`), replayed under the same state model.

The state model (``recorded``, ``effects`` or ``blind``; ``auto`` picks ``recorded`` when
every trace recorded its versions, else ``effects``: replay/sandbox.py) decides which
recorded steps start from the same filesystem version, and so which forks JASV reuses;
every result names it (``TraceResult.state_model``).

With a host model (``host=``, ``--cores``: replay/contention.py) every run's commands
share one simulated host of that many cores with its background load, so tool times
stretch: then every committed step's tool time is at least ``T_i``, a policy that
speculates nothing takes exactly ``sum(D_i) +`` its committed tool time, every result's
``serial_ns`` is the serial policy's latency on the same host (replayed too), and the
ceiling is reported but not enforced (a ceiling's forks take CPU too, so it is no bound
under contention). :func:`replay_together` replays several traces at once on one host (N
sessions of one machine).

A broken invariant raises EngineError naming the trace and the policy. A drafting call
that fails (an AospecError from a drafter) only loses its candidates; such calls are
counted in ``TraceResult.drafter_failures`` (with the first error in ``drafter_error``).
Virtual time is exact only below 2**53 ns (replay/actor.py): a trace whose serial replay
would come near it is refused with a ConfigError before it runs.

:func:`run_sweep` does this for a set of evaluation traces, fitting drafters only on
training traces: leave-one-task-out when no training set is given, else the given set.
The work is a :class:`SweepJob` (one trace per work item) run by an executor
(replay/executors.py): ``jobs`` local processes unless another executor is given (e.g.
replay/executors_ray.py's RayExecutor). A trace that fails is retried once by every
executor, then reported (SweepTaskError: its trace, and the policy and TPOT whose replay
failed, which :func:`replay_trace` notes on the exception as ``sweep_where``).
:func:`iter_sweep` yields each trace's results as it finishes (``aospec sweep`` streams
them to results.jsonl); :func:`run_sweep` collects them.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
from aospec.replay._input import MAX_FILE_BYTES
from aospec.replay.accuracy import action_accuracy, action_key, observation_accuracy, observation_key
from aospec.replay.actor import ReplayActor, VirtualClock, estimate_tokens, ms_to_ns, seconds_to_ns
from aospec.replay.contention import HostModel, SimulatedHost
from aospec.replay.executors import Executor, local_executor
from aospec.replay.policies import DrafterFailures, DrafterSet, Policy, check_drafters, parse_policy
from aospec.replay.readsets import ReadSetWorld
from aospec.replay.sandbox import ReplayWorld, resolve_state_model

from aospec.engine import Engine
from aospec.errors import ConfigError, EngineError
from aospec.types import Trace

__all__ = [
    "DEFAULT_TPOTS_MS",
    "SweepJob",
    "TraceRef",
    "TraceResult",
    "check_ceiling",
    "check_trajectory",
    "iter_sweep",
    "loading",
    "replay_together",
    "replay_trace",
    "run_sweep",
]

#: Model speeds of a default sweep (ms per output token).
DEFAULT_TPOTS_MS = (20.0, 15.0, 10.0, 5.0, 1.0)

#: Longest serial replay accepted, in virtual nanoseconds: half of the 2**53 ns below which
#: the clock is exact, leaving room for speculative work that outlasts the serial path.
MAX_VIRTUAL_NS = 2**52


@dataclass(frozen=True, slots=True)
class TraceResult:
    """One trace replayed under one policy at one TPOT (times in integer nanoseconds).

    ``hidden_tool_ns``, ``hidden_decode_ns`` and ``overhead_ns`` are the engine's
    :class:`aospec.ledger.EngineStatistics` fields ``tool_hidden_ns``, ``decode_hidden_ns``
    and ``overhead_ns`` (the overhead is 0 in virtual time); ``routes_fired``,
    ``routed_forks_launched`` and ``routed_forks_reused`` are its routing counters (0 for a
    policy without a router); ``wasted_cpu_ns`` is its ``wasted_cpu_ns``, the CPU the
    discarded forks used (metered on a contended host; else their tool time).
    """

    trace_id: str
    task: str
    policy: str
    tpot_ms: float
    steps: int
    actions_executed: int
    serial_ns: int
    latency_ns: int
    decode_ns: int
    tool_ns: int
    wait_actor_ns: int
    wait_tool_ns: int
    ceiling_ns: int
    forks_launched: int
    forks_reused: int
    forks_wasted: int
    drafts_started: int
    drafts_hit: int
    wasted_tool_ns: int
    wasted_decode_ns: int
    unknown_tool_steps: int
    drafts_canonical_hit: int = 0
    drafter_failures: int = 0
    drafter_error: str = ""
    hidden_tool_ns: int = 0
    hidden_decode_ns: int = 0
    overhead_ns: int = 0
    state_model: str = "effects"
    routes_fired: int = 0
    routed_forks_launched: int = 0
    routed_forks_reused: int = 0
    obs_calls_by_length: tuple[int, ...] = (0, 0, 0, 0)
    obs_exact_by_length: tuple[int, ...] = (0, 0, 0, 0)
    action_steps: int = 0
    action_hits_by_width: tuple[int, ...] = ()
    action_targets_by_distance: tuple[int, ...] = ()
    action_hits_by_distance: tuple[int, ...] = ()
    wasted_cpu_ns: int = 0

    @property
    def saving(self) -> float:
        """Fraction of serial latency saved."""
        return 1.0 - self.latency_ns / self.serial_ns if self.serial_ns else 0.0

    def to_json(self) -> dict[str, Any]:
        out = {f: _plain(getattr(self, f)) for f in self.__slots__}  # type: ignore[attr-defined]
        out["saving"] = self.saving
        out["latency_s"] = self.latency_ns * 1e-9
        out["serial_s"] = self.serial_ns * 1e-9
        out["hidden_tool_s"] = self.hidden_tool_ns * 1e-9
        out["hidden_decode_s"] = self.hidden_decode_ns * 1e-9
        return out


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


async def _run_one(
    trace: Trace,
    policy: Policy,
    tpot_ns: int,
    drafters: DrafterSet,
    prefill_ns_per_token: int,
    state_model: str,
    host: SimulatedHost | None = None,
    admission_model: Any = None,
) -> tuple[Any, ReplayActor, ReplayWorld, Engine, DrafterFailures]:
    """One replay of ``trace`` under ``policy`` (``admission_model``: what the speculation
    controller starts from, and learns into; a fresh one when None)."""
    clock = VirtualClock()
    canon = drafters.canonicalizer(policy.config.canonicalizer) if policy.engine.accept == "canonical" else None
    actor = ReplayActor(
        trace, tpot_ns=tpot_ns, clock=clock, prefill_ns_per_token=prefill_ns_per_token, canonicalizer=canon
    )
    world = ReadSetWorld(trace, clock, host) if state_model == "readsets" else ReplayWorld(trace, clock, state_model, host)
    failures = DrafterFailures()
    obs, act = drafters.charged(policy, clock, trace, actor, world, failures)
    evd = drafters.evd(policy.config.kernel) if obs and policy.engine.rank != "likelihood" else None
    router = drafters.router(policy.config.router) if policy.config.router_names else None
    # the engine's controller reads the simulated host (None: a quiet host)
    engine = Engine(
        actor,
        world.sandbox(),
        observation_drafters=obs,
        action_drafters=act,
        evd=evd,
        config=policy.engine,
        clock=clock,
        keep_events=False,
        canonicalizer=canon,
        router=router,
        host=host.host_monitor if host is not None else None,
        admission_model=admission_model,
    )
    history = await engine.run(trace.history(0), steps=len(trace))
    return history, actor, world, engine, failures


def check_trajectory(trace: Trace, history: Any, where: str) -> None:
    """Raise EngineError unless ``history`` holds exactly the recorded steps."""
    turns = history.turns
    if len(turns) != len(trace):
        raise EngineError(f"{where}: committed {len(turns)} steps, the recording has {len(trace)}")
    for i, (turn, step) in enumerate(zip(turns, trace.steps, strict=True)):
        if turn.action != step.action or turn.observation != step.observation:
            raise EngineError(f"{where}: committed step {i + 1} differs from the recording (losslessness broken)")


def check_ceiling(trace_id: str, policy: str, tpot_ms: float, latency_ns: int, ceiling_ns: int) -> None:
    """Raise EngineError if a policy's latency beats its matching ceiling's."""
    if latency_ns < ceiling_ns:
        raise EngineError(
            f"trace {trace_id!r}, policy {policy!r}, TPOT {tpot_ms:g} ms: latency {latency_ns * 1e-9:.6f} s "
            f"beats its ceiling ({ceiling_ns * 1e-9:.6f} s)"
        )


def _check_and_record(
    trace: Trace,
    policy: Policy,
    tpot_ms: float,
    history: Any,
    actor: ReplayActor,
    world: ReplayWorld,
    engine: Engine,
    failures: DrafterFailures,
) -> TraceResult:
    where = f"trace {trace.id!r}, policy {policy.name!r}, TPOT {tpot_ms:g} ms"
    check_trajectory(trace, history, where)
    st = engine.statistics()
    decode_total = sum(actor.decode_ns)
    tool_total = sum(world.tool_ns)
    serial_ns = decode_total + tool_total
    if world.host is None:
        if st.decode_ns != decode_total or st.tool_ns != tool_total:
            raise EngineError(
                f"{where}: committed decode/tool time {st.decode_ns}/{st.tool_ns} ns differs from the "
                f"recorded {decode_total}/{tool_total} ns"
            )
        if not policy.speculates and st.latency_ns != serial_ns:
            raise EngineError(f"{where}: latency {st.latency_ns} ns != sum(D_i + T_i) = {serial_ns} ns")
    else:
        # Contention only ever slows a command, and serial execution overlaps nothing.
        if st.decode_ns != decode_total or st.tool_ns < tool_total:
            raise EngineError(
                f"{where}: committed decode/tool time {st.decode_ns}/{st.tool_ns} ns, recorded "
                f"{decode_total}/{tool_total} ns: contention cannot make a command faster"
            )
        if not policy.speculates and st.latency_ns != decode_total + st.tool_ns:
            raise EngineError(
                f"{where}: serial latency {st.latency_ns} ns != sum(D_i) + its tool time = "
                f"{decode_total + st.tool_ns} ns"
            )
    return TraceResult(
        trace_id=trace.id,
        task=trace.task,
        policy=policy.name,
        tpot_ms=tpot_ms,
        steps=len(trace),
        actions_executed=st.actions_executed,
        serial_ns=serial_ns,
        latency_ns=st.latency_ns,
        decode_ns=st.decode_ns,
        tool_ns=st.tool_ns,
        wait_actor_ns=st.wait_actor_ns,
        wait_tool_ns=st.wait_tool_ns,
        ceiling_ns=-1,
        forks_launched=st.forks_launched,
        forks_reused=st.forks_reused,
        forks_wasted=st.forks_wasted,
        drafts_started=st.drafts_started,
        drafts_hit=st.drafts_hit,
        wasted_tool_ns=st.wasted_tool_ns,
        wasted_decode_ns=st.wasted_decode_ns,
        wasted_cpu_ns=st.wasted_cpu_ns,
        unknown_tool_steps=len(world.unknown_tool_steps),
        drafts_canonical_hit=st.drafts_canonical_hit,
        drafter_failures=failures.count,
        drafter_error=failures.first,
        hidden_tool_ns=st.tool_hidden_ns,
        hidden_decode_ns=st.decode_hidden_ns,
        overhead_ns=st.overhead_ns,
        state_model=world.state_model,
        routes_fired=st.routes_fired,
        routed_forks_launched=st.routed_forks_launched,
        routed_forks_reused=st.routed_forks_reused,
    )


def replay_trace(
    trace: Trace,
    policies: Sequence[Policy],
    tpots_ms: Sequence[float],
    drafters: DrafterSet,
    *,
    prefill_ms_per_ktok: float = 0.0,
    check_ceilings: bool = True,
    seed: int = 0,
    state_model: str = "auto",
    host: HostModel | None = None,
) -> list[TraceResult]:
    """Replay ``trace`` under every policy at every TPOT (one virtual-time event loop).

    Returns one result per (TPOT, policy) in that order; ``ceiling_ns`` holds the matching
    ceiling's latency when ``check_ceilings`` (its ceiling replayed under the same
    ``state_model``: ``recorded``, ``effects``, ``blind``, or ``auto`` = ``recorded`` when
    the trace has its versions, else ``effects``). Results are deterministic for a ``seed``.
    With ``host`` each run's commands share a simulated host of that model (one per run),
    and ``serial_ns`` is the serial policy's latency on it (see the module docstring).
    """
    from trio.testing import MockClock

    if not trace.steps:
        raise ConfigError(f"trace {trace.id!r} has no steps")
    check_tpots(tpots_ms, prefill_ms_per_ktok)
    prefill_ns = ms_to_ns(prefill_ms_per_ktok) // 1000
    check_virtual_time(trace, max(tpots_ms), prefill_ns, host.slowdown() if host is not None else 1.0)
    state_model, _ = resolve_state_model([trace], state_model)
    runs: dict[Any, Policy] = {}
    for p in policies:
        runs.setdefault(p.key, p)
        if check_ceilings:
            runs.setdefault(p.twin().key, p.twin())
    serial = _serial_policy() if host is not None else None
    if serial is not None:
        runs.setdefault(serial.key, serial)

    async def main() -> list[TraceResult]:
        out: list[TraceResult] = []
        for tpot_ms in tpots_ms:
            tpot_ns = ms_to_ns(tpot_ms)
            by_key: dict[Any, TraceResult] = {}
            for key, policy in runs.items():
                try:
                    sim = SimulatedHost(host, VirtualClock()) if host is not None else None
                    history, actor, world, engine, failures = await _run_one(
                        trace, policy, tpot_ns, drafters, prefill_ns, state_model, sim
                    )
                    by_key[key] = _check_and_record(trace, policy, tpot_ms, history, actor, world, engine, failures)
                except Exception as exc:
                    _mark(exc, trace.id, policy.name, tpot_ms)
                    raise
            for p in policies:
                r = by_key[p.key]
                if serial is not None:
                    r = _with(r, serial_ns=by_key[serial.key].latency_ns)
                if check_ceilings:
                    ceiling = by_key[p.twin().key]
                    if host is None:
                        try:
                            check_ceiling(trace.id, p.name, tpot_ms, r.latency_ns, ceiling.latency_ns)
                        except EngineError as exc:
                            _mark(exc, trace.id, p.name, tpot_ms)
                            raise
                    r = _with(r, policy=p.name, ceiling_ns=ceiling.latency_ns)
                else:
                    r = _with(r, policy=p.name)
                out.append(r)
        return out

    _seed_trio_scheduler(seed)
    results = anyio.run(main, backend="trio", backend_options={"clock": MockClock(autojump_threshold=0)})
    accuracy = _accuracy(trace, policies, drafters, tpots_ms[0])
    return [_with(r, **accuracy[r.policy]) for r in results]


def _accuracy(trace: Trace, policies: Sequence[Policy], drafters: DrafterSet, tpot_ms: float) -> dict[str, dict[str, Any]]:
    """The drafter counts of each policy on ``trace`` (aospec.replay.accuracy), computed once
    per distinct observation and action key; a failure names the policy (and the first TPOT)."""
    obs_counts: dict[Any, tuple[Any, ...]] = {}
    action_counts: dict[Any, tuple[Any, ...]] = {}
    out: dict[str, dict[str, Any]] = {}
    for p in policies:
        try:
            ok, ak = observation_key(p), action_key(p)
            if ok not in obs_counts:
                obs_counts[ok] = observation_accuracy(trace, p, drafters)
            if ak not in action_counts:
                action_counts[ak] = action_accuracy(trace, p, drafters)
        except Exception as exc:
            _mark(exc, trace.id, p.name, tpot_ms)
            raise
        (calls, hits), (steps, widths, targets, dists) = obs_counts[ok], action_counts[ak]
        out[p.name] = {
            "obs_calls_by_length": calls,
            "obs_exact_by_length": hits,
            "action_steps": steps,
            "action_hits_by_width": widths,
            "action_targets_by_distance": targets,
            "action_hits_by_distance": dists,
        }
    return out


def replay_together(
    traces: Sequence[Trace],
    policies: Sequence[Policy],
    tpot_ms: float,
    drafters: DrafterSet,
    host: HostModel,
    *,
    prefill_ms_per_ktok: float = 0.0,
    seed: int = 0,
    state_model: str = "auto",
) -> list[list[TraceResult]]:
    """Replay ``traces`` as concurrent sessions of one host: per policy, every trace at once
    (each its own engine, all starting at time 0) on one simulated host of ``host``'s model,
    at ``tpot_ms``. Returns, per policy, one result per trace (in the order given); each
    result's ``serial_ns`` is its trace's latency when every session runs serially on the
    same host at once (the serial policy is replayed too), ``ceiling_ns`` is -1. Every
    session is checked as :func:`replay_trace` checks a run (lossless, times)."""
    from trio.testing import MockClock

    if not traces:
        raise ConfigError("no traces to replay together")
    if any(not t.steps for t in traces):
        raise ConfigError(f"trace {next(t.id for t in traces if not t.steps)!r} has no steps")
    check_tpots([tpot_ms], prefill_ms_per_ktok)
    prefill_ns = ms_to_ns(prefill_ms_per_ktok) // 1000
    for t in traces:
        check_virtual_time(t, tpot_ms, prefill_ns, host.slowdown(len(traces)))
    state_model, _ = resolve_state_model(traces, state_model)
    serial = _serial_policy()
    runs = {serial.key: serial}
    for p in policies:
        runs.setdefault(p.key, p)
    tpot_ns = ms_to_ns(tpot_ms)

    async def together(policy: Policy) -> list[TraceResult]:
        sim = SimulatedHost(host, VirtualClock())
        out: list[TraceResult | None] = [None] * len(traces)

        async def one(k: int) -> None:
            trace = traces[k]
            try:
                done = await _run_one(trace, policy, tpot_ns, drafters, prefill_ns, state_model, sim)
                out[k] = _check_and_record(trace, policy, tpot_ms, *done)
            except Exception as exc:
                _mark(exc, trace.id, policy.name, tpot_ms)
                raise

        try:
            async with anyio.create_task_group() as tg:
                for k in range(len(traces)):
                    tg.start_soon(one, k)
        except BaseExceptionGroup as group:
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None  # the one session that failed, as itself
            raise
        return [r for r in out if r is not None]

    async def main() -> list[list[TraceResult]]:
        by_key = {key: await together(p) for key, p in runs.items()}
        serial_runs = by_key[serial.key]
        return [
            [_with(r, policy=p.name, serial_ns=s.latency_ns) for r, s in zip(by_key[p.key], serial_runs, strict=True)]
            for p in policies
        ]

    _seed_trio_scheduler(seed)
    return anyio.run(main, backend="trio", backend_options={"clock": MockClock(autojump_threshold=0)})


def check_tpots(tpots_ms: Sequence[float], prefill_ms_per_ktok: float = 0.0) -> None:
    """ConfigError unless the TPOTs are positive, finite and distinct (a repeated TPOT would
    count every trace twice in its summary) and the prefill rate is finite and >= 0."""
    if not tpots_ms:
        raise ConfigError("no TPOTs given")
    bad = [t for t in tpots_ms if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0)]
    if bad:
        raise ConfigError(f"TPOTs must be positive finite numbers of ms, got {bad[0]!r}")
    repeated = sorted({t for t in tpots_ms if list(tpots_ms).count(t) > 1})
    if repeated:
        raise ConfigError(f"TPOT {repeated[0]:g} ms listed twice (each TPOT once)")
    if not (math.isfinite(prefill_ms_per_ktok) and prefill_ms_per_ktok >= 0):
        raise ConfigError(f"prefill ms per 1k tokens must be finite and >= 0, got {prefill_ms_per_ktok!r}")


def check_virtual_time(trace: Trace, tpot_ms: float, prefill_ns_per_token: int = 0, slowdown: float = 1.0) -> None:
    """ConfigError if replaying ``trace`` serially at ``tpot_ms`` would take more than
    MAX_VIRTUAL_NS (an over-estimate of the prefill model counts every text in full);
    ``slowdown``: the most contention can stretch its tool time
    (:meth:`aospec.replay.contention.HostModel.slowdown`)."""
    tpot_ns = ms_to_ns(tpot_ms)
    total = 0
    for s in trace.steps:
        total += s.output_tokens * tpot_ns
        if s.tool_duration_s is not None:
            total += math.ceil(seconds_to_ns(s.tool_duration_s) * slowdown)
        if prefill_ns_per_token:
            total += estimate_tokens(s.observation) * prefill_ns_per_token
    if prefill_ns_per_token:
        total += estimate_tokens(trace.instruction or trace.task) * prefill_ns_per_token
    if total > MAX_VIRTUAL_NS:
        raise ConfigError(
            f"trace {trace.id!r} would replay for {total / 8.64e13:,.0f} days of virtual time at {tpot_ms:g} ms/token; "
            f"replay is exact only up to {MAX_VIRTUAL_NS / 8.64e13:.0f} days: split the trace or fix its durations"
        )


@functools.cache
def _serial_policy() -> Policy:
    return parse_policy("serial")


def _seed_trio_scheduler(seed: int) -> None:
    """Make trio's order among tasks woken at the same virtual instant reproducible.

    Latencies never depend on that order, but which speculative fork was launched first at
    a tie (and so the waste counters) can. trio draws that order from a module-level
    random.Random, seeded here. Seeding alone leaves the order of each batch of woken tasks
    to the order they were woken in, which for sleeps ending at the same virtual instant is
    trio's deadline heap's tie-break, ``id()`` of their cancel scopes: memory addresses,
    which differ from process to process (and so between two ``--jobs 2`` runs). trio's
    deterministic mode (``_ALLOW_DETERMINISTIC_SCHEDULING``, what its Hypothesis plugin
    turns on) sorts each batch by task creation order before the seeded shuffle, so the
    order no longer depends on addresses; on the bundled sample it changes no result. On
    the 47 tb1 trials (``aospec sweep DIR --jobs 2``, run twice) the counters of 3 of 1,880
    rows differed between two runs without it (forks_launched, forks_wasted, drafts_started,
    drafts_hit; latencies equal), none with it.
    """
    import trio

    run = getattr(getattr(trio, "_core", None), "_run", None)
    rng = getattr(run, "_r", None)
    if rng is not None and hasattr(rng, "seed"):
        rng.seed(seed)
    if run is not None and hasattr(run, "_ALLOW_DETERMINISTIC_SCHEDULING"):
        run._ALLOW_DETERMINISTIC_SCHEDULING = True


def _mark(exc: BaseException, trace_id: str, policy: str, tpot_ms: float) -> None:
    """Note on ``exc`` the replay it broke (``sweep_where``: trace id, policy name, TPOT),
    unless an inner replay already did; executors name them when they report the failure."""
    if getattr(exc, "sweep_where", None) is None:
        with contextlib.suppress(AttributeError, TypeError):
            exc.sweep_where = (trace_id, policy, tpot_ms)  # type: ignore[attr-defined]


def _with(r: TraceResult, **changes: Any) -> TraceResult:
    from dataclasses import replace

    return replace(r, **changes)


# ---------------------------------------------------------------------- sweeps


@dataclass(frozen=True, slots=True)
class TraceRef:
    """An evaluation trace by reference: its id, task and step count, and the file it is
    read from (``format``, at most ``max_file_bytes``). A sweep of references holds no
    steps on the driver or in the job; each worker reads a trace when it replays it
    (:meth:`load`) and drops it after. ``len(ref)`` is its step count."""

    id: str
    task: str
    path: str
    steps: int
    format: str = "auto"
    max_file_bytes: int = MAX_FILE_BYTES

    def __len__(self) -> int:
        return self.steps

    def load(self) -> Trace:
        from aospec.replay.io import import_traces

        for t in import_traces(self.path, self.format, max_file_bytes=self.max_file_bytes).traces:
            if t.id == self.id:
                return t
        raise ConfigError(f"trace {self.id!r} is no longer in {self.path}")

    @classmethod
    def of(cls, trace: Trace, path: Any, format: str = "auto", max_file_bytes: int = MAX_FILE_BYTES) -> TraceRef:
        """The reference to ``trace``, read from ``path`` (an ``import_traces`` ``keep``)."""
        return cls(trace.id, trace.task, str(path), len(trace), format, max_file_bytes)


def _loaded(t: Trace | TraceRef) -> Trace:
    return t.load() if isinstance(t, TraceRef) else t


class _Loading(Sequence[Trace]):
    """``traces`` with each reference read as it is reached (one at a time)."""

    def __init__(self, traces: Sequence[Trace | TraceRef]) -> None:
        self.traces = traces

    def __len__(self) -> int:
        return len(self.traces)

    def __getitem__(self, i: Any) -> Any:
        return _loaded(self.traces[i])

    def __iter__(self) -> Iterator[Trace]:
        return (_loaded(t) for t in self.traces)


def loading(traces: Sequence[Trace | TraceRef]) -> Sequence[Trace]:
    """``traces`` as a sequence of traces that reads each :class:`TraceRef` when reached, so
    that a pass over many references holds one trace at a time."""
    return _Loading(traces)


@dataclass(eq=False)
class SweepJob:
    """The work of a sweep: ``job(index)`` replays evaluation trace ``index`` under every
    policy at every TPOT. Picklable (an executor sends it to each worker once); it keeps the
    drafter sets of the last few folds it built, so a worker fits each fold once. Evaluation
    traces given as :class:`TraceRef` are read in the worker, one item at a time."""

    eval_traces: Sequence[Trace | TraceRef]
    train_traces: Sequence[Trace] | None
    policies: Sequence[Policy]
    tpots_ms: Sequence[float]
    drafter_options: Mapping[str, Mapping[str, Any]]
    prefill_ms_per_ktok: float = 0.0
    check_ceilings: bool = True
    state_model: str = "auto"
    host: HostModel | None = None
    _folds: dict[str, DrafterSet] = field(default_factory=dict, repr=False)

    def fold(self, index: int) -> DrafterSet:
        """The drafters for evaluation trace ``index``: fit on the training set, else on
        every trace of another task (leave-one-task-out)."""
        trace = self.eval_traces[index]
        key = "train" if self.train_traces is not None else trace.task
        folds = self._folds
        if key not in folds:
            train = self.train_traces
            if train is None:
                train = [_loaded(t) for t in self.eval_traces if t.task != trace.task]
            if len(folds) >= 4:
                folds.pop(next(iter(folds)))
            folds[key] = DrafterSet(train, self.drafter_options)
        return folds[key]

    def __call__(self, index: int) -> list[TraceResult]:
        return replay_trace(
            _loaded(self.eval_traces[index]),
            self.policies,
            self.tpots_ms,
            self.fold(index),
            prefill_ms_per_ktok=self.prefill_ms_per_ktok,
            check_ceilings=self.check_ceilings,
            state_model=self.state_model,
            host=self.host,
        )


def iter_sweep(
    eval_traces: Sequence[Trace | TraceRef],
    policies: Sequence[Policy],
    *,
    train_traces: Sequence[Trace] | None = None,
    tpots_ms: Sequence[float] = DEFAULT_TPOTS_MS,
    jobs: int = 1,
    drafter_options: Mapping[str, Mapping[str, Any]] | None = None,
    prefill_ms_per_ktok: float = 0.0,
    check_ceilings: bool = True,
    executor: Executor | None = None,
    state_model: str = "auto",
    host: HostModel | None = None,
) -> Iterator[tuple[int, list[TraceResult]]]:
    """:func:`run_sweep` as a stream: yields ``(index, results)`` for each evaluation trace
    (its index in ``eval_traces``; its results ordered by TPOT, then policy) as soon as it
    finishes, in the order traces finish. Nothing is kept after it is yielded, so a caller
    that writes each trace's results out (``aospec sweep``: replay/report.py's
    :class:`aospec.replay.report.ResultsFile`) holds only the traces in flight.

    The arguments are checked before the first trace runs (ConfigError). A trace that
    fails is retried once by the executor, then reported (:class:`aospec.replay.executors.SweepTaskError`,
    naming the trace, policy and TPOT); the stream ends there, after the traces that
    finished before it. Closing the generator early stops the executor's workers.

    Evaluation traces given as :class:`TraceRef` are read one at a time for the checks and
    in the workers for their replays: the driver and the job hold no steps. ``host``: every
    trace is replayed alone on a simulated host of that model (:func:`replay_trace`).
    """
    traces = list(eval_traces)
    if not traces:
        raise ConfigError("no evaluation traces")
    if (
        train_traces is None
        and len({t.task for t in traces}) < 2
        and any(p.speculates and not p.is_oracle for p in policies)
    ):
        raise ConfigError("leave-one-task-out needs traces of at least two tasks; give a training set with --train")
    if jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {jobs}")
    check_tpots(tpots_ms, prefill_ms_per_ktok)
    prefill_ns = ms_to_ns(prefill_ms_per_ktok) // 1000
    for t in loading(traces):
        check_virtual_time(t, max(tpots_ms), prefill_ns, host.slowdown() if host is not None else 1.0)
    state_model, _ = resolve_state_model(loading(traces), state_model)
    check_drafters(policies, drafter_options)
    order = sorted(range(len(traces)), key=lambda i: (traces[i].task, traces[i].id))
    job = SweepJob(
        traces,
        list(train_traces) if train_traces is not None else None,
        list(policies),
        list(tpots_ms),
        dict(drafter_options or {}),
        prefill_ms_per_ktok,
        check_ceilings,
        state_model,
        host,
    )
    if executor is None:
        executor = local_executor(min(jobs, len(traces), os.cpu_count() or 1))
    return _stream(executor, job, order)


def _stream(executor: Executor, job: SweepJob, order: list[int]) -> Iterator[tuple[int, list[TraceResult]]]:
    done = executor.map_unordered(job, order)
    try:
        yield from done
    finally:
        close = getattr(done, "close", None)
        if close is not None:
            close()  # stops the executor's workers when the sweep ends early


def run_sweep(
    eval_traces: Sequence[Trace],
    policies: Sequence[Policy],
    *,
    train_traces: Sequence[Trace] | None = None,
    tpots_ms: Sequence[float] = DEFAULT_TPOTS_MS,
    jobs: int = 1,
    drafter_options: Mapping[str, Mapping[str, Any]] | None = None,
    prefill_ms_per_ktok: float = 0.0,
    check_ceilings: bool = True,
    on_trace_done: Callable[[Trace], None] | None = None,
    executor: Executor | None = None,
    state_model: str = "auto",
    host: HostModel | None = None,
) -> list[TraceResult]:
    """Replay every evaluation trace under every policy at every TPOT.

    ``state_model`` applies to the whole set: ``recorded`` (ConfigError naming the first
    trace and step without recorded versions), ``effects``, ``blind``, or ``auto``:
    ``recorded`` when every trace has its versions, else ``effects``
    (:func:`aospec.replay.sandbox.resolve_state_model`).

    Drafters are fit on ``train_traces`` when given, else leave-one-task-out (each trace's
    drafters see only traces of other tasks; a set with a single task cannot be swept that
    way). The traces are replayed by ``executor`` (default: ``jobs`` local processes, in
    this process for one). Results are ordered by trace, then TPOT, then policy. Every
    result is held in memory; :func:`iter_sweep` streams them instead. ``host``: replay
    each trace on a simulated host of that model (``--cores``; replay/contention.py).
    """
    traces = list(eval_traces)
    results: dict[int, list[TraceResult]] = {}
    for i, trace_results in iter_sweep(
        traces,
        policies,
        train_traces=train_traces,
        tpots_ms=tpots_ms,
        jobs=jobs,
        drafter_options=drafter_options,
        prefill_ms_per_ktok=prefill_ms_per_ktok,
        check_ceilings=check_ceilings,
        executor=executor,
        state_model=state_model,
        host=host,
    ):
        results[i] = trace_results
        if on_trace_done is not None:
            on_trace_done(traces[i])
    return [r for i in range(len(traces)) for r in results[i]]
