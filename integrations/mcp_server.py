"""``aospec mcp``: an MCP tool server whose tool calls are co-speculated (docs/integrations.md).

Sandbox mode (the default) serves four tools on one committed aospec sandbox:

- ``bash(command)``: run a shell command (bash in the sandbox, working directory the
  sandbox's ``workdir``, default ``/``); the result is the interleaved stdout and stderr,
  followed by ``[exit status N]`` when N is not 0 and ``[timed out after S s]`` on a
  timeout. A failing command is a normal result, not a tool error.
- ``read_file(path)``: a UTF-8 text file's content. ``path`` is a sandbox path (relative
  ones resolve against ``workdir``; symlinks and ``..`` never leave the sandbox). Errors:
  missing, a directory, not UTF-8, more than :data:`MAX_READ_BYTES`.
- ``write_file(path, content)``: create or truncate ``path`` and write ``content``
  (at most :data:`MAX_WRITE_BYTES` of UTF-8); the parent directory must exist; an existing
  file keeps its mode, a new one gets 0644.
- ``edit_file(path, old_str, new_str)``: exact string replacement: ``old_str`` (not empty)
  must occur exactly once in the file, else a tool error saying how often it occurs.

Every error is an MCP tool error (``isError: true``) with a one-line message.

Out-of-band results (``--artifacts``, for clients on the same host that opt in): the
server runs a :class:`aospec.specbox.transport.ArtifactServer` (memfd backing, an abstract Unix
socket) for its lifetime. A ``read_file`` or ``bash`` output of at least the inline
threshold (64 KiB) is published there and the result carries its ref instead of the text,
in the form :mod:`aospec.specbox.mcp_env` documents (``structuredContent``
``{"aospec_artifact": REF}`` plus the text ``aospec-artifact:`` + the ref's JSON), which
``McpEnv.call`` or an :class:`~aospec.specbox.transport.ArtifactClient` takes zero-copy. A fifth
tool, ``export_file(path)``, hands any file of the sandbox (bytes; at most
``--max-artifact-mb``, 1 GiB by default; path rules as ``read_file``'s) the same way,
inline in the ref (base64) below the threshold. Only the result returned to the client is
ever published: a speculated call keeps its output in the fork's record until the call is
served, so a discarded fork leaves no artifact behind. Tokens nobody takes are freed after
``--artifact-ttl`` seconds; everything is freed when the server stops.

Speculation: after each committed call the predictor proposes likely next calls; each
runs in a copy-on-write fork of the committed sandbox. A ``tools/call`` whose action key
(tool + canonical JSON arguments) equals a speculated call's AND whose fork's origin
version equals the committed version (JASV) is answered with the fork's result and the
fork is committed (its state becomes the committed state, for writing tools too);
anything else runs on the committed sandbox. Forks whose origin is no longer the committed
version are discarded after every call.

Concurrency: all clients (and all sessions, over HTTP) share the one committed sandbox.
Calls are executed one at a time in the order the server received them (the order their
handlers started, which is the transport's delivery order); a call's result reflects every
call received before it and none received after it. ``tools/list`` never waits.

Prefetch (``aospec proxy --mcp``): over HTTP, ``POST /aospec/prefetch`` with
``{"name": TOOL, "arguments": {...}}`` starts that call in a fork of the committed
sandbox now (queued at the gate like a call, so it forks the state every call received
before it left) -- the call a model just emitted, before its harness sends it. It is an
ordinary speculative call: served only under JASV, discarded when the version moves.
It may displace a predicted call when ``--max-forks`` are live; at most
:func:`prefetch_cap` of the live forks are prefetched ones (half of ``--max-forks``, at
least one), and a new prefetch displaces the oldest one beyond that, so prefetches never
pin the forks that prediction needs. The route is behind the same guard as ``/mcp``
(Host, Origin, the token, the body limit: :mod:`aospec._http`) and takes only
``application/json``.

Proxy mode (``--upstream``): see ``integrations/_mcp_proxy.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import math
import os
import posixpath
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import mcp_types as types
from aospec.integrations._mcp_common import (
    REPLY_FIRST_S,
    ArrivalGate,
    Predictor,
    RepeatPredictor,
    combine,
    drafter_from_traces,
    error_result,
    load_transitions,
    prefetch_cap,
    propose,
    result_meta,
    text_result,
)

from aospec._http import TOKEN_ENV, HttpGuard, error_response, guarded, port_number, resolve_token, serve_asgi
from aospec.admission import Admission, AdmissionModel
from aospec.effects import classify_command
from aospec.engine import LoopClock
from aospec.engine_config import EngineConfig
from aospec.errors import ConfigError, FileTooLargeError, MissingDependencyError, SandboxError
from aospec.forks import ForkEntry, Forks
from aospec.ledger import EngineStatistics, Ledger
from aospec.metrics import Metrics, metrics_route, metrics_served
from aospec.protocols import SandboxCapabilities
from aospec.types import Action, Effect
from aospec.wrappers import SandboxWrapper

__all__ = [
    "EXPORT_TOOL",
    "MAX_ARTIFACT_BYTES",
    "MAX_READ_BYTES",
    "MAX_WRITE_BYTES",
    "SANDBOX_TOOLS",
    "SandboxToolServer",
    "ToolOutput",
    "artifact_result",
    "build_server",
    "prefetch_cap",
    "register",
    "run_call",
]

MAX_READ_BYTES = 1 << 20  # read_file refuses larger files (use bash: head, sed -n)
MAX_WRITE_BYTES = 1 << 20  # write_file/edit_file refuse larger contents
MAX_COMMAND_CHARS = 1 << 16
MAX_ARTIFACT_BYTES = 1 << 30  # export_file refuses larger files (--max-artifact-mb)
MAX_HELD_BYTES = 2 << 30  # published artifacts held at once, at most (--max-held-mb)
MAX_BODY_BYTES = 8 << 20  # an HTTP request body, at most (--max-body-mb): a 1 MiB write_file, JSON-escaped


def _tool(name: str, description: str, props: dict[str, Any], ann: types.ToolAnnotations) -> types.Tool:
    return types.Tool(
        name=name,
        description=description,
        input_schema={"type": "object", "properties": props, "required": list(props), "additionalProperties": False},
        annotations=ann,
    )


_STR = {"type": "string"}

#: The sandbox tools and their annotations. Every tool is closed-world (the sandbox has no
#: network unless configured, and sees no host path but declared binds).
SANDBOX_TOOLS: tuple[types.Tool, ...] = (
    _tool(
        "bash",
        "Run a shell command in the sandbox; returns its output (stdout and stderr), then "
        "[exit status N] when it is not 0.",
        {"command": {**_STR, "description": "the command line (bash)"}},
        types.ToolAnnotations(
            read_only_hint=False, destructive_hint=True, idempotent_hint=False, open_world_hint=False
        ),
    ),
    _tool(
        "read_file",
        "Read a UTF-8 text file in the sandbox (at most 1 MiB).",
        {"path": {**_STR, "description": "path in the sandbox (relative to the working directory)"}},
        types.ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False),
    ),
    _tool(
        "write_file",
        "Create or overwrite a text file in the sandbox (the parent directory must exist).",
        {"path": _STR, "content": _STR},
        types.ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=True, open_world_hint=False),
    ),
    _tool(
        "edit_file",
        "Replace the one occurrence of old_str in a file with new_str (old_str must occur exactly once).",
        {"path": _STR, "old_str": _STR, "new_str": _STR},
        types.ToolAnnotations(
            read_only_hint=False, destructive_hint=True, idempotent_hint=False, open_world_hint=False
        ),
    ),
)
#: The fifth tool, served only with ``--artifacts`` (module doc).
EXPORT_TOOL = _tool(
    "export_file",
    "Hand a file of the sandbox (any bytes) to the client out of band, through shared memory on "
    "this host: the result is an aospec artifact ref (structuredContent.aospec_artifact).",
    {"path": {**_STR, "description": "path in the sandbox (relative to the working directory)"}},
    types.ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False),
)
_SCHEMAS = {t.name: t.input_schema["properties"] for t in (*SANDBOX_TOOLS, EXPORT_TOOL)}


class ToolArgumentError(ValueError):
    """Arguments that do not fit the tool's schema (an MCP tool error)."""


