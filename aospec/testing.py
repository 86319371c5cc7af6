"""Small real implementations of the seams, shipped for tests and examples (no mocks).

- :class:`InMemorySandbox`: a tiny shell over an in-memory filesystem, with real
  copy-on-write-style forks and hash-chained versions (``H(parent, H(changes))``; a
  command that changes nothing keeps the version). :class:`BusySandbox` adds the
  ``burn S`` command (S seconds of one core's CPU), CPU metering
  (:class:`aospec.protocols.MeteredSandbox`) and pausing
  (:class:`aospec.protocols.PausableSandbox`), all in the event loop's (virtual) time.
  command that changes nothing keeps the version); :class:`ReadSetInMemorySandbox` also
  records what each command reads and rebases forks
  (:class:`aospec.protocols.ReadSetSandbox`).
- :class:`ScriptedActor`: an actor that is a function of its history (losslessness needs
  exactly that), with a configurable decode delay; :class:`StreamingScriptedActor` also
  streams its reply text in chunks (``decode_streaming``).
- :class:`ScriptedObservationDrafter`, :class:`ScriptedActionDrafter`: drafters backed by
  plain functions, with a configurable drafting delay; :class:`ScriptedRoutedActionDrafter`
  also proposes targets once a router named the tool (``propose_routed``).
- :class:`ScriptedRouter`: a stream router that names the program of a reply's fenced
  ``bash`` block once its first word is complete (or what a given function names).
- :class:`FitRecorder`: a trainable observation drafter that proposes nothing and records
  which traces it was fit on (to check train/eval separation).
- Fault injection (docs/engine.md, Faults): :class:`FaultySandbox` wraps any sandbox (and
  its forks) and injects the :class:`Fault` s of its plan (an error, an unexpected
  exception, a hang, or an error after the operation took effect) into ``fork``,
  ``execute``, ``commit``, ``discard`` or ``version``; :class:`FaultyActor`,
  :class:`FaultyObservationDrafter` and :class:`FaultyActionDrafter` wrap the others (an
  error, an unexpected exception, a hang, or garbage in place of drafts).

The shell understands commands joined by ``&&``: ``sleep S``, ``echo TEXT > PATH``,
``echo TEXT >> PATH``, ``cat PATH``, ``ls``, ``rm PATH``, ``true``. A command that fails
stops the chain (like ``&&``); the observation is ``<returncode>N</returncode>`` plus the
output, mini-swe-agent style.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self, cast

import anyio
import xxhash

from aospec.errors import DrafterError, SandboxError
from aospec.protocols import ActionDraft, ActionDrafter, Actor, ObservationDraft, ObservationDrafter, Sandbox
from aospec.readsets import ReadSet, WriteSet
from aospec.types import Action, History, Trace, canonical_json, version_hash
from aospec.wrappers import SandboxWrapper

__all__ = [
    "FAULT_KINDS",
    "Fault",
    "FaultCall",
    "FaultyActionDrafter",
    "FaultyActor",
    "FaultyObservationDrafter",
    "FaultySandbox",
    "BusySandbox",
    "FitRecorder",
    "InMemorySandbox",
    "InjectedFault",
    "ReadSetInMemorySandbox",
    "ScriptedActionDrafter",
    "ScriptedActor",
    "ScriptedObservationDrafter",
    "ScriptedRouteEvent",
    "ScriptedRoutedActionDrafter",
    "ScriptedRouter",
    "StreamingScriptedActor",
    "render_reply",
]


class InMemorySandbox:
    """An in-memory filesystem sandbox with forks and hash-chained versions.

    ``op_delay_s`` is slept before each command runs (plus whatever ``sleep`` asks for), so
    executions take real (or virtual) time. ``stats`` of the root counts forks opened and
    released, so tests can check nothing leaks. Forking while a command runs is an error
    (the engine must keep the committed sandbox idle) unless ``forks_during_execute``: then
    such a fork is at the state before the command, as the overlay backend's are (a command
    applies its changes and moves the version at once, when it is done), and the engine
    runs its steps on the committed sandbox itself.
    """

    def __init__(
        self, files: Mapping[str, str] | None = None, *, op_delay_s: float = 0.0, forks_during_execute: bool = False
    ) -> None:
        self.forks_during_execute = forks_during_execute
        self._files: dict[str, str] = dict(files or {})
        self._version = version_hash("root", canonical_json(sorted(self._files.items())))
        self.op_delay_s = op_delay_s
        self._root: InMemorySandbox = self
        self._closed = False
        self._busy = False
        self.forks_opened = 0
        self.forks_released = 0
        self.foreground = True
        self._reading: dict[str, set[str]] | None = None
        self._last_changes: list[tuple[str, str | None]] = []
        self._last_created: set[str] = set()

    @property
    def version(self) -> str:
        return self._version

    @property
    def files(self) -> dict[str, str]:
        """A copy of the current filesystem."""
        return dict(self._files)

    @property
    def live_forks(self) -> int:
        """Forks of this (root) sandbox not yet committed or discarded."""
        return self._root.forks_opened - self._root.forks_released

    def _check(self) -> None:
        if self._closed:
            raise SandboxError("sandbox was discarded or committed")

    async def execute(self, action: Action) -> str:
        self._check()
        if self._busy:
            raise SandboxError("execute while another execute is in flight")
        self._busy = True
        self._last_changes, self._last_created = [], set()
        try:
            if self.op_delay_s:
                await anyio.sleep(self.op_delay_s)
            if action.is_none:
                return "No tool call found in the reply."
            command = action.command
            if command is None:
                return f"<returncode>127</returncode>\n<output>\nunknown tool {action.tool}\n</output>"
            files = dict(self._files)
            out: list[str] = []
            code = 0
            for part in command.split("&&"):
                code = await self._run(part.strip(), files, out)
                if code:
                    break
            changes = sorted(
                (p, files.get(p)) for p in set(files) | set(self._files) if files.get(p) != self._files.get(p)
            )
            self._last_changes = [(p, v) for p, v in changes]
            self._last_created = {p for p, _ in changes if p not in self._files or p not in files}
            if changes:
                self._version = version_hash(self._version, canonical_json(changes))
                self._files = files
            return f"<returncode>{code}</returncode>\n<output>\n{''.join(out)}</output>"
        finally:
            self._busy = False

    async def _run(self, cmd: str, files: dict[str, str], out: list[str]) -> int:
        try:
            words = shlex.split(cmd)
        except ValueError as exc:
            out.append(f"parse error: {exc}\n")
            return 2
        if not words or words == ["true"]:
            return 0
        name, args = words[0], words[1:]
        note = self._note
        if name == "sleep" and len(args) == 1:
            await anyio.sleep(float(args[0]))
            return 0
        if name == "ls" and not args:
            note("trees", "")
            out.extend(f"{p}\n" for p in sorted(files))
            return 0
        if name == "cat" and len(args) == 1:
            note("nodes", args[0])
            if args[0] not in files:
                out.append(f"cat: {args[0]}: No such file or directory\n")
                return 1
            out.append(files[args[0]])
            return 0
        if name == "rm" and len(args) == 1:
            note("lookups", args[0])
            if files.pop(args[0], None) is None:
                out.append(f"rm: cannot remove '{args[0]}': No such file or directory\n")
                return 1
            return 0
        if name == "echo" and len(args) >= 3 and args[-2] in (">", ">>"):
            text = " ".join(args[:-2]) + "\n"
            path = args[-1]
            note("nodes" if args[-2] == ">>" else "lookups", path)
            files[path] = (files.get(path, "") + text) if args[-2] == ">>" else text
            return 0
        out.append(f"{name}: command not found\n")
        return 127

    def _note(self, kind: str, path: str) -> None:
        if self._reading is not None:
            self._reading[kind].add(path)

    async def fork(self) -> Self:
        self._check()
        if self._busy and not self.forks_during_execute:
            raise SandboxError("fork while an execute is in flight")
        child = type(self).__new__(type(self))
        child.forks_during_execute = self.forks_during_execute
        child._files = dict(self._files)
        child._version = self._version
        child.op_delay_s = self.op_delay_s
        child._root = self._root
        child._closed = False
        child._busy = False
        child.forks_opened = child.forks_released = 0
        child.foreground = True
        child._reading = None
        child._last_changes = []
        child._last_created = set()
        self._root.forks_opened += 1
        return child

    async def set_priority(self, *, foreground: bool) -> None:
        """The :class:`aospec.protocols.PrioritizedSandbox` capability: recorded in
        ``foreground`` only (nothing here competes for a CPU)."""
        self.foreground = foreground

    async def commit(self, fork: InMemorySandbox) -> None:
        self._check()
        fork._check()
        if fork._root is not self._root:
            raise SandboxError("commit of a fork from another sandbox")
        self._files = fork._files
        self._version = fork._version
        fork._closed = True
        self._root.forks_released += 1

    async def discard(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._root is not self:
            self._root.forks_released += 1


class BusySandbox(InMemorySandbox):
    """An :class:`InMemorySandbox` whose commands can take CPU, in the event loop's time.

    ``burn S`` runs for ``S`` seconds of one core's CPU; :attr:`cpu_ns` is the CPU its
    commands used so far (a :class:`aospec.protocols.MeteredSandbox`; a fork starts from
    0). :meth:`pause` freezes a running ``burn`` (no progress and no CPU until
    :meth:`resume`; a command started while paused starts frozen) and holds back the end
    of a ``sleep`` (a :class:`aospec.protocols.PausableSandbox`). ``pauses`` counts the
    pauses that froze something. ``fail_pause`` makes :meth:`pause` raise SandboxError
    (a host without a freezer)."""

    cpu_used_ns: int
    _paused: bool
    _resumed: anyio.Event
    _burning: tuple[anyio.CancelScope, float] | None

    def __init__(
        self, files: Mapping[str, str] | None = None, *, op_delay_s: float = 0.0, fail_pause: bool = False
    ) -> None:
        super().__init__(files, op_delay_s=op_delay_s)
        self.fail_pause = fail_pause
        self._busy_state()

    def _busy_state(self) -> None:
        self.cpu_used_ns = 0
        self.pauses = 0
        self._paused = False
        self._resumed = anyio.Event()
        self._burning = None

    @property
    def cpu_ns(self) -> int:
        if self._burning is not None:
            return self.cpu_used_ns + round((anyio.current_time() - self._burning[1]) * 1e9)
        return self.cpu_used_ns

    @property
    def paused(self) -> bool:
        return self._paused

    async def pause(self) -> None:
        if self.fail_pause:
            raise SandboxError("this sandbox has no freezer")
        if self._paused:
            return
        self._paused = True
        self._resumed = anyio.Event()
        if self._burning is not None:
            self.pauses += 1
            self._burning[0].cancel()

    async def resume(self) -> None:
        if self._paused:
            self._paused = False
            self._resumed.set()

    async def _wait_resumed(self) -> None:
        while self._paused:
            await self._resumed.wait()

    async def _run(self, cmd: str, files: dict[str, str], out: list[str]) -> int:
        words = cmd.split()
        if len(words) == 2 and words[0] == "burn":
            remaining = float(words[1])
            while remaining > 1e-9:
                await self._wait_resumed()
                start = anyio.current_time()
                with anyio.CancelScope() as scope:
                    self._burning = (scope, start)
                    await anyio.sleep(remaining)
                self._burning = None
                ran = anyio.current_time() - start
                self.cpu_used_ns += round(ran * 1e9)
                remaining -= ran
            return 0
        code = await super()._run(cmd, files, out)
        await self._wait_resumed()
        return code

    async def fork(self) -> BusySandbox:
        child = await super().fork()
        assert isinstance(child, BusySandbox)
        child.fail_pause = self.fail_pause
        child._busy_state()
        return child


class ReadSetInMemorySandbox(InMemorySandbox):
    """An :class:`InMemorySandbox` with the :class:`aospec.protocols.ReadSetSandbox`
    capability: a fork asked to ``trace_reads`` records what its next command reads (``cat
    P`` and ``echo >> P`` read ``P``, ``echo > P`` and ``rm P`` look it up, ``ls`` reads
    everything), ``write_set`` says what a command changed, and ``rebase`` commits a fork
    from an older version by applying its changes on top of this sandbox's files (the
    version moves on as running it here would move it). ``rebased`` counts rebases;
    ``traced`` (on the root sandbox) lists the commands that ran traced, in any fork."""

    rebased = 0
    traced: tuple[str, ...] = ()
    _trace_next = False
    _traced: ReadSet | None = None

    async def trace_reads(self) -> None:
        self._check()
        self._trace_next = True

    async def execute(self, action: Action) -> str:
        self._traced = None
        tracing, self._trace_next = self._trace_next, False
        if tracing:
            self._reading = {"lookups": set(), "nodes": set(), "lists": set(), "trees": set()}
            root = cast(ReadSetInMemorySandbox, self._root)
            root.traced = (*root.traced, str(action.args.get("command", action.key)))
        try:
            return await super().execute(action)
        finally:
            if tracing and self._reading is not None:
                self._traced = ReadSet(**{k: frozenset(v) for k, v in self._reading.items()})
            self._reading = None

    async def read_set(self) -> ReadSet | None:
        self._check()
        return self._traced

    async def write_set(self) -> WriteSet | None:
        self._check()
        changed = frozenset(p for p, _ in self._last_changes)
        return WriteSet(changed, changed, frozenset({""}) if self._last_created else frozenset())

    async def rebase(self, fork: ReadSetInMemorySandbox) -> WriteSet | None:
        self._check()
        fork._check()
        if fork._root is not self._root:
            raise SandboxError("rebase of a fork from another sandbox")
        writes = await fork.write_set()
        changes = fork._last_changes
        files = dict(self._files)
        for p, v in changes:
            if v is None:
                files.pop(p, None)
            else:
                files[p] = v
        if changes:
            self._version = version_hash(self._version, canonical_json(changes))
        self._files = files
        fork._closed = True
        self._root.forks_released += 1
        self._root.rebased += 1
        return writes


class ScriptedActor:
    """An actor whose next action is ``choose(history)``, after ``delay(history)`` seconds.

    ``choose`` must be a pure function of the history (the engine's losslessness relies on
    it). ``calls`` counts decodes started (including cancelled ones).
    """

    def __init__(self, choose: Callable[[History], Action], delay_s: float | Callable[[History], float] = 0.0) -> None:
        self.choose = choose
        self.delay_s = delay_s
        self.calls = 0

    @classmethod
    def hashing(
        cls, pool: Sequence[Action], *, seed: int = 0, delay_s: float | Callable[[History], float] = 0.0
    ) -> ScriptedActor:
        """An actor picking from ``pool`` by a hash of the whole history (so every drafted
        observation that differs from the real one leads somewhere else)."""
        actions = tuple(pool)
        if not actions:
            raise ValueError("pool must not be empty")

        def choose(history: History) -> Action:
            digest = xxhash.xxh3_64_intdigest(
                "\x1e".join(
                    [str(seed), history.task, *(f"{t.action.key}\x1f{t.observation}" for t in history.turns)]
                ).encode()
            )
            return actions[digest % len(actions)]

        return cls(choose, delay_s)

    async def decode(self, history: History) -> Action:
        self.calls += 1
        delay = self.delay_s(history) if callable(self.delay_s) else self.delay_s
        if delay:
            await anyio.sleep(delay)
        return self.choose(history)


def render_reply(action: Action) -> str:
    """A reply text for ``action``, mini-swe-agent style: a thought and a fenced ``bash``
    block for a shell action; ``TOOL {json args}`` for another tool; a thought alone for
    the non-action."""
    if action.is_none:
        return "THOUGHT: nothing left to do."
    command = action.command
    if command is not None:
        return f"THOUGHT: the next step.\n\n```bash\n{command}\n```"
    return f"{action.tool} {canonical_json(dict(action.args))}"


class StreamingScriptedActor(ScriptedActor):
    """A :class:`ScriptedActor` that also streams (:class:`aospec.protocols.StreamingActor`):
    ``decode_streaming`` reports ``render(action)`` (default :func:`render_reply`) in
    ``chunk_chars``-character pieces, the decode's delay spread evenly before them, then
    returns what ``decode`` returns. ``streaming`` counts decodes streaming right now and
    ``deltas`` the pieces reported so far (so tests can tell what happens mid-decode)."""

    def __init__(
        self,
        choose: Callable[[History], Action],
        delay_s: float | Callable[[History], float] = 0.0,
        *,
        render: Callable[[Action], str] = render_reply,
        chunk_chars: int = 4,
    ) -> None:
        super().__init__(choose, delay_s)
        if chunk_chars < 1:
            raise ValueError(f"chunk_chars must be >= 1, got {chunk_chars}")
        self.render = render
        self.chunk_chars = chunk_chars
        self.streaming = 0
        self.deltas = 0

    async def decode_streaming(self, history: History, on_delta: Callable[[object], None]) -> Action:
        self.calls += 1
        delay = self.delay_s(history) if callable(self.delay_s) else self.delay_s
        action = self.choose(history)
        text = self.render(action)
        pieces = [text[i : i + self.chunk_chars] for i in range(0, len(text), self.chunk_chars)] or [""]
        self.streaming += 1
        try:
            for piece in pieces:
                if delay:
                    await anyio.sleep(delay / len(pieces))
                self.deltas += 1
                on_delta(piece)
        finally:
            self.streaming -= 1
        return action


@dataclass(frozen=True, slots=True)
class ScriptedRouteEvent:
    """An event of :class:`ScriptedRouter` (the fields every router event has)."""

    tool: str
    confidence: float
    position: int
    router: str


_BASH_FENCE = re.compile(r"```(?:bash|sh)[^\n]*\n\s*(\S+)\s")


def _program_of_bash_block(text: str) -> str | None:
    m = _BASH_FENCE.search(text)
    return m.group(1) if m else None


class ScriptedRouter:
    """A stream router (:class:`aospec.protocols.StreamRouter`): each ``session()`` gathers
    the text of the ``str`` deltas fed to it and fires ``name(text)`` (default: the first
    word of the first fenced ``bash`` block, once complete) when that is a tool not fired
    yet in this session, at ``confidence``. A chat-completions chunk dict naming a tool
    call's function fires that name. ``sessions`` counts the sessions opened."""

    def __init__(
        self,
        name: Callable[[str], str | None] = _program_of_bash_block,
        *,
        confidence: float = 1.0,
        label: str = "scripted",
    ) -> None:
        self.name = name
        self.confidence = confidence
        self.label = label
        self.sessions = 0
        self.histories: list[History | None] = []

    def session(self, history: History | None = None) -> _ScriptedRouterSession:
        """A fresh session for one decode; ``history`` (what the engine passes: the history
        the decode starts from) is appended to ``histories``."""
        self.sessions += 1
        self.histories.append(history)
        return _ScriptedRouterSession(self)


