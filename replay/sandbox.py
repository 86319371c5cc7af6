"""The replay sandbox: recorded observations after recorded tool times, with versions.

A :class:`ReplayWorld` holds one trace's filesystem versions under a *state model*
(:data:`STATE_MODELS`, docs/replay.md "State models"):

- ``recorded``: the exact versions the trace recorded around every step
  (``Step.version_before``/``version_after``, written by aospec's own recorder; a step
  with only ``state_changed`` recorded gets a new version exactly when it is true). A step
  without a tool call and without versions ran nothing, so it keeps the version; a change
  between two steps (``version_after[i] != version_before[i+1]``, e.g. a background
  process) is attributed to step ``i``. A trace that lacks versions on a step that ran a
  tool cannot be replayed this way (:func:`recorded_versions_problem`).
- ``effects``: ``v_0`` at the start, and after step ``i`` a new version when the static
  classifier (:func:`aospec.effects.classify_action`) says the action may change the
  filesystem, the same version otherwise. Recorded versions and ``state_changed`` are
  ignored: this is the conservative bracket, what is known without a recorder.
- ``blind``: every step leaves the filesystem unchanged (one version throughout), so JASV
  passes whenever the action matches: the state-blind upper bracket.
- ``readsets``: the recorded versions plus each step's recorded read and write sets; a fork
  launched before a state-changing step is reused after it when read-set validation would
  accept it live (``aospec.replay.readsets``): between ``recorded`` and ``blind``.

``auto`` (:func:`resolve_state_model`) is ``recorded`` when every trace has its versions,
else ``effects``. Versions never return to an earlier value under ``effects``, like the
chained root hashes of the real runtime.

A :class:`ReplaySandbox` at version ``v`` whose lineage has committed ``p`` steps executes
action ``a`` by finding the first recorded step ``i >= p`` with ``version_before[i] == v``
and action ``a``: it sleeps ``T_i``, returns ``o_i`` and moves to ``version_after[i]``. That
is exactly the step JASV can commit this result to (a fork is consumed by the first
emission of ``a`` at ``v``, and the engine never forks the action the committed step is
executing from the same state). An action with no such step is off the recording: it
returns a deterministic placeholder after a plausible time (the same action's recorded time
elsewhere in the trace, else the trace's median tool time) and moves to a version of its
own, so it can never pass JASV for a recorded step (under every state model: what an
unrecorded action does to the filesystem is unknown).

A world given a :class:`aospec.replay.contention.SimulatedHost` (``--cores``) hands out
:class:`ContendedReplaySandbox` es instead: each command runs on that host, sharing its
cores with every other command and its background load (replay/contention.py), from the
step's recorded CPU time (``Step.tool_cpu_s``, else the host model's assumption); those
sandboxes are also pausable, metered and prioritised (:mod:`aospec.protocols`), so the
engine's pausing and priorities have their effect in replay. Without a host nothing of this
runs: a command takes exactly its recorded time.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Mapping, Sequence

from aospec.replay.actor import VirtualClock, seconds_to_ns
from aospec.replay.contention import IDLE_WEIGHT, HostedCommand, SimulatedHost

from aospec.effects import classify_action
from aospec.errors import ConfigError, SandboxError
from aospec.types import Action, Effect, Trace, version_hash

__all__ = [
    "OFF_RECORD_PREFIX",
    "STATE_MODELS",
    "STATE_MODEL_CHOICES",
    "STATE_MODEL_MEANING",
    "ContendedReplaySandbox",
    "ReplaySandbox",
    "ReplayWorld",
    "recorded_versions_problem",
    "resolve_state_model",
    "world_versions",
]

#: Every off-record observation starts with this text.
OFF_RECORD_PREFIX = "[aospec replay] no recorded result for this action from this state: "

#: The state models a replay can use (docs/replay.md, "State models").
STATE_MODELS = ("recorded", "effects", "blind", "readsets")
#: What ``--state-model`` accepts: a state model, or ``auto`` (see :func:`resolve_state_model`).
STATE_MODEL_CHOICES = ("auto", *STATE_MODELS)
#: One line per state model, for tables and summaries.
STATE_MODEL_MEANING = {
    "recorded": "the filesystem versions recorded around every step, exact",
    "effects": "the static effect classifier, a step that may write changes the state; the conservative bracket",
    "blind": "no step changes the filesystem, so JASV passes whenever the action matches; the upper bracket",
    "readsets": "the recorded versions and read/write sets: a fork survives commits that touched nothing it read or wrote",
}

_FIX = (
    "record the traces with aospec's own recorder (it writes version_before/version_after on every step), "
    "or choose --state-model effects (the static classifier), blind (the upper bracket) or auto"
)


def _step_label(trace: Trace, i: int) -> str:
    action = trace.steps[i].action
    what = action.command if action.command is not None else action.tool
    what = what if len(what) <= 60 else what[:57] + "..."
    return f"step {i + 1} ({what!r})"


def recorded_versions_problem(trace: Trace) -> str | None:
    """Why ``trace`` cannot be replayed under the ``recorded`` state model, or None.

    Every completed step that ran a tool needs both ``version_before`` and
    ``version_after`` (or a recorded ``state_changed``); a step cut off by the end of the
    recording needs ``version_before`` only; a step without a tool call may have neither
    (it ran nothing). Steps are named 1-based, with their command.
    """
    for i, s in enumerate(trace.steps):
        if s.version_before is not None and (s.version_after is not None or not s.completed):
            continue
        if s.state_changed is not None or (s.action.is_none and s.version_before is None and s.version_after is None):
            continue
        missing = [
            name
            for name, value, needed in (
                ("version_before", s.version_before, True),
                ("version_after", s.version_after, s.completed),
            )
            if needed and value is None
        ]
        return f"trace {trace.id!r} {_step_label(trace, i)} has no recorded {' or '.join(missing)}"
    return None


def resolve_state_model(
    traces: Sequence[Trace], requested: str = "auto", files: Mapping[str, str] | None = None
) -> tuple[str, str]:
    """The state model to replay ``traces`` under, and why (one line).

    ``recorded`` requires recorded versions on every trace (ConfigError naming the first
    trace, its file from ``files`` (trace id -> path) when known, and step, with the fix);
    ``auto`` picks ``recorded`` when every trace has them and ``effects`` otherwise;
    ``effects`` and ``blind`` apply to any trace. An unknown name is a ConfigError.
    """
    if requested not in STATE_MODEL_CHOICES:
        raise ConfigError(f"unknown state model {requested!r}; choose from {', '.join(STATE_MODEL_CHOICES)}")
    if requested in ("effects", "blind"):
        return requested, "as requested"
    if requested == "readsets":
        for t in traces:
            problem = recorded_versions_problem(t)
            if problem is None and not any("write_set" in s.extra for s in t.steps):
                problem = f"trace {t.id!r} records no read or write sets"
            if problem is not None:
                where = f" (file {files[t.id]})" if files and t.id in files else ""
                problem = problem.replace(f"trace {t.id!r}", f"trace {t.id!r}{where}", 1)
                raise ConfigError(
                    f"--state-model readsets: {problem}: record live runs with their read sets "
                    "(aospec run --record FILE --record-read-sets), or choose --state-model recorded"
                )
        return "readsets", "as requested"
    if requested == "auto" and not any(
        s.version_before is not None or s.version_after is not None for t in traces for s in t.steps
    ):
        return "effects", "auto: the traces record no filesystem versions"
    for t in traces:
        problem = recorded_versions_problem(t)
        if problem is None:
            continue
        where = f" (file {files[t.id]})" if files and t.id in files else ""
        problem = problem.replace(f"trace {t.id!r}", f"trace {t.id!r}{where}", 1)
        if requested == "recorded":
            raise ConfigError(f"--state-model recorded: {problem}: {_FIX}")
        return "effects", f"auto: {problem}, so the static classifier is used"
    if requested == "recorded":
        return "recorded", "as requested"
    return "recorded", "auto: every step has recorded versions"


def world_versions(trace: Trace, state_model: str) -> tuple[str, list[str], list[str], list[Effect]]:
    """``(origin, version_before, version_after, effects)`` of ``trace``'s steps under
    ``state_model`` (one of :data:`STATE_MODELS`; ``recorded`` raises ConfigError when the
    trace lacks versions)."""
    steps = trace.steps
    before: list[str] = []
    after: list[str] = []
    effects: list[Effect] = []
    if state_model in ("recorded", "readsets"):
        problem = recorded_versions_problem(trace)
        if problem is not None:
            raise ConfigError(f"--state-model recorded: {problem}: {_FIX}")
        first = next((s.version_before for s in steps if s.version_before is not None), None)
        v = origin = first if first is not None else version_hash("origin", trace.id)
        for i, s in enumerate(steps):
            if s.version_before is not None:
                if after and s.version_before != v:
                    after[-1] = s.version_before  # changed between steps: attributed to the step before
                    effects[-1] = Effect.READ_ONLY if after[-1] == before[-1] else Effect.MAY_CHANGE
                v = s.version_before
            before.append(v)
            if s.version_after is not None:
                v = s.version_after
            elif s.state_changed or (s.state_changed is None and not s.action.is_none):
                v = version_hash(v, "step", str(i))  # changed, or cut off before it finished (unknown)
            after.append(v)
            effects.append(Effect.READ_ONLY if v == before[-1] else Effect.MAY_CHANGE)
        return origin, before, after, effects
    origin = v = version_hash("origin", trace.id)
    if state_model == "blind":
        n = len(steps)
        return origin, [origin] * n, [origin] * n, [Effect.READ_ONLY] * n
    if state_model != "effects":
        raise ConfigError(f"unknown state model {state_model!r}; choose from {', '.join(STATE_MODELS)}")
    for i, s in enumerate(steps):
        effect = classify_action(s.action)
        effects.append(effect)
        before.append(v)
        if effect is Effect.MAY_CHANGE:
            v = version_hash(v, "step", str(i))
        after.append(v)
    return origin, before, after, effects


class ReplayWorld:
    """Versions, results and tool times of one trace (shared by a sandbox and its forks).

    ``tool_ns[i]`` is the recorded tool time in exact nanoseconds; an unknown one counts as
    0 and is listed in ``unknown_tool_steps``. ``state_model`` is one of
    :data:`STATE_MODEL_CHOICES` (``auto`` is resolved for this trace alone; the resolved
    model is ``self.state_model``).

    ``host``: the simulated host its commands run on (None: each takes its recorded time);
    then ``cpu_ns[i]`` is step ``i``'s CPU time, recorded or assumed (the host model's
    ``unrecorded_cpu`` share of its tool time).
    """

    def __init__(
        self, trace: Trace, clock: VirtualClock, state_model: str = "auto", host: SimulatedHost | None = None
    ) -> None:
        self.trace = trace
        self.clock = clock
        self.host = host
        if state_model == "auto":
            state_model, _ = resolve_state_model([trace], "auto")
        self.state_model = state_model
        steps = trace.steps
        n = len(steps)
        self.observations = [s.observation for s in steps]
        self.tool_ns: list[int] = []
        self.unknown_tool_steps: list[int] = []
        for i, s in enumerate(steps):
            if s.tool_duration_s is None:
                self.tool_ns.append(0)
                self.unknown_tool_steps.append(i)
            else:
                self.tool_ns.append(seconds_to_ns(s.tool_duration_s))
        self.origin, self.version_before, self.version_after, self.effects = world_versions(trace, state_model)
        self._index: dict[tuple[str, str], list[int]] = {}
        self._first_ns: dict[str, int] = {}
        unknown = set(self.unknown_tool_steps)
        for i, s in enumerate(steps):
            self._index.setdefault((self.version_before[i], s.action.key), []).append(i)
            if i not in unknown:
                self._first_ns.setdefault(s.action.key, self.tool_ns[i])
        known = [self.tool_ns[i] for i in range(n) if i not in unknown]
        self._median_ns = int(statistics.median_low(known)) if known else 0
        self.cpu_ns: list[int] = []
        if host is not None:
            self._cpu_index(host.model.unrecorded_cpu, unknown)

    def _cpu_index(self, unrecorded: float, unknown: set[int]) -> None:
        """Each step's CPU time, and what an off-record action uses: the same action's
        recorded CPU, else the trace's CPU share of its median tool time."""
        self._first_cpu_ns: dict[str, int] = {}
        for i, s in enumerate(self.trace.steps):
            tool = self.tool_ns[i]
            cpu = seconds_to_ns(s.tool_cpu_s) if s.tool_cpu_s is not None else int(unrecorded * tool)
            self.cpu_ns.append(cpu)
            if i not in unknown:
                self._first_cpu_ns.setdefault(s.action.key, cpu)
        tool_total = sum(t for i, t in enumerate(self.tool_ns) if i not in unknown)
        cpu_total = sum(c for i, c in enumerate(self.cpu_ns) if i not in unknown)
        self._cpu_share = cpu_total / tool_total if tool_total else unrecorded

    def match(self, version: str, action: Action, position: int) -> int | None:
        """The first recorded step ``i >= position`` that ran ``action`` from ``version``."""
        found = self._index.get((version, action.key))
        if not found:
            return None
        k = bisect.bisect_left(found, position)
        return found[k] if k < len(found) else None

    def reuse_ok(self, origin: int, step: int) -> bool:
        """Whether a fork launched at recorded position ``origin`` can be reused for recorded
        step ``step`` (JASV: the same version; ``aospec.replay.readsets`` widens it)."""
        return self.version_before[origin] == self.version_before[step]

    def off_record_ns(self, action: Action) -> int:
        return self._first_ns.get(action.key, self._median_ns)

    def off_record_cpu_ns(self, action: Action) -> int:
        """The CPU time of an off-record action (only with a host)."""
        found = self._first_cpu_ns.get(action.key)
        return found if found is not None else int(self._cpu_share * self.off_record_ns(action))

    def sandbox(self) -> ReplaySandbox:
        """The committed sandbox at the trace's initial version (a
        :class:`ContendedReplaySandbox` when the world has a host)."""
        if self.host is not None:
            return ContendedReplaySandbox(self, self.origin, 0)
        return ReplaySandbox(self, self.origin, 0)