def check_args(tool: str, args: dict[str, Any], *, export: bool = False) -> None:
    """ToolArgumentError unless ``args`` fit ``tool``'s schema (``export_file`` is a tool only
    with ``export``, i.e. ``--artifacts``)."""
    names = sorted(n for n in _SCHEMAS if export or n != EXPORT_TOOL.name)
    props = _SCHEMAS.get(tool) if tool in names else None
    if props is None:
        raise ToolArgumentError(f"unknown tool {tool!r}; the tools are {', '.join(names)}")
    missing = [k for k in props if k not in args]
    extra = [k for k in args if k not in props]
    if missing or extra:
        raise ToolArgumentError(
            f"{tool}: "
            + "; ".join(
                ([f"missing argument(s) {', '.join(missing)}"] if missing else [])
                + ([f"unknown argument(s) {', '.join(extra)}"] if extra else [])
            )
        )
    for k in props:
        if not isinstance(args[k], str):
            raise ToolArgumentError(f"{tool}: argument {k!r} must be a string")
        if k in ("command", "path") and "\0" in args[k]:
            raise ToolArgumentError(f"{tool}: argument {k!r} contains a NUL character, which no {k} can hold")


def read_only(action: Action) -> bool:
    """Calls that never change the sandbox: read_file, export_file, and bash commands
    aospec's effect rules classify read-only."""
    if action.tool in ("read_file", "export_file"):
        return True
    return action.command is not None and classify_command(action.command) is Effect.READ_ONLY


@dataclass(frozen=True, slots=True)
class ToolOutput:
    """A call's ``result`` as a plain server returns it, and ``payload``: the raw output a
    client may take out of band (read_file's file and bash's output text as UTF-8, both
    with ``--artifacts`` only; export_file's file), None for results that are never published."""

    result: types.CallToolResult
    payload: bytes | None = None


def _read_only_no_export(action: Action) -> bool:
    """``read_only`` without export_file (a tool only with ``--artifacts``)."""
    return action.tool != EXPORT_TOOL.name and read_only(action)


async def run_tool(sb: Any, action: Action, *, workdir: str, timeout_s: float | None) -> types.CallToolResult:
    """Execute ``action`` on sandbox ``sb`` (the committed one or a fork)."""
    return (await run_call(sb, action, workdir=workdir, timeout_s=timeout_s)).result


