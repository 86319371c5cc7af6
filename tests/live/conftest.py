"""Shared fixtures of the live tests: the bundled traces and serve-trace servers on
loopback ports (real uvicorn servers in a thread of their own; any event loop in the test).

- ``bundled_traces``: the bundled tb1 sample (a list of Trace).
- ``serve_traces(traces, tpot_ms=0, **kw)``: starts serve-trace for ``traces`` and returns
  its :class:`aospec.live.serve_trace.TraceServer` (``.base_url`` is ``http://127.0.0.1:PORT/v1``,
  ``.stats`` what it served); stopped when the test ends.
- ``trace_server``: serve-trace over the bundled sample at tpot 0.
- ``serve_app(app)``: runs any ASGI app (e.g. a small starlette fault server) the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from typing import Any

import pytest
from aospec.live.serve_trace import TraceServer, serve_trace_app, serving
from aospec.replay import bundled_traces_path, load_traces

from aospec.types import Trace


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def bundled_traces() -> list[Trace]:
    return load_traces(bundled_traces_path())


@pytest.fixture
def serve_app() -> Iterator[Callable[[Any], TraceServer]]:
    with ExitStack() as stack:

        def start(app: Any) -> TraceServer:
            return stack.enter_context(serving(app))

        yield start


@pytest.fixture
def serve_traces(serve_app: Callable[[Any], TraceServer]) -> Callable[..., TraceServer]:
    def start(traces: Sequence[Trace], tpot_ms: float = 0.0, **kw: Any) -> TraceServer:
        return serve_app(serve_trace_app(traces, tpot_ms, **kw))

    return start


@pytest.fixture
def trace_server(serve_traces: Callable[..., TraceServer], bundled_traces: list[Trace]) -> TraceServer:
    return serve_traces(bundled_traces, 0.0)
