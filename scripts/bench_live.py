#!/usr/bin/env python3
"""Live benchmark (issue 11): real tasks, real tools, real sandboxes, real time.

Tasks (scripts/bench_live/): a Python package whose unittest suite runs for seconds, a C
program built with gcc/make, installs from a local wheelhouse (built here with ``pip
wheel``, no network) into a venv, and a CSV data-processing script, with the reads, greps
and edits between them. Each task's scripted mini-swe-agent trajectory (explore, run,
edit, re-run, submit) is served by ``serve-trace`` over HTTP at the TPOT measured; the
bash agent (live/agent.py) runs it on overlay sandboxes, serially and speculatively (the
``aospec`` policy's drafters, fitted only on the training tasks' recorded runs), each from
a fresh sandbox of the same base and project copy.

Per TPOT (20, 10, 1 ms) and load condition it reports, over all tasks: serial and
speculative wall time, the saving, tool time hidden, observation and action hit rates, wasted sandbox CPU-seconds
(the speculative run's sandbox CPU minus the serial run's), the engine overhead on the
critical path per step, peak RSS, and beside them the replay prediction
(``--state-model recorded``) for the serial run's recorded trace and its error. Every
speculative run must reproduce the serial run exactly: same actions, observations and
per-step versions (lossless), else the benchmark fails.

It also measures what bytecode caches do to action reuse: the Python tasks once more with
``PYTHONDONTWRITEBYTECODE`` unset (steps whose version changes only by ``__pycache__``,
whether serial and speculative versions still agree, action hits).

Load conditions (issue 22): ``--compare --sessions 1,4,8`` runs each condition's N sessions
at once on this host (session j of a batch runs task j mod 4), all serially and all
speculatively (the arms in an order rotated per repeat, each after the previous runs'
writeback); ``--background-load 0,2`` runs each condition beside K CPU-bound processes
(started before, always killed after); ``--repeats R`` repeats every condition,
interleaved, and reports the median with min..max. Beside every live figure is the
replay's prediction on a simulated host of this host's cores (``--cores``) and the
condition's background load, from the quiet serial recordings (one session, no load, the
same TPOT; each serial step records its CPU time), replaying the condition's sessions
together (``aospec.replay.sweep.replay_together``), and its error; ``--plot`` draws the
saving against TPOT, one line per condition. ``process_cpu_s`` (``serial_process_cpu_s``)
is this process's CPU over the speculative (serial) runs: the engine, the actor's stream
parsing and serve-trace's serving, apart from the sandboxes' ``wasted_cpu_s``.
``--policy serial`` runs the engine with speculation on but no guess (no drafter, no
branch, no fork): its saving is the measurement's own noise and the engine's bare cost.
``fork_wasted_cpu_s`` is the CPU the discarded guesses used, each in its own fork's cgroup
(``wasted_cpu_s``, the difference of the two runs' sandbox CPU, also holds the committed
commands' run-to-run variation). ``--carry-model``: a session's speculative runs continue
from the controller's model its previous run left, as an Engine's runs do. ``--profile-cpu
DIR``: this process's CPU time by function over each condition's serial and speculative
arms, and what the speculative ones spent beyond the serial ones (DIR/*.diff.txt).

Usage:
  .venv/bin/python scripts/bench_live.py [--json] [--quick] [--plot live.png] [--out DIR]
  .venv/bin/python scripts/bench_live.py --compare --sessions 1,4,8 --background-load 0,2 --repeats 3 --json
  .venv/bin/python scripts/bench_live.py --sessions 32 [--quick] [--json]   # concurrency, leaks
  .venv/bin/python scripts/bench_live.py --integrations [LIST] [--quick] [--json]  # a row per integration
  .venv/bin/python scripts/bench_live.py --specbox [--quick] [--json]       # + a run with the SpecBox layer

``--specbox`` (issue 13): a third run per task and TPOT, speculative with the SpecBox layer
under the engine (live/specbox_layer.py: the result cache for deterministic reads, a pool of
forks made ahead, the exact parse router with routed action drafting, and a Markov drafter
fitted on the training runs), beside the plain speculative run; lossless against the same
serial run. ``--specbox-cache``, ``--specbox-pool-depth``, ``--specbox-router`` and
``--no-specbox-markov`` change its parts.

``--policy SPEC`` repeated (issue 25): several policies against the same serial runs, e.g.
lookahead 2-4 with and without read-set validation (``aospec:depth=3:read_sets=false``);
per batch the serial runs and each policy's speculative runs, in an order rotated from
repeat to repeat (no arm always first), each after the previous runs' writeback; a row per
policy with its forks launched, wasted and rebased
(reused across a state-changing step), also per task.

``--integrations`` (issue 12): each integration (mini-swe-agent's SpeculativeAgent, ``aospec
proxy``, ``aospec mcp``) against the same harness without aospec's speculation, on the same
tasks and trajectories at the same TPOTs (scripts/bench_live/integrations.py); then the
third-party harnesses (issue 26: ``openai-agents``, ``opencode``, ``opencode-proxy``,
scripts/bench_harnesses.py's measurement on its own scripted task, ``--repeats`` runs per
mode), each skipped with one line where its install is missing.

Run as root (overlay sandboxes). The base is built on first use (about 2 minutes, needs a
Debian mirror): ``aospec sandbox build-base debootstrap:bookworm --include
python3,python3-pip,python3-venv,gcc,libc6-dev,make``; ``--base busybox`` runs what it can
(no python or gcc: the commands fail, fast, but still losslessly).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import math
import os
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from aospec.runtime import Bind, SandboxConfig, default_state_root, open_sandbox
from bench_live.load import background_load
from bench_live.tasks import MEASURED, QUICK, TRAINING, Trajectory

from aospec.errors import ConfigError
from aospec.host import check_budget, host_budget
from aospec.types import Action, Step, Trace

TPOTS_MS = (20.0, 10.0, 1.0)
BASE = "debootstrap:bookworm+gcc,libc6-dev,make,python3,python3-pip,python3-venv"
#: The sandbox environment of every run: no pip self-check (no network), no pip cache,
#: reproducible pip-compiled bytecode (hash-based .pyc). PYTHONDONTWRITEBYTECODE is set by
#: the runs themselves (``bytecode`` below).
ENV = {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_CACHE_DIR": "1", "SOURCE_DATE_EPOCH": "1700000000"}
PLACEHOLDER = "<returncode>0</returncode>\n<output>\n</output>"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def script_trace(traj: Trajectory) -> Trace:
    """The trajectory as a canonical trace for serve-trace: the replies and their token
    counts; the observations are placeholders (the sandbox produces the real ones)."""
    steps = tuple(
        Step(
            action=Action.bash(cmd),
            observation=PLACEHOLDER,
            output_tokens=tokens,
            output_tokens_estimated=True,
            reply=reply,
        )
        for (_, cmd), reply, tokens in zip(traj.steps, traj.replies(), traj.output_tokens(), strict=True)
    )
    return Trace(
        id=traj.id,
        task=traj.task,
        harness="mini-swe-agent",
        actor_model="scripted",
        source="scripts/bench_live/tasks.py",
        steps=steps,
        instruction=traj.instruction,
    )


def stage(trajs: Sequence[Trajectory], root: Path) -> dict[str, Path]:
    """Copy each project once into ``root`` and prepare it (the wheelhouse)."""
    out: dict[str, Path] = {}
    for t in trajs:
        if t.project in out:
            continue
        from bench_live.tasks import PROJECTS

        dest = root / t.project
        shutil.copytree(PROJECTS / t.project, dest, ignore=shutil.ignore_patterns("__pycache__"))
        if t.prepare is not None:
            t.prepare(dest)
        out[t.project] = dest
    return out


class SandboxCpu:
    """CPU-seconds used by this process's descendants (the sandboxes' commands), killed
    ones included: this process moves itself into a cgroup of its own in the cgroup-v1
    ``cpuacct`` hierarchy, so what it starts is counted there (``cpuacct.usage`` minus this
    process's own CPU), and the sandboxes' commands, which aospec moves into its own
    cgroups below ``aospec/`` in that hierarchy (metering), are counted there: a parent's
    usage keeps what its removed children used. So the benchmark must be the only aospec
    user of the host while it runs. Without a cgroup (cgroup v2, not root), commands that
    finished and were reaped (``RUSAGE_CHILDREN``): killed speculative commands are then
    missed."""

    def __init__(self) -> None:
        self.group: Path | None = None
        root = Path("/sys/fs/cgroup/cpuacct")
        self.aospec = root / "aospec"
        if (root / "cpuacct.usage").exists() and os.geteuid() == 0:
            try:
                group = root / f"aospec-bench-live-{os.getpid()}"
                group.mkdir(exist_ok=True)
                (group / "cgroup.procs").write_text(str(os.getpid()))
                self.group = group
            except OSError:
                self.group = None

    @property
    def source(self) -> str:
        return "cpuacct" if self.group else "rusage_children"

    def __call__(self) -> float:
        if self.group is not None:
            me = resource.getrusage(resource.RUSAGE_SELF)
            sandboxes = 0
            with contextlib.suppress(OSError, ValueError):
                sandboxes = int((self.aospec / "cpuacct.usage").read_text())
            own = int((self.group / "cpuacct.usage").read_text())
            return (own + sandboxes) * 1e-9 - (me.ru_utime + me.ru_stime)
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    def exclude(self, pid: int) -> None:
        """Count ``pid`` (and what it starts from now) no more: move it out of the group
        (the ``--background-load`` processes are not sandbox CPU)."""
        if self.group is not None:
            with contextlib.suppress(OSError):
                (self.group.parent / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        if self.group is not None:
            try:
                (self.group.parent / "cgroup.procs").write_text(str(os.getpid()))
                self.group.rmdir()
            except OSError:
                pass
            self.group = None


children_cpu_s = SandboxCpu()
# Why: made on import (a test that imports this module makes one too); removed at exit
atexit.register(children_cpu_s.close)

#: The speculation controller's model fitted on the training runs (``aospec run
#: --train-traces``' calibration, :func:`aospec.replay.calibrate.fit_admission`), as JSON,
#: by policy: each speculative run starts from a copy of its policy's and learns on from
#: there. Empty (``--no-calibration``): each run starts from the uncalibrated prior.
CALIBRATION: dict[str, Any] = {}


#: ``--speculation-budget``: the host's budget every speculative session shares (None: none).
BUDGET: Any = None


#: ``--carry-model``: each session's speculative runs of one repeat continue from the
#: controller's model the session's previous run left (as an Engine's runs do, and the runs
#: of ``aospec run --calibration FILE``), by (policy, session); emptied at every repeat.
CARRY: dict[tuple[str, int], Any] | None = None


#: ``--profile-cpu``: a CPU-time profiler per (TPOT, condition, arm) over the timed runs,
#: enabled around each arm's runs of every repeat (None: no profiling).
PROFILES: dict[tuple[str, str], Any] | None = None


@contextlib.contextmanager
def profiled(condition: str, arm: str) -> Any:
    """This process's CPU (``time.process_time``, not wall time) by function while the
    block runs, into ``PROFILES[(condition, arm)]`` (nothing without ``--profile-cpu``).
    cProfile sees this thread only: serve-trace's server thread is not in it."""
    if PROFILES is None:
        yield
        return
    import cProfile

    prof = PROFILES.setdefault((condition, arm), cProfile.Profile(timer=time.process_time))
    prof.enable()
    try:
        yield
    finally:
        prof.disable()


def write_profiles(directory: str) -> list[str]:
    """Each profile as ``<condition>.<arm>.prof`` (read with ``python -m pstats``), and per
    condition ``<condition>.diff.txt``: the functions whose cumulative CPU each policy's
    runs spent beyond the serial runs', the largest first. Returns the files written."""
    import io
    import pstats

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    assert PROFILES is not None
    for (condition, arm), prof in sorted(PROFILES.items()):
        path = out / f"{condition}.{arm}.prof"
        prof.dump_stats(str(path))
        written.append(str(path))
    for condition in sorted({c for c, _ in PROFILES}):
        serial = PROFILES.get((condition, "serial"))
        if serial is None:
            continue
        base = pstats.Stats(serial).stats  # type: ignore[attr-defined]
        text = io.StringIO()
        for (c, arm), prof in sorted(PROFILES.items()):
            if c != condition or arm == "serial":
                continue
            stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
            total = sum(v[2] for v in stats.values()) - sum(v[2] for v in base.values())
            text.write(f"{arm} - serial, {condition}: {total:+.3f} s of this thread's CPU (profiled)\n")
            text.write("  cumulative CPU s  own CPU s  calls  function\n")
            rows = []
            for key in stats.keys() | base.keys():
                a, b = stats.get(key, (0, 0, 0.0, 0.0)), base.get(key, (0, 0, 0.0, 0.0))
                rows.append((a[3] - b[3], a[2] - b[2], a[1] - b[1], key))
            rows.sort(key=lambda r: -r[0])
            for cum, own, calls, (file, line, name) in rows[:40]:
                text.write(f"  {cum:+16.3f}  {own:+9.3f}  {calls:+5d}  {file}:{line}({name})\n")
            text.write("\n")
        path = out / f"{condition}.diff.txt"
        path.write_text(text.getvalue())
        written.append(str(path))
    return written


def calibrated_model(policy: str = "aospec", slot: int = 0) -> Any:
    """The controller's model a speculative run of ``policy`` starts from: a copy of the
    calibrated one, or with ``--carry-model`` the one session ``slot``'s last run left."""
    from aospec.admission import AdmissionModel

    if CARRY is not None and (policy, slot) in CARRY:
        return CARRY[(policy, slot)]
    model = CALIBRATION.get(policy)
    fresh = AdmissionModel.from_json(model) if model is not None else None
    if CARRY is None:
        return fresh
    # (without a calibration the run's own model, so that what it learns is carried)
    return CARRY.setdefault((policy, slot), fresh if fresh is not None else AdmissionModel())


def policy_slug(policy: str) -> str:
    """A policy spec as part of a file or trace name (``aospec:depth=3`` -> ``aospec_depth=3``)."""
    return "".join(c if c.isalnum() or c in "=-" else "_" for c in policy)


def remove_private_root(root: str, wait_s: float = 10.0) -> None:
    """At exit: remove the private state root this process made, once the sessions' state
    directories in it are gone (their last removals may still be under way: it waits up to
    ``wait_s``). One that stays non-empty is left, with a line naming it."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.rmdir(root)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() >= deadline:
                log(f"note: {root} is not empty; left as it is (aospec gc cleans stale state)")
                return
            time.sleep(0.1)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class Run:
    traj: Trajectory
    speculate: bool
    tpot_ms: float
    result: Any
    trace: Trace
    cpu_s: float
    store_id: str = ""
    specbox: dict[str, Any] | None = None

    @property
    def key(self) -> list[tuple[Any, ...]]:
        """What must be equal between a serial and a speculative run."""
        return [(s.action.key, s.observation, s.version_before, s.version_after) for s in self.result.steps]


async def run_agent(
    traj: Trajectory,
    base_url: str,
    staged: dict[str, Path],
    *,
    speculate: bool,
    tpot_ms: float,
    drafters: Any,
    base: str,
    bytecode: bool = False,
    specbox: Any = None,
    train: Sequence[Trace] = (),
    router: Any = None,
    measure_cpu: bool = False,
    tag: str = "",
    policy: str = "aospec",
    slot: int = 0,
) -> Run:
    """One run of ``traj`` in a fresh sandbox: the project copied to /work, then the agent;
    with ``specbox`` (aospec.live.specbox_layer.SpecBoxOptions) under that layer (its Markov
    drafter fitted on ``train``; ``router``: the one built for ``specbox.router`` once, by
    the caller, else it is built here). ``measure_cpu``: the run is alone on the host and
    serial, so the sandbox CPU between two committed steps is the step's command's: it
    becomes the recorded step's ``tool_cpu_s`` where the sandbox did not meter it (replay's
    contention model reads it). ``tag`` ends the recorded trace's id; ``policy`` names the
    policy whose calibrated controller a speculative run starts from (``drafters`` carry its
    engine configuration), ``slot`` the session it is (:func:`calibrated_model`)."""
    from aospec.live.actors import OpenAIChatActor
    from aospec.live.agent import Agent
    from aospec.live.record import step_of
    from aospec.live.specbox_layer import SpecBoxOptions, open_specbox

    env = {**ENV, "PYTHONDONTWRITEBYTECODE": "" if bytecode else "1"}
    cfg = SandboxConfig(
        base=base,
        binds=(Bind(str(staged[traj.project]), f"/src/{traj.project}"),),
        env=env,
        timeout_s=300,
        formatter="mini-swe-agent",  # the agent's observation format (aospec.live.agent)
    )
    async with open_sandbox(cfg) as sb:
        store_id = str(getattr(getattr(sb, "store", None), "id", ""))
        # cp -a keeps the project's times; /work's own is fixed too (``ls -la`` shows ``..``)
        setup = await sb.run(
            f"mkdir -p /work && cp -a /src/{traj.project} /work/{traj.project} && touch -d @1700000000 /work"
        )
        if setup.returncode != 0:
            raise RuntimeError(f"{traj.id}: copying the project failed: {setup.output}")
        box_options = specbox if specbox is not None else SpecBoxOptions()
        async with (
            OpenAIChatActor(base_url, "serve-trace") as actor,
            open_specbox(sb, box_options, train, router=router) as box,
        ):
            marks: list[float] = []

            def on_step(step: Any, _stats: Any) -> None:
                if measure_cpu:
                    marks.append(children_cpu_s())
                box.observe(step.action)

            agent = Agent(
                actor,
                box.sandbox,
                speculate=speculate,
                drafters=box.with_drafters(drafters) if drafters is not None else None,
                step_limit=len(traj.steps) + 2,
                router=box.router,
                on_step=on_step,
                admission_model=calibrated_model(policy, slot) if speculate else None,
                budget=BUDGET if speculate else None,
            )
            cpu0 = children_cpu_s()
            marks.append(cpu0)
            result = await agent.run(traj.instruction)
            cpu = children_cpu_s() - cpu0
            box_summary = box.summary() if specbox is not None else None
    mode = ("specbox" if specbox is not None else "spec") if speculate else "serial"
    if speculate and policy != "aospec":
        mode += "." + policy_slug(policy)
    steps = [step_of(s) for s in result.steps]
    if measure_cpu:
        steps = [
            s if s.tool_cpu_s is not None else replace(s, tool_cpu_s=round(max(0.0, b - a), 6))
            for s, a, b in zip(steps, marks, marks[1:], strict=False)
        ]
    trace = Trace(
        id=f"{traj.id}.{mode}.tpot{tpot_ms:g}{'.pyc' if bytecode else ''}{tag}",
        task=traj.task,
        harness="aospec-run",
        actor_model="serve-trace",
        source="scripts/bench_live.py",
        steps=tuple(steps),
        instruction=traj.instruction,
        meta={
            "tpot_ms": tpot_ms,
            "speculate": speculate,
            "bytecode": bytecode,
            "exit_reason": result.exit_reason,
            "specbox": box_summary,
            **({"policy": policy} if speculate else {}),
        },
    )
    return Run(traj, speculate, tpot_ms, result, trace, cpu, store_id, box_summary)


def divergence(serial: Run, spec: Run) -> str | None:
    """None when the speculative run reproduced the serial one, else what differs."""
    if serial.result.exit_reason != "submitted":
        return f"serial run ended with {serial.result.exit_reason} ({serial.result.error})"
    if spec.result.final_version != serial.result.final_version:
        return f"final versions differ: {serial.result.final_version} vs {spec.result.final_version}"
    a, b = serial.key, spec.key
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} steps"
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            what = ["action", "observation", "version before", "version after"]
            return f"step {i}: {', '.join(w for w, p, q in zip(what, x, y, strict=True) if p != q)} differ"
    return None


def replay_prediction(
    batches: Sequence[Sequence[Trace]], drafters: Any, tpot_ms: float, policy: str = "aospec", host: Any = None
) -> tuple[int, int]:
    """(serial ns, ``policy`` ns) the replay predicts at ``tpot_ms`` for ``batches`` of
    sessions (one batch after the other, the sessions of a batch at once, as the live
    condition ran them), summed over every session, under ``--state-model recorded``.
    Without ``host`` each trace is replayed alone and uncontended (the replay before
    contention); with one (an ``aospec.replay.contention.HostModel``) each batch shares one
    simulated host of that many cores and background processes."""
    from aospec.replay.policies import parse_policies
    from aospec.replay.sweep import replay_together, replay_trace

    # --policy serial: the speculative runs' engine with the serial policy (its overhead alone)
    policies = parse_policies(["serial"] if policy.strip() == "serial" else ["serial", policy])
    name = policies[-1].name
    serial = spec = 0
    for batch in batches:
        if host is not None and len(batch) > 1:
            s_res, *rest = replay_together(batch, policies, tpot_ms, drafters, host, state_model="recorded")
            p_res = rest[0] if rest else s_res
            serial += sum(r.latency_ns for r in s_res)
            spec += sum(r.latency_ns for r in p_res)
            continue
        for t in batch:
            res = replay_trace(
                t, policies, [tpot_ms], drafters, check_ceilings=False, state_model="recorded", host=host
            )
            by = {r.policy: r for r in res}
            serial += by["serial"].latency_ns
            spec += by[name].latency_ns
    return serial, spec


def state_changing_steps(run: Run) -> int:
    """The steps of ``run`` that changed the sandbox's version."""
    return sum(s.version_before != s.version_after for s in run.result.steps)