class _ScriptedRouterSession:
    def __init__(self, router: ScriptedRouter) -> None:
        self._router = router
        self._text = ""
        self._fired: set[str] = set()
        self.position = 0

    def feed(self, delta: object) -> list[ScriptedRouteEvent]:
        self.position += 1
        if isinstance(delta, str):
            self._text += delta
            tool = self._router.name(self._text)
        else:
            tool = _tool_call_name(delta)
        if tool is None or tool in self._fired:
            return []
        self._fired.add(tool)
        return [ScriptedRouteEvent(tool, self._router.confidence, self.position, self._router.label)]


def _tool_call_name(chunk: object) -> str | None:
    """The function name a chat-completions chunk dict starts a tool call with, if any."""
    try:
        for call in chunk["choices"][0]["delta"].get("tool_calls") or ():  # type: ignore[index]
            name = (call.get("function") or {}).get("name")
            if name:
                return name
    except (KeyError, IndexError, TypeError, AttributeError):
        return None
    return None


class ScriptedObservationDrafter:
    """Candidate observations from ``propose(history, action)``, after ``delay_s``."""

    def __init__(self, propose: Callable[[History, Action], Sequence[ObservationDraft]], delay_s: float = 0.0) -> None:
        self.propose = propose
        self.delay_s = delay_s

    async def draft(self, history: History, action: Action, n: int) -> Sequence[ObservationDraft]:
        if self.delay_s:
            await anyio.sleep(self.delay_s)
        return list(self.propose(history, action))[:n]


