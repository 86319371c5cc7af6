#!/usr/bin/env python3
"""Function-calling agents through the speculating MCP proxy: wall time with and without
speculation, on recorded tool-call trajectories (tau-bench's format or any ``aospec
traces`` reads), the calls drafter (``aospec.drafters.calls``) proposing what to prefetch.

Each trajectory is replayed by a scripted agent: before each call it "decodes" for the
step's output tokens x ``--tpot`` ms, then calls the tool through ``aospec mcp --upstream``
(the official MCP SDK over stdio). The upstream is this script in ``--serve`` mode: an MCP
server answering each call with the observation the trajectory recorded for it, after
``--latency-ms`` (a remote API's latency; a call it has no recording for is an error, which
only a speculative call can make). The agent's replies and the user's turns (``respond``
and any tool its trust file does not list) are not tool calls; they cost their decode time
only, and the proxy never sees them, so its drafters are fitted on the trajectories'
tool calls only, leave-one-task-out (``--train-traces`` of the other tasks' trajectories).

Per trajectory, interleaved: ``serial`` (``--no-speculate``) then ``speculative``
(``--train-traces``, ``--predict table``, ``--speculate K``); the speculative run must see
every result byte for byte as the serial run did. Read-only tools are named by
``--trust-tools`` (default: the tau-bench airline lookups). Prints one line per trajectory
on stderr (progress) and the totals: saving (the whole set's wall time, medians of the
repeats per trajectory, and the same per repeat: the spread), calls served from
speculation, speculative calls launched; ``--json`` prints one JSON object on stdout.

``--harness chat`` runs a chat harness instead, as a user would deploy one: the ``openai``
SDK (streamed, temperature 0, every tool of the trajectory declared) against ``aospec
proxy`` in front of ``aospec serve-trace`` (the trajectory's replies, each a tool call, at
``--tpot``), its tool calls through ``aospec mcp --http --upstream`` (the same recording
server), the user's turns and the agent's thoughts answered with their recorded text. The
first user message is the trajectory's instruction. Configurations, interleaved per
trajectory and repeat (``--configs``; ``serial`` always runs, the others must see its
replies and results exactly):

- ``serial``: the proxy passes through, the MCP server does not speculate;
- ``mcp``: the MCP server's drafters, fitted on the other tasks' tool calls, speculate
  after each call (what ``--harness mcp`` measures, behind a proxy);
- ``proxy``: the proxy's drafters, fitted on the other tasks' whole trajectories, draft
  the next calls on the conversation when each request arrives and prefetch the best
  ``--speculate`` of them through the server (``--mcp-any-tool``); the calls each reply
  holds are prefetched too; no observation speculation (``--max-speculative 0``);
- ``both``: the two together.

Usage:
  .venv/bin/python scripts/bench_calls.py ../shared/traces/tau-bench-gpt-4o-airline [--limit 12] [--tpot 20] [--latency-ms 300] [--repeats 1] [--json]
  .venv/bin/python scripts/bench_calls.py ../shared/traces/tau-bench-gpt-4o-airline --harness chat [--configs serial,mcp,proxy,both] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

TAU_LOOKUPS = (
    "get_user_details",
    "get_reservation_details",
    "search_direct_flight",
    "search_onestop_flight",
    "list_all_airports",
    "calculate",
)


def _serve(path: str, latency_ms: float) -> None:
    """The upstream: answers each call with its recorded observation (``path``: JSON
    ``[[ACTION_KEY, OBSERVATION], ...]``) after ``latency_ms``."""
    import mcp_types as types
    from mcp.server.lowlevel import Server
    from mcp.server.stdio import stdio_server

    from aospec.types import Action

    answers: dict[str, str] = {}
    tools: dict[str, None] = {}
    for key, obs in json.loads(Path(path).read_text()):
        a = Action.from_json(json.loads(key))
        answers.setdefault(a.key, obs)
        tools[a.tool] = None
    listed = [
        types.Tool(name=t, description=t, input_schema={"type": "object", "additionalProperties": True}) for t in tools
    ]

    async def on_list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=listed)

    async def on_call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        await anyio.sleep(latency_ms / 1000)
        key = Action(params.name, params.arguments or {}).key
        if key in answers:
            return types.CallToolResult(content=[types.TextContent(text=answers[key])])
        return types.CallToolResult(content=[types.TextContent(text="no recording for this call")], is_error=True)

    server = Server("aospec-bench-calls", on_list_tools=on_list_tools, on_call_tool=on_call_tool)

    async def run() -> None:
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())

    anyio.run(run)


async def _run(trace: Any, proxy_args: list[str], tpot_ms: float) -> dict[str, Any]:
    from mcp import ClientSession, StdioServerParameters, stdio_client

    params = StdioServerParameters(
        command=sys.executable, args=["-m", "aospec", "mcp", "--stdio", *proxy_args], env=dict(os.environ)
    )
    results: list[tuple[str, bool]] = []
    meta: dict[str, Any] = {}
    served = 0
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        with anyio.fail_after(600):
            await session.initialize()
        t0 = time.perf_counter()
        for step in trace.steps:
            await anyio.sleep(step.output_tokens * tpot_ms / 1000)
            a = step.action
            if not _is_call(a):
                continue
            r = await session.call_tool(a.tool, a.to_json()["args"], read_timeout_seconds=600)
            text = "".join(getattr(c, "text", "") for c in r.content)
            results.append((text, bool(r.is_error)))
            meta = (r.meta or {}).get("aospec", {})
            served += bool(meta.get("speculated"))
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "results": results, "served": served, "stats": meta.get("stats", {})}


def _is_call(action: Any) -> bool:
    """A call the agent makes through the proxy: not a reply to the user, a thought or no action."""
    return action.tool not in ("respond", "think") and not action.is_none


def _tools_of(trace: Any) -> set[str]:
    return {s.action.tool for s in trace.steps if _is_call(s.action)}


def _calls_only(trace: Any) -> Any:
    """The trajectory as the proxy sees it: its tool calls only, and no task text (its
    histories' task is blank: ``instruction`` a space, which ``Trace.history`` prefers to
    the task's name; the task stays, so the drafters' calibration can fold by it)."""
    import dataclasses

    steps = tuple(s for s in trace.steps if _is_call(s.action))
    return dataclasses.replace(trace, steps=steps, instruction=" ")


#: The servers' token (AOSPEC_TOKEN; passed on as AOSPEC_UPSTREAM_TOKEN), the harness's API key.
TOKEN = "bench-calls-token"
#: ``--harness chat`` configurations: (aospec proxy speculates calls from the conversation,
#: aospec mcp speculates from the calls it saw).
CHAT_CONFIGS = {"serial": (False, False), "mcp": (False, True), "proxy": (True, False), "both": (True, True)}


class _Proc:
    """An aospec verb as a process that prints its URL (on stdout or stderr); stopped with
    SIGTERM (then SIGKILL) on the way out, whatever happens."""

    def __init__(self, args: list[str], pattern: str, log: Path) -> None:
        import re
        import subprocess

        env = {**os.environ, "AOSPEC_TOKEN": TOKEN, "AOSPEC_UPSTREAM_TOKEN": TOKEN}
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "aospec", *args], stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env
            )
        deadline = time.monotonic() + 120
        self.url = ""
        try:
            while not self.url:
                m = re.search(pattern, log.read_text(errors="replace"))
                if m:
                    self.url = m.group(1)
                elif self.proc.poll() is not None or time.monotonic() > deadline:
                    tail = log.read_text(errors="replace").strip().splitlines()[-3:]
                    raise RuntimeError(f"aospec {args[0]} did not start: {' | '.join(tail)}")
                else:
                    time.sleep(0.05)
        except BaseException:  # SIGTERM or Ctrl-C while it starts, too: it stops with us
            self.stop()
            raise

    def stop(self) -> None:
        import subprocess

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _tool_specs(trace: Any) -> list[dict[str, Any]]:
    names = dict.fromkeys(s.action.tool for s in trace.steps if not s.action.is_none)
    return [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in names]


async def _chat_run(
    trace: Any, model_url: str, proxy_args: list[str], mcp_args: list[str], tmp: Path
) -> dict[str, Any]:
    """One run of the chat harness: ``aospec proxy`` (``proxy_args``) in front of serve-trace
    at ``model_url``, the tool calls through ``aospec mcp --http`` (``mcp_args``)."""
    import httpx2
    import openai
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client
    from openai.lib.streaming.chat import ChatCompletionStreamState

    procs: list[_Proc] = []
    try:
        mcp = _Proc(["mcp", "--http", "0", *mcp_args], r"listening on (http://\S+/mcp)", tmp / "mcp.log")
        procs.append(mcp)
        extra = ["--mcp", mcp.url] if "--train-traces" in proxy_args else []
        proxy = _Proc(
            ["proxy", "--upstream", model_url, "--port", "0", *extra, *proxy_args],
            r"aospec proxy at (http://\S+/v1)",
            tmp / "proxy.log",
        )
        procs.append(proxy)
        client = openai.AsyncOpenAI(base_url=proxy.url, api_key=TOKEN, max_retries=0, timeout=600)
        tools = _tool_specs(trace)
        messages: list[dict[str, Any]] = [{"role": "user", "content": trace.instruction or trace.task}]
        results: list[tuple[str, bool]] = []
        replies: list[Any] = []
        served = 0
        meta: dict[str, Any] = {}
        async with (
            httpx2.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=600) as http,
            streamable_http_client(mcp.url, http_client=http) as (read, write),
            ClientSession(read, write) as session,
        ):
            with anyio.fail_after(600):
                await session.initialize()
            t0 = time.perf_counter()
            for step in trace.steps:
                state = ChatCompletionStreamState()  # the SDK's own accumulation of a stream
                stream = await client.chat.completions.create(
                    model="m", messages=messages, tools=tools, temperature=0, stream=True
                )
                async for chunk in stream:
                    state.handle_chunk(chunk)
                reply = state.get_final_completion().choices[0].message
                text = reply.content or ""
                tool_calls = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": c.function.arguments},
                    }
                    for c in reply.tool_calls or ()
                ]
                replies.append((text, tool_calls))
                messages.append({"role": "assistant", "content": text or None, "tool_calls": tool_calls})
                a = step.action
                if _is_call(a) and tool_calls:
                    r = await session.call_tool(a.tool, a.to_json()["args"], read_timeout_seconds=600)
                    out = "".join(getattr(c, "text", "") for c in r.content)
                    results.append((out, bool(r.is_error)))
                    meta = (r.meta or {}).get("aospec", {})
                    served += bool(meta.get("speculated"))
                else:
                    out = step.observation  # the user's answer, a thought's echo
                if tool_calls:
                    messages.append({"role": "tool", "tool_call_id": tool_calls[0]["id"], "content": out})
                else:
                    messages.append({"role": "user", "content": out})
            wall = time.perf_counter() - t0
        await client.close()
        stats = {}
        if "--train-traces" in proxy_args:
            import httpx

            stats = httpx.get(
                proxy.url.removesuffix("/v1") + "/aospec/stats", headers={"Authorization": f"Bearer {TOKEN}"}
            ).json()
    except Exception:
        for p in procs:  # what the servers said, for the one-line error that follows
            tail = p.log.read_text(errors="replace").strip().splitlines()[-3:]
            print(f"  {p.log.stem}: {' | '.join(tail)}", file=sys.stderr)
        raise
    finally:
        for p in reversed(procs):
            p.stop()
    return {
        "wall_s": wall,
        "results": results,
        "replies": replies,
        "served": served,
        "stats": meta.get("stats", {}),
        "proxy_stats": stats,
    }


def main() -> int:
    from aospec.errors import AospecError
    from aospec.signals import interrupt_on_signals

    try:
        with interrupt_on_signals():  # SIGTERM unwinds like Ctrl-C: the temporary files go
            return _main()
    except AospecError as exc:
        print(f"bench_calls: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench_calls: interrupted", file=sys.stderr)
        return 130


def _main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="?", help="trajectories with tool calls (a file or directory)")
    ap.add_argument("--limit", type=int, default=12, help="trajectories to run, one per task first (default 12)")
    ap.add_argument("--tpot", type=float, default=20.0, help="ms per output token of the agent's decode (20)")
    ap.add_argument("--latency-ms", type=float, default=300.0, help="each tool call's latency at the upstream (300)")
    ap.add_argument("--speculate", type=int, default=2, help="speculative calls after each call (2)")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved serial/speculative pairs per trajectory (1)")
    ap.add_argument("--trust-tools", default=",".join(TAU_LOOKUPS), help="read-only tools the proxy may prefetch")
    ap.add_argument(
        "--harness",
        choices=("mcp", "chat"),
        default="mcp",
        help="mcp: a scripted agent calls aospec mcp (default); chat: an openai-SDK chat harness through aospec "
        "proxy on serve-trace, its calls through aospec mcp --http",
    )
    ap.add_argument(
        "--configs",
        default=",".join(CHAT_CONFIGS),
        help=f"with --harness chat: configurations to interleave, of {', '.join(CHAT_CONFIGS)} (all)",
    )
    ap.add_argument(
        "--offline",
        action="store_true",
        help="no servers: how often the next tool call is among the drafters' first 1 / 2 / 4, drafted on the calls "
        "only (what aospec mcp sees) and on the whole trajectory (what aospec proxy sees), leave-one-task-out",
    )
    ap.add_argument(
        "--uncalibrated",
        action="store_true",
        help="with --offline: rank the drafters' targets by their raw scores (before calibration)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--serve", metavar="ANSWERS", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        _serve(args.serve, args.latency_ms)
        return 0
    if not args.traces:
        ap.error("give the trajectories (e.g. ../shared/traces/tau-bench-gpt-4o-airline)")
    if args.limit < 1 or args.repeats < 1 or args.speculate < 1 or args.tpot < 0 or args.latency_ms < 0:
        ap.error("--limit, --repeats and --speculate must be >= 1; --tpot and --latency-ms >= 0")
    from aospec.replay.io import load_traces

    traces = load_traces([args.traces])
    # one trajectory per task first (the first of each, by id), then the others, up to --limit
    ordered = sorted((t for t in traces if _tools_of(t)), key=lambda t: (t.task, t.id))
    firsts = {t.task: t for t in reversed(ordered)}
    runnable = ([*firsts.values()][::-1] + [t for t in ordered if firsts[t.task] is not t])[: args.limit]
    if not runnable:
        print(f"{args.traces}: no trajectory with tool calls", file=sys.stderr)
        return 1
    if len({t.task for t in ordered}) < 2:
        print(
            f"{args.traces}: the drafters are fit leave-one-task-out: give trajectories of two tasks or more",
            file=sys.stderr,
        )
        return 1
    trusted = {t for t in args.trust_tools.split(",") if t}
    if args.offline:
        return _offline(args, traces)
    if args.harness == "chat":
        return _chat_main(args, runnable, traces, trusted)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="aospec-bench-calls-") as tmp:
        trust = Path(tmp) / "trust.json"
        trust.write_text(json.dumps({"tools": {t: {"readOnly": True, "openWorld": False} for t in trusted}}))
        for n, trace in enumerate(runnable, 1):
            base, spec_args = _mcp_args(args, trace, traces, Path(tmp), trust)
            serial_w: list[float] = []
            spec_w: list[float] = []
            served = launched = calls = 0
            hidden = 0.0
            for _ in range(args.repeats):
                try:
                    s = anyio.run(_run, trace, [*base, "--no-speculate"], args.tpot)
                    p = anyio.run(_run, trace, spec_args, args.tpot)
                except Exception as exc:  # one line, not the MCP client's exception group
                    print(f"{trace.id}: a run through aospec mcp failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                    return 1
                if p["results"] != s["results"]:
                    print(f"{trace.id}: the speculative run saw different results", file=sys.stderr)
                    return 1
                serial_w.append(s["wall_s"])
                spec_w.append(p["wall_s"])
                served += p["served"]
                launched += int(p["stats"].get("launched", 0))
                hidden += float(p["stats"].get("hidden_s", 0.0))
                calls += len(p["results"])
            row = {
                "trace": trace.id,
                "calls": calls // args.repeats,
                "serial_s": statistics.median(serial_w),
                "speculative_s": statistics.median(spec_w),
                "serial_runs_s": serial_w,
                "speculative_runs_s": spec_w,
                "served": served / args.repeats,
                "launched": launched / args.repeats,
                "hidden_s": hidden / args.repeats,
            }
            rows.append(row)
            saving = 1 - row["speculative_s"] / row["serial_s"] if row["serial_s"] > 0 else 0.0
            print(
                f"[{n}/{len(runnable)}] {trace.id}: {row['calls']} calls, serial {row['serial_s']:.2f} s, "
                f"speculative {row['speculative_s']:.2f} s ({saving:+.1%}), served {row['served']:g}, "
                f"launched {row['launched']:g}",
                file=sys.stderr,
            )
    serial = sum(r["serial_s"] for r in rows)
    spec = sum(r["speculative_s"] for r in rows)
    total = {
        "trajectories": len(rows),
        "calls": sum(r["calls"] for r in rows),
        "served": sum(r["served"] for r in rows),
        "launched": sum(r["launched"] for r in rows),
        "hidden_s": sum(r["hidden_s"] for r in rows),
        "serial_s": serial,
        "speculative_s": spec,
        "saving": 1 - spec / serial if serial else 0.0,
        "per_trajectory_saving_median": statistics.median(
            1 - r["speculative_s"] / r["serial_s"] if r["serial_s"] > 0 else 0.0 for r in rows
        ),
        # the whole set's saving in each repeat (repeat k: every trajectory's k-th pair)
        "saving_by_repeat": [
            1 - sum(r["speculative_runs_s"][k] for r in rows) / max(sum(r["serial_runs_s"][k] for r in rows), 1e-9)
            for k in range(args.repeats)
        ],
        "tpot_ms": args.tpot,
        "latency_ms": args.latency_ms,
        "repeats": args.repeats,
    }
    if args.json:
        print(json.dumps({"total": total, "rows": rows}, indent=2))
    else:
        print(
            f"{total['trajectories']} trajectories, {total['calls']} calls: serial {serial:.1f} s, speculative "
            f"{spec:.1f} s, saving {total['saving']:+.1%} (repeats {min(total['saving_by_repeat']):+.1%} to "
            f"{max(total['saving_by_repeat']):+.1%}; median per trajectory "
            f"{total['per_trajectory_saving_median']:+.1%}); {total['served']:g} calls served from speculation "
            f"({total['hidden_s']:.1f} s of their upstream time hidden), {total['launched']:g} speculative calls "
            "launched"
        )
    return 0


def _mcp_args(
    args: argparse.Namespace, trace: Any, traces: list[Any], tmp: Path, trust: Path
) -> tuple[list[str], list[str]]:
    """``aospec mcp``'s arguments for ``trace``: in front of this script serving its
    recorded results (written to ``tmp``), and the same with the drafters fitted on the
    other tasks' tool calls (leave-one-task-out) speculating ``--speculate`` calls."""
    from aospec.replay.io import write_jsonl

    answers, train = tmp / "answers.json", tmp / "calls.jsonl"
    answers.write_text(json.dumps([[s.action.key, s.observation] for s in trace.steps]))
    write_jsonl([_calls_only(t) for t in traces if t.task != trace.task and _tools_of(t)], train)
    serve = [sys.executable, os.path.abspath(__file__), "--serve", str(answers), "--latency-ms", str(args.latency_ms)]
    base = ["--upstream", shlex.join(serve), "--trust", str(trust)]
    return base, [*base, "--predict", "table", "--train-traces", str(train), "--speculate", str(args.speculate)]


