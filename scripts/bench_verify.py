#!/usr/bin/env python3
"""What verifying a persistent state directory costs (issue 9, item 1): reopening a state
with ``--mb`` MB of changes on disk (its layers are re-hashed against HEAD's digests)
next to reopening an empty one, the digest alone with a warm and a cold page cache
(cold needs root: it drops the page cache), and ``aospec sandbox verify``'s check
(the base re-hashed too).

Usage:
  sudo .venv/bin/python scripts/bench_verify.py [--mb 100] [--files 100] [--repeat 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import anyio
from aospec.runtime import SandboxConfig, open_sandbox
from aospec.runtime._fs import remove_tree
from aospec.runtime._integrity import layer_digest
from aospec.runtime.overlay import verify_state_dir


async def _make_state(state: Path, mb: int, files: int) -> None:
    async with open_sandbox(SandboxConfig(state_dir=str(state))) as sb:
        each = mb * 1_000_000 // max(files, 1)
        if mb:
            cmd = f"mkdir /d; for i in $(seq {files}); do head -c {each} /dev/urandom > /d/f$i; done"
            result = await sb.run(cmd, timeout=600)
            assert result.returncode == 0, result.output


async def _reopen_s(state: Path) -> float:
    start = time.perf_counter()
    async with open_sandbox(SandboxConfig(state_dir=str(state))):
        opened = time.perf_counter()
    return opened - start


def _median_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1000, 2)


async def main(args: argparse.Namespace) -> dict[str, float]:
    top = Path(tempfile.mkdtemp(prefix="aospec-bench-verify-", dir="/var/tmp"))
    try:
        empty, full = top / "empty", top / "full"
        await _make_state(empty, 0, 0)
        await _make_state(full, args.mb, args.files)
        out: dict[str, float] = {"mb": args.mb, "files": args.files}
        out["reopen_empty_ms"] = _median_ms([await _reopen_s(empty) for _ in range(args.repeat)])
        out["reopen_full_ms"] = _median_ms([await _reopen_s(full) for _ in range(args.repeat)])
        layers = [full / "l" / d for d in os.listdir(full / "l")]
        warm = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            for layer in layers:
                layer_digest(layer)
            warm.append(time.perf_counter() - start)
        out["digest_warm_ms"] = _median_ms(warm)
        if os.geteuid() == 0:
            subprocess.run(["sync"], check=True)
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            start = time.perf_counter()
            for layer in layers:
                layer_digest(layer)
            out["digest_cold_ms"] = _median_ms([time.perf_counter() - start])
        start = time.perf_counter()
        check = verify_state_dir(full)
        out["verify_cli_check_ms"] = _median_ms([time.perf_counter() - start])
        assert check.ok, check.problems
        return out
    finally:
        remove_tree(top)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=100, help="MB of changes in the state (default 100)")
    parser.add_argument("--files", type=int, default=100, help="how many files hold them (default 100)")
    parser.add_argument("--repeat", type=int, default=5, help="repetitions of each warm measurement")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    ns = parser.parse_args()
    result = anyio.run(main, ns)
    if ns.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:22} {v}")