async def run_call(
    sb: Any,
    action: Action,
    *,
    workdir: str,
    timeout_s: float | None,
    max_export_bytes: int | None = None,
) -> ToolOutput:
    """Execute ``action`` on sandbox ``sb``; ``export_file`` is a tool only when
    ``max_export_bytes`` is given (``--artifacts``)."""
    args = dict(action.args)
    try:
        check_args(action.tool, args, export=max_export_bytes is not None)
    except ToolArgumentError as exc:
        return ToolOutput(error_result(str(exc)))
    try:
        if action.tool == "bash":
            command = args["command"]
            if len(command) > MAX_COMMAND_CHARS:
                return ToolOutput(error_result(f"bash: the command is longer than {MAX_COMMAND_CHARS} characters"))
            r = await sb.run(command, timeout=timeout_s)
            text = r.output
            if r.timed_out:
                text += ("" if not text or text.endswith("\n") else "\n") + f"[timed out after {timeout_s or 'the'} s]"
            elif r.returncode != 0:
                text += ("" if not text or text.endswith("\n") else "\n") + f"[exit status {r.returncode}]"
            if r.truncated:
                text += "\n[the middle of the output was truncated]"
            out = text_result(text)
            if r.timed_out:
                out = out.model_copy(update={"meta": {"aospec": {"timed_out": r.timed_out}}})
            # the payload (a second copy of the output) only where it may be published
            return ToolOutput(out, text.encode() if max_export_bytes is not None else None)
        path = posixpath.join(workdir, args["path"])
        if action.tool == "write_file":
            data = args["content"].encode()
            if len(data) > MAX_WRITE_BYTES:
                return ToolOutput(
                    error_result(f"write_file: the content is {len(data)} bytes, over the {MAX_WRITE_BYTES}-byte limit")
                )
            await sb.write_file(path, data)
            return ToolOutput(text_result(f"wrote {len(data)} bytes to {args['path']}"))
        exporting = action.tool == "export_file"
        if exporting:
            assert max_export_bytes is not None
        limit = max_export_bytes if exporting and max_export_bytes is not None else MAX_READ_BYTES
        try:
            # the size is checked on the open file before a byte is read (a sparse 2 GiB file
            # is refused at once, not after reading it)
            raw = await sb.read_file(path, max_bytes=limit)
        except FileTooLargeError as exc:
            fix = "(--max-artifact-mb)" if exporting else "(use bash: head, tail, sed -n)"
            return ToolOutput(
                error_result(f"{action.tool}: {args['path']} is {exc.size} bytes, over the {limit}-byte limit {fix}")
            )
        if exporting:
            return ToolOutput(text_result(f"exported {len(raw)} bytes of {args['path']}"), raw)
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            return ToolOutput(error_result(f"{action.tool}: {args['path']} is not UTF-8 text"))
        if action.tool == "read_file":
            return ToolOutput(text_result(text), raw if max_export_bytes is not None else None)
        old, new = args["old_str"], args["new_str"]
        if not old:
            return ToolOutput(error_result("edit_file: old_str must not be empty"))
        n = text.count(old)
        if n != 1:
            where = "does not occur" if n == 0 else f"occurs {n} times"
            return ToolOutput(error_result(f"edit_file: old_str {where} in {args['path']}; it must occur exactly once"))
        data = text.replace(old, new, 1).encode()
        if len(data) > MAX_WRITE_BYTES:
            return ToolOutput(
                error_result(f"edit_file: the result is {len(data)} bytes, over the {MAX_WRITE_BYTES}-byte limit")
            )
        await sb.write_file(path, data)
        return ToolOutput(text_result(f"edited {args['path']}"))
    except (SandboxError, OSError) as exc:
        msg = str(exc) if isinstance(exc, SandboxError) else f"{args.get('path', '')}: {exc.strerror or exc}"
        return ToolOutput(error_result(f"{action.tool}: {msg}"))


def artifact_result(ref: Any, meta: dict[str, Any] | None = None) -> types.CallToolResult:
    """A result carrying the :class:`~aospec.specbox.transport.ArtifactRef` ``ref`` instead of the
    output: :func:`aospec.specbox.mcp_env.artifact_result` (imported only with ``--artifacts``)."""
    from aospec.specbox.mcp_env import artifact_result as build

    result: types.CallToolResult = build(ref, meta)
    return result


class _GuessTimedOut(SandboxError):
    """A speculated call timed out: a timeout depends on the machine's load, not on the
    state, so the fork's result is never served (the call runs on the committed sandbox)."""


class _ToolSandbox(SandboxWrapper):
    """The committed sandbox (or a fork of it) as the engine's :class:`~aospec.forks.Forks`
    sees it: ``execute`` runs one tool call (``call``, i.e. :func:`run_call`) and keeps its
    :class:`ToolOutput` in ``output``, which JASV then serves (each fork runs one call)."""

    def __init__(self, inner: Any, call: Callable[[Any, Action], Awaitable[ToolOutput]]) -> None:
        super().__init__(inner)
        self._call = call
        self.output: ToolOutput | None = None

    async def fork(self) -> _ToolSandbox:
        return _ToolSandbox(await self.inner.fork(), self._call)

    async def execute(self, action: Action) -> str:
        out = await self._call(self.inner, action)
        if (out.result.meta or {}).get("aospec", {}).get("timed_out"):
            raise _GuessTimedOut(f"speculative {action.tool} timed out")
        self.output = out
        return _text(out.result)


