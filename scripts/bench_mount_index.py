#!/usr/bin/env python3
"""What overlayfs's inode index costs the overlay backend (docs/runtime.md, Versions): the
same sandbox work with sandboxes mounted ``index=on`` (aospec's default, which keeps hard
links across layers) and ``index=off`` (overlayfs's default), interleaved, ``--repeats``
times each, in alternating order.

Per mode: a committed command on the root (it freezes its upper after every command, so
each one mounts again) and a fork + command + commit, each the mean over ``--commands``;
printed as the median and range over the repeats, with ``--json`` one JSON document.
Timing-sensitive: figures from a loaded host are noisy.

Usage:
  sudo .venv/bin/python scripts/bench_mount_index.py [--repeats 4] [--commands 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import anyio
import aospec.runtime.overlay as overlay
from aospec.runtime import SandboxConfig, open_sandbox

MODES = {"index=on": overlay.MOUNT_OPTS, "index=off": overlay.MOUNT_OPTS.replace("index=on", "index=off")}


async def _trial(opts: str, n: int) -> tuple[float, float]:
    overlay.MOUNT_OPTS = opts  # what the next mounts of this process use
    async with open_sandbox(SandboxConfig(backend="overlay", timeout_s=60)) as sb:
        await sb.run("mkdir -p /w && echo x > /w/a && ln /w/a /w/b")
        start = time.perf_counter()
        for i in range(n):
            await sb.run(f"echo {i} >> /w/log")
        root = (time.perf_counter() - start) / n
        start = time.perf_counter()
        for _ in range(n):
            fork = await sb.fork()
            await fork.run("cat /w/a > /dev/null; echo y > /w/c")
            await sb.commit(fork)
        return root, (time.perf_counter() - start) / n


async def _main(repeats: int, n: int) -> dict[str, dict[str, list[float]]]:
    out: dict[str, dict[str, list[float]]] = {m: {"root_command_ms": [], "fork_run_commit_ms": []} for m in MODES}
    names = list(MODES)
    for r in range(repeats):
        for mode in names if r % 2 == 0 else names[::-1]:
            root, fork = await _trial(MODES[mode], n)
            out[mode]["root_command_ms"].append(round(root * 1000, 2))
            out[mode]["fork_run_commit_ms"].append(round(fork * 1000, 2))
            print(
                f"repeat {r + 1}/{repeats} {mode}: root {root * 1000:.1f} ms, fork {fork * 1000:.1f} ms",
                file=sys.stderr,
            )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=4, help="trials per mode (default 4)")
    ap.add_argument("--commands", type=int, default=30, help="commands per trial and kind (default 30)")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.commands < 1:
        ap.error("--repeats and --commands must be at least 1")
    res = anyio.run(_main, args.repeats, args.commands)
    summary = {
        mode: {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "runs": v} for k, v in kinds.items()}
        for mode, kinds in res.items()
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for mode, kinds in summary.items():
            parts = [f"{k} {s['median']:.1f} [{s['min']:.1f}-{s['max']:.1f}]" for k, s in kinds.items()]
            print(f"{mode:10}  " + "  ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