class ScriptedActionDrafter:
    """Candidate target actions from ``propose(history)``, after ``delay_s``."""

    def __init__(self, propose: Callable[[History], Sequence[ActionDraft]], delay_s: float = 0.0) -> None:
        self.propose_fn = propose
        self.delay_s = delay_s

    async def propose(self, history: History, width: int, depth: int) -> Sequence[ActionDraft]:
        if self.delay_s:
            await anyio.sleep(self.delay_s)
        return [d for d in self.propose_fn(history) if d.offset < depth][:width]


class ScriptedRoutedActionDrafter(ScriptedActionDrafter):
    """A :class:`ScriptedActionDrafter` that is also a
    :class:`aospec.protocols.RoutedActionDrafter`: ``propose_routed(history, tool, width)``
    returns ``routed(history, tool)`` (at most ``width``), after ``delay_s``; its
    boundary targets come from ``propose`` (none by default). ``routed_calls`` lists
    ``(len(history), tool)`` of every routed call."""

    def __init__(
        self,
        routed: Callable[[History, str], Sequence[ActionDraft]],
        propose: Callable[[History], Sequence[ActionDraft]] = lambda history: (),
        delay_s: float = 0.0,
    ) -> None:
        super().__init__(propose, delay_s)
        self.routed_fn = routed
        self.routed_calls: list[tuple[int, str]] = []

    async def propose_routed(self, history: History, tool: str, width: int) -> Sequence[ActionDraft]:
        self.routed_calls.append((len(history), tool))
        if self.delay_s:
            await anyio.sleep(self.delay_s)
        return list(self.routed_fn(history, tool))[:width]


