"""Prometheus metrics of aospec's servers and runs (docs/integrations.md, Metrics).

:class:`Metrics` is one process's metrics, in a registry of its own. Its counters are read,
at scrape time, from what the engine counts already: every watched source's
:class:`~aospec.ledger.EngineStatistics` (``aospec mcp``'s server, ``aospec run``'s engine)
and its live forks; nothing here counts a speculation a second time. What the statistics do
not hold -- requests, errors, and the latency of each step -- a caller reports with
:meth:`Metrics.request`, :meth:`Metrics.error` and :meth:`Metrics.step`. ``aospec proxy``
(integrations/proxy.py) watches its own statistics in the same vocabulary: a model request
answered is a step, a speculative upstream request on a drafted observation an
``observation`` speculation (docs/integrations.md, Metrics).

============================================  =====================================================
``aospec_requests_total``                     requests served or sent (MCP ``tools/call``;
                                              ``aospec run``: model requests); by ``endpoint``
                                              where a watched source counts by endpoint
                                              (``aospec proxy``)
``aospec_errors_total{kind}``                 ``tool`` (a tool error result), ``request`` (a
                                              malformed request), ``model`` (a failed model
                                              request), ``run`` (a run that failed),
                                              ``speculation`` (a speculative operation that failed:
                                              it cost time only)
``aospec_steps_total``                        committed steps (MCP: calls answered)
``aospec_speculations_launched_total{kind}``  ``action``: forks launched; ``observation``:
                                              provisional continuations started on drafts
``aospec_speculations_hit_total{kind}``       forks JASV reused; drafts adopted
``aospec_speculations_wasted_total{kind}``    forks discarded unused; continuations cancelled
``aospec_tool_seconds_total``                 tool time of the committed steps
``aospec_tool_seconds_hidden_total``          of it, the part that ran before the step was asked
                                              for (in a reused fork)
``aospec_decode_seconds_hidden_total``        decoding that ran during the previous tool call
``aospec_wasted_seconds_total{kind}``         ``tool``: time commands ran in discarded forks;
                                              ``decode``: decoding of cancelled continuations
``aospec_live_forks``                         speculative forks alive now (gauge)
``aospec_step_seconds``                       each committed step's latency (histogram)
``aospec_tool_call_seconds``                  each committed step's tool time (histogram; steps
                                              whose tool time the caller knows)
============================================  =====================================================

``prometheus_client`` is an optional dependency (``pip install 'aospec[metrics]'``); without
it, building a :class:`Metrics` raises :class:`~aospec.errors.MissingDependencyError` naming
that install. :func:`serve_metrics` serves ``GET /metrics`` on a loopback port behind the
guard every aospec server has (:mod:`aospec._http`); :func:`metrics_route` is the same route
for a server that has its own (``aospec mcp --http``, ``aospec proxy``), a 501 naming the
install when there are no metrics.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import anyio.abc

from aospec.errors import MissingDependencyError, single_leaf
from aospec.ledger import EngineStatistics

__all__ = ["INSTALL", "Metrics", "metrics_route", "metrics_served", "serve_metrics"]

#: The install line a missing ``prometheus_client`` names.
INSTALL = "pip install 'aospec[metrics]'"
#: Latency buckets (seconds): sub-millisecond tool calls to minutes-long steps.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_S = 1e-9


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise MissingDependencyError(f"metrics need prometheus_client: {INSTALL}") from None
    return prometheus_client


@dataclass(frozen=True, slots=True)
class _Source:
    statistics: Callable[[], EngineStatistics]
    live_forks: Callable[[], int] | None
    requests: Callable[[], int | Mapping[str, int]] | None
    errors: Callable[[], Mapping[str, int]] | None


class Metrics:
    """The metrics of one process (module doc), in :attr:`registry`, a
    ``prometheus_client.CollectorRegistry`` of its own."""

    def __init__(self) -> None:
        pc = _prometheus()
        self._pc = pc
        self.registry = pc.CollectorRegistry(auto_describe=False)
        self._sources: list[_Source] = []
        self._requests = 0
        self._errors: dict[str, int] = {}
        self._step = pc.Histogram(
            "aospec_step_seconds", "Latency of each committed step", buckets=BUCKETS, registry=self.registry
        )
        self._tool = pc.Histogram(
            "aospec_tool_call_seconds", "Tool time of each committed step", buckets=BUCKETS, registry=self.registry
        )
        self.registry.register(_Collector(self))

    def watch(
        self,
        statistics: Callable[[], EngineStatistics],
        *,
        live_forks: Callable[[], int] | None = None,
        requests: Callable[[], int | Mapping[str, int]] | None = None,
        errors: Callable[[], Mapping[str, int]] | None = None,
    ) -> None:
        """Read the totals of an engine (or a server on the engine's forks) at every scrape:
        ``statistics()`` its :class:`~aospec.ledger.EngineStatistics`, ``live_forks()`` its
        live forks; ``requests()`` (a total, or totals by endpoint) and ``errors()`` (by
        kind) counters it keeps itself. Every watched source adds to the same metrics."""
        self._sources.append(_Source(statistics, live_forks, requests, errors))

    def request(self) -> None:
        """One request served or sent."""
        self._requests += 1

    def error(self, kind: str) -> None:
        """One error of ``kind`` (module doc)."""
        self._errors[kind] = self._errors.get(kind, 0) + 1

    def step(self, latency_ns: int, tool_ns: int | None) -> None:
        """A committed step took ``latency_ns`` from being asked for to being answered, of
        which the tool ran ``tool_ns`` (in its fork: possibly before it was asked for; None
        where the caller does not see the tool, as ``aospec proxy``)."""
        self._step.observe(latency_ns * _S)
        if tool_ns is not None:
            self._tool.observe(tool_ns * _S)

    def render(self) -> tuple[bytes, str]:
        """``(body, content type)`` of a scrape, in the Prometheus text format."""
        return self._pc.generate_latest(self.registry), self._pc.CONTENT_TYPE_LATEST

    def asgi(self, app: Any = None) -> Any:
        """An ASGI app answering ``GET /metrics``, and passing every other request to ``app``
        (404 without one). Put it behind the server's guard (:func:`aospec._http.guarded`)."""

        async def metrics_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] != "http" or scope["path"] != "/metrics":
                if app is not None:
                    await app(scope, receive, send)
                    return
                if scope["type"] != "http":
                    return
                status, body, ctype = 404, b"not found: the route is GET /metrics\n", "text/plain; charset=utf-8"
            elif scope["method"] not in ("GET", "HEAD"):
                status, body, ctype = 405, b"GET /metrics\n", "text/plain; charset=utf-8"
            else:
                status = 200
                body, ctype = self.render()
            headers = [(b"content-type", ctype.encode()), (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})

        return metrics_app

    # -- what a scrape reads -------------------------------------------------------------------

    def _totals(self) -> tuple[EngineStatistics | None, int, dict[str, int], dict[str, int]]:
        stats: list[EngineStatistics] = []
        forks, requests, errors = 0, {"": self._requests}, dict(self._errors)
        for source in self._sources:
            stats.append(source.statistics())
            if source.live_forks is not None:
                forks += source.live_forks()
            if source.requests is not None:
                counts = source.requests()
                for endpoint, n in counts.items() if isinstance(counts, Mapping) else [("", counts)]:
                    requests[endpoint] = requests.get(endpoint, 0) + n
            if source.errors is not None:
                for kind, n in source.errors().items():
                    errors[kind] = errors.get(kind, 0) + n
        total = None
        if stats:
            total = EngineStatistics(
                **{f.name: sum(getattr(s, f.name) for s in stats) for f in dataclasses.fields(EngineStatistics)}
            )
            errors["speculation"] = errors.get("speculation", 0) + total.speculative_failures
        return total, forks, requests, errors