@dataclass
class Stats:
    calls: int = 0  # tools/call requests executed
    served_speculated: int = 0  # answered from a fork that JASV accepted
    ran_committed: int = 0  # run on the committed sandbox
    launched: int = 0  # speculative calls started
    stale_discarded: int = 0  # forks thrown away because the committed version moved
    wasted: int = 0  # speculative forks that ran but whose result was not used (incl. stale)
    prefetched: int = 0  # speculative calls started by POST /aospec/prefetch
    budget_refused: int = 0  # speculative calls not started: every slot of --speculation-budget was held

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class SandboxToolServer:
    """The sandbox tools on one committed sandbox, with speculative forks (see module doc).

    The forks are the engine's (:class:`aospec.forks.Forks`, without forks for the calls
    themselves: a call JASV finds no fork for runs on the committed sandbox, as serial
    execution does): the one JASV registry, launch, prioritising, commit and discard
    aospec has. Its totals are an :class:`~aospec.ledger.EngineStatistics`
    (:meth:`statistics`: one step per call), which ``stats`` and the metrics read."""

    def __init__(
        self,
        root: Any,
        tg: anyio.abc.TaskGroup,
        *,
        predictor: Predictor | None,
        max_forks: int = 4,
        workdir: str = "/",
        timeout_s: float | None = None,
        artifacts: Any = None,
        max_export_bytes: int = MAX_ARTIFACT_BYTES,
        budget: Any = None,
        metrics: Metrics | None = None,
    ) -> None:
        """``artifacts``: a started :class:`aospec.specbox.transport.ArtifactServer` to hand large
        results out of band through (and serve ``export_file`` of at most
        ``max_export_bytes``); None: every result in band, four tools. ``budget``: the host's
        :class:`aospec.host.SpeculationBudget` (a speculative call runs only on a free slot).
        ``metrics``: where each call's latency and tool time are observed (:mod:`aospec.metrics`)."""
        self.root = root
        self.budget = budget
        self.tg = tg
        self.predictor = predictor
        self._draft_failures = 0
        self.max_forks = max_forks
        self.workdir = workdir
        self.timeout_s = timeout_s
        self.artifacts = artifacts
        self.max_export_bytes = max_export_bytes if artifacts is not None else None
        self.metrics = metrics
        self.gate = ArrivalGate()
        self._clock = LoopClock()
        self._ledger = ledger = Ledger(keep_events=False)
        self._counts = Stats()
        committed = _ToolSandbox(root, self._run)

        def failed(what: str, exc: BaseException, *, warn: bool = False) -> None:
            ledger.speculation_failed(self._clock.now_ns(), what, exc, warn=warn)

        # every predicted call is launched (no pricing: admission off), within the host's
        # speculation budget when there is one (a slot per running speculative call)
        config = EngineConfig(max_live_forks=max(1, max_forks), admission="off")
        admission = Admission(AdmissionModel(), config, clock=self._clock, ledger=ledger, failed=failed, budget=budget)
        self._forks = Forks(
            committed,
            SandboxCapabilities.of(committed),
            use_forks=False,
            config=config,
            clock=self._clock,
            ledger=ledger,
            task_group=tg,
            failed=failed,
            admission=admission,
        )
        self._prefetched: list[tuple[str, str]] = []  # (origin, key) of prefetched forks, oldest first

    @property
    def stats(self) -> Stats:
        """The server's counters (in every result's ``_meta``, and ``--stats``)."""
        s = self._ledger.statistics()
        c = self._counts
        return Stats(
            calls=c.calls,
            served_speculated=c.served_speculated,
            ran_committed=c.ran_committed,
            launched=s.forks_launched,
            stale_discarded=c.stale_discarded,
            wasted=s.forks_wasted,
            prefetched=c.prefetched,
            budget_refused=s.refused_budget,
        )

    def statistics(self) -> EngineStatistics:
        """The engine totals of the calls so far (a call is a step, decoding is 0)."""
        return self._ledger.statistics()

    def live_forks(self) -> int:
        """Speculative calls live now (running or done, not yet served or discarded)."""
        return len(self._forks.registry)

    async def list_tools(self) -> list[types.Tool]:
        return [*SANDBOX_TOOLS, EXPORT_TOOL] if self.artifacts is not None else list(SANDBOX_TOOLS)

    async def _run(self, sb: Any, action: Action) -> ToolOutput:
        return await run_call(
            sb, action, workdir=self.workdir, timeout_s=self.timeout_s, max_export_bytes=self.max_export_bytes
        )

    async def _deliver(self, action: Action, out: ToolOutput) -> types.CallToolResult:
        """The result the client gets: ``out.result``, or with ``--artifacts`` a large
        output (any export) published and replaced by its ref. Publishing happens only
        here, for the one result returned, so no speculated output is ever published."""
        if self.artifacts is None or out.payload is None or out.result.is_error:
            return out.result
        if action.tool != EXPORT_TOOL.name and len(out.payload) < self.artifacts.threshold:
            return out.result
        from aospec.specbox.transport import ArtifactBudgetError

        try:  # one copy into a sealed memfd (up to the export cap): off the event loop
            ref = await anyio.to_thread.run_sync(self.artifacts.put, out.payload)
        except (OSError, ArtifactBudgetError) as exc:  # no memory or over --max-held-mb: the call failed
            return error_result(f"{action.tool}: cannot publish {len(out.payload)} bytes out of band: {exc}")
        return artifact_result(ref, out.result.meta)

    async def call(self, name: str, arguments: dict[str, Any] | None) -> types.CallToolResult:
        try:
            action = Action(name, arguments or {})
        except (ValueError, TypeError) as exc:
            return error_result(f"invalid call: {exc}")
        async with self.gate:
            self._counts.calls += 1
            clock, forks = self._clock, self._forks
            emitted = clock.now_ns()
            origin = self.root.version
            output: ToolOutput | None = None
            # JASV (the engine's): a fork of this very call, forked from the committed version
            fork = await forks.verify(action, emitted)
            if fork is not None:
                fork = await forks.wait(fork)  # None: it failed (or timed out); run it here
            if fork is not None:
                assert isinstance(fork.sandbox, _ToolSandbox) and fork.sandbox.output is not None
                output = fork.sandbox.output
                committed_then_failed = await forks.commit(fork, origin, self._ledger.step)
                if committed_then_failed is not None:
                    raise committed_then_failed
                self._counts.served_speculated += 1
                start, end = fork.exec_start_ns, fork.exec_end_ns
            else:
                self._counts.ran_committed += 1
                start = clock.now_ns()
                output = await self._run(self.root, action)
                end = clock.now_ns()
            assert start is not None and end is not None
            result = await self._deliver(action, output)
            now = clock.now_ns()
            tool_ns = end - start
            self._ledger.committed_step(
                now,
                action.key,
                wait_actor_ns=0,
                wait_tool_ns=now - emitted,
                decode_ns=0,
                tool_ns=tool_ns,
                decode_waited_ns=0,
                tool_waited_ns=max(0, min(now, end) - max(emitted, start)),
                executed=True,
            )
            if self.metrics is not None:
                self.metrics.step(now - emitted, tool_ns)
            # pruning and launching the next speculations happen after the reply is sent, in
            # a task that queues at the gate right now (so before any later call)
            self.tg.start_soon(self._after, action, _text(output.result))
            extra = {"artifacts": vars(self.artifacts.stats)} if self.artifacts is not None else {}
            return result_meta(
                result,
                speculated=fork is not None,
                origin=origin,
                version=self.root.version,
                stats=self.stats.as_dict(),
                **extra,
            )

    async def prefetch(self, name: str, arguments: dict[str, Any] | None) -> bool | str:
        """Start ``name(arguments)`` in a fork of the committed sandbox (module doc);
        ``"tool"`` when ``name`` is none of the sandbox tools, False when it is not a valid
        call or no fork slot is free. At most :func:`prefetch_cap` prefetched calls are live:
        the oldest makes room for a new one."""
        if name not in {t.name for t in SANDBOX_TOOLS}:
            return "tool"
        try:
            action = Action(name, arguments or {})
            check_args(action.tool, dict(action.args), export=self.artifacts is not None)
        except (ValueError, TypeError):
            return False
        cap = prefetch_cap(self.max_forks)
        if cap == 0:
            return False
        async with self.gate:
            registry = self._forks.registry
            version = self.root.version
            if registry.has(version, action.key):
                return True
            self._prefetched = [k for k in self._prefetched if registry.has(*k)]
            if len(self._prefetched) >= cap:
                # the oldest prefetch makes room: prefetches never hold more than their share
                # of the forks, however many arrive
                self._evict(registry.get(*self._prefetched.pop(0)))
            elif len(registry) >= self.max_forks:
                victim = next((e for e in registry if (e.origin, e.action.key) not in self._prefetched), None)
                if victim is None:
                    return False
                self._evict(victim)
            if not self._forks.launch(action, 0, 1.0):
                return False
            self._prefetched.append((version, action.key))
            self._counts.prefetched += 1
            return True

    def _evict(self, entry: ForkEntry | None) -> None:
        if entry is not None:
            self._forks.registry.remove(entry)
            self._forks.release([entry])

    async def _after(self, action: Action, observation: str) -> None:
        async with self.gate:
            # drafters are CPU work that never yields: let the reply reach the transport
            # first (every task ready to run runs before a timer fires); holding the gate
            # keeps this before any later call
            await anyio.sleep(REPLY_FIRST_S)
            # prune: forks whose origin is no longer the committed version can never pass JASV
            version = self.root.version
            self._counts.stale_discarded += sum(1 for e in self._forks.registry if e.origin != version)
            self._forks.prune()
            try:
                await self._speculate(action, observation)
            except Exception as exc:  # a predictor that fails only loses its guesses
                self._draft_failures += 1
                if self._draft_failures == 1:
                    print(
                        f"aospec mcp: note: drafting failed ({type(exc).__name__}: {exc}); "
                        "calls run without speculation while it fails",
                        file=sys.stderr,
                    )

    async def _speculate(self, last: Action, observation: str) -> None:
        if self.predictor is None:
            return
        for action in await propose(self.predictor, last, observation):
            if len(self._forks.registry) >= self.max_forks:
                break
            self._forks.launch(action, 0, 1.0)  # False when an equal one is live already

    async def aclose(self) -> None:
        """Stop every speculative call and discard its fork (shielded)."""
        live = list(self._forks.registry)
        for entry in live:
            self._forks.registry.remove(entry)
        self._forks.release(live)
        await self._forks.close()