class FitRecorder:
    """Trainable observation drafter that proposes nothing; ``FitRecorder.fits`` lists the
    trace ids of every ``fit`` call in this process."""

    fits: ClassVar[list[tuple[str, ...]]] = []

    def fit(self, traces: Sequence[Trace]) -> None:
        FitRecorder.fits.append(tuple(t.id for t in traces))

    async def draft(self, history: History, action: Action, n: int) -> Sequence[ObservationDraft]:
        return []


# ---------------------------------------------------------------------------------- faults

#: How an injected fault shows: ``error`` raises the seam's own AospecError (SandboxError,
#: DrafterError; the actor's is DrafterError too), ``unexpected`` raises
#: :class:`InjectedFault` (no AospecError: a bug or a foreign library's error), ``hang``
#: never returns (until cancelled), ``late`` (sandbox operations only) raises SandboxError
#: after the operation took effect.
FAULT_KINDS = ("error", "unexpected", "hang", "late")


class InjectedFault(RuntimeError):
    """An injected exception that is no AospecError."""


def _raise(kind: str, what: str, error: type[Exception]) -> None:
    if kind == "unexpected":
        raise InjectedFault(f"injected fault: {what}")
    raise error(f"injected fault: {what}")


@dataclass(frozen=True, slots=True)
class FaultCall:
    """One call a :class:`FaultySandbox` sees. ``op``: ``fork``, ``execute``, ``commit``,
    ``discard`` or ``version``; ``on``: ``committed`` (the wrapped sandbox itself) or
    ``fork`` (one of its forks); ``origin``: the version the sandbox was forked at (the
    committed sandbox's current version for it); ``action``: the action executed (for
    ``commit``, the last one the committed fork executed; else None); ``n``: how many calls
    of ``op`` the plan saw before this one."""

    op: str
    on: str
    origin: str
    action: Action | None
    n: int