class _Collector:
    """The counters and the gauge, read from :meth:`Metrics._totals` at every scrape."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s, forks, requests, errors = self._metrics._totals()
        if any(requests):  # a source counts by endpoint (the rest as "": Prometheus reads it as no label)
            req = CounterMetricFamily("aospec_requests", "Requests served or sent, by endpoint", labels=["endpoint"])
            for endpoint, n in sorted(requests.items()):
                if endpoint or n:
                    req.add_metric([endpoint], n)
            yield req
        else:
            yield CounterMetricFamily("aospec_requests", "Requests served or sent", value=requests.get("", 0))
        err = CounterMetricFamily("aospec_errors", "Errors, by kind", labels=["kind"])
        for kind in sorted({"tool", "speculation", *errors}):
            err.add_metric([kind], errors.get(kind, 0))
        yield err
        yield GaugeMetricFamily("aospec_live_forks", "Speculative forks alive now", value=forks)
        s = s or EngineStatistics(**{f.name: 0 for f in dataclasses.fields(EngineStatistics)})
        yield CounterMetricFamily("aospec_steps", "Committed steps", value=s.steps)
        for name, doc, action, observation in (
            ("launched", "Speculations started", s.forks_launched, s.drafts_started),
            (
                "hit",
                "Speculations used (JASV reuse; adopted draft)",
                s.forks_reused,
                s.drafts_hit + s.drafts_canonical_hit,
            ),
            ("wasted", "Speculations thrown away", s.forks_wasted, s.drafts_cancelled),
        ):
            family = CounterMetricFamily(f"aospec_speculations_{name}", doc, labels=["kind"])
            family.add_metric(["action"], action)
            family.add_metric(["observation"], observation)
            yield family
        yield CounterMetricFamily("aospec_tool_seconds", "Tool time of the committed steps", value=s.tool_ns * _S)
        yield CounterMetricFamily(
            "aospec_tool_seconds_hidden",
            "Tool time that ran before its step was asked for",
            value=s.tool_hidden_ns * _S,
        )
        yield CounterMetricFamily(
            "aospec_decode_seconds_hidden",
            "Decoding that ran during the previous tool call",
            value=s.decode_hidden_ns * _S,
        )
        wasted = CounterMetricFamily("aospec_wasted_seconds", "Speculative work thrown away", labels=["kind"])
        wasted.add_metric(["tool"], s.wasted_tool_ns * _S)
        wasted.add_metric(["decode"], s.wasted_decode_ns * _S)
        yield wasted


def metrics_route(app: Any, metrics: Metrics | None) -> Any:
    """``app`` with ``GET /metrics``: ``metrics``' scrape (:meth:`Metrics.asgi`), or, with
    ``metrics`` None (``prometheus_client`` is not installed), a 501 naming the install
    (:data:`INSTALL`). Put it behind the server's guard (:func:`aospec._http.guarded`)."""
    if metrics is not None:
        return metrics.asgi(app)
    from aospec._http import error_response

    async def no_metrics(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/metrics":
            await error_response(send, 501, f"metrics need prometheus_client: {INSTALL}", "not_installed")
            return
        await app(scope, receive, send)

    return no_metrics


@asynccontextmanager
async def metrics_served(metrics: Metrics, port: int, *, prog: str, token: str | None = None) -> AsyncIterator[int]:
    """:func:`serve_metrics` in the background while the block runs (yields the bound
    port); the block's own error comes out as itself, not in a task group's group."""
    try:
        async with anyio.create_task_group() as tg:
            bound = await tg.start(partial(serve_metrics, metrics, port, prog=prog, token=token))
            try:
                yield bound
            finally:
                tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        leaf = single_leaf(group)
        if leaf is None:
            raise
        raise leaf from leaf.__cause__


async def serve_metrics(
    metrics: Metrics,
    port: int,
    *,
    prog: str,
    token: str | None = None,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``GET /metrics`` on ``127.0.0.1:PORT`` (0: any free port) until cancelled,
    behind the loopback guard (Host and Origin checked; ``token``, when given, required as
    a bearer token). Prints ``PROG: metrics on URL`` on stderr; ``task_status`` gets the
    bound port."""
    from aospec._http import HttpGuard, guarded, serve_asgi

    app = guarded(metrics.asgi(), HttpGuard.for_bind("127.0.0.1", token, 1 << 16))

    def listening(bound: int) -> None:
        print(f"{prog}: metrics on http://127.0.0.1:{bound}/metrics", file=sys.stderr, flush=True)
        task_status.started(bound)

    await serve_asgi(app, "127.0.0.1", port, listening=listening)