@dataclass
class TpotFigures:
    tpot_ms: float
    runs: list[tuple[Run, Run]] = field(default_factory=list)
    diverged: list[str] = field(default_factory=list)
    policy: str = "aospec"
    #: the speculative runs with the SpecBox layer (``--specbox``), one per task as in ``runs``
    box_runs: list[Run] = field(default_factory=list)
    box_diverged: list[str] = field(default_factory=list)
    #: the condition: sessions at once, background processes beside them
    sessions: int = 1
    background_load: int = 0
    #: per batch of ``sessions`` concurrent runs (serial and speculative, interleaved): the
    #: trajectories' ids and the two batches' wall times (s)
    batches: list[tuple[list[str], float, float]] = field(default_factory=list)
    #: per batch: this process's CPU time (s) over the serial runs and over the speculative
    #: ones (the engine, the actor's client and serve-trace's thread; not the sandboxes)
    process_cpu: list[tuple[float, float]] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        """The live figures of this repeat (the replay's prediction is added by
        :func:`condition_row`)."""
        serial_wall = sum(s.result.wall_s for s, _ in self.runs)
        spec_wall = sum(p.result.wall_s for _, p in self.runs)
        steps = sum(len(p.result.steps) for _, p in self.runs)
        st = [p.result.statistics for _, p in self.runs]
        saving = 1 - spec_wall / serial_wall if serial_wall else 0.0
        wasted_cpu = sum(p.cpu_s - s.cpu_s for s, p in self.runs)
        serial_cpu = sum(s.cpu_s for s, _ in self.runs)
        fork_cpu = sum(x.wasted_cpu_s for x in st)
        hidden = sum(x.tool_time_hidden_s for x in st)
        return {
            "tpot_ms": self.tpot_ms,
            "policy": self.policy,
            "sessions": self.sessions,
            "background_load": self.background_load,
            "tasks": len(self.runs),
            "steps": steps,
            "serial_s": round(serial_wall, 3),
            "speculative_s": round(spec_wall, 3),
            "saving": round(saving, 4),
            "serial_latency_s": round(sum(s.result.statistics.latency_s for s, _ in self.runs), 3),
            "speculative_latency_s": round(sum(x.latency_s for x in st), 3),
            "speculative_tool_s": round(sum(x.tool_time_s for x in st), 3),
            "tool_s": round(sum(s.result.statistics.tool_time_s for s, _ in self.runs), 3),
            "tool_hidden_s": round(hidden, 3),
            "decode_hidden_s": round(sum(x.decode_time_hidden_s for x in st), 3),
            "obs_hit_rate": round(sum(x.drafts_hit for x in st) / steps, 4) if steps else 0.0,
            # observation branches started, and guesses (forks and branches) the controller
            # refused because they cost more than they would hide
            "drafts_started": sum(x.drafts_started for x in st),
            "refused_price": sum(x.refused_price for x in st),
            # drafting rounds not run: not worth their CPU at the host's price
            "drafting_skipped": sum(x.drafting_skipped for x in st),
            "action_hit_rate": round(sum(x.forks_reused for x in st) / steps, 4) if steps else 0.0,
            "forks_launched": sum(x.forks_launched for x in st),
            "forks_wasted": sum(x.forks_wasted for x in st),
            # reused from an older origin than the committed version: across a
            # state-changing step, by read-set validation (docs/engine.md, "Read sets")
            "forks_rebased": sum(x.forks_rebased for x in st),
            # traced for their read sets (only while the host has a core to spare)
            "forks_traced": sum(x.forks_traced for x in st),
            "state_changing_steps": sum(state_changing_steps(s) for s, _ in self.runs),
            "wasted_cpu_s": round(wasted_cpu, 3),
            "serial_cpu_s": round(serial_cpu, 3),
            # issue 22's efficiency figures: tool time hidden per wasted sandbox CPU-second,
            # and the wasted sandbox CPU against the serial runs' own
            "tool_hidden_per_wasted_cpu_s": round(hidden / wasted_cpu, 3)
            if wasted_cpu > 0
            else None,
            "wasted_cpu_per_serial_cpu": round(wasted_cpu / serial_cpu, 3) if serial_cpu > 0 else None,
            # the same two from the CPU the discarded guesses themselves used (each fork's own
            # cgroup, the engine's ``wasted_cpu_s``): the difference above also holds how much
            # more (or less) CPU the committed commands happened to use in this run than in the
            # serial one, which on a shared host moves by more than every guess together
            "fork_wasted_cpu_s": round(fork_cpu, 3),
            "tool_hidden_per_fork_cpu_s": round(hidden / fork_cpu, 3)
            if fork_cpu > 0
            else None,
            "fork_cpu_per_serial_cpu": round(fork_cpu / serial_cpu, 3) if serial_cpu > 0 else None,
            "cpu_source": children_cpu_s.source,
            "wasted_tool_s": round(sum(x.speculative_tool_time_wasted_s for x in st), 3),
            "overhead_ms_per_step": round(1000 * sum(x.overhead_s for x in st) / steps, 3) if steps else 0.0,
            "serial_overhead_ms_per_step": round(
                1000 * sum(s.result.statistics.overhead_s for s, _ in self.runs) / steps, 3
            )
            if steps
            else 0.0,
            "peak_rss_mb": round(peak_rss_mb(), 1),
            "serial_batches_s": round(sum(b[1] for b in self.batches), 3),
            "speculative_batches_s": round(sum(b[2] for b in self.batches), 3),
            # the benchmark's own process: the engine's drafting, pricing and bookkeeping, the
            # actor's stream parsing and serve-trace's serving (sandbox CPU is apart)
            "serial_process_cpu_s": round(sum(c[0] for c in self.process_cpu), 3),
            "process_cpu_s": round(sum(c[1] for c in self.process_cpu), 3),
            "carry_model": CARRY is not None,
            "lossless": not self.diverged and not self.box_diverged,
            "diverged": self.diverged,
            **self.specbox_figures(serial_wall),
            "per_task": {
                s.traj.id: {
                    "serial_s": round(s.result.wall_s, 3),
                    "speculative_s": round(p.result.wall_s, 3),
                    "steps": len(p.result.steps),
                    "tool_s": round(s.result.statistics.tool_time_s, 3),
                    "obs_hits": p.result.statistics.drafts_hit,
                    "action_hits": p.result.statistics.forks_reused,
                    "forks_launched": p.result.statistics.forks_launched,
                    "forks_wasted": p.result.statistics.forks_wasted,
                    "forks_rebased": p.result.statistics.forks_rebased,
                    "state_changing_steps": state_changing_steps(s),
                }
                for s, p in self.runs
            },
        }

    def specbox_figures(self, serial_wall: float) -> dict[str, Any]:
        """The ``--specbox`` runs' figures (none without them): wall time and saving against
        the same serial runs, and what each part of the layer did."""
        if not self.box_runs:
            return {}
        steps = sum(len(r.result.steps) for r in self.box_runs)
        st = [r.result.statistics for r in self.box_runs]
        wall = sum(r.result.wall_s for r in self.box_runs)
        cache: dict[str, int] = {}
        for r in self.box_runs:
            for k, v in (r.result.cache_counts or {}).items():
                cache[k] = cache.get(k, 0) + v
        pools = [r.specbox["pool"] for r in self.box_runs if r.specbox and r.specbox.get("pool")]
        return {
            "specbox": self.box_runs[0].specbox and {k: v for k, v in self.box_runs[0].specbox.items() if k != "pool"},
            "specbox_s": round(wall, 3),
            "specbox_saving": round(1 - wall / serial_wall, 4) if serial_wall else 0.0,
            "specbox_tool_hidden_s": round(sum(x.tool_time_hidden_s for x in st), 3),
            "specbox_action_hit_rate": round(sum(x.forks_reused for x in st) / steps, 4) if steps else 0.0,
            "specbox_obs_hit_rate": round(sum(x.drafts_hit for x in st) / steps, 4) if steps else 0.0,
            "specbox_forks_launched": sum(x.forks_launched for x in st),
            "specbox_forks_wasted": sum(x.forks_wasted for x in st),
            "specbox_wasted_cpu_s": round(
                sum(b.cpu_s - s.cpu_s for (s, _), b in zip(self.runs, self.box_runs, strict=True)), 3
            ),
            "routes_fired": sum(x.routes_fired for x in st),
            "routed_forks_launched": sum(x.routed_forks_launched for x in st),
            "routed_forks_reused": sum(x.routed_forks_reused for x in st),
            "cache_hits": sum(x.cache_hits for x in st),
            "cache_saved_s": round(sum(x.cache_saved_ns for x in st) * 1e-9, 3),
            "cache_counts": cache,
            "pool_served": sum(p["served"] for p in pools),
            "pool_made": sum(p["made"] for p in pools),
            "pool_misses": sum(p["misses"] for p in pools),
            "specbox_lossless": not self.box_diverged,
            "specbox_diverged": self.box_diverged,
            "specbox_per_task": {
                b.traj.id: {
                    "speculative_s": round(b.result.wall_s, 3),
                    "action_hits": b.result.statistics.forks_reused,
                    "routed_reused": getattr(b.result.statistics, "routed_forks_reused", 0),
                    "cache_hits": getattr(b.result.statistics, "cache_hits", 0),
                }
                for b in self.box_runs
            },
        }