@dataclass(frozen=True, slots=True)
class Fault:
    """Inject ``kind`` (:data:`FAULT_KINDS`) into the calls of ``op`` on ``on`` (``committed``,
    ``fork`` or ``any``) for which ``when(call)`` holds (every call when None), at most
    ``limit`` times (no limit when None). ``version`` cannot hang (it is a property)."""

    op: str
    kind: str = "error"
    on: str = "any"
    when: Callable[[FaultCall], bool] | None = None
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.op not in ("fork", "execute", "commit", "discard", "version"):
            raise ValueError(f"unknown sandbox operation {self.op!r}")
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; known: {', '.join(FAULT_KINDS)}")
        if self.on not in ("committed", "fork", "any"):
            raise ValueError(f"on must be committed, fork or any, not {self.on!r}")


class _FaultPlan:
    def __init__(self, faults: Sequence[Fault]) -> None:
        self.faults = tuple(faults)
        self.calls: dict[str, int] = {}
        self.used: dict[int, int] = {}
        self.injected: list[tuple[Fault, FaultCall]] = []
        self.undiscarded: list[Sandbox] = []
        self.hanging = 0

    def match(self, op: str, on: str, origin: str, action: Action | None) -> Fault | None:
        n = self.calls.get(op, 0)
        self.calls[op] = n + 1
        call = FaultCall(op, on, origin, action, n)
        for i, f in enumerate(self.faults):
            if f.op != op or f.on not in ("any", on):
                continue
            if f.limit is not None and self.used.get(i, 0) >= f.limit:
                continue
            if f.when is not None and not f.when(call):
                continue
            self.used[i] = self.used.get(i, 0) + 1
            self.injected.append((f, call))
            return f
        return None

    async def before(self, fault: Fault | None, what: str) -> None:
        if fault is None or fault.kind == "late":
            return
        if fault.kind == "hang":
            self.hanging += 1
            try:
                await anyio.sleep_forever()
            finally:
                self.hanging -= 1
        _raise(fault.kind, what, SandboxError)


