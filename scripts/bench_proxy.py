#!/usr/bin/env python3
"""The speculating proxy's latency (issue 12, section 2): a harness loop with the official
``openai`` SDK against ``aospec serve-trace`` at several TPOTs, directly and through
``aospec proxy``, byte-identical replies required.

The harness behaves like mini-swe-agent: it sends the growing messages list (temperature
0, streamed), appends the reply, "runs" the command (sleeps the step's recorded tool time,
capped at ``--max-tool-s``; the observation is the recorded one, verbatim, as a user
message) and appends the observation. Per TPOT and trace it runs:

- ``direct``: the harness on serve-trace;
- ``proxy-passthrough``: through the proxy with speculation off (its overhead);
- ``proxy``: through the proxy with the ``aospec`` policy's observation drafters (patterns
  + cache) fitted on the other bundled traces (leave one trace out);
- ``proxy-oracle``: through the proxy with a drafter that knows the recorded observation
  (the ceiling of observation speculation across the HTTP boundary, not a real drafter).

It fails unless every proxied run saw exactly the replies the direct run saw (text, tool
calls, usage). Figures are wall-clock seconds of the whole loop.

By default serve-trace and the proxy run in threads of this process (so the proxy's own
overhead includes sharing the interpreter lock with the upstream and the harness);
``--processes`` starts them as ``aospec serve-trace`` and ``aospec proxy`` processes, as a
user would (no oracle row there: its drafter exists only in process).

``--actions`` measures action speculation instead (``aospec proxy --mcp``; needs root and
overlayfs): the harness executes each reply's ```` ```bash ```` action through an
``aospec mcp --http`` server's ``bash`` tool (a fresh busybox sandbox per run, its own
predictor off so only the proxy's prefetches are speculated) and sends the result as the
observation. The actions are ``sleep T; echo ...`` with T each step's recorded tool time
on the chosen bundled traces, at least ``--min-tool-s`` (their recorded times are mostly
20 ms) and at most ``--max-tool-s``; the replies are synthetic:
``block-last`` (a thought of 30 tokens, then the block: the action completes with the
reply) and ``block-then-text`` (the same, then 40 more tokens after the block). Configs:
``actions-off`` (the proxy without ``--mcp``) and ``actions-on``; it fails unless both saw
identical replies and tool results and ended at the same sandbox version.

Usage:
  .venv/bin/python scripts/bench_proxy.py [--tpot 20 10 1] [--traces 3] [--steps 8] [--processes] [--json]
  .venv/bin/python scripts/bench_proxy.py --actions [--tpot 20 10 1] [--traces 1] [--steps 6] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import openai
from aospec.integrations.proxy import default_drafters, proxy_app
from aospec.live.serve_trace import serve_trace_app, serving
from aospec.replay import bundled_traces_path, load_traces
from aospec.replay.io import write_jsonl

from aospec.protocols import ObservationDraft
from aospec.types import Action, History, Trace

AOSPEC = str(Path(sys.executable).parent / "aospec")
#: The servers' token (AOSPEC_TOKEN; the proxy passes it on as AOSPEC_UPSTREAM_TOKEN), the
#: harness's API key.
TOKEN = "bench-token"
ENV = {**os.environ, "AOSPEC_TOKEN": TOKEN, "AOSPEC_UPSTREAM_TOKEN": TOKEN}


@contextmanager
def process(args: list[str]) -> Iterator[str]:
    """Run an aospec verb that prints its ``http://.../v1`` URL; yield the URL."""
    proc = subprocess.Popen([AOSPEC, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        url = None
        while url is None:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                raise RuntimeError(f"aospec {args[0]} exited before serving")
            m = re.search(r"(http://\S+/v1)", line)
            url = m.group(1) if m else None
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


class OracleDrafter:
    """The recorded observation of the step (an upper bound, not a real drafter)."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace

    async def draft(self, history: History, action: Action, n: int) -> Sequence[ObservationDraft]:
        i = len(history)
        return [ObservationDraft(self.trace.steps[i].observation, 1.0)] if i < len(self.trace.steps) else []


def harness(base_url: str, trace: Trace, steps: int, max_tool_s: float) -> tuple[float, list[Any]]:
    client = openai.OpenAI(base_url=base_url, api_key=TOKEN, max_retries=0)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a shell agent."},
        {"role": "user", "content": trace.instruction or trace.task},
    ]
    seen = []
    start = time.perf_counter()
    for i in range(min(steps, len(trace.steps))):
        text, usage = "", None
        for chunk in client.chat.completions.create(
            model="m", messages=messages, temperature=0, stream=True, stream_options={"include_usage": True}
        ):
            usage = chunk.usage.model_dump() if chunk.usage else usage
            for ch in chunk.choices:
                text += ch.delta.content or ""
        seen.append((text, usage))
        step = trace.steps[i]
        time.sleep(min(max_tool_s, step.tool_duration_s or 0.0))
        messages.append({"role": "assistant", "content": text})
        messages.append({"role": "user", "content": step.observation})
    return time.perf_counter() - start, seen


THOUGHT = "THOUGHT: " + " ".join(["reasoning"] * 28) + "\n\n"
AFTER = "\n\nThis " + " ".join(["explains"] * 38) + "."


def action_trace(trace: Trace, steps: int, min_tool_s: float, max_tool_s: float, shape: str) -> Trace:
    """``trace``'s first ``steps`` steps as sleep commands with synthetic replies (module doc)."""
    from aospec.types import Step

    out = []
    for i, st in enumerate(trace.steps[:steps]):
        t = min(max_tool_s, max(min_tool_s, st.tool_duration_s or 0.0))
        cmd = f"sleep {t:.2f}; echo step {i} >> /tmp/bench.log; wc -l < /tmp/bench.log"
        reply = THOUGHT + f"```bash\n{cmd}\n```" + (AFTER if shape == "block-then-text" else "")
        out.append(Step(Action.bash(cmd), "", 80 if shape == "block-then-text" else 40, reply=reply))
    return Trace(trace.id, trace.task, trace.harness, trace.actor_model, trace.source, tuple(out), trace.instruction)


@contextmanager
def mcp_server() -> Iterator[str]:
    """``aospec mcp --http 0`` on a fresh sandbox, its own predictor off; yields its URL."""
    with tempfile.TemporaryDirectory() as state:
        cmd = [AOSPEC, "mcp", "--http", "0", "--predict", "table", "--command-timeout", "600"]
        env = {**ENV, "AOSPEC_STATE_ROOT": state}
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        try:
            url = None
            while url is None:
                line = proc.stderr.readline()  # type: ignore[union-attr]
                if not line:
                    raise RuntimeError("aospec mcp exited before serving")
                m = re.search(r"listening on (\S+)", line)
                url = m.group(1) if m else None
            yield url
        finally:
            proc.terminate()
            proc.wait(60)


async def action_harness(base_url: str, mcp_url: str, trace: Trace) -> tuple[float, list[Any], list[Any]]:
    import httpx2
    from aospec.live.chat import ChatFormat
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    client = openai.AsyncOpenAI(base_url=base_url, api_key=TOKEN, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": trace.instruction or trace.task}]
    seen, metas = [], []
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=600) as http,
        streamable_http_client(mcp_url, http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        start = time.perf_counter()
        for _ in trace.steps:
            text = ""
            async for chunk in await client.chat.completions.create(
                model="m", messages=messages, temperature=0, stream=True
            ):
                for ch in chunk.choices:
                    text += ch.delta.content or ""
            action = ChatFormat(action_format="bash").parse(text, ())
            result = await session.call_tool("bash", {"command": action.command}, read_timeout_seconds=600)
            out = "".join(getattr(c, "text", "") for c in result.content)
            seen.append((text, out))
            metas.append(result.meta["aospec"])
            messages.append({"role": "assistant", "content": text})
            messages.append({"role": "user", "content": out})
        wall = time.perf_counter() - start
    await client.close()
    return wall, seen, metas


def bench_actions(args: argparse.Namespace, chosen: list[Trace]) -> int:
    import asyncio

    rows: list[dict[str, Any]] = []
    for tpot in args.tpot:
        for shape in ("block-last", "block-then-text"):
            for base_trace in chosen:
                trace = action_trace(base_trace, args.steps, args.min_tool_s, args.max_tool_s, shape)
                baseline: tuple[list[Any], str] | None = None
                for name in ("actions-off", "actions-on"):
                    with ExitStack() as stack:
                        up = stack.enter_context(serving(serve_trace_app([trace], tpot)))
                        mcp_url = stack.enter_context(mcp_server())
                        proxy = proxy_app(up.base_url, mcp=mcp_url if name == "actions-on" else None, mcp_token=TOKEN)
                        url = stack.enter_context(serving(proxy)).base_url
                        wall, seen, metas = asyncio.run(action_harness(url, mcp_url, trace))
                    got = (seen, metas[-1]["version"])
                    if baseline is None:
                        baseline = got
                    elif got != baseline:
                        print(f"NOT LOSSLESS: {name} {shape} on {trace.id} at tpot {tpot}", file=sys.stderr)
                        return 1
                    rows.append(
                        {
                            "tpot_ms": tpot,
                            "shape": shape,
                            "trace": trace.id,
                            "config": name,
                            "steps": len(seen),
                            "tool_s": round(
                                sum(float(st.action.command.split()[1].rstrip(";")) for st in trace.steps), 2
                            ),
                            "wall_s": round(wall, 3),
                            "fork_hits": sum(bool(m.get("speculated")) for m in metas),
                            "prefetched": proxy.stats.actions_prefetched,
                        }
                    )
    summary = []
    for tpot in args.tpot:
        for shape in ("block-last", "block-then-text"):
            base = sum(
                r["wall_s"] for r in rows if (r["tpot_ms"], r["shape"], r["config"]) == (tpot, shape, "actions-off")
            )
            for name in ("actions-off", "actions-on"):
                sel = [r for r in rows if (r["tpot_ms"], r["shape"], r["config"]) == (tpot, shape, name)]
                wall = sum(r["wall_s"] for r in sel)
                summary.append(
                    {
                        "tpot_ms": tpot,
                        "shape": shape,
                        "config": name,
                        "wall_s": round(wall, 3),
                        "saving_pct": round(100 * (base - wall) / base, 1) if base else 0.0,
                        "fork_hits": sum(r["fork_hits"] for r in sel),
                        "calls": sum(r["steps"] for r in sel),
                        "tool_s": round(sum(r["tool_s"] for r in sel), 2),
                    }
                )
    out = {"traces": [t.id for t in chosen], "steps": args.steps, "max_tool_s": args.max_tool_s, "lossless": True,
           "summary": summary, "runs": rows}  # fmt: skip
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"action speculation; traces: {', '.join(out['traces'])}; {args.steps} steps; tool time capped at "
          f"{args.max_tool_s} s, at least {args.min_tool_s} s (sleep)")  # fmt: skip
    print(f"{'tpot ms':>8} {'reply':<16} {'config':<12} {'wall s':>8} {'saving':>8} {'fork hits':>10} {'tool s':>7}")
    for r in summary:
        print(
            f"{r['tpot_ms']:>8g} {r['shape']:<16} {r['config']:<12} {r['wall_s']:>8.2f} {r['saving_pct']:>7.1f}% "
            f"{r['fork_hits']:>5}/{r['calls']:<4} {r['tool_s']:>7.2f}"
        )
    print("actions-on saw identical replies, tool results and final sandbox version to actions-off")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tpot", type=float, nargs="+", default=[20.0, 10.0, 1.0], help="ms per output token")
    ap.add_argument("--traces", type=int, default=3, help="how many bundled traces (fewest output tokens first)")
    ap.add_argument("--steps", type=int, default=8, help="steps per trace")
    ap.add_argument("--max-tool-s", type=float, default=1.0, help="cap on each step's tool time (s)")
    ap.add_argument("--processes", action="store_true", help="serve-trace and the proxy as their own processes")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--min-tool-s", type=float, default=0.5, help="--actions: least sleep per action (s)")
    ap.add_argument("--actions", action="store_true", help="measure action speculation (--mcp; needs root)")
    args = ap.parse_args(argv)

    all_traces = load_traces(bundled_traces_path())
    chosen = sorted(all_traces, key=lambda t: sum(s.output_tokens for s in t.steps[: args.steps]))[: args.traces]
    if args.actions:
        return bench_actions(args, chosen)
    rows: list[dict[str, Any]] = []
    for tpot in args.tpot:
        for trace in chosen:
            train = [t for t in all_traces if t.task != trace.task]
            configs: dict[str, Any] = {
                "direct": None,
                "proxy-passthrough": (),
                "proxy": default_drafters(train) if not args.processes else ["--train", "TRAIN"],
            }
            if not args.processes:
                configs["proxy-oracle"] = (OracleDrafter(trace),)
            baseline: list[Any] | None = None
            for name, drafters in configs.items():
                with ExitStack() as stack:
                    proxy = None
                    if args.processes:
                        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
                        write_jsonl([trace], tmp / "served.jsonl")
                        write_jsonl(train, tmp / "train.jsonl")
                        url = stack.enter_context(
                            process(["serve-trace", str(tmp / "served.jsonl"), "--tpot-ms", str(tpot), "--port", "0"])
                        )
                        if drafters is not None:
                            extra = ["--no-speculate"] if not drafters else ["--train-traces", str(tmp / "train.jsonl")]
                            url = stack.enter_context(process(["proxy", "--upstream", url, "--port", "0", *extra]))
                    else:
                        up = stack.enter_context(serving(serve_trace_app([trace], tpot)))
                        url = up.base_url
                        if drafters is not None:
                            proxy = proxy_app(up.base_url, drafters=drafters, max_speculative=2)
                            url = stack.enter_context(serving(proxy)).base_url
                    stats_url = url.removesuffix("/v1") + "/aospec/stats"
                    wall, seen = harness(url, trace, args.steps, args.max_tool_s)
                    st = None
                    if proxy is not None:
                        st = proxy.stats.to_json()
                    elif args.processes and drafters is not None:
                        import httpx

                        st = httpx.get(stats_url, headers={"Authorization": f"Bearer {TOKEN}"}).json()
                if baseline is None:
                    baseline = seen
                elif seen != baseline:
                    print(f"NOT LOSSLESS: {name} on {trace.id} at tpot {tpot}", file=sys.stderr)
                    return 1
                rows.append(
                    {
                        "tpot_ms": tpot,
                        "trace": trace.id,
                        "config": name,
                        "steps": len(seen),
                        "wall_s": round(wall, 3),
                        "hits": st["hits"] if st else 0,
                        "midstream_hits": st["midstream_hits"] if st else 0,
                        "speculated": st["speculated"] if st else 0,
                        "cancelled": st["cancelled"] if st else 0,
                    }
                )
    summary = []
    for tpot in args.tpot:
        base = sum(r["wall_s"] for r in rows if r["tpot_ms"] == tpot and r["config"] == "direct")
        for name in ("direct", "proxy-passthrough", "proxy", "proxy-oracle"):
            sel = [r for r in rows if r["tpot_ms"] == tpot and r["config"] == name]
            if not sel:
                continue
            wall = sum(r["wall_s"] for r in sel)
            summary.append(
                {
                    "tpot_ms": tpot,
                    "config": name,
                    "wall_s": round(wall, 3),
                    "saving_pct": round(100 * (base - wall) / base, 1) if base else 0.0,
                    "hits": sum(r["hits"] for r in sel),
                    "requests": sum(r["steps"] for r in sel),
                    "speculated": sum(r["speculated"] for r in sel),
                }
            )
    out = {
        "traces": [t.id for t in chosen],
        "steps": args.steps,
        "max_tool_s": args.max_tool_s,
        "processes": args.processes,
        "lossless": True,
        "summary": summary,
        "runs": rows,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"traces: {', '.join(out['traces'])}; {args.steps} steps each; tool time capped at {args.max_tool_s} s")
    print(f"{'tpot ms':>8} {'config':<18} {'wall s':>8} {'saving':>8} {'hits':>9} {'speculated':>10}")
    for s in summary:
        print(
            f"{s['tpot_ms']:>8g} {s['config']:<18} {s['wall_s']:>8.2f} {s['saving_pct']:>7.1f}% "
            f"{s['hits']:>4}/{s['requests']:<4} {s['speculated']:>10}"
        )
    print("all proxied runs saw byte-identical replies (text and usage) to the direct runs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
