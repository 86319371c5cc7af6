"""Run by test_recovery.py in a subprocess that the test kills with SIGKILL.

Usage: python recovery_child.py BACKEND STATE_DIR MODE ; MODE is ``loop`` (fork, change,
commit forever) or ``inflight`` (a few commits, then a fork and the committed sandbox both
busy with a command when READY is printed).
"""

from __future__ import annotations

import sys

import anyio
from aospec.runtime import SandboxConfig, open_sandbox


async def main(backend: str, state_dir: str, mode: str) -> None:
    async with open_sandbox(SandboxConfig(backend=backend, state_dir=state_dir, timeout_s=300)) as sb:
        print("OPEN", sb.version, flush=True)
        i = 0
        while True:
            fork = await sb.fork()
            await fork.run(f"echo {i} > /tmp/counter; rm -rf /tmp/d{i % 3}; mkdir /tmp/d{i % 3}")
            print("BEGIN", i, fork.version, flush=True)
            await sb.commit(fork)
            print("DONE", i, sb.version, flush=True)
            i += 1
            if mode == "inflight" and i == 3:
                break
        fork = await sb.fork()
        async with anyio.create_task_group() as tg:
            tg.start_soon(fork.run, "echo fork > /tmp/fork; sleep 987")
            tg.start_soon(sb.run, "echo partial > /tmp/partial; sleep 986")
            await anyio.sleep(1.5)
            print("READY", flush=True)
            await anyio.sleep(3600)


if __name__ == "__main__":
    anyio.run(main, *sys.argv[1:4])
