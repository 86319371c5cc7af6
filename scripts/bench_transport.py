#!/usr/bin/env python
"""Out-of-band handover vs JSON-RPC: how long a consumer waits for a producer's artifact.

A producer process (``python -m specbox.transport``) publishes an artifact of each size
(1, 10, 100, 1000 MB; ``--quick`` stops at 100 MB). For each, the consumer (this process)
measures, from the request to holding a usable buffer:

- ``shm``: ``ArtifactClient.open(ref)``: one request on a Unix socket, a memfd received
  over SCM_RIGHTS, an ``mmap`` read-only — a zero-copy memoryview of the producer's memory;
- ``touch``: reading one byte of every 4 KiB page of that view afterwards (the page faults
  a consumer pays on first use; not part of the handover, shown for honesty);
- ``json-rpc``: a JSON-RPC 2.0 ``get`` over a Unix stream socket returning the bytes as
  base64, parsed with ``json`` and decoded — the usual tool-server path.

Medians (p50) of ``--reps`` repetitions; JSON-RPC runs once at 1 GB and above (it holds
about 5 GB across both processes; ``--rpc-reps-large`` changes that). Prints a table, or
one JSON object per size with ``--json``.

    python scripts/bench_transport.py --quick
    python scripts/bench_transport.py --json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time

import numpy as np

from specbox.transport import ArtifactClient, ArtifactRef, JsonRpcClient

MB = 1_000_000
PAGE = 4096


def expected_byte(i: int, seed: int = 0) -> int:
    """Byte ``i`` of specbox.transport.fill_pattern (for spot checks)."""
    return (i % (251 * 4096) * 7 + seed) % 251


class Producer:
    def __init__(self, backing: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specbox.transport", "--backing", backing],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        word, self.address, self.rpc_address, _ = self.line().split()
        assert word == "ready"

    def line(self) -> str:
        assert self.proc.stdout is not None
        text = self.proc.stdout.readline()
        if not text:
            raise RuntimeError("the producer exited")
        return text.strip()

    def ask(self, command: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.line()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def spot_check(view: memoryview, size: int) -> None:
    for i in (0, 1, size // 2, size - 1):
        if view[i] != expected_byte(i):
            raise AssertionError(f"byte {i}: got {view[i]}, expected {expected_byte(i)}")


def bench_size(
    producer: Producer, client: ArtifactClient, rpc: JsonRpcClient, size: int, reps: int, rpc_reps: int
) -> dict[str, float | int]:
    ref = ArtifactRef.from_json(json.loads(producer.ask(f"put {size}")))
    assert ref.token is not None
    shm, touch = [], []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        art = client.open(ref)
        t1 = time.perf_counter_ns()
        arr = np.frombuffer(art.view, dtype=np.uint8)
        t2 = time.perf_counter_ns()
        int(arr[::PAGE].sum())
        t3 = time.perf_counter_ns()
        spot_check(art.view, size)
        del arr
        art.close()
        shm.append(t1 - t0)
        touch.append(t3 - t2)
    rpc_ns = []
    for _ in range(rpc_reps):
        t0 = time.perf_counter_ns()
        data = rpc.get(f"a{ref.token:016x}")
        t1 = time.perf_counter_ns()
        if len(data) != size:
            raise AssertionError(f"JSON-RPC returned {len(data)} bytes, expected {size}")
        spot_check(memoryview(data), size)
        del data
        gc.collect()
        rpc_ns.append(t1 - t0)
    if producer.ask(f"release {ref.token:016x}") != "ok":
        raise RuntimeError("release failed")
    shm_ms = statistics.median(shm) / 1e6
    rpc_ms = statistics.median(rpc_ns) / 1e6 if rpc_ns else float("nan")
    return {
        "size_mb": size // MB,
        "bytes": size,
        "shm_p50_ms": round(shm_ms, 4),
        "shm_touch_p50_ms": round(statistics.median(touch) / 1e6, 3),
        "rpc_p50_ms": round(rpc_ms, 2),
        "speedup": round(rpc_ms / shm_ms, 1) if rpc_ns else float("nan"),
        "shm_reps": reps,
        "rpc_reps": len(rpc_ns),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="stop at 100 MB")
    parser.add_argument("--sizes", type=int, nargs="+", help="sizes in MB (default 1 10 100 1000)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions per size (default 5)")
    parser.add_argument("--rpc-reps-large", type=int, default=1, help="JSON-RPC repetitions at >= 1 GB (default 1)")
    parser.add_argument("--backing", choices=["memfd", "shm"], default="memfd")
    parser.add_argument("--json", action="store_true", help="one JSON object per size")
    args = parser.parse_args(argv)
    sizes = args.sizes or ([1, 10, 100] if args.quick else [1, 10, 100, 1000])
    producer = Producer(args.backing)
    rows = []
    try:
        with ArtifactClient(producer.address) as client, JsonRpcClient(producer.rpc_address, timeout_s=600) as rpc:
            for mb in sizes:
                rpc_reps = args.rpc_reps_large if mb >= 1000 else args.reps
                row = bench_size(producer, client, rpc, mb * MB, args.reps, rpc_reps)
                row["backing"] = args.backing
                rows.append(row)
                if args.json:
                    print(json.dumps(row), flush=True)
    finally:
        producer.close()
    if not args.json:
        print(f"{'size':>8} {'shm p50 ms':>11} {'touch ms':>9} {'json-rpc p50 ms':>16} {'speedup':>9}  reps")
        for r in rows:
            print(
                f"{r['size_mb']:>5} MB {r['shm_p50_ms']:>11.3f} {r['shm_touch_p50_ms']:>9.1f} "
                f"{r['rpc_p50_ms']:>16.1f} {r['speedup']:>8.0f}x  {r['shm_reps']}/{r['rpc_reps']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
