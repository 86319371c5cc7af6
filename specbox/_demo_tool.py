"""A stand-in for an MCP tool server with a real cold start (tests and benchmarks only).

It is *not* an MCP server: it speaks one JSON object per line on stdio. On start it pays a
simulated import cost (``--startup-s`` of sleep, plus importing a few real standard-library
modules so the process has some resident memory, and ``--ballast-mb`` of allocated
bytes), then prints ``{"ready": true, "pid": N}``. Each request line ``{"id": ..., "tool":
..., "args": {...}}`` is answered with ``{"id": ..., "result": ...}`` after ``--call-s``
seconds. End of input ends it.

Run: ``python -m aospec.specbox._demo_tool --startup-s 0.3 --ballast-mb 20``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="aospec.specbox._demo_tool")
    p.add_argument("--startup-s", type=float, default=0.2, help="simulated import time")
    p.add_argument("--ballast-mb", type=int, default=0, help="resident memory to hold")
    p.add_argument("--call-s", type=float, default=0.0, help="time per call")
    args = p.parse_args(argv)
    import decimal  # noqa: F401  (some real import work)
    import email.parser  # noqa: F401
    import sqlite3  # noqa: F401

    ballast = bytearray(args.ballast_mb << 20)
    for i in range(0, len(ballast), 4096):  # touch the pages so they are resident
        ballast[i] = 1
    time.sleep(args.startup_s)
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            req = json.loads(line)
        except ValueError:
            print(json.dumps({"error": "bad json"}), flush=True)
            continue
        if args.call_s:
            time.sleep(args.call_s)
        print(
            json.dumps({"id": req.get("id"), "result": {"tool": req.get("tool"), "args": req.get("args")}}), flush=True
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