# -- the MCP server --------------------------------------------------------------------------


class ToolBackend:  # the structural seam between build_server and the two modes
    list_tools: Callable[[], Awaitable[list[types.Tool]]]
    call: Callable[[str, dict[str, Any] | None], Awaitable[types.CallToolResult]]


def build_server(backend: Any, name: str = "aospec", metrics: Metrics | None = None) -> Any:
    """An MCP low-level Server answering tools/list and tools/call from ``backend``; each
    call is a request in ``metrics``, and a tool error result an error of kind ``tool``."""
    from mcp.server.lowlevel import Server

    async def on_list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=await backend.list_tools())

    async def on_call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        if metrics is not None:
            metrics.request()
        result: types.CallToolResult = await backend.call(params.name, params.arguments)
        if metrics is not None and result.is_error:
            metrics.error("tool")
        return result

    return Server(name, on_list_tools=on_list_tools, on_call_tool=on_call_tool)


class _StdinLines(contextlib.AbstractContextManager["_StdinLines"]):
    """The server's input, line by line, read without a worker thread (non-blocking reads
    and ``anyio.wait_readable``): the SDK's reader blocks a thread in ``readline``, which a
    cancellation (SIGTERM) must wait for until the client sends a line. While it is open,
    fd 0 points at /dev/null, as with the SDK's reader, so that no child reads the wire."""

    def __enter__(self) -> _StdinLines:
        self.fd = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, 3)
        null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        os.dup2(null, 0)
        os.close(null)
        self._blocking = os.get_blocking(self.fd)
        os.set_blocking(self.fd, False)
        return self

    def __exit__(self, *exc: object) -> None:
        os.set_blocking(self.fd, self._blocking)
        os.dup2(self.fd, 0)
        os.close(self.fd)

    async def __aiter__(self) -> AsyncIterator[str]:
        buf = bytearray()
        searched = 0
        while True:
            nl = buf.find(b"\n", searched)
            if nl >= 0:
                line = bytes(buf[: nl + 1])
                del buf[: nl + 1]
                searched = 0
                yield line.decode("utf-8", errors="replace")
                continue
            searched = len(buf)
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                await anyio.wait_readable(self.fd)
                continue
            if not chunk:
                if buf:
                    yield buf.decode("utf-8", errors="replace")
                return
            buf += chunk


async def serve_stdio(server: Any) -> None:
    """MCP over stdin/stdout until the input ends or the server is cancelled."""
    from mcp.server.stdio import stdio_server

    with _StdinLines() as lines:
        async with stdio_server(stdin=lines) as (read, write):  # type: ignore[arg-type]
            await server.run(read, write, server.create_initialization_options())