def _offline(args: argparse.Namespace, traces: list[Any]) -> int:
    """``--offline``: top-k accuracy of the next tool call (every call of every trajectory),
    drafted on the calls only by ``aospec mcp``'s drafters (history and calls) and on the
    whole trajectory by ``aospec proxy``'s (the ``aospec`` policy's), each fitted, and its
    ranking calibrated, on the other tasks' trajectories in that same form
    (``--uncalibrated``: the drafters' raw scores, as before)."""
    from aospec.integrations._mcp_common import MergedDrafter, calls_drafters
    from aospec.integrations.proxy import action_drafter

    from aospec.types import Action, History

    widths = (1, 2, 4)
    hits = {v: dict.fromkeys(widths, 0) for v in ("calls", "conversation")}
    n = 0
    tasks = sorted({t.task for t in traces if _tools_of(t)})
    policy = "aospec:calibrate_actions=false" if args.uncalibrated else "aospec"

    async def run() -> None:
        nonlocal n
        for i, task in enumerate(tasks, 1):
            others = [t for t in traces if t.task != task]
            for view in ("calls", "conversation"):
                if view == "calls":
                    train = [_calls_only(t) for t in others if _tools_of(t)]
                    merged = MergedDrafter(calls_drafters(train, not args.uncalibrated), who="bench_calls")
                else:
                    merged = action_drafter(others, policy=policy)
                for t in (t for t in traces if t.task == task):
                    shown = _calls_only(t) if view == "calls" else t
                    h = History(shown.instruction or shown.task if view == "conversation" else "")
                    for step in shown.steps:
                        if _is_call(step.action):
                            n += view == "calls"
                            drafted = [d.action.key for d in await merged.propose(h, 8, 1) if d.offset == 0]
                            drafted = [k for k in drafted if _is_call(Action.from_json(json.loads(k)))]
                            for w in widths:
                                hits[view][w] += step.action.key in drafted[:w]
                        h = h.extend(step.action, step.observation)
            print(f"[{i}/{len(tasks)}] {task}", file=sys.stderr)

    anyio.run(run)
    acc = {v: {str(w): hits[v][w] / max(n, 1) for w in widths} for v in hits}
    if args.json:
        print(json.dumps({"calls": n, "accuracy": acc}, indent=2))
    else:
        print(f"{n} tool calls; the next one among the drafters' first 1 / 2 / 4:")
        for v in acc:
            print(
                f"  drafted on {'the calls only' if v == 'calls' else 'the whole trajectory'}: "
                + " / ".join(f"{acc[v][str(w)]:.1%}" for w in widths)
            )
    return 0