class FaultySandbox(SandboxWrapper):
    """Any sandbox (and, through ``fork``, its forks) with the faults of a plan injected.

    Calls pass to ``inner`` unless a :class:`Fault` matches: ``error``/``unexpected``/``hang``
    strike before the inner call, ``late`` after it (the operation took effect, then
    SandboxError). ``injected`` lists (fault, call) of every fault injected so far, across
    the forks; ``hanging`` counts hung calls not yet cancelled (0 once a run is over: no
    task left behind). A :class:`aospec.wrappers.SandboxWrapper`: the inner sandbox's
    optional capabilities (priority, a result cache) pass through, without faults, and so
    do its other attributes (``files``, ``live_forks``, ``root_path``, ...).
    """

    def __init__(self, inner: Sandbox, faults: Sequence[Fault] = (), *, _plan: _FaultPlan | None = None) -> None:
        super().__init__(inner)
        self._plan = _plan if _plan is not None else _FaultPlan(faults)
        self._on = "fork" if _plan is not None else "committed"
        self.origin = inner.version
        self.last_action: Action | None = None

    @property
    def injected(self) -> list[tuple[Fault, FaultCall]]:
        return list(self._plan.injected)

    @property
    def hanging(self) -> int:
        return self._plan.hanging

    def _origin_now(self) -> str:
        return self.inner.version if self._on == "committed" else self.origin

    @property
    def version(self) -> str:
        fault = self._plan.match("version", self._on, self._origin_now(), None)
        if fault is not None and fault.kind != "late":
            _raise("unexpected" if fault.kind == "unexpected" else "error", "version", SandboxError)
        version = self.inner.version
        if fault is not None:
            raise SandboxError("injected fault: version (late)")
        return version

    async def execute(self, action: Action) -> str:
        fault = self._plan.match("execute", self._on, self._origin_now(), action)
        self.last_action = action
        await self._plan.before(fault, f"execute {action.key}")
        observation = await self.inner.execute(action)
        if fault is not None:
            raise SandboxError(f"injected fault: execute {action.key} (after it ran)")
        return observation

    async def fork(self) -> FaultySandbox:
        fault = self._plan.match("fork", self._on, self._origin_now(), None)
        await self._plan.before(fault, "fork")
        child = FaultySandbox(await self.inner.fork(), _plan=self._plan)
        if fault is not None:
            await child.inner.discard()
            raise SandboxError("injected fault: fork (after it forked; the fork was discarded)")
        return child

    async def commit(self, fork: FaultySandbox) -> None:
        fault = self._plan.match("commit", self._on, fork.origin, fork.last_action)
        await self._plan.before(fault, "commit")
        await self.inner.commit(fork.inner)
        if fault is not None:
            raise SandboxError("injected fault: commit (after it took effect)")

    @property
    def undiscarded(self) -> list[Sandbox]:
        """Inner sandboxes whose ``discard`` failed before it took effect (the backend still
        holds those not consumed otherwise)."""
        return list(self._plan.undiscarded)

    async def discard(self) -> None:
        fault = self._plan.match("discard", self._on, self._origin_now(), None)
        if fault is not None and fault.kind != "late":
            self._plan.undiscarded.append(self.inner)
        await self._plan.before(fault, "discard")
        await self.inner.discard()
        if fault is not None:
            raise SandboxError("injected fault: discard (after it took effect)")