def _with_prefetch(app: Any, prefetch: Callable[[str, dict[str, Any] | None], Awaitable[bool | str]]) -> Any:
    """``app`` plus ``POST /aospec/prefetch`` (module doc); behind :func:`serve_http`'s guard."""
    import json

    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/aospec/prefetch" or scope["method"] != "POST":
            await app(scope, receive, send)
            return
        ctype = next((v for k, v in scope["headers"] if k.lower() == b"content-type"), b"").decode("latin-1")
        if ctype.split(";")[0].strip().lower() != "application/json":
            await error_response(send, 415, "POST /aospec/prefetch takes application/json", "bad_content_type")
            return
        msg = await receive()  # the guard hands the whole body over in one message
        if msg["type"] != "http.request":
            return
        try:
            req = json.loads(msg.get("body", b""))
            name, args = req["name"], req.get("arguments")
            ok = isinstance(name, str) and (args is None or isinstance(args, dict))
        except (ValueError, KeyError, TypeError, RecursionError):
            ok = False
        outcome = ok and await prefetch(name, args)
        reply: dict[str, Any] = {"launched": outcome is True}
        if isinstance(outcome, str):  # "tool": no call of this tool is ever prefetched here
            reply["refused"] = outcome
        data = json.dumps(reply).encode()
        status = 200 if ok else 400
        await send(
            {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]}
        )
        await send({"type": "http.response.body", "body": data})

    return wrapped


def _security_settings(guard: HttpGuard) -> Any:
    """The MCP SDK's own Host/Origin check of ``/mcp``, set as the guard's (which runs first)."""
    from mcp.server.transport_security import TransportSecuritySettings

    if guard.hosts is None:
        return TransportSecuritySettings(enable_dns_rebinding_protection=False)
    names = [f"[{h}]" if ":" in h else h for h in sorted(guard.hosts)]
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=[*names, *(f"{n}:*" for n in names)],
        allowed_origins=[o for n in names for o in (f"http://{n}", f"http://{n}:*")],
    )


async def serve_http(
    server: Any,
    host: str,
    port: int,
    guard: HttpGuard,
    prefetch: Callable[[str, dict[str, Any] | None], Awaitable[bool | str]] | None = None,
    metrics: Metrics | None = None,
) -> None:
    """Streamable HTTP at ``http://HOST:PORT/mcp`` (port 0: any free port; the URL is
    printed on stderr as ``aospec mcp: listening on URL``), every route behind ``guard``
    (:mod:`aospec._http`), until cancelled; with ``prefetch``, also ``POST /aospec/prefetch``
    (module doc); with ``metrics``, also ``GET /metrics`` (:mod:`aospec.metrics`). Cancelling
    it cancels the calls in flight (they run in the MCP session manager's task group, which
    runs here, not in uvicorn's lifespan task) and closes every connection."""
    mcp_app = server.streamable_http_app(
        host=host, transport_security=_security_settings(guard), max_request_body_size=guard.max_body
    )
    app = mcp_app if prefetch is None else _with_prefetch(mcp_app, prefetch)
    app = metrics_route(app, metrics)
    shown = f"[{host}]" if ":" in host else host

    def listening(bound: int) -> None:
        print(f"aospec mcp: listening on http://{shown}:{bound}/mcp", file=sys.stderr, flush=True)

    # the session manager (its tasks run the calls) lives around the serving
    await serve_asgi(
        guarded(app, guard), host, port, listening=listening, around=lambda: mcp_app.router.lifespan_context(mcp_app)
    )


@contextlib.asynccontextmanager
async def _sandbox_backend(args: argparse.Namespace) -> AsyncIterator[SandboxToolServer]:
    from aospec.runtime import open_sandbox

    overrides: dict[str, Any] = {"backend": args.backend, "base": args.base}
    if args.state:
        overrides["state_dir"] = args.state
    if args.timeout is not None:
        overrides["timeout_s"] = args.timeout
    # export_file is never speculated: each speculated export would hold up to
    # --max-artifact-mb in memory per fork for a result that is rarely taken
    predictor = _predictor(args, eligible=_read_only_no_export)
    async with contextlib.AsyncExitStack() as stack:
        artifacts = None
        if args.artifacts:
            from aospec.specbox.transport import ArtifactServer, sweep_forever

            # closed on the way out whatever ends the server (EOF, a signal, an error): every
            # memfd is closed and the abstract socket goes with the listener
            artifacts = stack.enter_context(
                ArtifactServer(
                    threshold=args.artifact_threshold,
                    backing="memfd",
                    max_bytes=int(args.max_held_mb * (1 << 20)),
                    limit_flag="--max-held-mb",
                )
            )
        root = await stack.enter_async_context(open_sandbox(**overrides))
        tg = await stack.enter_async_context(anyio.create_task_group())
        backend = SandboxToolServer(
            root,
            tg,
            predictor=predictor,
            metrics=args.metrics,
            max_forks=args.max_forks,
            workdir=root.store.config.workdir,
            timeout_s=args.timeout,
            artifacts=artifacts,
            max_export_bytes=int(args.max_artifact_mb * (1 << 20)),
            budget=_budget(args),
        )
        if artifacts is not None:
            tg.start_soon(sweep_forever, artifacts, args.artifact_ttl)
        try:
            yield backend
        finally:
            with anyio.CancelScope(shield=True):
                await backend.aclose()
            tg.cancel_scope.cancel()
            if args.stats:
                print(f"aospec mcp: {backend.stats.as_dict()}", file=sys.stderr)


def _budget(args: argparse.Namespace) -> Any:
    """The host's speculation budget of ``--speculation-budget`` (:func:`aospec.host.host_budget`:
    auto where it is not given; None for none or without speculation)."""
    if args.no_speculate:
        return None
    from aospec.host import host_budget

    budget = host_budget(args.speculation_budget)
    for note in budget.notes if budget is not None else ():
        print(f"aospec mcp: note: {note}", file=sys.stderr)
    return budget


def _text(result: types.CallToolResult) -> str:
    return "".join(c.text for c in result.content if isinstance(c, types.TextContent))


