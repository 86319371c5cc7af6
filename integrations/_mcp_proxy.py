"""``aospec mcp --upstream ...``: a speculating proxy of other MCP servers.

The proxy connects to each upstream as an MCP client (a command line run over stdio, or a
streamable HTTP URL, sent ``Authorization: Bearer $AOSPEC_UPSTREAM_TOKEN`` when that is
set: the token of an ``aospec mcp --http`` upstream), forwards ``tools/list`` (tool names that occur in more than one
upstream are namespaced ``SERVER__tool``) and ``tools/call``.

Speculation is limited to the tools a trusted configuration (``--trust FILE``, see
:func:`aospec.integrations._mcp_common.load_trust`) marks read-only AND closed-world; an upstream's
own annotations never suffice, since any server can claim anything. After each call the
predictor's proposals for trusted tools (drafted once the reply is on its way; the next
call waits for that drafting) are issued to the upstream at once, and their
results are kept under ``(tool, canonical arguments, state epoch)``. The epoch is a counter
of the upstream state as the proxy knows it: every call to a tool that is not trusted moves
it (before the call is forwarded and again when it returns), which discards every
speculative result, finished or in flight; a speculative result is served only when the
epoch it was issued at is still the current epoch when it completes and when the real call
arrives. Calls are forwarded one at a time in arrival order (as in sandbox mode), so a
trusted read never overlaps a write it could observe half-done.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import mcp_types as types
from aospec.integrations._mcp_common import (
    REPLY_FIRST_S,
    ArrivalGate,
    Predictor,
    error_result,
    load_trust,
    prefetch_cap,
    propose,
    result_meta,
)

from aospec._http import UPSTREAM_TOKEN_ENV
from aospec.types import Action

__all__ = ["ProxyBackend", "Upstream", "connect_upstream", "open_proxy"]


@dataclass
class Upstream:
    spec: str
    name: str
    session: Any


async def connect_upstream(stack: contextlib.AsyncExitStack, spec: str, index: int) -> Upstream:
    """Connect to one upstream (kept open by ``stack``); raises ConnectionError naming it."""
    from mcp import ClientSession, StdioServerParameters, stdio_client
    from mcp.client.streamable_http import streamable_http_client

    try:
        if re.match(r"https?://", spec):
            token = os.environ.get(UPSTREAM_TOKEN_ENV, "").strip()
            http = None
            if token:  # an aospec mcp --http upstream (or any bearer-token server)
                import httpx2  # the MCP SDK's HTTP client

                client = httpx2.AsyncClient(
                    headers={"Authorization": f"Bearer {token}"}, timeout=httpx2.Timeout(30.0, read=300.0)
                )
                http = await stack.enter_async_context(client)
            read, write = await stack.enter_async_context(streamable_http_client(spec, http_client=http))
        else:
            argv = shlex.split(spec)
            if not argv:
                raise ValueError("empty command")
            params = StdioServerParameters(command=argv[0], args=argv[1:], env=dict(os.environ))
            read, write = await stack.enter_async_context(stdio_client(params))
        session = await stack.enter_async_context(ClientSession(read, write))
        with anyio.fail_after(60):
            init = await session.initialize()
    except Exception as exc:  # one clear line, whatever the transport raised
        raise ConnectionError(f"upstream {spec!r} is unreachable or not an MCP server: {exc}") from None
    name = re.sub(r"[^A-Za-z0-9_-]+", "_", init.server_info.name or "") or f"u{index}"
    return Upstream(spec, name, session)


@dataclass
class _PSpec:
    action: Action
    epoch: int
    done: anyio.Event = field(default_factory=anyio.Event)
    result: types.CallToolResult | None = None
    prefetched: bool = False
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    started: float | None = None  # time.monotonic() when it was issued upstream
    ended: float | None = None


class ProxyBackend:
    def __init__(
        self,
        upstreams: list[Upstream],
        trusted: frozenset[str],
        tg: anyio.abc.TaskGroup,
        *,
        predictor: Predictor | None,
        max_inflight: int = 4,
    ) -> None:
        self.upstreams = upstreams
        self.trusted = trusted
        self.tg = tg
        self.predictor = predictor
        self.max_inflight = max_inflight
        self.gate = ArrivalGate()
        self.epoch = 0
        self.route: dict[str, tuple[Upstream, str]] = {}
        self._specs: dict[tuple[int, str], _PSpec] = {}
        self._drafting: anyio.Event | None = None  # set once the last call's drafting is done
        self.stats = {
            "calls": 0,
            "served_speculated": 0,
            "forwarded": 0,
            "launched": 0,
            "prefetched": 0,
            "epoch_moves": 0,
            "draft_failures": 0,
            "hidden_s": 0.0,
        }

    async def list_tools(self) -> list[types.Tool]:
        """Every upstream's tools (all pages), colliding names namespaced ``SERVER__tool``."""
        listed: list[tuple[Upstream, types.Tool]] = []
        for up in self.upstreams:
            cursor = None
            for _ in range(1000):  # bounded pagination
                page = await up.session.list_tools(
                    params=types.PaginatedRequestParams(cursor=cursor) if cursor else None
                )
                listed.extend((up, t) for t in page.tools)
                cursor = page.next_cursor
                if not cursor:
                    break
        counts: dict[str, int] = {}
        for _, t in listed:
            counts[t.name] = counts.get(t.name, 0) + 1
        prefixes = _prefixes(self.upstreams)
        route: dict[str, tuple[Upstream, str]] = {}
        tools = []
        for up, t in listed:
            exposed = t.name if counts[t.name] == 1 else f"{prefixes[id(up)]}__{t.name}"
            route[exposed] = (up, t.name)
            tools.append(t if exposed == t.name else t.model_copy(update={"name": exposed}))
        self.route = route
        return tools

    async def call(self, name: str, arguments: dict[str, Any] | None) -> types.CallToolResult:
        try:
            action = Action(name, arguments or {})
        except (ValueError, TypeError) as exc:
            return error_result(f"invalid call: {exc}")
        if not self.route:
            await self.list_tools()
        arrived = time.monotonic()
        async with self.gate:
            if self._drafting is not None:
                await self._drafting.wait()  # the previous call's drafting, launches included
            self.stats["calls"] += 1
            if name not in self.route:
                return error_result(f"unknown tool {name!r}")
            up, upstream_name = self.route[name]
            trusted = name in self.trusted
            if not trusted:
                self._move_epoch()
            epoch = self.epoch
            spec = self._specs.pop((epoch, action.key), None) if trusted else None
            result = None
            if spec is not None:
                await spec.done.wait()
                if spec.result is not None and spec.epoch == self.epoch:
                    result = spec.result
                    self.stats["served_speculated"] += 1
                    # the upstream time the agent did not wait for: the call ran before it came
                    if spec.started is not None and spec.ended is not None:
                        hidden = max(0.0, min(arrived, spec.ended) - spec.started)
                        self.stats["hidden_s"] = round(self.stats["hidden_s"] + hidden, 6)
            speculated = result is not None
            if result is None:
                self.stats["forwarded"] += 1
                try:
                    result = await up.session.call_tool(upstream_name, dict(arguments or {}))
                finally:
                    if not trusted:
                        self._move_epoch()  # what ran while it was in flight saw an unknown state
            # drafting and launching the next speculations happen after the reply is sent
            # (drafting is milliseconds of CPU the agent would wait for); the next call
            # waits for them, so the predictor sees the calls in order and the call it
            # drafted for finds what it launched
            self._drafting = anyio.Event()
            self.tg.start_soon(
                self._after, action, "".join(getattr(c, "text", "") for c in result.content), self._drafting
            )
            return result_meta(result, speculated=speculated, epoch=self.epoch, stats=dict(self.stats))

    async def _after(self, action: Action, observation: str, done: anyio.Event) -> None:
        try:
            # drafters are CPU work that never yields: let the reply reach the transport
            # first (every task ready to run runs before a timer fires)
            await anyio.sleep(REPLY_FIRST_S)
            await self._speculate(action, observation)
        except Exception as exc:  # a predictor that fails only loses its guesses
            self.stats["draft_failures"] += 1
            if self.stats["draft_failures"] == 1:
                print(
                    f"aospec mcp: note: drafting failed ({type(exc).__name__}: {exc}); "
                    "calls are forwarded without speculation while it fails",
                    file=sys.stderr,
                )
        finally:
            done.set()

    async def prefetch(self, name: str, arguments: dict[str, Any] | None) -> bool | str:
        """Issue ``name(arguments)`` to its upstream now, as a speculative call of the current
        epoch (``POST /aospec/prefetch``: ``aospec proxy --mcp`` sends the calls a model is
        emitting, or those its drafters expect from the whole conversation). Only trusted
        tools: ``"tool"`` when it is not one (no call of it ever will be), False when it is
        not a valid call or ``max_inflight`` is 0. It queues at the gate like a
        call (after the previous call's drafting). At most :func:`prefetch_cap` of
        ``max_inflight`` are prefetched ones (the oldest makes room for a new one); a
        prefetch displaces a predicted call when all are in flight."""
        try:
            action = Action(name, arguments or {})
        except (ValueError, TypeError):
            return False
        if not self.route:
            await self.list_tools()
        if name not in self.trusted or name not in self.route:
            return "tool"
        cap = prefetch_cap(self.max_inflight)
        if cap == 0:
            return False
        async with self.gate:
            if self._drafting is not None:
                await self._drafting.wait()
            key = (self.epoch, action.key)
            if key in self._specs:
                return True
            mine = [k for k, sp in self._specs.items() if sp.prefetched]
            if len(mine) >= cap:
                self._drop(mine[0])  # the oldest prefetch makes room
            elif len(self._specs) >= self.max_inflight:
                # the least likely predicted call (launched in rank order, so the last)
                self._drop(next(k for k, sp in reversed(self._specs.items()) if not sp.prefetched))
            spec = _PSpec(action, self.epoch, prefetched=True)
            self._specs[key] = spec
            self.stats["prefetched"] += 1
            self.tg.start_soon(self._run_spec, spec)
            return True

    def _drop(self, key: tuple[int, str]) -> None:
        """Forget a speculative call and stop it (its result is never served)."""
        spec = self._specs.pop(key)
        spec.scope.cancel()

    def _move_epoch(self) -> None:
        self.epoch += 1
        self.stats["epoch_moves"] += 1
        self._specs.clear()  # in-flight ones see the epoch moved and keep no result

    async def _speculate(self, last: Action, observation: str) -> None:
        if self.predictor is None:
            return
        for action in await propose(self.predictor, last, observation):
            if action.tool not in self.trusted or action.tool not in self.route:
                continue  # only what the trusted configuration allows
            if len(self._specs) >= self.max_inflight:
                break
            key = (self.epoch, action.key)
            if key in self._specs:
                continue
            spec = _PSpec(action, self.epoch)
            self._specs[key] = spec
            self.stats["launched"] += 1
            self.tg.start_soon(self._run_spec, spec)

    async def _run_spec(self, spec: _PSpec) -> None:
        try:
            up, upstream_name = self.route[spec.action.tool]
            with spec.scope:
                spec.started = time.monotonic()
                result = await up.session.call_tool(upstream_name, dict(spec.action.args))
                spec.ended = time.monotonic()
                if spec.epoch == self.epoch:  # no untrusted call started while it ran
                    spec.result = result
        except Exception as exc:  # a failed speculation is only a missed chance
            print(f"aospec mcp: speculative {spec.action.tool} failed: {exc}", file=sys.stderr)
        finally:
            spec.done.set()


def _prefixes(upstreams: list[Upstream]) -> dict[int, str]:
    seen: dict[str, int] = {}
    for up in upstreams:
        seen[up.name] = seen.get(up.name, 0) + 1
    return {id(up): (up.name if seen[up.name] == 1 else f"{up.name}{i}") for i, up in enumerate(upstreams)}


@contextlib.asynccontextmanager
async def open_proxy(
    args: argparse.Namespace, make_predictor: Callable[..., Predictor | None]
) -> AsyncIterator[ProxyBackend]:
    trusted = load_trust(args.trust) if args.trust else frozenset()
    async with contextlib.AsyncExitStack() as stack:
        upstreams = [await connect_upstream(stack, spec, i) for i, spec in enumerate(args.upstream)]
        async with anyio.create_task_group() as tg:
            backend = ProxyBackend(
                upstreams,
                trusted,
                tg,
                predictor=None,
                max_inflight=args.max_forks,
            )
            backend.predictor = make_predictor(args, eligible=lambda a: a.tool in trusted)
            await backend.list_tools()
            try:
                yield backend
            finally:
                tg.cancel_scope.cancel()
