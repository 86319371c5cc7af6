"""A mini-swe-agent-style bash agent on the engine (``aospec run``).

The agent owns its loop and drives :meth:`aospec.engine.Engine.session`: per step it asks
the session for the actor's next action (``decode``) and runs it (``execute``: JASV,
execute, commit). Each action is one command in a fresh shell of the sandbox (the runtime
sandboxes start a new shell per command), so the filesystem is the only state carried
from one step to the next, as in mini-swe-agent.

- **Templates** belong to the actor's :class:`aospec.live.chat.ChatFormat` (system and instance
  templates, the format-error message); the agent passes them through.
- **Format errors.** A reply without exactly one bash block is ``Action.none()``; the
  sandboxes run nothing for it and answer ``""``. The agent's sandbox wrapper
  (:class:`FormatErrorSandbox`) answers it with the chat format's ``format_error``
  instead, in the committed sandbox and in every fork alike, so the observation the actor
  sees (and the trace records) is the same in serial and speculative runs.
- **Observations** are mini-swe-agent 1.7's text (:data:`OBSERVATION_FORMAT`, which the
  harness asks its sandbox for: ``SandboxConfig(formatter=OBSERVATION_FORMAT)``; the
  runtime itself favours no harness).
- **Stops** when a command's output submits (:func:`submission`, mini-swe-agent's rule),
  at the step limit, or on an error (the exception propagates after the steps committed
  so far were reported to ``on_step``).
- ``speculate=False`` runs the same actor and sandbox serially: no drafters, no forks; the
  serial baseline whose trajectory a speculative run must reproduce exactly.
- **Drafters**: the cheap defaults of the ``aospec`` replay policy
  (:func:`default_drafters`), fitted on training traces when given. A drafter that raises
  or hangs costs only speed: the engine counts the failure and drops that drafter's
  candidates, and drafting still running when the real observation (or the next
  boundary) arrives is cancelled.
- **The speculation controller** prices every guess (docs/engine.md): ``host`` (default
  :class:`aospec.host.ProcHostMonitor`, this host's load), ``budget`` (the host's
  :class:`aospec.host.SpeculationBudget`) and ``admission_model`` (what it has learned,
  e.g. loaded with ``AdmissionModel.load``) go to the engine of a speculative run.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from aospec.runtime.observation import CommandResult, MiniSweAgentFormatter

from aospec.admission import AdmissionModel
from aospec.engine import Engine
from aospec.engine_config import EngineConfig
from aospec.errors import AospecError
from aospec.evd import EVDEstimator
from aospec.host import ProcHostMonitor, SpeculationBudget
from aospec.ledger import EngineStatistics
from aospec.protocols import CachingSandbox, HostMonitor, MeteredSandbox, Sandbox
from aospec.readsets import ReadSet, WriteSet
from aospec.types import Action, History, Trace
from aospec.wrappers import SandboxWrapper

__all__ = [
    "OBSERVATION_FORMAT",
    "SUBMIT_MARKERS",
    "Agent",
    "AgentResult",
    "Drafters",
    "FormatErrorSandbox",
    "ObservationFormatWarning",
    "StepRecord",
    "default_drafters",
    "serial_config",
    "submission",
    "submitted",
]

#: First output line that ends the run: mini-swe-agent 2.x's marker and 1.x's.
SUBMIT_MARKERS = ("COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", "MINI_SWE_AGENT_FINAL_OUTPUT")

#: The observation format of this agent's sandbox (``SandboxConfig(formatter=...)``):
#: mini-swe-agent 1.7's text, as in the tb1 traces the drafters learn from. The harness
#: chooses it (the runtime's default is the raw output) and reads submissions back with
#: its inverse (:func:`submission`).
OBSERVATION_FORMAT = "mini-swe-agent"


class ObservationFormatWarning(UserWarning):
    """A command's observation is not in the agent's format (:data:`OBSERVATION_FORMAT`)."""


def submitted(result: CommandResult) -> str | None:
    """The submission when the command ``result`` submits, else None.

    mini-swe-agent 2.x's rule (``environments/local.py``, ``_check_finished``): the
    command's output, leading whitespace stripped, has as its first line (stripped)
    ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` and the command exited 0; the submission is
    the rest of the output. 1.x's marker ``MINI_SWE_AGENT_FINAL_OUTPUT`` is accepted the same
    way. A timed-out command never submits.
    """
    if result.timed_out or result.returncode != 0:
        return None
    lines = result.output.lstrip().splitlines(keepends=True)
    if lines and lines[0].strip() in SUBMIT_MARKERS:
        return "".join(lines[1:])
    return None


def submission(observation: str) -> str | None:
    """The submission when ``observation`` (a command's result in this agent's format,
    :data:`OBSERVATION_FORMAT`) submits, else None: :func:`submitted` on the result the
    format's inverse reads back (a format error or any other text never submits)."""
    result = MiniSweAgentFormatter.parse(observation)
    return None if result is None else submitted(result)


@dataclass(frozen=True)
class Drafters:
    """What a speculative run drafts with: observation and action drafters, the EVD
    estimator, and the engine configuration."""

    observation: tuple[Any, ...] = ()
    action: tuple[Any, ...] = ()
    evd: EVDEstimator | None = None
    config: EngineConfig = field(default_factory=EngineConfig)


def default_drafters(
    train: Sequence[Trace] = (), policy: str = "aospec", options: Mapping[str, Mapping[str, Any]] | None = None
) -> Drafters:
    """The drafters and engine configuration of the replay policy ``policy`` (default
    ``aospec``: the patterns and cache observation drafters, the history action drafter,
    EVD with the pattern kernel), fitted on ``train``; built by replay/policies.py's own
    builder, so live runs and replays speculate alike (``options``: keyword options per
    drafter name, as ``aospec sweep --drafter-options``, e.g. ``{"lm": {"model": "OUT"}}``).
    The history drafter gets the routers' label rule (``aospec.specbox.routers.tool_label``)
    for ``propose_routed``."""
    from aospec.replay.policies import DrafterSet, check_drafter_names, parse_policy

    p = parse_policy(policy)
    check_drafter_names([p])
    if "oracle" in p.config.obs_names or "oracle" in p.config.action_names:
        raise AospecError(f"policy {policy!r} uses the oracle drafter, which only exists in replay")
    ds = DrafterSet(list(train), options)
    obs = tuple(ds.observation(n) for n in p.config.obs_names) if p.engine.branch_budget > 0 else ()
    # routed_action: a drafter that takes a label rule (the history drafter, for
    # propose_routed) gets the routers' (tool_label)
    act = (
        tuple(ds.routed_action(n, calibrated=p.config.calibrate_actions) for n in p.config.action_names)
        if p.engine.fork_width > 0
        else ()
    )
    evd = ds.evd(p.config.kernel) if obs and p.engine.rank != "likelihood" else None
    return Drafters(obs, act, evd, p.engine)


def serial_config() -> EngineConfig:
    """The serial baseline's configuration: no observation or action speculation."""
    return EngineConfig(branch_budget=0, fork_width=0, provisional_targets=False)


class FormatErrorSandbox(SandboxWrapper):
    """A sandbox (and, through ``fork``, each of its forks) whose answer to
    ``Action.none()`` (or to a tool call of another tool than ``bash``) is
    ``format_error``; everything else goes to ``inner``.

    A :class:`aospec.wrappers.SandboxWrapper`: the inner sandbox's result cache
    (``last_cache_hit_ns``, ``cache_counts``) and priority (``set_priority``) pass through
    when it has them, else they are absent; ``last_cache_hit_ns`` is None after an answer
    given here (nothing ran, and no cache served it).

    ``last_cpu_ns`` is the CPU time of the command whose result this sandbox holds last: its
    own last ``execute``, or the committed fork's (its ``commit``); 0 after an answer given
    here, None when the inner sandbox is not a :class:`aospec.protocols.MeteredSandbox`."""

    def __init__(self, inner: Sandbox, format_error: str) -> None:
        super().__init__(inner)
        self.format_error = format_error
        self._answered_here = False
        self._metered = isinstance(self, MeteredSandbox)
        self.last_cpu_ns: int | None = None

    def _forwarded_cache_hit_ns(self) -> int | None:
        return None if self._answered_here else super()._forwarded_cache_hit_ns()

    def answered(self, observation: str) -> bool:
        """Whether ``observation`` is this wrapper's own answer (the format error)."""
        return observation == self.format_error

    async def execute(self, action: Action) -> str:
        if action.is_none or action.command is None:
            # No action, or a tool call of a tool other than bash (mini-swe-agent 2.x answers
            # an unknown tool with its format error too): nothing runs.
            self._answered_here = True
            self.last_cpu_ns = 0 if self._metered else None
            return self.format_error
        self._answered_here = False
        if not self._metered:
            return await self.inner.execute(action)
        before = cast(MeteredSandbox, self.inner).cpu_ns
        observation = await self.inner.execute(action)
        self.last_cpu_ns = cast(MeteredSandbox, self.inner).cpu_ns - before
        return observation

    async def fork(self) -> FormatErrorSandbox:
        return FormatErrorSandbox(await self.inner.fork(), self.format_error)

    async def commit(self, fork: FormatErrorSandbox) -> None:
        await super().commit(fork)
        self.last_cpu_ns = fork.last_cpu_ns


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One committed step of a live run.

    ``reply`` is the actor's reply that decoded it (None for actors that keep none);
    versions are the committed sandbox's exact content versions around the step; times are
    nanoseconds of the engine's clock: ``boundary_ns`` (from the run's start) is when the
    agent asked for the action, ``wait_actor_ns``/``wait_tool_ns`` what the step waited for
    the actor and the tool, ``tool_ns`` the tool time of the committed execution,
    ``tool_hidden_ns`` the part of it that ran while the actor decoded (a reused fork);
    ``tool_cpu_ns`` the CPU time that execution used (None when the sandbox does not meter
    its commands: :class:`aospec.protocols.MeteredSandbox`).
    ``tool_hidden_ns`` the part of it that ran while the actor decoded (a reused fork).
    ``read_set``/``write_set``: what the step's command read and wrote, with
    ``Agent(record_access=True)`` (a read set where the sandbox traced it: ``read_sets="all"``).
    """

    index: int
    action: Action
    observation: str
    reply: Any
    version_before: str
    version_after: str
    boundary_ns: int
    wait_actor_ns: int
    wait_tool_ns: int
    tool_ns: int
    tool_hidden_ns: int
    fork_reused: bool
    draft_hit: bool
    tool_cpu_ns: int | None = None
    read_set: ReadSet | None = None
    write_set: WriteSet | None = None


@dataclass(frozen=True)
class AgentResult:
    """The outcome of :meth:`Agent.run`.

    ``exit_reason``: ``submitted``, ``step_limit``, ``no_action`` (``stop_on_no_action``),
    ``error`` or ``interrupted``; ``error`` the one-line message of a failed run.
    """

    task: str
    history: History
    steps: tuple[StepRecord, ...]
    exit_reason: str
    submission: str | None
    statistics: EngineStatistics
    wall_s: float
    version_before: str
    final_version: str
    speculate: bool
    error: str | None = None
    cache_counts: Mapping[str, int] | None = None

    def summary(self) -> dict[str, Any]:
        """The figures of the run as JSON-ready data (``aospec run --format json``).

        ``routes_fired``, ``routed_forks_launched``/``_reused``: router events during the
        decodes and the forks launched from them (and reused); ``cache_hits``,
        ``cache_saved_s``: committed steps the result cache served, and the tool time their
        entries took when they really ran; ``cache``: the cache's own counters over every
        execute, speculative forks' included (None without a cache). The speculation
        controller's: ``wasted_cpu_s`` (CPU of the discarded forks; their tool time where
        the sandbox meters no CPU), ``efficiency`` (tool seconds hidden per wasted
        CPU-second; None when nothing was wasted), ``admission`` (candidates launched,
        refused by reason, let through as probes, steps under the guard) and
        ``forks_paused``, ``paused_s``, ``forks_dropped``."""
        s = self.statistics
        return {
            "exit_reason": self.exit_reason,
            "error": self.error,
            "speculate": self.speculate,
            "steps": len(self.steps),
            "wall_s": round(self.wall_s, 6),
            "latency_s": round(s.latency_s, 6),
            "decode_s": round(s.decode_time_s, 6),
            "tool_s": round(s.tool_time_s, 6),
            "tool_hidden_s": round(s.tool_time_hidden_s, 6),
            "decode_hidden_s": round(s.decode_time_hidden_s, 6),
            "overhead_s": round(s.overhead_s, 6),
            "forks_launched": s.forks_launched,
            "forks_reused": s.forks_reused,
            "forks_wasted": s.forks_wasted,
            "drafts_started": s.drafts_started,
            "drafts_hit": s.drafts_hit,
            "speculative_failures": s.speculative_failures,
            "wasted_tool_s": round(s.speculative_tool_time_wasted_s, 6),
            "wasted_decode_s": round(s.provisional_decode_wasted_s, 6),
            "routes_fired": s.routes_fired,
            "routed_forks_launched": s.routed_forks_launched,
            "routed_forks_reused": s.routed_forks_reused,
            "cache_hits": s.cache_hits,
            "cache_saved_s": round(s.cache_saved_ns * 1e-9, 6),
            "cache": dict(self.cache_counts) if self.cache_counts is not None else None,
            "wasted_cpu_s": round(s.wasted_cpu_s, 6),
            "efficiency": round(s.efficiency, 4) if s.efficiency is not None else None,
            "admission": {
                "launched": s.admitted,
                "refused": {
                    "price": s.refused_price,
                    "guard": s.refused_guard,
                    "budget": s.refused_budget,
                    "memory": s.refused_memory,
                },
                "probes": s.probes,
                "guarded_steps": s.guarded_steps,
                # drafting rounds not run (not worth their CPU at the host's price), and
                # those run all the same as probes
                "drafting_skipped": s.drafting_skipped,
                "drafting_probes": s.drafting_probes,
            },
            "forks_paused": s.forks_paused,
            "paused_s": round(s.paused_ns * 1e-9, 6),
            "forks_dropped": s.forks_dropped,
            "version_before": self.version_before,
            "final_version": self.final_version,
            "submission": self.submission,
        }


OnStep = Callable[[StepRecord, EngineStatistics], None]


class Agent:
    """A bash agent: ``actor`` decides, ``sandbox`` (the committed sandbox of an open
    runtime session) executes.

    ``format_error`` answers replies without exactly one action (default: the actor's
    ``chat_format.format_error``, else aospec.live.chat's default). ``drafters`` (default: none
    fitted, i.e. :func:`default_drafters` on no traces) only matter with
    ``speculate=True``. ``step_limit`` 0 means none. ``on_step(step, statistics)`` is
    called after every committed step (the recorder and the progress line hang here);
    an exception from it ends the run. ``router`` (an ``aospec.protocols.StreamRouter``,
    e.g. ``aospec.specbox.routers.ParseRouter()``) reads each decode's stream when the actor
    streams (``decode_streaming``); its events go to ``route_listeners`` (e.g.
    ``aospec.specbox.pool.router_adapter(pool)``) and, speculating, to the action drafters that
    have ``propose_routed``. The serial engine gets the router too (its events are only
    counted and passed to the listeners: no drafters, no forks). ``host``, ``budget`` and
    ``admission_model`` are the speculation controller's (module docstring; ``host`` None:
    this host's :class:`aospec.host.ProcHostMonitor`).
    counted and passed to the listeners: no drafters, no forks). ``record_access`` keeps each
    step's read and write sets in its :class:`StepRecord` (docs/engine.md, "Read sets").
    """

    def __init__(
        self,
        actor: Any,
        sandbox: Sandbox,
        *,
        speculate: bool = True,
        drafters: Drafters | None = None,
        step_limit: int = 50,
        format_error: str | None = None,
        stop_on_no_action: bool = False,
        on_step: OnStep | None = None,
        router: Any = None,
        route_listeners: Sequence[Callable[[Any], None]] = (),
        host: HostMonitor | None = None,
        budget: SpeculationBudget | None = None,
        admission_model: AdmissionModel | None = None,
        record_access: bool = False,
    ) -> None:
        if step_limit < 0:
            raise AospecError(f"step limit must be >= 0 (0: none), got {step_limit}")
        if format_error is None:
            fmt = getattr(actor, "chat_format", None)
            format_error = getattr(fmt, "format_error", None)
            if format_error is None:
                from aospec.live.chat import DEFAULT_FORMAT_ERROR

                format_error = DEFAULT_FORMAT_ERROR
        self.actor = actor
        self.sandbox = FormatErrorSandbox(sandbox, format_error)
        self.speculate = speculate
        self.step_limit = step_limit
        self.stop_on_no_action = stop_on_no_action
        self._warned_format = False
        self.on_step = on_step
        self.record_access = record_access
        routing: dict[str, Any] = {}
        if router is not None or route_listeners:
            routing = {"router": router, "route_listeners": tuple(route_listeners)}
        if speculate:
            d = drafters if drafters is not None else default_drafters(())
            self.engine = Engine(
                actor,
                self.sandbox,
                observation_drafters=d.observation,
                action_drafters=d.action,
                evd=d.evd,
                config=d.config,
                host=host if host is not None else ProcHostMonitor(),
                budget=budget,
                admission_model=admission_model,
                **routing,
            )
        else:
            self.engine = Engine(actor, self.sandbox, config=serial_config(), **routing)

    def reply_for(self, history: History) -> Any:
        """The actor's reply that decoded the action after ``history`` (None when the actor
        keeps no replies)."""
        get = getattr(self.actor, "reply_for", None)
        return get(history) if callable(get) else None

    async def run(self, task: str) -> AgentResult:
        """Run the task until it submits, the step limit, or an error (re-raised after the
        steps committed so far were reported). Returns the result of a finished run."""
        steps: list[StepRecord] = []
        clock = self.engine.clock
        t0_wall = time.monotonic()
        t0 = clock.now_ns()
        version0 = self.sandbox.version
        exit_reason, sub = "step_limit", None
        async with self.engine.session(History(task)) as session:
            session.record_access = self.record_access
            while not self.step_limit or len(steps) < self.step_limit:
                history = session.history
                before = session.statistics()
                boundary = clock.now_ns()
                action = await session.decode()
                version_before = self.sandbox.version
                observation = await session.execute(action)
                version_after = self.sandbox.version
                after = session.statistics()
                reads, writes = session.step_access or (None, None)
                step = StepRecord(
                    index=len(steps),
                    action=action,
                    observation=observation,
                    reply=self.reply_for(history),
                    version_before=version_before,
                    version_after=version_after,
                    boundary_ns=boundary - t0,
                    wait_actor_ns=after.wait_actor_ns - before.wait_actor_ns,
                    wait_tool_ns=after.wait_tool_ns - before.wait_tool_ns,
                    tool_ns=after.tool_ns - before.tool_ns,
                    tool_hidden_ns=after.tool_hidden_ns - before.tool_hidden_ns,
                    fork_reused=after.forks_reused > before.forks_reused,
                    draft_hit=after.drafts_hit > before.drafts_hit,
                    tool_cpu_ns=self.sandbox.last_cpu_ns,
                    read_set=reads,
                    write_set=writes,
                )
                steps.append(step)
                if self.on_step is not None:
                    self.on_step(step, after)
                if not action.is_none:
                    result = MiniSweAgentFormatter.parse(observation)
                    if result is None and not self.sandbox.answered(observation):
                        self._warn_foreign_format()
                    sub = None if result is None else submitted(result)
                    if sub is not None:
                        exit_reason = "submitted"
                        break
                elif self.stop_on_no_action:
                    exit_reason = "no_action"
                    break
            history = session.history
        return AgentResult(
            task=task,
            history=history,
            steps=tuple(steps),
            exit_reason=exit_reason,
            submission=sub,
            statistics=self.engine.statistics(),
            wall_s=time.monotonic() - t0_wall,
            version_before=version0,
            final_version=self.sandbox.version,
            speculate=self.speculate,
            cache_counts=self.cache_counts(),
        )

    def _warn_foreign_format(self) -> None:
        if not self._warned_format:
            self._warned_format = True
            warnings.warn(
                "a command's observation is not in the agent's format (mini-swe-agent text): no submission can be "
                f"seen, so the run ends at the step limit; open the sandbox with formatter={OBSERVATION_FORMAT!r} "
                "(aospec.live.agent.OBSERVATION_FORMAT)",
                ObservationFormatWarning,
                stacklevel=3,
            )

    def cache_counts(self) -> dict[str, int] | None:
        """The sandbox's result-cache counters (``aospec.specbox.cache.CachedSandbox``), or None."""
        return self.sandbox.cache_counts() if isinstance(self.sandbox, CachingSandbox) else None