#: Figures of a condition with their minimum and maximum over repeats beside the median.
SPREAD = ("serial_s", "speculative_s", "saving")


def aggregate(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One condition's figures over its repeats: the median of every number (of the
    repeats that have one; with ``<key>_min``/``<key>_max`` for :data:`SPREAD`), the first
    repeat's other values, lossless only when every repeat was (every repeat's divergences
    listed)."""
    out: dict[str, Any] = {}
    for key, value in rows[0].items():
        values = [r[key] for r in rows]
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if not numbers or any(v is not None and v not in numbers for v in values):
            out[key] = value  # not a number (None counts as missing beside numbers)
            continue
        median = statistics.median(numbers)
        whole = all(isinstance(v, int) for v in numbers) and median == int(median)
        out[key] = int(median) if whole else round(median, 4)
    for key in SPREAD:
        out[f"{key}_min"] = min(r[key] for r in rows)
        out[f"{key}_max"] = max(r[key] for r in rows)
    out["repeats"] = len(rows)
    out["peak_rss_mb"] = max(r["peak_rss_mb"] for r in rows)
    out["lossless"] = all(r["lossless"] for r in rows)
    out["diverged"] = [d for r in rows for d in r["diverged"]]
    return out


def condition_row(
    repeats: Sequence[TpotFigures], quiet: Sequence[dict[str, Trace]], drafters: Any, cores: float
) -> dict[str, Any]:
    """A condition's figures at one TPOT (:func:`aggregate` over its repeats) and beside
    them the replay's prediction: the quiet serial recordings (one session, no background
    load, the same TPOT; repeat ``r`` uses quiet repeat ``r``) replayed as the condition
    ran them, on a simulated host of ``cores`` and the condition's background load
    (``--cores``/``--background-load``), and once without contention (the replay as it was)."""
    from aospec.replay.contention import HostModel

    first = repeats[0]
    host = HostModel(cores, first.background_load)
    row = aggregate([f.figures() for f in repeats])
    contended, plain, serial_ns = [], [], []
    for r, fig in enumerate(repeats):
        recorded = quiet[r % len(quiet)]
        batches = [[recorded[i] for i in ids] for ids, _, _ in fig.batches]
        ps, pp = replay_prediction(batches, drafters, fig.tpot_ms, fig.policy, host)
        us, up = replay_prediction(batches, drafters, fig.tpot_ms, fig.policy)
        contended.append(1 - pp / ps if ps else 0.0)
        plain.append(1 - up / us if us else 0.0)
        serial_ns.append(ps)
    serial_wall, spec_wall = row["serial_s"], row["speculative_s"]
    pred = statistics.median(contended)
    pred_plain = statistics.median(plain)
    pred_serial = statistics.median(serial_ns) * 1e-9

    def error(predicted: float, live: float) -> float:
        return round(abs(predicted - live) / live, 4) if live else 0.0

    row.update(
        {
            "cores": cores,
            "replay_host": host.describe(),
            "replay_state_model": "recorded",
            "replay_serial_s": round(pred_serial, 3),
            "serial_prediction_error": error(pred_serial, serial_wall),
            "predicted_saving": round(pred, 4),
            "predicted_speculative_s": round(serial_wall * (1 - pred), 3),
            "prediction_error": error(serial_wall * (1 - pred), spec_wall),
            "predicted_saving_no_contention": round(pred_plain, 4),
            "prediction_error_no_contention": error(serial_wall * (1 - pred_plain), spec_wall),
        }
    )
    return row


def recorded_by_task(fig: TpotFigures) -> dict[str, Trace]:
    """The serial recordings of a repeat, by trajectory (the first session's of each)."""
    out: dict[str, Trace] = {}
    for serial, _ in fig.runs:
        out.setdefault(serial.traj.id, serial.trace)
    return out


async def record_training(staged: dict[str, Path], base: str, trajs: Sequence[Trajectory]) -> list[Trace]:
    """The training tasks' runs, recorded (serial, no decode time): the drafters' data."""
    from aospec.live.serve_trace import serve_trace

    out = []
    async with serve_trace([script_trace(t) for t in trajs], 0.0) as server:
        for t in trajs:
            run = await run_agent(t, server.base_url, staged, speculate=False, tpot_ms=0.0, drafters=None, base=base)
            out.append(run.trace)
            log(
                f"  training {t.id}: {len(run.result.steps)} steps, {run.result.wall_s:.1f} s ({run.result.exit_reason})"
            )
    return out


def session_batches(trajs: Sequence[Trajectory], sessions: int) -> list[list[Trajectory]]:
    """The batches of ``sessions`` concurrent runs that cover every task once at least:
    session ``j`` of batch ``b`` runs task ``(b * sessions + j) mod T`` (one task after the
    other for one session; with more sessions than tasks, tasks run several times at once)."""
    n = max(1, math.ceil(len(trajs) / sessions))
    return [[trajs[(b * sessions + j) % len(trajs)] for j in range(sessions)] for b in range(n)]


async def run_batch(
    batch: Sequence[Trajectory], base_url: str, staged: dict[str, Path], **kw: Any
) -> tuple[list[Run], float]:
    """The runs of ``batch`` at once; the batch's wall time. Each run's ``cpu_s`` is the
    batch's sandbox CPU shared equally (one host: it cannot be told apart)."""
    runs: list[Run | None] = [None] * len(batch)
    tag = kw.pop("tag", "")

    async def one(j: int) -> None:
        runs[j] = await run_agent(batch[j], base_url, staged, tag=f"{tag}.s{j}", slot=j, **kw)

    cpu0, t0 = children_cpu_s(), time.monotonic()
    async with anyio.create_task_group() as tg:
        for j in range(len(batch)):
            tg.start_soon(one, j)
    wall, cpu = time.monotonic() - t0, children_cpu_s() - cpu0
    done = [r for r in runs if r is not None]
    for r in done:
        r.cpu_s = cpu / len(done)
    return done, wall


#: The serial runs' arm among a batch's policies (:func:`measure_tpot`).
SERIAL_ARM = -1


async def settle() -> None:
    """Before a timed arm: the previous runs' dirty pages written back (os.sync), so their
    writeback is not charged to whichever arm runs next."""
    await anyio.to_thread.run_sync(os.sync)


async def measure_tpot(
    tpot_ms: float,
    trajs: Sequence[Trajectory],
    staged: dict[str, Path],
    drafters: Any,
    base: str,
    *,
    bytecode: bool = False,
    policy: str = "aospec",
    more: Sequence[tuple[str, Any]] = (),
    rotate: int = 0,
    specbox: Any = None,
    train: Sequence[Trace] = (),
    router: Any = None,
    sessions: int = 1,
    background_load: int = 0,
    tag: str = "",
    serial_only: bool = False,
) -> list[TpotFigures]:
    """One repeat of a condition at ``tpot_ms``: per batch of ``sessions`` concurrent runs
    (:func:`session_batches`), every run serially and every run speculatively, once per
    policy (``policy`` with ``drafters``, then each ``(policy, drafters)`` of ``more``); the
    serial arm and the policies' in an order rotated by ``rotate`` (interleaved, none always
    first), each after :func:`settle`; and with
    ``specbox`` once more with the layer (the first policy, one session only), each
    speculative run checked against its serial one. One session's serial runs record each
    step's CPU time. ``serial_only``: the serial runs alone (a quiet reference for the
    replay). Returns one :class:`TpotFigures` per policy, in the order given, sharing the
    serial runs."""
    from aospec.live.serve_trace import serve_trace

    specs = [(policy, drafters), *more]
    if CARRY is not None:
        CARRY.clear()  # each repeat's sessions start from the calibrated model again
    figs = [TpotFigures(tpot_ms, policy=name, sessions=sessions, background_load=background_load) for name, _ in specs]
    # the arms of a batch: the serial runs (SERIAL_ARM), then each policy's; rotated as a
    # whole, so no arm always runs first (right after the last batch's writeback)
    arms = [SERIAL_ARM] if serial_only else [SERIAL_ARM, *range(len(specs))]
    if rotate:
        arms = arms[rotate % len(arms) :] + arms[: rotate % len(arms)]
    condition = f"tpot{tpot_ms:g}.n{sessions}.k{background_load}{'.pyc' if bytecode else ''}"  # --profile-cpu's
    async with serve_trace([script_trace(t) for t in trajs], tpot_ms) as server:
        for batch in session_batches(trajs, sessions):
            kw = {"tpot_ms": tpot_ms, "drafters": drafters, "base": base, "bytecode": bytecode}
            # per arm: its runs, their wall time, and this process's CPU over them (s)
            arm_runs: dict[int, tuple[list[Run], float, float]] = {}
            for i in arms:
                serial = i == SERIAL_ARM
                run_kw = kw if serial else {**kw, "policy": specs[i][0], "drafters": specs[i][1]}
                await settle()
                cpu0 = time.process_time()
                arm = "serial" if serial else policy_slug(specs[i][0])
                with profiled(condition, arm) if not serial_only else contextlib.nullcontext():
                    if sessions == 1:
                        t0 = time.monotonic()
                        # alone on the host and serial: the serial run records each step's CPU
                        run = await run_agent(
                            batch[0],
                            server.base_url,
                            staged,
                            speculate=not serial,
                            measure_cpu=serial,
                            tag=tag,
                            **run_kw,
                        )
                        runs, wall = [run], time.monotonic() - t0
                    else:
                        runs, wall = await run_batch(
                            batch, server.base_url, staged, speculate=not serial, tag=tag, **run_kw
                        )
                arm_runs[i] = (runs, wall, time.process_time() - cpu0)
            serials, serial_wall, serial_cpu = arm_runs.pop(SERIAL_ARM)
            if serial_only:
                figs[0].batches.append(([t.id for t in batch], serial_wall, 0.0))
                figs[0].runs.extend((r, r) for r in serials)
                continue
            for i, fig in enumerate(figs):
                specs_i, spec_wall, spec_cpu = arm_runs[i]
                fig.batches.append(([t.id for t in batch], serial_wall, spec_wall))
                fig.process_cpu.append((serial_cpu, spec_cpu))
                for t, serial, spec in zip(batch, serials, specs_i, strict=True):
                    why = divergence(serial, spec)
                    if why:
                        fig.diverged.append(f"{t.id}: {why}")
                    fig.runs.append((serial, spec))
                    st = spec.result.statistics
                    log(
                        f"  tpot {tpot_ms:g} ms{' (bytecode)' if bytecode else ''}{tag}"
                        f"{f' [{fig.policy}]' if len(figs) > 1 else ''} {t.id}: serial "
                        f"{serial.result.wall_s:.2f} s, speculative {spec.result.wall_s:.2f} s, obs hits "
                        f"{st.drafts_hit}/{len(spec.result.steps)} ({st.drafts_started} branches), "
                        f"action hits {st.forks_reused} "
                        f"(rebased {st.forks_rebased}), forks {st.forks_launched} ({st.forks_wasted} wasted), "
                        f"{'lossless' if not why else 'DIVERGED: ' + why}"
                    )
            if specbox is not None and sessions == 1:
                fig = figs[0]
                t, serial = batch[0], serials[0]
                box = await run_agent(
                    t,
                    server.base_url,
                    staged,
                    speculate=True,
                    specbox=specbox,
                    train=train,
                    router=router,
                    tag=tag,
                    policy=policy,
                    **kw,
                )
                why = divergence(serial, box)
                if why:
                    fig.box_diverged.append(f"{t.id}: {why}")
                fig.box_runs.append(box)
                bs = box.result.statistics
                log(
                    f"  tpot {tpot_ms:g} ms {t.id} with SpecBox: {box.result.wall_s:.2f} s, action hits "
                    f"{bs.forks_reused} (routed {bs.routed_forks_reused}/"
                    f"{bs.routed_forks_launched}), cache hits {bs.cache_hits}, "
                    f"pool served {((box.specbox or {}).get('pool') or {}).get('served', 0)}, "
                    f"{'lossless' if not why else 'DIVERGED: ' + why}"
                )
    return figs


def bytecode_effect(clean: TpotFigures, pyc: TpotFigures) -> dict[str, Any]:
    """Steps whose version changed only because of bytecode caches: changed with bytecode
    written, unchanged without it (same trajectory, same TPOT)."""
    cache_only = changed_with = changed_without = steps = 0
    per_task = {}
    for (s0, _), (s1, _) in zip(clean.runs, pyc.runs, strict=True):
        n = 0
        for a, b in zip(s0.result.steps, s1.result.steps, strict=False):
            c0, c1 = a.version_before != a.version_after, b.version_before != b.version_after
            changed_with += c1
            changed_without += c0
            n += c1 and not c0
        cache_only += n
        steps += len(s1.result.steps)
        per_task[s0.traj.id] = n
    spec_hits = lambda f: sum(p.result.statistics.forks_reused for _, p in f.runs)  # noqa: E731
    return {
        "tpot_ms": clean.tpot_ms,
        "steps": steps,
        "state_changing_steps_with_bytecode": changed_with,
        "state_changing_steps_without": changed_without,
        "cache_only_steps": cache_only,
        "cache_only_per_task": per_task,
        "action_hits_with_bytecode": spec_hits(pyc),
        "action_hits_without": spec_hits(clean),
        "saving_with_bytecode": round(
            1 - sum(p.result.wall_s for _, p in pyc.runs) / sum(s.result.wall_s for s, _ in pyc.runs), 4
        ),
        "saving_without": round(
            1 - sum(p.result.wall_s for _, p in clean.runs) / sum(s.result.wall_s for s, _ in clean.runs), 4
        ),
        "diverged_with_bytecode": pyc.diverged,
        "diverged_without": clean.diverged,
    }


def leaks(store_ids: Sequence[str]) -> dict[str, int]:
    """What the sessions of ``store_ids`` left on this host: mounts and state directories
    under this benchmark's private state root, sandbox processes (orphans included) and
    cgroups of those stores. Scoped, since other aospec users of the host may be running."""
    from aospec.runtime._fs import mounts_under
    from aospec.runtime.host import host_support
    from aospec.runtime.processes import marked_processes

    _, cgroups = host_support()
    root = default_state_root()
    roots = set(cgroups.roots.values()) if cgroups else set()
    ids = [i for i in store_ids if i]
    return {
        "mounts": len(mounts_under(str(root))),
        "processes": sum(len(marked_processes(f"aospec-{i}-")) for i in ids),
        "cgroups": sum(len(list(r.glob(f"aospec-{i}*"))) for r in roots for i in ids),
        "state_dirs": len([p for p in root.glob("*") if p.is_dir()]) if root.exists() else 0,
    }


async def concurrent_sessions(
    n: int, trajs: Sequence[Trajectory], staged: dict[str, Path], drafters: Any, base: str, tpot_ms: float
) -> dict[str, Any]:
    """``n`` speculative sessions at once (cycling through ``trajs``), each compared with a
    serial reference run of its trajectory; then the leak check."""
    from aospec.live.serve_trace import serve_trace

    async with serve_trace([script_trace(t) for t in trajs], tpot_ms) as server:
        refs = {}
        for t in trajs:
            refs[t.id] = await run_agent(
                t, server.base_url, staged, speculate=False, tpot_ms=tpot_ms, drafters=None, base=base
            )
        runs: list[Run | BaseException] = [None] * n  # type: ignore[list-item]

        async def one(i: int) -> None:
            try:
                runs[i] = await run_agent(
                    trajs[i % len(trajs)],
                    server.base_url,
                    staged,
                    speculate=True,
                    tpot_ms=tpot_ms,
                    drafters=drafters,
                    base=base,
                )
            except Exception as exc:  # reported below
                runs[i] = exc
            r = runs[i]
            log(f"  session {i}: " + (f"{r.result.wall_s:.1f} s" if isinstance(r, Run) else f"failed: {r}"))

        t0 = time.monotonic()
        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(one, i)
        wall = time.monotonic() - t0
    await anyio.sleep(0.5)
    failed = [f"session {i}: {type(r).__name__}: {r}" for i, r in enumerate(runs) if isinstance(r, BaseException)]
    diverged = [
        f"session {i} ({r.traj.id}): {why}"
        for i, r in enumerate(runs)
        if isinstance(r, Run) and (why := divergence(refs[r.traj.id], r))
    ]
    ok = [r for r in runs if isinstance(r, Run)]
    leaked = {k: v for k, v in leaks([r.store_id for r in [*ok, *refs.values()]]).items() if v}
    return {
        "sessions": n,
        "tpot_ms": tpot_ms,
        "completed": len(ok),
        "wall_s": round(wall, 3),
        "serial_sum_s": round(sum(refs[r.traj.id].result.wall_s for r in ok), 3),
        "failed": failed,
        "diverged": diverged,
        "leaked": leaked,
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "ok": not failed and not diverged and not leaked,
    }


def condition_label(row: dict[str, Any], policy: bool = False) -> str:
    n, k = row["sessions"], row["background_load"]
    label = f"{n} session{'s' if n != 1 else ''}, {k} background process{'es' if k != 1 else ''}"
    return f"{row['policy']}, {label}" if policy else label


def plot(rows: Sequence[dict[str, Any]], path: str) -> None:
    """Saving against TPOT, one line per load condition (sessions, background processes;
    and policy, with several ``--policy``):
    the live median with its min-max over repeats, and the replay's prediction dashed; beside
    it the prediction's error."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    several = len({r["policy"] for r in rows}) > 1
    if len({r["tpot_ms"] for r in rows}) == 1:
        # One TPOT: no line to draw; a bar per condition (and policy), live and replay
        fig, ax = plt.subplots(figsize=(10, 1.2 + 0.5 * len(rows)))
        labels = [condition_label(r, several) for r in rows]
        ys = range(len(rows))
        mid = [100 * r["saving"] for r in rows]
        err = [
            [100 * (r["saving"] - r.get("saving_min", r["saving"])) for r in rows],
            [100 * (r.get("saving_max", r["saving"]) - r["saving"]) for r in rows],
        ]
        ax.barh(ys, mid, xerr=err, color="C0", capsize=3, label="live (median, min-max over repeats)")
        ax.plot([100 * r["predicted_saving"] for r in rows], ys, "s", color="C1", label="replay")
        ax.set_yticks(list(ys), labels, fontsize=8)
        ax.invert_yaxis()
        ax.axvline(0, color="grey", lw=0.8)
        ax.set_xlabel("saving vs serial (%)")
        ax.set_title(f"saving at TPOT {rows[0]['tpot_ms']:g} ms")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        return
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(condition_label(r, several), []).append(r)
    for i, (label, rs) in enumerate(by.items()):
        rs = sorted(rs, key=lambda r: r["tpot_ms"])
        xs = [r["tpot_ms"] for r in rs]
        color = f"C{i % 10}"
        mid = [100 * r["saving"] for r in rs]
        err = [
            [100 * (r["saving"] - r.get("saving_min", r["saving"])) for r in rs],
            [100 * (r.get("saving_max", r["saving"]) - r["saving"]) for r in rs],
        ]
        ax.errorbar(xs, mid, yerr=err, fmt="o-", color=color, capsize=3, label=f"{label}: live")
        ax.plot(xs, [100 * r["predicted_saving"] for r in rs], "s--", color=color, alpha=0.7, label=f"{label}: replay")
        ax2.plot(xs, [100 * r["prediction_error"] for r in rs], "o-", color=color, label=label)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("TPOT (ms)")
    ax.set_ylabel("saving vs serial (%)")
    ax.set_title("saving against TPOT (median, min-max over repeats)")
    ax.legend(fontsize=7)
    ax2.axhline(10, color="grey", lw=0.8, ls=":")
    ax2.set_xlabel("TPOT (ms)")
    ax2.set_ylabel("replay prediction error (%)")
    ax2.set_title("replay (--cores, --background-load) against live")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_table(rows: Sequence[dict[str, Any]], policies: bool = False) -> None:
    cols = [
        *([("policy", "policy", "{}")] if policies else []),
        ("TPOT", "tpot_ms", "{:g} ms"),
        ("N", "sessions", "{:g}"),
        ("K", "background_load", "{:g}"),
        ("serial", "serial_s", "{:.1f} s"),
        ("spec", "speculative_s", "{:.1f} s"),
        ("saving", "saving", "{:.1%}"),
        ("min..max", "saving_range", "{}"),
        ("replay", "predicted_saving", "{:.1%}"),
        ("pred err", "prediction_error", "{:.1%}"),
        ("tool hidden", "tool_hidden_s", "{:.1f} s"),
        ("obs hit", "obs_hit_rate", "{:.0%}"),
        ("act hit", "action_hit_rate", "{:.0%}"),
        ("forks", "forks_launched", "{}"),
        ("wasted", "forks_wasted", "{}"),
        ("rebased", "forks_rebased", "{}"),
        ("wasted CPU", "wasted_cpu_s", "{:.1f} s"),
        ("fork CPU", "fork_wasted_cpu_s", "{:.2f} s"),
        ("overhead/step", "overhead_ms_per_step", "{:.2f} ms"),
        ("peak RSS", "peak_rss_mb", "{:.0f} MB"),
        ("lossless", "lossless", "{}"),
    ]
    rows = [{**r, "saving_range": f"{r['saving_min']:.1%}..{r['saving_max']:.1%}"} for r in rows]
    cells = [[fmt.format(r[k]) for _, k, fmt in cols] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _, _) in enumerate(cols)]
    print("  ".join(h.rjust(w) for (h, _, _), w in zip(cols, widths, strict=True)))
    for c in cells:
        print("  ".join(x.rjust(w) for x, w in zip(c, widths, strict=True)))


def print_specbox_table(rows: Sequence[dict[str, Any]]) -> None:
    cols = [
        ("TPOT", "tpot_ms", "{:g} ms"),
        ("serial", "serial_s", "{:.1f} s"),
        ("spec", "speculative_s", "{:.1f} s"),
        ("saving", "saving", "{:.1%}"),
        ("spec+SpecBox", "specbox_s", "{:.1f} s"),
        ("saving", "specbox_saving", "{:.1%}"),
        ("act hit", "specbox_action_hit_rate", "{:.0%}"),
        ("routes", "routes_fired", "{}"),
        ("routed reused/launched", "routed", "{}"),
        ("cache hits", "cache_hits", "{}"),
        ("pool served", "pool_served", "{}"),
        ("lossless", "specbox_lossless", "{}"),
    ]
    rows = [{**r, "routed": f"{r['routed_forks_reused']}/{r['routed_forks_launched']}"} for r in rows]
    cells = [[fmt.format(r[k]) for _, k, fmt in cols] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _, _) in enumerate(cols)]
    print()
    print("  ".join(h.rjust(w) for (h, _, _), w in zip(cols, widths, strict=True)))
    for c in cells:
        print("  ".join(x.rjust(w) for x, w in zip(c, widths, strict=True)))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--json",
        action="store_true",
        help="one JSON line per TPOT and condition (then the bytecode and sessions lines)",
    )
    ap.add_argument("--quick", action="store_true", help="two tasks (Python tests, C build): a few minutes")
    ap.add_argument(
        "--sessions",
        default=None,
        metavar="N[,N...]",
        help="with --compare: conditions of N concurrent sessions each (all serial against all speculative); "
        "without it: run N concurrent speculative sessions instead and check them for leaks",
    )
    ap.add_argument(
        "--compare",
        action="store_true",
        help="the TPOT table for every --sessions and --background-load condition (serial against speculative)",
    )
    ap.add_argument(
        "--background-load",
        default="0",
        metavar="K[,K...]",
        help="conditions with K CPU-bound processes beside the runs (default 0; started and always cleaned up)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="R",
        help="repeats of every condition, interleaved (serial and speculative runs alternate); figures are "
        "medians with min..max (default 1)",
    )
    ap.add_argument(
        "--cores",
        type=float,
        default=None,
        metavar="C",
        help="the replay's simulated host for its prediction (default: the CPUs this process may use)",
    )
    ap.add_argument("--tpots", default=",".join(f"{t:g}" for t in TPOTS_MS), help="TPOTs in ms (default 20,10,1)")
    ap.add_argument("--tasks", default=None, help="comma-separated task names (default: all, or the quick subset)")
    ap.add_argument("--base", default=BASE, help=f"sandbox base (default {BASE})")
    ap.add_argument(
        "--policy",
        action="append",
        default=None,
        metavar="SPEC",
        help="the replay policy whose drafters and engine configuration run (default aospec; a spec such as "
        "aospec:depth=3:read_sets=false); repeat it to compare several: each policy's speculative runs follow "
        "the same serial runs, interleaved (their order rotated per repeat), a row per policy. --integrations, "
        "--sessions without --compare, --specbox and the bytecode check use the first",
    )
    ap.add_argument(
        "--integrations",
        nargs="?",
        const="all",
        default=None,
        metavar="LIST",
        help="instead of the TPOT table: a row per integration (mini-swe-agent,proxy,mcp and the third-party "
        "harnesses openai-agents,opencode,opencode-proxy, each skipped with one line where its install is missing; "
        "default all) against the same harness without aospec; with --quick one task at TPOT 10 ms; the harnesses "
        "run their own scripted task, --repeats times per mode",
    )
    ap.add_argument("--no-bytecode-check", action="store_true", help="skip the bytecode-cache measurement")
    ap.add_argument(
        "--speculation-budget",
        default=None,
        metavar="CORES[,MEMORY]",
        help="the host's speculation budget the speculative sessions share (aospec run --speculation-budget; "
        "default: auto, as aospec run: one slot per two cores; none: no host budget)",
    )
    ap.add_argument(
        "--no-calibration",
        action="store_true",
        help="speculative runs start from the controller's uncalibrated prior, not from its model fitted on the "
        "training runs (what aospec run --train-traces does)",
    )
    ap.add_argument(
        "--carry-model",
        action="store_true",
        help="each session's speculative runs continue from the controller's model its previous run left (an "
        "Engine's runs, or aospec run --calibration FILE run after run), instead of each from the calibrated one",
    )
    ap.add_argument(
        "--train-traces",
        action="append",
        default=None,
        metavar="PATH",
        help="more training traces for the drafters, beside the training tasks' runs (default: the bundled "
        "tb1 sample; 'none' for none)",
    )
    ap.add_argument(
        "--specbox",
        action="store_true",
        help="also run each task speculatively with the SpecBox layer (cache, pool, router, Markov) and report it",
    )
    ap.add_argument("--specbox-cache", default="reads", choices=("off", "reads"), help="with --specbox (default reads)")
    ap.add_argument("--specbox-pool-depth", type=int, default=2, metavar="N", help="with --specbox (default 2)")
    ap.add_argument(
        "--specbox-router", default="parse", choices=("off", "parse", "trained"), help="with --specbox (default parse)"
    )
    ap.add_argument(
        "--specbox-markov",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --specbox: the Markov drafter fitted on the training runs (default on)",
    )
    ap.add_argument(
        "--profile-cpu",
        default=None,
        metavar="DIR",
        help="profile this process's CPU time by function over each condition's serial and speculative arms "
        "(cProfile with a CPU-time timer, all repeats together): DIR/<condition>.<arm>.prof and "
        "DIR/<condition>.diff.txt, the functions the speculative runs spent CPU in beyond the serial runs. "
        "Profiling slows this process: its savings are not the benchmark's",
    )
    ap.add_argument("--plot", default=None, help="write a PNG plot here")
    ap.add_argument("--out", default=None, help="keep the recorded traces (JSONL) in this directory")
    args = ap.parse_args(argv)
    try:
        check_budget(args.speculation_budget)
    except ConfigError as exc:
        ap.error(str(exc))
    if args.integrations and args.quick:
        if "--tpots" not in (argv if argv is not None else sys.argv):
            args.tpots = "10"
        if not args.tasks:
            args.tasks = QUICK[0]
    tpots = [float(x) for x in args.tpots.split(",") if x]
    policies = args.policy or ["aospec"]
    if len(set(policies)) != len(policies):
        ap.error(f"--policy listed twice: {', '.join(sorted({p for p in policies if policies.count(p) > 1}))}")
    try:
        from aospec.replay.policies import check_drafter_names, parse_policy

        for spec in policies:
            check_drafter_names([parse_policy(spec)])
    except ConfigError as exc:
        ap.error(str(exc))
    args.policy = policies[0]
    try:
        sessions = [int(x) for x in (args.sessions or "1").split(",") if x.strip()]
        loads = [int(x) for x in args.background_load.split(",") if x.strip()]
    except ValueError:
        ap.error("--sessions and --background-load take comma-separated whole numbers")
    if not sessions or min(sessions) < 1 or not loads or min(loads) < 0 or args.repeats < 1:
        ap.error("--sessions must be >= 1, --background-load >= 0 and --repeats >= 1")
    legacy_sessions = args.sessions is not None and not args.compare
    if legacy_sessions and len(sessions) != 1:
        ap.error("without --compare, --sessions takes one number (concurrent speculative sessions)")
    cores = args.cores if args.cores is not None else float(len(os.sched_getaffinity(0)))
    conditions = [(n, k) for k in dict.fromkeys(loads) for n in dict.fromkeys(sessions)]
    # SIGTERM ends the benchmark as Ctrl-C does: background load and sandboxes are cleaned up
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if "AOSPEC_STATE_ROOT" not in os.environ:  # a private one: the leak check counts only this run's
        private = tempfile.mkdtemp(prefix="aospec-bench-live-", dir="/var/tmp")
        os.environ["AOSPEC_STATE_ROOT"] = private
        atexit.register(remove_private_root, private)
    names = args.tasks.split(",") if args.tasks else (list(QUICK) if args.quick else [t.task for t in MEASURED])
    trajs = [t for t in MEASURED if t.task in names]
    if not trajs:
        ap.error(f"no task among {names}; have {', '.join(t.task for t in MEASURED)}")
    from aospec.live.agent import default_drafters
    from aospec.runtime.bases import build_base, open_base

    if args.base.startswith("debootstrap"):
        log(f"base {args.base} (built on first use, about 2 minutes) ...")
        build_base(args.base)
    base_fs = open_base(args.base)
    log(f"base {base_fs.name} version {base_fs.version}; tasks: {', '.join(t.id for t in trajs)}; TPOTs {tpots} ms")

    with tempfile.TemporaryDirectory(prefix="aospec-bench-live-") as tmp:
        staged = stage([*trajs, *TRAINING], Path(tmp))
        log("recording the training tasks (drafters are fitted on these only) ...")
        train = anyio.run(record_training, staged, args.base, TRAINING)
        from aospec.replay import bundled_traces_path, load_traces

        paths = [p for p in (args.train_traces or [str(bundled_traces_path())]) if p != "none"]
        extra_train = load_traces(paths) if paths else []
        log(f"drafters fitted on {len(train)} training runs + {len(extra_train)} traces of {paths or 'nothing'}")
        train = [*train, *extra_train]
        drafters = default_drafters(train, policy=args.policy)
        more = [(p, default_drafters(train, policy=p)) for p in policies[1:]]
        global BUDGET, CARRY, PROFILES
        BUDGET = host_budget(args.speculation_budget)  # auto unless given: aospec run's default
        CARRY = {} if args.carry_model else None
        PROFILES = {} if args.profile_cpu else None
        for note in BUDGET.notes if BUDGET is not None else ():
            log(f"note: {note}")
        log(f"host speculation budget: {'none' if BUDGET is None else f'{BUDGET.slots} slot(s)'}")
        if not args.no_calibration:
            from aospec.replay.calibrate import fit_admission

            for p in policies:
                CALIBRATION[p] = fit_admission(train, policy=p).to_json()
            log(f"speculation controller calibrated on the same {len(train)} traces (aospec run --train-traces)")
        specbox = router = None
        if args.specbox:
            from aospec.live.specbox_layer import SpecBoxOptions, build_router

            specbox = SpecBoxOptions(
                cache=args.specbox_cache,
                pool_depth=args.specbox_pool_depth,
                router=args.specbox_router,
                markov=args.specbox_markov,
            )
            router = build_router(specbox.router, train)  # fitted once, shared by every task and TPOT
            log(f"with the SpecBox layer: {specbox}")
        out_lines: list[dict[str, Any]] = []
        if legacy_sessions:
            log(f"{sessions[0]} concurrent speculative sessions at TPOT {tpots[len(tpots) // 2]:g} ms ...")
            res = anyio.run(
                concurrent_sessions, sessions[0], trajs, staged, drafters, args.base, tpots[len(tpots) // 2]
            )
            print(json.dumps(res) if args.json else json.dumps(res, indent=2))
            return 0 if res["ok"] else 1
        if args.integrations:
            from bench_live.integrations import INTEGRATIONS, measure_integrations, print_integrations

            which = INTEGRATIONS if args.integrations == "all" else tuple(args.integrations.split(","))
            if unknown := [w for w in which if w not in INTEGRATIONS]:
                ap.error(f"unknown integrations {unknown}; have {', '.join(INTEGRATIONS)}")
            env = {**ENV, "PYTHONDONTWRITEBYTECODE": "1"}
            irows: list[dict[str, Any]] = []
            for tpot in tpots:
                log(f"integrations at TPOT {tpot:g} ms ...")
                for row in measure_integrations(
                    tpot,
                    trajs,
                    staged,
                    drafters,
                    args.base,
                    env,
                    train,
                    Path(tmp),
                    which=which,
                    run_agent=run_agent,
                    divergence=divergence,
                    script_trace=script_trace,
                    log=log,
                    repeats=args.repeats,
                ):
                    irows.append(row)
                    if args.json:
                        print(json.dumps(row), flush=True)
            if args.out:
                out = Path(args.out)
                out.mkdir(parents=True, exist_ok=True)
                (out / "integrations.json").write_text(json.dumps(irows, indent=2) + "\n")
            if not args.json:
                print_integrations(irows)
            return 0 if all(r["identical"] for r in irows) else 1
        from aospec.replay.policies import DrafterSet

        replay_drafters = DrafterSet(list(train))  # the replay's, fitted once on the same traces
        rows: list[dict[str, Any]] = []
        figs: dict[float, TpotFigures] = {}  # one session, no load, first repeat: the bytecode check's
        recorded: list[TpotFigures] = []
        for tpot in tpots:
            # per condition, per policy (in --policy order): the repeats' figures
            by_condition: dict[tuple[int, int], list[list[TpotFigures]]] = {
                c: [[] for _ in policies] for c in conditions
            }
            quiet_ref: TpotFigures | None = None
            if (1, 0) not in by_condition:
                log(f"TPOT {tpot:g} ms: quiet serial reference for the replay (one session, no background load) ...")
                quiet_ref = anyio.run(
                    lambda tpot=tpot: measure_tpot(
                        tpot, trajs, staged, drafters, args.base, policy=args.policy, tag=".quiet", serial_only=True
                    )
                )[0]
                recorded.append(quiet_ref)
            for r in range(args.repeats):
                for n, k in conditions:
                    tag = "" if (n, k, r) == (1, 0, 0) else f".n{n}.k{k}.r{r}"
                    log(
                        f"TPOT {tpot:g} ms, {n} session(s), {k} background process(es), repeat {r + 1}/{args.repeats} ..."
                    )
                    with background_load(k, exclude=children_cpu_s.exclude):
                        per_policy = anyio.run(
                            lambda tpot=tpot, n=n, k=k, tag=tag, r=r: measure_tpot(
                                tpot,
                                trajs,
                                staged,
                                drafters,
                                args.base,
                                policy=args.policy,
                                more=more,
                                rotate=r,
                                specbox=specbox,
                                train=train,
                                router=router,
                                sessions=n,
                                background_load=k,
                                tag=tag,
                            )
                        )
                    for i, fig in enumerate(per_policy):
                        by_condition[(n, k)][i].append(fig)
                    recorded.extend(per_policy)
            if (1, 0) in by_condition:
                figs[tpot] = by_condition[(1, 0)][0][0]
                quiet = [recorded_by_task(f) for f in by_condition[(1, 0)][0]]
            else:
                assert quiet_ref is not None
                quiet = [recorded_by_task(quiet_ref)]
            for c in conditions:
                for repeats in by_condition[c]:
                    rows.append(condition_row(repeats, quiet, replay_drafters, cores))
                    if args.json:
                        print(json.dumps(rows[-1]), flush=True)
        extra: dict[str, Any] = {}
        py = [t for t in trajs if t.project in ("inventory", "shipping", "sales")]
        if not args.no_bytecode_check and py and figs:
            tpot = min(tpots)
            log(f"bytecode caches: the Python tasks again at TPOT {tpot:g} ms with PYTHONDONTWRITEBYTECODE unset ...")
            clean = TpotFigures(
                tpot,
                [r for r in figs[tpot].runs if r[0].traj in py],
                [d for d in figs[tpot].diverged if d.split(":")[0] in {t.id for t in py}],
                args.policy,
            )
            pyc = anyio.run(
                lambda: measure_tpot(tpot, py, staged, drafters, args.base, bytecode=True, policy=args.policy)
            )[0]
            extra["bytecode"] = bytecode_effect(clean, pyc)
            if args.json:
                print(json.dumps(extra["bytecode"]), flush=True)
        if args.out:
            from aospec.replay import write_jsonl

            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            write_jsonl([t for t in train if t.source == "scripts/bench_live.py"], out / "training.jsonl")
            runs = {id(r): r for f in recorded for s, p in f.runs for r in (s, p)}
            write_jsonl(
                [r.trace for r in runs.values()] + [b.trace for f in recorded for b in f.box_runs],
                out / "live.jsonl",
            )
            (out / "figures.json").write_text(json.dumps({"tpots": rows, **extra}, indent=2) + "\n")
        if args.plot:
            plot(rows, args.plot)
        if args.profile_cpu and PROFILES:
            files = write_profiles(args.profile_cpu)
            log(f"CPU profiles: {len(files)} files in {args.profile_cpu} (the speculative arms' extra: *.diff.txt)")
        if not args.json:
            print_table(rows, policies=len(policies) > 1)
            if specbox is not None:
                print_specbox_table(rows)
            if "bytecode" in extra:
                b = extra["bytecode"]
                print(
                    f"\nbytecode caches (Python tasks, TPOT {b['tpot_ms']:g} ms): {b['cache_only_steps']} of "
                    f"{b['steps']} steps changed the version only by writing caches; action hits "
                    f"{b['action_hits_with_bytecode']} with vs {b['action_hits_without']} without; saving "
                    f"{b['saving_with_bytecode']:.1%} vs {b['saving_without']:.1%}; diverged with bytecode: "
                    f"{b['diverged_with_bytecode'] or 'none'}"
                )
        del out_lines
    ok = all(r["lossless"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        children_cpu_s.close()
