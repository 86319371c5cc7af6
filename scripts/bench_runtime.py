#!/usr/bin/env python3
"""Sandbox runtime benchmark (issue 4): fork, fork+exec, version, hashing and commit
latencies of the overlay and docker backends (medians and p99), and a leak check over
many fork/execute/discard cycles. Issue 22: pause and resume of a running command (both
backends), and what a committed step costs the runtime: run in a fork and committed, or
run directly on the committed root (whose forks no longer wait for its command).

Usage:
  .venv/bin/python scripts/bench_runtime.py [--json] [--plot runtime.png] [--quick]
  .venv/bin/python scripts/bench_runtime.py --cycles 10000 [--json]   # reliability run

Targets (overlay): fork ready <= 1 ms p50; fork + run `true` <= 15 ms p50; version of a
fork with 10 small changed files <= 1 ms; hashing >= 1 GB/s; commit <= 2 ms (small
changes). Docker figures are reported beside them, at concurrency 1 and 16.
``step_*`` (overlay): the same small agent steps (a write, a read, ``true``), each run in a
fresh fork of the committed root and committed (``step_via_fork``: what the engine does
when it keeps the root idle; ``step_fork_commit_overhead``: that minus the command's own
run), or directly on the root (``step_direct``); ``fork_while_root_runs``: a fork of the root
taken while a command runs there (it does not wait for the command).
Run as root (overlayfs mounts); docker figures need a running dockerd.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
from aospec.runtime import SandboxConfig, default_state_root, hash_file, open_sandbox
from aospec.runtime._fs import mounts_under
from aospec.runtime.host import host_support
from aospec.runtime.processes import marked_processes

from aospec.progress import progress
from aospec.types import Action


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))] * 1000


async def timed(n: int, make: Callable[[], Awaitable[Any]], bar: Any, task: Any) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await make()
        out.append(time.perf_counter() - t)
        bar.advance(task)
    return out


async def bench_backend(backend: str, n: int, bar: Any) -> dict[str, float]:
    r: dict[str, float] = {}
    p = backend
    async with open_sandbox(SandboxConfig(backend=backend)) as sb:
        await sb.run("mkdir -p /work && for i in 0 1 2 3 4 5 6 7 8 9; do echo seed > /work/f$i; done")
        task = bar.add_task(f"{backend}: fork / discard", total=2 * n)
        forks, discards = [], []
        for _ in range(n):
            t = time.perf_counter()
            f = await sb.fork()
            forks.append(time.perf_counter() - t)
            t = time.perf_counter()
            await f.discard()
            discards.append(time.perf_counter() - t)
            bar.advance(task, 2)
        r[f"{p}_fork_p50_ms"], r[f"{p}_fork_p99_ms"] = pct(forks, 50), pct(forks, 99)
        r[f"{p}_discard_p50_ms"] = pct(discards, 50)

        task = bar.add_task(f"{backend}: run true", total=n)
        runs = await timed(n, lambda: sb.run("true"), bar, task)
        r[f"{p}_exec_true_p50_ms"], r[f"{p}_exec_true_p99_ms"] = pct(runs, 50), pct(runs, 99)
        if backend == "overlay":
            # the floor under those figures on this machine right now: bare bubblewrap + bash
            raw = []
            root = str(sb.root_path)
            for _ in range(max(10, n // 4)):
                t = time.perf_counter()
                subprocess.run(
                    [
                        "bwrap",
                        "--unshare-all",
                        "--unshare-user",
                        "--die-with-parent",
                        "--cap-drop",
                        "ALL",
                        "--bind",
                        root,
                        "/",
                        "--proc",
                        "/proc",
                        "--dev",
                        "/dev",
                        "--",
                        "/bin/bash",
                        "-c",
                        "true",
                    ],
                    check=True,
                )
                raw.append(time.perf_counter() - t)
            r["bare_bwrap_bash_p50_ms"] = pct(raw, 50)

        task = bar.add_task(f"{backend}: fork + run true", total=n)
        fx = []
        for _ in range(n):
            t = time.perf_counter()
            f = await sb.fork()
            await f.run("true")
            fx.append(time.perf_counter() - t)
            await f.discard()
            bar.advance(task)
        r[f"{p}_fork_exec_p50_ms"], r[f"{p}_fork_exec_p99_ms"] = pct(fx, 50), pct(fx, 99)

        task = bar.add_task(f"{backend}: version / commit", total=n)
        versions, commits = [], []
        for i in range(n):
            f = await sb.fork()
            await f.run("true")  # the fork is mounted and idle
            root = f.root_path if backend == "overlay" else f._box.merged
            for k in range(10):
                (root / "work" / f"f{k}").write_text(f"change {i} {k}\n")
            tracker = f.tracker if backend == "overlay" else f._box.tracker
            t = time.perf_counter()
            layer = tracker.diff()
            f._version = layer.apply_to(f._version)
            versions.append(time.perf_counter() - t)
            assert len(layer.records) == 10
            t = time.perf_counter()
            await sb.commit(f)
            commits.append(time.perf_counter() - t)
            bar.advance(task)
        r[f"{p}_version_10files_ms"], r[f"{p}_version_10files_p99_ms"] = pct(versions, 50), pct(versions, 99)
        r[f"{p}_commit_p50_ms"], r[f"{p}_commit_p99_ms"] = pct(commits, 50), pct(commits, 99)

        task = bar.add_task(f"{backend}: 16 concurrent fork + run", total=16 * max(1, n // 16))
        lat: list[float] = []
        walls = []
        for _ in range(max(1, n // 16)):

            async def one() -> None:
                t = time.perf_counter()
                f = await sb.fork()
                await f.run("true")
                lat.append(time.perf_counter() - t)
                await f.discard()
                bar.advance(task)

            t0 = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for _ in range(16):
                    tg.start_soon(one)
            walls.append(time.perf_counter() - t0)
        r[f"{p}_fork_exec_c16_p50_ms"], r[f"{p}_fork_exec_c16_p99_ms"] = pct(lat, 50), pct(lat, 99)
        r[f"{p}_fork_exec_c16_wall_ms"] = statistics.median(walls) * 1000
    return r


async def bench_docker_fork_methods(n: int, bar: Any) -> dict[str, float]:
    r = {}
    for method in ("commit", "copy-upper"):
        async with open_sandbox(SandboxConfig(backend="docker", docker_fork=method)) as sb:
            await sb.run("mkdir -p /work && echo x > /work/a")
            task = bar.add_task(f"docker: fork via {method}", total=n)
            xs = []
            for _ in range(n):
                t = time.perf_counter()
                f = await sb.fork()
                xs.append(time.perf_counter() - t)
                await f.discard()
                bar.advance(task)
            r[f"docker_fork_{method.replace('-', '_')}_p50_ms"] = pct(xs, 50)
    return r


def bench_hash(size_mb: int) -> float:
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        f = Path(d) / "blob"
        chunk = os.urandom(1 << 20)
        with open(f, "wb") as out:
            for _ in range(size_mb):
                out.write(chunk)
        hash_file(f)  # warm the page cache
        best = min(_time(lambda: hash_file(f)) for _ in range(5))
    return size_mb / 1024 / best


def _time(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def leak_snapshot() -> dict[str, int]:
    _, cgroups = host_support()
    root = default_state_root()
    kids = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return {
        "mounts": len(mounts_under(str(root))),
        "processes": len(kids),
        "cgroups": sum(len(list(r.glob("aospec-*"))) for r in set(cgroups.roots.values())) if cgroups else 0,
        "fds": sum(not link.startswith("socket:") for link in links),
        "state_dirs": len(list(root.iterdir())) if root.exists() else 0,
    }


async def cycles(backend: str, n: int, bar: Any) -> dict[str, Any]:
    before = leak_snapshot()
    containers_before = None
    if backend == "docker":
        from aospec.runtime.daemon import docker_client

        client = docker_client()
        containers_before = len(client.containers.list(all=True))
    t0 = time.perf_counter()
    async with open_sandbox(SandboxConfig(backend=backend)) as sb:
        task = bar.add_task(f"{backend}: fork/execute/discard cycles", total=n)
        for i in range(n):
            f = await sb.fork()
            await f.run(f"echo {i} > /tmp/x; sleep 0 &")
            await f.discard()
            bar.advance(task)
        store_id = sb.store.id
    wall = time.perf_counter() - t0
    after = leak_snapshot()
    out: dict[str, Any] = {f"{backend}_cycles": n, f"{backend}_cycles_per_s": n / wall}
    out[f"{backend}_leaked_sandbox_processes"] = len(marked_processes(f"aospec-{store_id}-")) if backend == "overlay" else 0
    for k in before:
        out[f"{backend}_leaked_{k}"] = after[k] - before[k]
    _, cgroups = host_support()
    if backend == "overlay" and cgroups is not None:
        # this store's only: a store's cgroup lives as long as its session, so others'
        # sessions running meanwhile would count as leaks
        out["overlay_leaked_cgroups"] = sum(len(list(r.glob(f"aospec-{store_id}*"))) for r in set(cgroups.roots.values()))
    if containers_before is not None:
        out["docker_leaked_containers"] = len(client.containers.list(all=True)) - containers_before
        client.close()
    return out


async def bench_pause(backend: str, n: int, bar: Any) -> dict[str, float]:
    """pause() / resume() of a fork whose CPU-bound command runs (the engine's price of
    yielding the CPU to the step it waits on)."""
    pauses, resumes = [], []
    async with open_sandbox(SandboxConfig(backend=backend)) as sb:
        fork = await sb.fork()
        task = bar.add_task(f"{backend}: pause / resume", total=n)
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: fork.run("while :; do :; done", timeout=3600))
            with anyio.move_on_after(10):  # (cpu_ns stays 0 on a host without CPU accounting)
                while fork.cpu_ns == 0:
                    await anyio.sleep(0.01)
            for _ in range(n):
                t = time.perf_counter()
                await fork.pause()
                pauses.append(time.perf_counter() - t)
                t = time.perf_counter()
                await fork.resume()
                resumes.append(time.perf_counter() - t)
                await anyio.sleep(0.005)
                bar.advance(task)
            tg.cancel_scope.cancel()
        await fork.discard()
    return {
        f"{backend}_pause_p50_ms": pct(pauses, 50),
        f"{backend}_pause_p99_ms": pct(pauses, 99),
        f"{backend}_resume_p50_ms": pct(resumes, 50),
        f"{backend}_resume_p99_ms": pct(resumes, 99),
    }


_STEPS = ("echo {i} > /work/s{j}", "cat /work/s0 /work/f0 >/dev/null 2>&1; ls /work >/dev/null", "true")


async def bench_step(n: int, bar: Any) -> dict[str, float]:
    """A committed step's runtime cost: in a fork + commit, or directly on the root."""
    r: dict[str, float] = {}
    async with open_sandbox(SandboxConfig(backend="overlay")) as sb:
        await sb.run("mkdir -p /work && echo seed > /work/f0")
        task = bar.add_task("overlay: steps via a fork / direct", total=2 * n)
        via, overhead, direct = [], [], []
        for i in range(n):
            action = Action.bash(_STEPS[i % 3].format(i=i, j=i % 4))
            t0 = time.perf_counter()
            f = await sb.fork()
            t1 = time.perf_counter()
            await f.execute(action)
            t2 = time.perf_counter()
            await sb.commit(f)
            t3 = time.perf_counter()
            via.append(t3 - t0)
            overhead.append((t1 - t0) + (t3 - t2))
            bar.advance(task)
        for i in range(n):
            action = Action.bash(_STEPS[i % 3].format(i=i, j=i % 4))
            t = time.perf_counter()
            await sb.execute(action)
            direct.append(time.perf_counter() - t)
            bar.advance(task)
        r["step_via_fork_p50_ms"], r["step_via_fork_p99_ms"] = pct(via, 50), pct(via, 99)
        r["step_fork_commit_overhead_p50_ms"] = pct(overhead, 50)
        r["step_fork_commit_overhead_mean_ms"] = statistics.mean(overhead) * 1000
        r["step_direct_p50_ms"], r["step_direct_p99_ms"] = pct(direct, 50), pct(direct, 99)

        task = bar.add_task("overlay: fork while the root runs a command", total=n)
        during: list[float] = []
        taken: list[Any] = []

        async def fork_during() -> None:
            await anyio.sleep(0.02)
            t = time.perf_counter()
            taken.append(await sb.fork())
            during.append(time.perf_counter() - t)

        for _ in range(n):
            async with anyio.create_task_group() as tg:
                tg.start_soon(fork_during)
                await sb.run("echo x > /work/during; sleep 0.1")
            await taken.pop().discard()
            bar.advance(task)
        r["fork_while_root_runs_p50_ms"], r["fork_while_root_runs_p99_ms"] = pct(during, 50), pct(during, 99)
    return r