def _predictor(args: argparse.Namespace, eligible: Callable[[Action], bool]) -> Predictor | None:
    if args.no_speculate:
        return None
    parts: list[Predictor] = []
    if args.predict_file:
        parts.append(load_transitions(args.predict_file, args.speculate))
    if args.train_traces:
        # the proxy speculates trusted tools only: its drafters' slots go to those
        parts.append(drafter_from_traces(args.train_traces, args.speculate, keep=eligible if args.upstream else None))
    if args.predict in ("repeat", "both") or (args.predict == "auto" and not parts):
        parts.append(RepeatPredictor(eligible, k=args.speculate))
    if not parts:
        return None
    return combine(*parts, k=args.speculate)


async def _serve(args: argparse.Namespace) -> None:
    """Serve until the input ends (stdio) or a signal cancels it (SIGINT, and SIGTERM and
    SIGHUP through aospec.signals, which the ``aospec`` dispatcher sets for every verb)."""
    if args.upstream:
        from aospec.integrations._mcp_proxy import open_proxy

        opener: Any = open_proxy(args, _predictor)
    else:
        opener = _sandbox_backend(args)
    metrics = args.metrics
    async with opener as backend:
        if metrics is not None and isinstance(backend, SandboxToolServer):
            metrics.watch(backend.statistics, live_forks=backend.live_forks)
        server = build_server(backend, metrics=metrics)
        if args.http is not None:
            prefetch = None if args.no_speculate else getattr(backend, "prefetch", None)
            await serve_http(server, args.host, args.http, args.guard, prefetch, metrics)
            return
        if args.metrics_port is None:
            await serve_stdio(server)
            return
        assert metrics is not None
        token = os.environ.get(TOKEN_ENV, "").strip() or None
        async with metrics_served(metrics, args.metrics_port, prog="aospec mcp", token=token):
            await serve_stdio(server)