def _chat_main(args: argparse.Namespace, runnable: list[Any], traces: list[Any], trusted: set[str]) -> int:
    """``--harness chat``: per trajectory, the configurations interleaved ``--repeats`` times
    (module doc); every configuration must see the serial run's replies and results."""
    from aospec.replay.io import write_jsonl

    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CHAT_CONFIGS]
    if unknown or not configs:
        print(f"--configs: unknown {unknown or 'none given'}; choose from {', '.join(CHAT_CONFIGS)}", file=sys.stderr)
        return 1
    if "serial" not in configs:
        configs.insert(0, "serial")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="aospec-bench-calls-") as tmp_s:
        tmp = Path(tmp_s)
        trust = tmp / "trust.json"
        trust.write_text(json.dumps({"tools": {t: {"readOnly": True, "openWorld": False} for t in trusted}}))
        for n, trace in enumerate(runnable, 1):
            model_trace = tmp / "model.jsonl"
            write_jsonl([trace], model_trace)
            full_train = tmp / "full.jsonl"
            write_jsonl([t for t in traces if t.task != trace.task], full_train)
            base, mcp_on = _mcp_args(args, trace, traces, tmp, trust)
            mcp_prefetch = [*base, "--predict", "table"]
            proxy_on = ["--train-traces", str(full_train), "--mcp-any-tool", "--max-speculative", "0"]
            proxy_on += ["--predict-calls", str(args.speculate)]
            setups = {
                "serial": (["--no-speculate"], [*base, "--no-speculate"]),
                "mcp": (["--no-speculate"], mcp_on),
                "proxy": (proxy_on, mcp_prefetch),
                "both": (proxy_on, mcp_on),
            }
            try:
                model = _Proc(
                    ["serve-trace", str(model_trace), "--tpot-ms", str(args.tpot), "--port", "0"],
                    r"at (http://\S+/v1)",
                    tmp / "model.log",
                )
            except RuntimeError as exc:
                print(f"{trace.id}: {exc}", file=sys.stderr)
                return 1
            walls: dict[str, list[float]] = {c: [] for c in configs}
            served = dict.fromkeys(configs, 0.0)
            launched = dict.fromkeys(configs, 0.0)
            hidden = dict.fromkeys(configs, 0.0)
            try:
                for _ in range(args.repeats):
                    ref = None
                    for c in configs:
                        try:
                            r = anyio.run(_chat_run, trace, model.url, *setups[c], tmp)
                        except Exception as exc:  # one line, not an exception group
                            while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
                                exc = exc.exceptions[0]
                            print(f"{trace.id}: the {c} run failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                            return 1
                        seen = (r["replies"], r["results"])
                        if ref is None:
                            ref = seen
                        elif seen != ref:
                            print(f"{trace.id}: the {c} run saw other replies or results than serial", file=sys.stderr)
                            return 1
                        walls[c].append(r["wall_s"])
                        served[c] += r["served"] / args.repeats
                        st = r["stats"]
                        launched[c] += (int(st.get("launched", 0)) + int(st.get("prefetched", 0))) / args.repeats
                        hidden[c] += float(st.get("hidden_s", 0.0)) / args.repeats
            finally:
                model.stop()
            row = {
                "trace": trace.id,
                "calls": sum(1 for s in trace.steps if _is_call(s.action)),
                "runs_s": walls,
                "median_s": {c: statistics.median(w) for c, w in walls.items()},
                "served": served,
                "launched": launched,
                "hidden_s": hidden,
            }
            rows.append(row)
            med = row["median_s"]
            shown = ", ".join(
                f"{c} {med[c]:.2f} s ({1 - med[c] / med['serial']:+.1%}, served {served[c]:g}/{row['calls']}, "
                f"hid {hidden[c]:.2f} s)"
                for c in configs
                if c != "serial"
            )
            print(f"[{n}/{len(runnable)}] {trace.id}: serial {med['serial']:.2f} s; {shown}", file=sys.stderr)
    total: dict[str, Any] = {
        "trajectories": len(rows),
        "calls": sum(r["calls"] for r in rows),
        "tpot_ms": args.tpot,
        "latency_ms": args.latency_ms,
        "repeats": args.repeats,
        "configs": {},
    }
    serial = sum(r["median_s"]["serial"] for r in rows)
    for c in configs:
        wall = sum(r["median_s"][c] for r in rows)
        by_repeat = [
            1 - sum(r["runs_s"][c][k] for r in rows) / max(sum(r["runs_s"]["serial"][k] for r in rows), 1e-9)
            for k in range(args.repeats)
        ]
        total["configs"][c] = {
            "wall_s": wall,
            "saving": 1 - wall / serial if serial else 0.0,
            "saving_by_repeat": by_repeat,
            "served": sum(r["served"][c] for r in rows),
            "launched": sum(r["launched"][c] for r in rows),
            "hidden_s": sum(r["hidden_s"][c] for r in rows),
        }
    if args.json:
        print(json.dumps({"total": total, "rows": rows}, indent=2))
    else:
        print(f"{total['trajectories']} trajectories, {total['calls']} tool calls, serial {serial:.1f} s:")
        for c, t in total["configs"].items():
            if c != "serial":
                print(
                    f"  {c}: {t['wall_s']:.1f} s, saving {t['saving']:+.1%} (repeats {min(t['saving_by_repeat']):+.1%} "
                    f"to {max(t['saving_by_repeat']):+.1%}), {t['served']:g} calls served from speculation, "
                    f"{t['hidden_s']:.1f} s of their upstream time hidden, {t['launched']:g} speculative calls"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