class ReplaySandbox:
    """A sandbox (or fork) replaying its world's recorded results; see the module docstring."""

    __slots__ = ("_closed", "_position", "_version", "world")

    def __init__(self, world: ReplayWorld, version: str, position: int) -> None:
        self.world = world
        self._version = version
        self._position = position
        self._closed = False

    @property
    def version(self) -> str:
        return self._version

    @property
    def position(self) -> int:
        """Recorded steps this sandbox's lineage has executed."""
        return self._position

    async def execute(self, action: Action) -> str:
        if self._closed:
            raise SandboxError("replay sandbox was discarded or committed")
        w = self.world
        i = w.match(self._version, action, self._position)
        if i is None:
            await w.clock.sleep_ns(w.off_record_ns(action))
            self._version = version_hash(self._version, "off-record", action.key)
            return OFF_RECORD_PREFIX + action.key[:200]
        await w.clock.sleep_ns(w.tool_ns[i])
        self._version = w.version_after[i]
        self._position = i + 1
        return w.observations[i]

    async def fork(self) -> ReplaySandbox:
        if self._closed:
            raise SandboxError("replay sandbox was discarded or committed")
        return ReplaySandbox(self.world, self._version, self._position)

    async def commit(self, fork: ReplaySandbox) -> None:
        if fork._closed or fork.world is not self.world:
            raise SandboxError("commit of a fork that is closed or from another replay")
        self._version = fork._version
        self._position = fork._position
        fork._closed = True

    async def discard(self) -> None:
        self._closed = True