def _positive(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value > 0


def _usage_error(args: argparse.Namespace) -> str | None:
    """The first option that does not fit, as one line; None when all do."""
    if args.upstream and (args.state or args.backend != "overlay" or args.base != "busybox"):
        return "--state-dir, --backend and --base apply to the sandbox tools, not to --upstream"
    artifact_opts = [
        flag
        for flag, given in (
            ("--max-artifact-mb", args.max_artifact_mb is not None),
            ("--artifact-threshold", args.artifact_threshold is not None),
            ("--artifact-ttl", args.artifact_ttl is not None),
            ("--max-held-mb", args.max_held_mb is not None),
        )
        if given
    ]
    if args.artifacts and args.upstream:
        return "--artifacts applies to the sandbox tools, not to --upstream"
    if artifact_opts and not args.artifacts:
        return f"{', '.join(artifact_opts)}: only with --artifacts"
    args.max_artifact_mb = MAX_ARTIFACT_BYTES / (1 << 20) if args.max_artifact_mb is None else args.max_artifact_mb
    args.artifact_threshold = _inline_threshold() if args.artifact_threshold is None else args.artifact_threshold
    args.artifact_ttl = 300.0 if args.artifact_ttl is None else args.artifact_ttl
    args.max_held_mb = MAX_HELD_BYTES / (1 << 20) if args.max_held_mb is None else args.max_held_mb
    if not (_positive(args.max_artifact_mb) and _positive(args.artifact_ttl) and _positive(args.max_held_mb)):
        return "--max-artifact-mb, --max-held-mb and --artifact-ttl must be finite numbers > 0"
    if args.artifact_threshold < 1:
        return "--artifact-threshold must be >= 1"
    if args.timeout is not None and not _positive(args.timeout):
        return f"--command-timeout must be a finite number of seconds > 0, got {args.timeout:g}"
    if args.max_forks < 0 or args.speculate < 0:
        return "--max-forks and --speculate must be >= 0"
    if not _positive(args.max_body_mb):
        return "--max-body-mb must be a finite number > 0"
    if args.http is None and args.token_file is not None:
        return "--token-file: only with --http (stdio needs no token)"
    if args.http is not None and args.metrics_port is not None:
        return "--metrics-port: only with stdio; over --http the metrics are GET /metrics on the server"
    return None


def _run(args: argparse.Namespace) -> int:
    problem = _usage_error(args)
    if problem is not None:
        print(f"aospec mcp: {problem}", file=sys.stderr)
        return 2
    try:
        # over --http the metrics are served when prometheus_client is installed (else
        # GET /metrics names the install); --metrics-port needs it
        args.metrics = Metrics() if args.http is not None or args.metrics_port is not None else None
    except MissingDependencyError as exc:
        if args.metrics_port is not None:
            print(f"aospec mcp: --metrics-port: {exc}", file=sys.stderr)
            return 2
        args.metrics = None
    if args.http is not None:
        try:
            token, generated = resolve_token("aospec mcp", args.host, args.token_file)
        except ConfigError as exc:
            print(f"aospec mcp: {exc}".replace("aospec mcp: aospec mcp: ", "aospec mcp: "), file=sys.stderr)
            return 2
        args.guard = HttpGuard.for_bind(args.host, token, int(args.max_body_mb * (1 << 20)))
        if generated:
            print(
                f"aospec mcp: token {token} (clients send 'Authorization: Bearer {token}'; "
                "--token-file FILE or AOSPEC_TOKEN sets one)",
                file=sys.stderr,
                flush=True,
            )
    if args.upstream and not args.trust and not args.no_speculate:
        print("aospec mcp: note: no --trust file, so no upstream tool is speculated", file=sys.stderr)
    if not args.no_speculate:
        from aospec.host import check_budget

        try:
            check_budget(args.speculation_budget)
        except ConfigError as exc:
            print(f"aospec mcp: {exc}", file=sys.stderr)
            return 2
    try:
        anyio.run(_serve, args)
    except KeyboardInterrupt:  # SIGINT, SIGTERM or SIGHUP: everything was cancelled and cleaned up
        print("aospec mcp: stopped", file=sys.stderr)
        return 0
    except (OSError, ValueError, SandboxError, ConnectionError, ConfigError) as exc:
        print(f"aospec mcp: {exc}", file=sys.stderr)
        return 1
    except BaseExceptionGroup as group:  # a transport's task group wraps what failed
        leaves = _leaves(group)
        if not all(isinstance(e, Exception) for e in leaves):
            raise
        print(f"aospec mcp: {'; '.join(f'{type(e).__name__}: {e}' for e in leaves)}", file=sys.stderr)
        if args.upstream:
            print(f"aospec mcp: check that every --upstream is reachable: {', '.join(args.upstream)}", file=sys.stderr)
        return 1
    return 0


def _inline_threshold() -> int:
    from aospec.specbox.transport import INLINE_THRESHOLD

    return INLINE_THRESHOLD


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "mcp",
        help="an MCP server of sandbox tools (or a proxy of other MCP servers) with speculative tool calls",
        description="Serve bash, read_file, write_file and edit_file (and, with --artifacts, export_file: large "
        "results out of band through shared memory) on a copy-on-write aospec sandbox over MCP "
        "(stdio by default, or streamable HTTP), speculating likely next calls in forks; or, with --upstream, "
        "proxy other MCP servers and speculate the calls a --trust file marks read-only and closed-world.",
    )
    t = p.add_mutually_exclusive_group()
    t.add_argument("--stdio", action="store_true", help="serve on stdin/stdout (the default)")
    t.add_argument(
        "--http", type=port_number, metavar="PORT", help="serve streamable HTTP at http://HOST:PORT/mcp (0: any)"
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address for --http (default 127.0.0.1; any other than a loopback one needs --token-file or AOSPEC_TOKEN)",
    )
    p.add_argument(
        "--token-file",
        metavar="FILE",
        help="with --http: the bearer token every request must carry (default: $AOSPEC_TOKEN, else a new one, "
        "printed on stderr)",
    )
    p.add_argument(
        "--max-body-mb",
        type=float,
        default=MAX_BODY_BYTES / (1 << 20),
        metavar="MB",
        help=f"with --http: the largest request body (default {MAX_BODY_BYTES >> 20})",
    )
    p.add_argument("--backend", default="overlay", help="sandbox backend: overlay (default) or docker")
    p.add_argument("--base", default="busybox", help="sandbox base (default busybox)")
    p.add_argument("--state-dir", dest="state", metavar="DIR", help="a persistent sandbox state directory (kept on exit)")
    p.add_argument("--command-timeout", dest="timeout", type=float, default=None, metavar="S", help="per-command timeout of bash")
    from aospec.cli import add_alias

    add_alias(p, "--state", "--state-dir")
    add_alias(p, "--timeout", "--command-timeout")
    p.add_argument(
        "--upstream",
        action="append",
        metavar="CMD_OR_URL",
        help="proxy this MCP server (a command line run over stdio, or an http(s):// streamable HTTP URL); repeatable",
    )
    p.add_argument("--trust", metavar="FILE", help="JSON naming the upstream tools that are read-only and closed-world")
    p.add_argument("--no-speculate", action="store_true", help="never speculate (plain serial server)")
    p.add_argument("--speculate", type=int, default=2, metavar="K", help="speculative calls after each call (2)")
    p.add_argument("--max-forks", type=int, default=4, metavar="N", help="live speculative calls at most (4)")
    p.add_argument(
        "--speculation-budget",
        default=None,
        metavar="CORES[,MEMORY]",
        help="speculative calls running at once on this host, in cores (and memory: 4G), shared by every aospec "
        "session of the host; auto (the default, or $AOSPEC_SPECULATION_BUDGET): one per two cores; none: no "
        "host budget",
    )
    p.add_argument(
        "--predict",
        choices=("auto", "repeat", "table", "both"),
        default="auto",
        help="repeat: recent read-only calls; table: only --predict-file/--train-traces; "
        "both; auto (default): repeat unless a table is given",
    )
    p.add_argument("--predict-file", metavar="FILE", help="a JSON transition table [{after, next: [...]}]")
    p.add_argument("--train-traces", action="append", metavar="PATH", help="fit a transition table from traces")
    p.add_argument("--stats", action="store_true", help="print speculation counters on stderr at exit")
    p.add_argument(
        "--metrics-port",
        type=port_number,
        metavar="PORT",
        help="with stdio: serve Prometheus metrics at http://127.0.0.1:PORT/metrics (0: any free port; "
        "$AOSPEC_TOKEN, when set, is required as a bearer token); over --http they are GET /metrics on the "
        "server. Needs prometheus_client (pip install 'aospec[metrics]')",
    )
    p.add_argument(
        "--artifacts",
        action="store_true",
        help="hand large results out of band through shared memory (memfd) on this host: read_file and bash "
        "outputs of at least --artifact-threshold bytes come back as an aospec artifact ref "
        "(structuredContent.aospec_artifact, read with aospec.specbox.mcp_env.McpEnv or aospec.specbox.transport.ArtifactClient), "
        "and an export_file(path) tool hands any sandbox file over that way. Off by default: ordinary MCP clients "
        "cannot read shared memory, and only a client on the same host (same network namespace) can",
    )
    p.add_argument(
        "--max-artifact-mb",
        type=float,
        default=None,
        metavar="MB",
        help="with --artifacts: the largest file export_file hands over (default 1024 MiB)",
    )
    p.add_argument(
        "--artifact-threshold",
        type=int,
        default=None,
        metavar="BYTES",
        help="with --artifacts: outputs of at least this many bytes go out of band; smaller exports travel "
        "inline in the ref, base64 (default 65536)",
    )
    p.add_argument(
        "--max-held-mb",
        type=float,
        default=None,
        metavar="MB",
        help="with --artifacts: published results held at once, at most; the oldest untaken ones make room "
        f"(default {MAX_HELD_BYTES >> 20})",
    )
    p.add_argument(
        "--artifact-ttl",
        type=float,
        default=None,
        metavar="S",
        help="with --artifacts: free a published result no client took within S seconds (default 300)",
    )
    p.set_defaults(func=_run)