class _Faulty:
    """What the faulty actor and drafters share: which calls fail, and counters."""

    def __init__(self, kind: str, garbage: Callable[[Any], Any] | None) -> None:
        if kind not in ("error", "unexpected", "hang", "garbage"):
            raise ValueError(f"unknown fault kind {kind!r}; known: error, unexpected, hang, garbage")
        if (kind == "garbage") != (garbage is not None):
            raise ValueError("garbage= goes with kind='garbage' (and only with it)")
        self.kind = kind
        self.garbage = garbage
        self.calls = 0
        self.faults = 0
        self.cancelled = 0
        self.hanging = 0

    async def _call(self, hit: bool, what: str, real: Callable[[], Awaitable[Any]]) -> Any:
        self.calls += 1
        if not hit:
            return await real()
        self.faults += 1
        if self.kind == "garbage":
            assert self.garbage is not None
            return self.garbage(await real())
        if self.kind == "hang":
            self.hanging += 1
            try:
                await anyio.sleep_forever()
            except anyio.get_cancelled_exc_class():
                self.cancelled += 1
                raise
            finally:
                self.hanging -= 1
        _raise(self.kind, what, DrafterError)


class FaultyActor(_Faulty):
    """``inner``, except that decodes from a history for which ``when(history)`` holds
    (every one when None) fail with ``kind`` (``error``, ``unexpected``, ``hang``).
    ``hanging`` counts hung decodes not yet cancelled."""

    def __init__(self, inner: Actor, kind: str = "error", *, when: Callable[[History], bool] | None = None) -> None:
        super().__init__(kind, None)
        self.inner = inner
        self.when = when

    async def decode(self, history: History) -> Action:
        hit = self.when is None or self.when(history)
        return await self._call(hit, f"decode after {len(history)} turns", lambda: self.inner.decode(history))