class ContendedReplaySandbox(ReplaySandbox):
    """A replay sandbox whose commands run on its world's simulated host (``--cores``):
    they share the host's cores (replay/contention.py) instead of taking their recorded time.

    It is a :class:`aospec.protocols.PausableSandbox` (a paused sandbox's command takes no
    CPU and makes no progress; a command started while paused starts frozen), a
    :class:`aospec.protocols.MeteredSandbox` (``cpu_ns``: the CPU its commands used, the
    running one's so far; a fork starts from 0) and a
    :class:`aospec.protocols.PrioritizedSandbox` (background: :data:`IDLE_WEIGHT`, as the
    runtime's SCHED_IDLE). Its forks are of its class and start in the foreground, unpaused."""

    __slots__ = ("_command", "_cpu_done_ns", "_paused", "_weight")

    def __init__(self, world: ReplayWorld, version: str, position: int) -> None:
        super().__init__(world, version, position)
        self._command: HostedCommand | None = None
        self._cpu_done_ns = 0
        self._paused = False
        self._weight = 1.0

    async def execute(self, action: Action) -> str:
        if self._closed:
            raise SandboxError("replay sandbox was discarded or committed")
        w = self.world
        host = w.host
        assert host is not None
        i = w.match(self._version, action, self._position)
        if i is None:
            wall, cpu = w.off_record_ns(action), w.off_record_cpu_ns(action)
        else:
            wall, cpu = w.tool_ns[i], w.cpu_ns[i]
        command = self._command = HostedCommand(wall, cpu, weight=self._weight, paused=self._paused)
        try:
            await host.run(command)
        finally:
            self._command = None
            self._cpu_done_ns += int(command.cpu_used_ns)
        if i is None:
            self._version = version_hash(self._version, "off-record", action.key)
            return OFF_RECORD_PREFIX + action.key[:200]
        self._version = w.version_after[i]
        self._position = i + 1
        return w.observations[i]

    async def fork(self) -> ContendedReplaySandbox:
        if self._closed:
            raise SandboxError("replay sandbox was discarded or committed")
        return ContendedReplaySandbox(self.world, self._version, self._position)

    async def pause(self) -> None:
        self._paused = True
        if self._command is not None:
            self.world.host.set_paused(self._command, True)  # type: ignore[union-attr]

    async def resume(self) -> None:
        self._paused = False
        if self._command is not None:
            self.world.host.set_paused(self._command, False)  # type: ignore[union-attr]

    @property
    def paused(self) -> bool:
        return self._paused

    async def set_priority(self, *, foreground: bool) -> None:
        self._weight = 1.0 if foreground else IDLE_WEIGHT
        if self._command is not None:
            self.world.host.set_weight(self._command, self._weight)  # type: ignore[union-attr]

    @property
    def cpu_ns(self) -> int:
        running = self._command
        if running is None:
            return self._cpu_done_ns
        return self._cpu_done_ns + self.world.host.cpu_used_ns(running)  # type: ignore[union-attr]
