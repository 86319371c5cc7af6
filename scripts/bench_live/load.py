"""CPU-bound background processes beside a live benchmark run (``--background-load K``).

Each is a Python busy loop at normal priority (what another user's build or test run is
to the scheduler). They are always cleaned up: killed and reaped when the block ends, on an
error, on Ctrl-C and on SIGTERM (the benchmark turns SIGTERM into SystemExit), and each
also ends by itself within a few tens of milliseconds once the benchmark process is gone
(it watches its parent), so not even ``kill -9`` of the benchmark leaves one burning a core.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator

#: The loader: spin, checking every million iterations that its parent (the pid it is
#: given: a parent gone before the loader started is noticed too) still lives.
LOADER = "import os, sys\np = int(sys.argv[1])\nwhile os.getppid() == p:\n    for _ in range(1_000_000):\n        pass\n"


@contextlib.contextmanager
def background_load(k: int, exclude: Callable[[int], None] | None = None) -> Iterator[list[int]]:
    """``k`` CPU-bound processes while the block runs; yields their pids. ``exclude(pid)``
    runs for each as soon as it started (the benchmark moves it out of the cgroup that
    counts the sandboxes' CPU)."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(k):
            proc = subprocess.Popen(
                [sys.executable, "-c", LOADER, str(os.getpid())],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C in the terminal reaches the benchmark, which kills them
            )
            procs.append(proc)
            if exclude is not None:
                exclude(proc.pid)
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
        for p in procs:
            p.wait()
