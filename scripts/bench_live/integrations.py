"""The integration rows of scripts/bench_live.py (issue 12 section 4): each integration on the
same tasks and trajectories (served by serve-trace at the same TPOT), against the same
harness without aospec's speculation.

- ``mini-swe-agent``: mini-swe-agent's own ``DefaultAgent`` vs ``SpeculativeAgent``
  (integrations/minisweagent.py), both on ``AospecEnvironment`` (the tasks need the
  sandbox base with python and gcc, so the "harness without speculation" is DefaultAgent on
  AospecEnvironment, not on LocalEnvironment). The model is :class:`ServeTraceModel`, a
  tiny mini-swe-agent ``Model`` that posts to serve-trace's OpenAI-compatible endpoint with
  httpx (LitellmModel would need litellm's cost map from the network), parsing the reply's
  ```` ```bash ```` block with mini-swe-agent's own ``parse_regex_actions`` and rendering
  observations with its ``format_observation_messages``.
- ``proxy``: the bench's own bash agent (live/agent.py, serial) pointed at serve-trace
  directly vs through ``aospec proxy`` (integrations/proxy.py's app, the ``aospec``
  policy's observation drafters fitted on the training runs, served on loopback in a thread
  as ``aospec proxy --upstream`` serves it).
- ``mcp``: a minimal chat loop (httpx to serve-trace, one ```` ```bash ```` block per reply)
  that runs each command through the ``bash`` tool of ``aospec mcp``'s sandbox backend
  (integrations/mcp_server.py's ``SandboxToolServer``, called in process: no MCP
  transport) with speculation off (``--no-speculate``) vs on (its default predictor plus
  ``--train-traces`` of the training runs).

- ``openai-agents``, ``opencode``, ``opencode-proxy``: third-party harnesses configured
  only by their own settings (issue 26), measured by scripts/bench_harnesses.py's own
  functions (:func:`bench_harnesses.measure`) on its scripted task in the harness's own
  format (tool calls; not the bench's tasks, whose replies are mini-swe-agent ```` ```bash
  ```` blocks): serial (``aospec mcp --no-speculate``) vs speculating (``aospec mcp
  --train-traces`` of the task's own trajectory; ``opencode-proxy``: behind ``aospec proxy
  --mcp ... --mcp-tool-prefix aospec_``). A harness whose install is missing is skipped
  with one line (the Agents SDK: ``pip install openai-agents``; opencode: ``npm install -g
  opencode-ai``). Codex CLI has no row: it runs its commands on the host, not through
  aospec mcp, so there is nothing to fork (docs/harness-codex.md).

Identical results: same messages (timestamps aside) and final sandbox version for
mini-swe-agent and MCP; for the proxy, the bench's lossless check (actions, observations,
per-step versions, final version); for the harnesses, bench_harnesses' check (the same tool
outputs, final files, final text and requests seen upstream, byte for byte, in every run).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import httpx

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")  # mini-swe-agent's banner would corrupt --json

BASH_BLOCK = r"```bash\s*\n(.*?)\n```"
SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
SYSTEM = "You are a bash agent. Reply with a THOUGHT and exactly one ```bash block."
#: The third-party harnesses' rows (scripts/bench_harnesses.py's ``HARNESSES``).
HARNESS_ROWS = ("openai-agents", "opencode", "opencode-proxy")
INTEGRATIONS = ("mini-swe-agent", "proxy", "mcp", *HARNESS_ROWS)


# -- mini-swe-agent ------------------------------------------------------------------------


class ServeTraceModel:
    """A mini-swe-agent (2.x) ``Model`` for an OpenAI-compatible endpoint (serve-trace):
    greedy (``temperature: 0``) chat completions over httpx, text-based actions."""

    def __init__(self, base_url: str, model_name: str = "serve-trace") -> None:
        from pydantic import BaseModel

        class Config(BaseModel):
            model_name: str
            base_url: str
            observation_template: str = (
                "<returncode>{{output.returncode}}</returncode>\n<output>\n{{output.output}}</output>"
            )

        self.config = Config(model_name=model_name, base_url=base_url.rstrip("/"))

    def query(self, messages: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        from minisweagent.models.utils.actions_text import parse_regex_actions

        body = {
            "model": self.config.model_name,
            "messages": [{k: v for k, v in m.items() if k != "extra"} for m in messages],
            "temperature": 0,
        }
        r = httpx.post(f"{self.config.base_url}/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        content = r.json()["choices"][0]["message"]["content"] or ""
        actions = parse_regex_actions(content, action_regex=BASH_BLOCK, format_error_template="{{ error }}")
        return {
            "role": "assistant",
            "content": content,
            "extra": {"actions": actions, "cost": 0.0, "timestamp": time.time()},
        }

    def format_message(self, **kwargs: Any) -> dict[str, Any]:
        return dict(kwargs)

    def format_observation_messages(
        self, message: dict[str, Any], outputs: list[dict[str, Any]], template_vars: dict[str, Any] | None = None
    ) -> list[dict[str, Any]]:
        from minisweagent.models.utils.actions_text import format_observation_messages

        return format_observation_messages(
            outputs, observation_template=self.config.observation_template, template_vars=template_vars
        )

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return self.config.model_dump()

    def serialize(self) -> dict[str, Any]:
        return {"info": {"config": {"model": self.config.model_dump(mode="json"), "model_type": "ServeTraceModel"}}}


def _strip(messages: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(str(m.get("role")), str(m.get("content"))) for m in messages]


def minisweagent_run(
    traj: Any, base_url: str, project: Path, base: str, env: dict[str, str], *, speculate: bool, drafters: Any
) -> dict[str, Any]:
    """One run (synchronous: mini-swe-agent's loop is)."""
    from aospec.integrations.minisweagent import AospecEnvironment, SpeculativeAgent
    from minisweagent.agents.default import DefaultAgent

    templates = {
        "system_template": SYSTEM,
        "instance_template": "{{task}}",
        "step_limit": len(traj.steps) + 2,
        "cost_limit": 0,
    }
    with AospecEnvironment(
        base=base,
        env=env,
        timeout=300,
        sandbox={"binds": [{"source": str(project), "target": f"/src/{traj.project}"}]},
    ) as environment:
        setup = environment.execute(
            {
                "command": f"mkdir -p /work && cp -a /src/{traj.project} /work/{traj.project} && touch -d @1700000000 /work"
            }
        )
        if setup["returncode"] != 0:
            raise RuntimeError(f"{traj.id}: copying the project failed: {setup['output']}")
        model = ServeTraceModel(base_url)
        if speculate:
            agent: Any = SpeculativeAgent(model, environment, drafters=drafters, **templates)
        else:
            agent = DefaultAgent(model, environment, **templates)
        t0 = time.monotonic()
        result = agent.run(traj.instruction)
        wall = time.monotonic() - t0
        stats = getattr(agent, "statistics", None)
        return {
            "wall_s": wall,
            "messages": _strip(agent.messages),
            "exit": str((result or {}).get("exit_status", "")) if isinstance(result, dict) else str(result),
            "version": str(environment.version),
            "stats": {k: getattr(stats, k) for k in ("forks_reused", "drafts_hit")} if stats is not None else {},
        }


# -- MCP -----------------------------------------------------------------------------------


async def mcp_run(
    traj: Any, base_url: str, project: Path, base: str, env: dict[str, str], *, speculate: bool, train_path: str | None
) -> dict[str, Any]:
    """One run of a minimal chat loop whose commands go through the MCP server's bash tool."""
    from aospec.integrations._mcp_common import RepeatPredictor, combine, drafter_from_traces
    from aospec.integrations.mcp_server import SandboxToolServer, _text, read_only
    from aospec.runtime import Bind, SandboxConfig, open_sandbox

    cfg = SandboxConfig(
        base=base,
        binds=(Bind(str(project), f"/src/{traj.project}"),),
        env=env,
        timeout_s=300,
        formatter="mini-swe-agent",
    )
    predictor = None
    if speculate:  # aospec mcp's default (--speculate 2, --predict auto) with --train-traces
        parts: list[Any] = [drafter_from_traces([train_path], 2)] if train_path else []
        predictor = combine(*parts, RepeatPredictor(read_only, k=2), k=2) if parts else RepeatPredictor(read_only, k=2)
    messages: list[dict[str, str]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": traj.instruction},
    ]
    async with open_sandbox(cfg) as sb, anyio.create_task_group() as tg:
        setup = await sb.run(
            f"mkdir -p /work && cp -a /src/{traj.project} /work/{traj.project} && touch -d @1700000000 /work"
        )
        if setup.returncode != 0:
            raise RuntimeError(f"{traj.id}: copying the project failed: {setup.output}")
        server = SandboxToolServer(sb, tg, predictor=predictor, workdir="/", timeout_s=300)
        exit_status = "step_limit"
        versions = []
        t0 = time.monotonic()
        async with httpx.AsyncClient(timeout=600) as http:
            for _ in range(len(traj.steps) + 2):
                r = await http.post(
                    f"{base_url}/chat/completions",
                    json={"model": "serve-trace", "messages": messages, "temperature": 0},
                )
                r.raise_for_status()
                content = r.json()["choices"][0]["message"]["content"] or ""
                messages.append({"role": "assistant", "content": content})
                found = re.findall(BASH_BLOCK, content, re.DOTALL)
                if len(found) != 1:
                    messages.append({"role": "user", "content": f"Expected exactly 1 action, found {len(found)}."})
                    continue
                out = _text(await server.call("bash", {"command": found[0].strip()}))
                versions.append(str(sb.version))
                if out.lstrip().startswith(SUBMIT):
                    exit_status = "submitted"
                    break
                messages.append({"role": "user", "content": out})
        wall = time.monotonic() - t0
        with anyio.CancelScope(shield=True):
            await server.aclose()
        tg.cancel_scope.cancel()
        return {
            "wall_s": wall,
            "messages": [(m["role"], m["content"]) for m in messages],
            "versions": versions,
            "exit": exit_status,
            "version": str(sb.version),
            "stats": {"forks_reused": server.stats.served_speculated, "launched": server.stats.launched},
        }


# -- the rows ------------------------------------------------------------------------------


def _same(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    if a["exit"] != b["exit"]:
        return f"exit {a['exit']} vs {b['exit']}"
    if a["version"] != b["version"]:
        return "final versions differ"
    if a["messages"] != b["messages"]:
        return "messages differ"
    if a.get("versions") != b.get("versions"):
        return "per-step versions differ"
    return None


def measure_integrations(
    tpot_ms: float,
    trajs: Sequence[Any],
    staged: dict[str, Path],
    drafters: Any,
    base: str,
    env: dict[str, str],
    train: Sequence[Any],
    tmp: Path,
    *,
    which: Sequence[str] = INTEGRATIONS,
    run_agent: Any = None,
    divergence: Any = None,
    script_trace: Any = None,
    log: Any = print,
    repeats: int = 1,
) -> list[dict[str, Any]]:
    """One row per integration at ``tpot_ms`` over ``trajs`` (a harness row: over its own
    task, ``repeats`` runs per mode, see :func:`harness_rows`)."""
    from aospec.live.serve_trace import serve_trace_app, serving

    train_path = None
    if "mcp" in which:
        from aospec.replay import write_jsonl

        train_path = str(tmp / "integrations-training.jsonl")
        write_jsonl(list(train), Path(train_path))
    rows = []
    app = serve_trace_app([script_trace(t) for t in trajs], tpot_ms)
    with serving(app) as server:
        for name in [w for w in which if w not in HARNESS_ROWS]:
            base_wall = spec_wall = 0.0
            diverged: list[str] = []
            hits = 0
            per_task = {}
            extra_stats: dict[str, Any] = {}
            for t in trajs:
                project = staged[t.project]
                if name == "mini-swe-agent":
                    a = minisweagent_run(t, server.base_url, project, base, env, speculate=False, drafters=drafters)
                    b = minisweagent_run(t, server.base_url, project, base, env, speculate=True, drafters=drafters)
                    why = _same(a, b) or (None if a["exit"] == "Submitted" else f"baseline ended: {a['exit']}")
                    wa, wb, h = a["wall_s"], b["wall_s"], b["stats"].get("forks_reused", 0)
                elif name == "mcp":
                    kw = {"train_path": train_path}
                    a = anyio.run(partial(mcp_run, t, server.base_url, project, base, env, speculate=False, **kw))
                    b = anyio.run(partial(mcp_run, t, server.base_url, project, base, env, speculate=True, **kw))
                    why = _same(a, b) or (None if a["exit"] == "submitted" else f"baseline ended: {a['exit']}")
                    wa, wb, h = a["wall_s"], b["wall_s"], b["stats"]["forks_reused"]
                elif name == "proxy":
                    from aospec.integrations.proxy import proxy_app

                    kw = {"speculate": False, "tpot_ms": tpot_ms, "drafters": None, "base": base}
                    a = anyio.run(partial(run_agent, t, server.base_url, staged, **kw))
                    papp = proxy_app(server.base_url, drafters=tuple(drafters.observation))
                    with serving(papp) as proxy:
                        b = anyio.run(partial(run_agent, t, proxy.base_url, staged, **kw))
                    why = divergence(a, b)
                    wa, wb = a.result.wall_s, b.result.wall_s
                    pst = papp.stats.to_json()
                    h = int(pst.get("hits", 0))
                    extra_stats[t.id] = {
                        k: pst.get(k) for k in ("chat_requests", "speculable", "speculated", "hits", "misses")
                    }
                else:
                    raise ValueError(f"unknown integration {name!r}")
                base_wall += wa
                spec_wall += wb
                hits += h
                if why:
                    diverged.append(f"{t.id}: {why}")
                per_task[t.id] = {"baseline_s": round(wa, 3), "aospec_s": round(wb, 3), "hits": h}
                if t.id in extra_stats:
                    per_task[t.id]["proxy_stats"] = extra_stats[t.id]
                log(
                    f"  {name} tpot {tpot_ms:g} ms {t.id}: baseline {wa:.2f} s, aospec {wb:.2f} s, hits {h}, "
                    f"{'identical' if not why else 'DIFFERENT: ' + why}"
                )
            rows.append(
                {
                    "integration": name,
                    "harness": HARNESS[name],
                    "tpot_ms": tpot_ms,
                    "tasks": len(trajs),
                    "baseline_s": round(base_wall, 3),
                    "aospec_s": round(spec_wall, 3),
                    "saving": round(1 - spec_wall / base_wall, 4) if base_wall else 0.0,
                    "hits": hits,
                    "identical": not diverged,
                    "diverged": diverged,
                    "per_task": per_task,
                }
            )
    if harnesses := [w for w in which if w in HARNESS_ROWS]:
        rows += harness_rows(tpot_ms, harnesses, tmp / "harnesses", repeats=repeats, log=log)
    return rows


def harness_rows(
    tpot_ms: float, which: Sequence[str], tmp: Path, *, repeats: int = 1, log: Any = print
) -> list[dict[str, Any]]:
    """The rows of the third-party harnesses ``which`` at ``tpot_ms``: scripts/bench_harnesses.py's
    measurement (:func:`bench_harnesses.measure`) as integration rows; a harness whose install
    is missing is skipped with one line."""
    import bench_harnesses as bh

    present = []
    for name in which:
        if why := bh.harness_missing(name):
            log(f"  skip {name}: {why}")
        else:
            present.append(name)
    tmp.mkdir(parents=True, exist_ok=True)
    rows = []
    for r in bh.measure(present, tpot_ms, repeats, tmp):
        name = r["harness"]
        task = (bh.agents_trace() if name == "openai-agents" else bh.opencode_trace()).id
        counters = {k: v for k, v in r.items() if k.startswith(("mcp_", "proxy_"))}
        hits = r.get("mcp_hits")  # None: the server's counters were not read
        why = None if r["identical"] else "tool outputs, final text or upstream requests differ from serial"
        log(
            f"  {name} tpot {tpot_ms:g} ms {task}: baseline {r['serial_s']:.2f} s, aospec {r['aospec_s']:.2f} s, "
            f"hits {hits}, {'identical' if not why else 'DIFFERENT: ' + why}"
        )
        rows.append(
            {
                "integration": name,
                "harness": HARNESS[name],
                "tpot_ms": tpot_ms,
                "tasks": 1,
                "repeats": repeats,
                "baseline_s": r["serial_s"],
                "aospec_s": r["aospec_s"],
                "saving": r["saving"],
                "hits": hits,
                "identical": not why,
                "diverged": [f"{task}: {why}"] if why else [],
                "per_task": {task: {"baseline_s": r["serial_s"], "aospec_s": r["aospec_s"], "hits": hits, **counters}},
            }
        )
    return rows


HARNESS = {
    "mini-swe-agent": "DefaultAgent vs SpeculativeAgent (AospecEnvironment both)",
    "proxy": "bench agent -> serve-trace vs -> aospec proxy -> serve-trace",
    "mcp": "chat loop + aospec mcp bash tool, --no-speculate vs speculating",
    "openai-agents": "OpenAI Agents SDK + aospec mcp (stdio), --no-speculate vs speculating",
    "opencode": "opencode run + aospec mcp, --no-speculate (local) vs speculating (--http)",
    "opencode-proxy": "opencode run + aospec mcp, --no-speculate vs --http behind aospec proxy --mcp",
}


def print_integrations(rows: Sequence[dict[str, Any]]) -> None:
    cols = [
        ("integration", "integration", "{}"),
        ("TPOT", "tpot_ms", "{:g} ms"),
        ("baseline", "baseline_s", "{:.1f} s"),
        ("aospec", "aospec_s", "{:.1f} s"),
        ("saving", "saving", "{:.1%}"),
        ("hits", "hits", "{}"),  # None (a harness's server not read): "-"
        ("identical", "identical", "{}"),
    ]
    cells = [["-" if r[k] is None else fmt.format(r[k]) for _, k, fmt in cols] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _, _) in enumerate(cols)]
    print("  ".join(h.rjust(w) for (h, _, _), w in zip(cols, widths, strict=True)))
    for c in cells:
        print("  ".join(x.rjust(w) for x, w in zip(c, widths, strict=True)))