def docker_available() -> bool:
    try:
        from aospec.runtime.daemon import docker_client

        docker_client().close()
        return True
    except Exception:
        return False


def plot(results: dict[str, float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [
        ("fork", "fork"),
        ("fork + run true", "fork_exec"),
        ("run true", "exec_true"),
        ("commit", "commit"),
        ("16 concurrent fork+run", "fork_exec_c16"),
    ]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, backend in zip(axes, ("overlay", "docker"), strict=True):
        labels, p50, p99 = [], [], []
        for label, key in ops:
            if f"{backend}_{key}_p50_ms" in results:
                labels.append(label)
                p50.append(results[f"{backend}_{key}_p50_ms"])
                p99.append(results.get(f"{backend}_{key}_p99_ms", 0))
        xs = range(len(labels))
        ax.bar([x - 0.2 for x in xs], p50, 0.4, label="p50")
        ax.bar([x + 0.2 for x in xs], p99, 0.4, label="p99")
        ax.set_xticks(list(xs), labels, rotation=20, ha="right")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.set_title(f"{backend} backend")
        ax.legend()
    fig.suptitle(f"aospec runtime latencies (hash {results.get('hash_gb_per_s', 0):.1f} GB/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="few repetitions (smoke run)")
    ap.add_argument("-n", type=int, default=None, help="repetitions per overlay measurement (default 200)")
    ap.add_argument("--docker-n", type=int, default=None, help="repetitions per docker measurement (default 16)")
    ap.add_argument("--no-docker", action="store_true", help="skip the docker backend")
    ap.add_argument("--cycles", type=int, default=0, help="run N fork/execute/discard cycles and report leaks instead")
    ap.add_argument("--cycles-backend", default="overlay", help="backend of the --cycles run")
    ap.add_argument("--plot", default=None, help="write a PNG of the latencies here")
    args = ap.parse_args()
    n = args.n or (16 if args.quick else 200)
    dn = args.docker_n or (4 if args.quick else 16)
    results: dict[str, Any] = {"load_avg_1m": os.getloadavg()[0], "cpus": os.cpu_count()}
    with progress(disable=args.json or None) as bar:
        if args.cycles:
            results.update(anyio.run(cycles, args.cycles_backend, args.cycles, bar))
        else:
            results["hash_gb_per_s"] = bench_hash(64 if args.quick else 512)
            results.update(anyio.run(bench_backend, "overlay", n, bar))
            results.update(anyio.run(bench_step, n, bar))
            results.update(anyio.run(bench_pause, "overlay", n, bar))
            if not args.no_docker and docker_available():
                results.update(anyio.run(bench_backend, "docker", dn, bar))
                results.update(anyio.run(bench_docker_fork_methods, max(2, dn // 4), bar))
                results.update(anyio.run(bench_pause, "docker", dn, bar))
            else:
                results["docker"] = "unavailable"
    if args.plot and not args.cycles:
        plot(results, args.plot)
    if args.json:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in results.items()}))
    else:
        for k, v in results.items():
            print(f"{k:34} {v:10.3f}" if isinstance(v, float) else f"{k:34} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
