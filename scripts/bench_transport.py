#!/usr/bin/env python
"""Out-of-band handover vs JSON-RPC: how long a consumer waits for a producer's artifact.

A producer process (``python -m aospec.specbox.transport``) publishes an artifact of each size
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

``--mcp`` measures the same through a live ``aospec mcp`` server instead (needs root and
overlayfs, like the sandbox): a text file of each size (1, 16, 128 MB by default) is made
in the sandbox, and the official MCP SDK client over stdio (``--transport http``: streamable
HTTP) times, from ``call_tool`` to a usable buffer:

- ``text``: ``read_file``, the text in the JSON-RPC result, encoded to bytes (only up to
  read_file's 1 MiB limit);
- ``base64``: ``export_file`` on a server whose inline threshold is above every size, so
  the bytes travel base64 in the JSON-RPC result (``aospec mcp --artifacts
  --artifact-threshold 2147483648``), decoded;
- ``oob``: ``export_file`` on ``aospec mcp --artifacts``: the ref in-band, then
  ``ArtifactClient.take(ref)``: the zero-copy mapping of the server's memfd (``touch``:
  reading one byte per page of it afterwards).

All three include the server reading the file from its sandbox; servers run
``--no-speculate`` (the transport is measured, not speculation). In-band results that the
SDK's client refuses (over HTTP it caps one server-sent event at 1 MiB) are reported as
failed, with the error.

    python scripts/bench_transport.py --quick
    python scripts/bench_transport.py --json
    python scripts/bench_transport.py --mcp --reps 5
    python scripts/bench_transport.py --mcp --reps 5 --transport http
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from aospec.specbox.transport import ArtifactClient, ArtifactRef, JsonRpcClient

MB = 1_000_000
PAGE = 4096


def expected_byte(i: int, seed: int = 0) -> int:
    """Byte ``i`` of aospec.specbox.transport.fill_pattern (for spot checks)."""
    return (i % (251 * 4096) * 7 + seed) % 251


class Producer:
    def __init__(self, backing: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "aospec.specbox.transport", "--backing", backing],
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


AOSPEC_BIN = Path(sys.executable).with_name("aospec")


async def _mcp_server(extra: list[str], transport: str) -> Any:
    """(exit stack, initialised SDK ClientSession) to ``aospec mcp --no-speculate EXTRA``
    over ``transport`` (stdio, or streamable HTTP on loopback); close the stack to stop it."""
    import tempfile

    from mcp import ClientSession, StdioServerParameters, stdio_client
    from mcp.client.streamable_http import streamable_http_client

    stack = contextlib.AsyncExitStack()
    command = str(AOSPEC_BIN) if AOSPEC_BIN.exists() else "aospec"
    argv = ["mcp", "--no-speculate", "--command-timeout", "600", *extra]
    if transport == "stdio":
        params = StdioServerParameters(command=command, args=[*argv, "--stdio"], env=dict(os.environ))
        read, write = await stack.enter_async_context(stdio_client(params))
    else:
        err = stack.enter_context(tempfile.TemporaryFile())  # noqa: SIM115 (closed by the stack)
        token = "bench-token"  # the server's token (AOSPEC_TOKEN), sent by the client below
        env = {**os.environ, "AOSPEC_TOKEN": token}
        proc = subprocess.Popen([command, *argv, "--http", "0"], stdin=subprocess.DEVNULL, stderr=err, env=env)
        stack.callback(proc.wait, 120)
        stack.callback(proc.terminate)
        url = None
        for _ in range(3000):
            err.seek(0)
            text = err.read().decode()
            if "listening on " in text:
                url = text.split("listening on ", 1)[1].split()[0]
                break
            if proc.poll() is not None:
                raise RuntimeError(f"aospec mcp --http did not start: {text}")
            time.sleep(0.1)
        if url is None:
            raise RuntimeError("aospec mcp --http did not print its URL")
        import httpx2

        http = await stack.enter_async_context(
            httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=600)
        )
        read, write = await stack.enter_async_context(streamable_http_client(url, http_client=http))
    session = await stack.enter_async_context(ClientSession(read, write))
    await session.initialize()
    return stack, session


async def _mcp_bench(sizes_mb: list[int], reps: int, transport: str, inband_reps_large: int) -> list[dict[str, Any]]:
    from aospec.specbox.mcp_env import artifact_ref_of
    from mcp.shared.exceptions import MCPError as McpError

    stack_in, inband = await _mcp_server(["--artifacts", "--artifact-threshold", str(1 << 31)], transport)
    stack_oob, oob = await _mcp_server(["--artifacts"], transport)
    rows = []
    clients: dict[str, ArtifactClient] = {}
    try:
        for mb in sizes_mb:
            size = mb * MB
            path = f"/tmp/bench-{mb}mb"
            make = f"yes 0123456789abcdefghijklmnopqrstuvwxyz | head -c {size} > {path} && md5sum < {path}"
            want = [(await s.call_tool("bash", {"command": make})).content[0].text.split()[0] for s in (inband, oob)]
            times: dict[str, list[int]] = {"text": [], "base64": [], "oob": [], "touch": []}
            inband_error = None
            for _ in range(reps):
                if size <= 1 << 20:
                    t0 = time.perf_counter_ns()
                    r = await inband.call_tool("read_file", {"path": path}, read_timeout_seconds=600)
                    data = r.content[0].text.encode()
                    times["text"].append(time.perf_counter_ns() - t0)
                    if hashlib.md5(data).hexdigest() != want[0]:
                        raise AssertionError("read_file: wrong bytes")
                    del r, data
                if inband_error is None and len(times["base64"]) < (inband_reps_large if mb >= 100 else reps):
                    t0 = time.perf_counter_ns()
                    try:
                        r = await inband.call_tool("export_file", {"path": path}, read_timeout_seconds=600)
                    except McpError as exc:  # the SDK's HTTP client caps an SSE event at 1 MiB
                        inband_error = str(exc)
                    else:
                        ref = artifact_ref_of(r)
                        assert ref is not None and ref.inline is not None
                        data = ref.inline
                        times["base64"].append(time.perf_counter_ns() - t0)
                        if hashlib.md5(data).hexdigest() != want[0]:
                            raise AssertionError("export_file in band: wrong bytes")
                        del r, ref, data
                        gc.collect()
                t0 = time.perf_counter_ns()
                r = await oob.call_tool("export_file", {"path": path}, read_timeout_seconds=600)
                ref = artifact_ref_of(r)
                assert ref is not None and ref.address is not None
                client = clients.get(ref.address) or clients.setdefault(ref.address, ArtifactClient(ref.address))
                art = client.take(ref)
                t1 = time.perf_counter_ns()
                int(np.frombuffer(art.view, dtype=np.uint8)[::PAGE].sum())
                t2 = time.perf_counter_ns()
                times["oob"].append(t1 - t0)
                times["touch"].append(t2 - t1)
                if hashlib.md5(art.view).hexdigest() != want[1]:
                    raise AssertionError("export_file out of band: wrong bytes")
                art.close()
                del r, ref
            p50 = {k: round(statistics.median(v) / 1e6, 2) if v else None for k, v in times.items()}
            row = {
                "size_mb": mb,
                "bytes": size,
                "text_p50_ms": p50["text"],
                "base64_p50_ms": p50["base64"],
                "oob_p50_ms": p50["oob"],
                "oob_touch_p50_ms": p50["touch"],
                "speedup_vs_base64": round(p50["base64"] / p50["oob"], 1) if p50["base64"] else None,
                "base64_error": inband_error,
                "reps": reps,
                "base64_reps": len(times["base64"]),
            }
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)  # progress: the slow in-band sizes take minutes
            await oob.call_tool("bash", {"command": f"rm {path}"})
            await inband.call_tool("bash", {"command": f"rm {path}"})
    finally:
        for client in clients.values():
            client.close()
        await stack_oob.aclose()
        await stack_in.aclose()
    return rows


def mcp_main(args: argparse.Namespace) -> int:
    import anyio

    sizes = args.sizes or [1, 16, 128]
    load = [f"{x:.2f}" for x in os.getloadavg()]  # as /proc/loadavg writes them
    rows = anyio.run(_mcp_bench, sizes, args.reps, args.transport, args.inband_reps_large)
    if args.json:
        for r in rows:
            print(json.dumps({**r, "transport": args.transport, "loadavg_before": load}))
        return 0
    print(
        f"aospec mcp over {args.transport}, p50 of {args.reps} (base64 at >= 100 MB: {args.inband_reps_large}); "
        f"load average before: {' '.join(load)}"
    )
    print(f"{'size':>8} {'read_file text':>15} {'export base64':>14} {'export oob':>11} {'touch':>7} {'speedup':>8}")
    for r in rows:
        text = f"{r['text_p50_ms']:.1f}" if r["text_p50_ms"] is not None else "-"
        b64 = f"{r['base64_p50_ms']:.1f}" if r["base64_p50_ms"] is not None else "-"
        b64 = "failed" if r["base64_error"] else b64
        speedup = f"{r['speedup_vs_base64']:.1f}x" if r["speedup_vs_base64"] is not None else "-"
        print(
            f"{r['size_mb']:>5} MB {text:>15} {b64:>14} {r['oob_p50_ms']:>11.1f} "
            f"{r['oob_touch_p50_ms']:>7.1f} {speedup:>8}"
        )
        if r["base64_error"]:
            print(f"         in band: {r['base64_error']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="stop at 100 MB")
    parser.add_argument("--sizes", type=int, nargs="+", help="sizes in MB (default 1 10 100 1000; with --mcp 1 16 128)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions per size (default 5)")
    parser.add_argument("--rpc-reps-large", type=int, default=1, help="JSON-RPC repetitions at >= 1 GB (default 1)")
    parser.add_argument("--backing", choices=["memfd", "shm"], default="memfd")
    parser.add_argument("--json", action="store_true", help="one JSON object per size")
    parser.add_argument("--mcp", action="store_true", help="through a live aospec mcp server (module doc; root)")
    parser.add_argument(
        "--inband-reps-large",
        type=int,
        default=1,
        help="with --mcp: base64 repetitions at >= 100 MB (default 1: the SDK's stdio client is slow there)",
    )
    parser.add_argument("--transport", choices=["stdio", "http"], default="stdio", help="with --mcp (default stdio)")
    args = parser.parse_args(argv)
    if args.mcp:
        return mcp_main(args)
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