class FaultyObservationDrafter(_Faulty):
    """``inner`` (no drafts when None), except that calls for which ``when(history, action)``
    holds (every one when None) fail with ``kind``: ``error`` (DrafterError),
    ``unexpected``, ``hang``, or ``garbage``: return ``garbage(the inner drafts)``."""

    def __init__(
        self,
        inner: ObservationDrafter | None = None,
        kind: str = "error",
        *,
        when: Callable[[History, Action], bool] | None = None,
        garbage: Callable[[list[ObservationDraft]], Any] | None = None,
    ) -> None:
        super().__init__(kind, garbage)
        self.inner = inner
        self.when = when

    async def _real(self, history: History, action: Action, n: int) -> list[ObservationDraft]:
        return [] if self.inner is None else list(await self.inner.draft(history, action, n))

    async def draft(self, history: History, action: Action, n: int) -> Sequence[ObservationDraft]:
        hit = self.when is None or self.when(history, action)
        return await self._call(hit, f"draft {action.key}", lambda: self._real(history, action, n))


class FaultyActionDrafter(_Faulty):
    """Like :class:`FaultyObservationDrafter`, for action drafters (``when(history)``)."""

    def __init__(
        self,
        inner: ActionDrafter | None = None,
        kind: str = "error",
        *,
        when: Callable[[History], bool] | None = None,
        garbage: Callable[[list[ActionDraft]], Any] | None = None,
    ) -> None:
        super().__init__(kind, garbage)
        self.inner = inner
        self.when = when

    async def _real(self, history: History, width: int, depth: int) -> list[ActionDraft]:
        return [] if self.inner is None else list(await self.inner.propose(history, width, depth))

    async def propose(self, history: History, width: int, depth: int) -> Sequence[ActionDraft]:
        hit = self.when is None or self.when(history)
        return await self._call(hit, f"propose after {len(history)} turns", lambda: self._real(history, width, depth))
