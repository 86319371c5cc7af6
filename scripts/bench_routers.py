"""Speed of the intent routers per streamed token (prints a table; ``--json`` prints JSON).

For each router (keyword, TF-IDF, exact parse, the union of keyword and TF-IDF, and
``union+parse``: keyword, TF-IDF and parse with the Markov prior gate at 0.3) fitted on
the training half of the traces (split by task), every eval step's stream is fed token by
token; the figures are the wall time of ``RouterSession.feed`` per token (mean, p50, p99
over tokens, best of ``--repeat`` passes for the mean; the process's CPU time per token
too, which leaves out waiting for a core on a shared machine) and, for the TF-IDF router, the
time of one from-scratch re-scoring of a whole prefix (scikit-learn ``transform`` plus the
similarity products) for comparison with the incremental update.

    .venv/bin/python scripts/bench_routers.py --traces ../shared/traces/tb1-mini-swe-agent-claude-sonnet-4
    .venv/bin/python scripts/bench_routers.py --bundled --json

Pin the threads (``OMP_NUM_THREADS=1``) on a shared machine; contention shows in p99 first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _per_token(router: Any, steps: list[Any], limit: int) -> dict[str, float]:
    import numpy as np

    times: list[float] = []
    clock = time.perf_counter_ns
    cpu0 = time.process_time_ns()
    for s in steps[:limit] if limit else steps:
        session = router.session(s.context)
        for d in s.deltas:
            t0 = clock()
            session.feed(d)
            times.append(clock() - t0)
    cpu = time.process_time_ns() - cpu0
    arr = np.asarray(times, dtype=float) / 1000.0
    return {
        "tokens": len(times),
        # CPU time of this process per token (loop included): unlike wall time, it leaves out
        # the time the process waited for a core on a shared machine.
        "cpu_us_mean": round(cpu / max(1, len(times)) / 1000.0, 2),
        "us_mean": round(float(arr.mean()), 2) if len(arr) else 0.0,
        "us_p50": round(float(np.median(arr)), 2) if len(arr) else 0.0,
        "us_p99": round(float(np.quantile(arr, 0.99)), 2) if len(arr) else 0.0,
    }


def _rescore_from_scratch(tf: Any, steps: list[Any], limit: int) -> dict[str, float]:
    """One full re-vectorisation and scoring of each step's whole stream (what scoring every
    token without the incremental vector would cost per token)."""
    from aospec.specbox.routers import delta_text

    clock = time.perf_counter_ns
    times = []
    for s in steps[:limit] if limit else steps:
        text = "".join(delta_text(d) for d in s.deltas)
        t0 = clock()
        qw = tf.word_vec.transform([text])
        qc = tf.char_vec.transform([text])
        _ = (qw @ tf.xw_t).toarray()[0] + (qc @ tf.xc_t).toarray()[0]
        times.append(clock() - t0)
    return {"streams": len(times), "us_mean": round(sum(times) / len(times) / 1000.0, 1) if times else 0.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--traces", nargs="*", default=[], help="trace files or directories")
    parser.add_argument("--bundled", action="store_true", help="use the tb1 sample bundled with aospec")
    parser.add_argument("--limit", type=int, default=200, help="eval steps to stream per router (0: all)")
    parser.add_argument("--repeat", type=int, default=3, help="passes per router; the fastest mean is kept")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)

    from aospec.replay import bundled_traces_path, load_traces
    from aospec.specbox.markov import MarkovPrefetcher
    from aospec.specbox.routers import Assembly, KeywordRouter, ParseRouter, TfidfRouter, stream_steps
    from aospec.training.dataset import split_by_task

    paths = list(args.traces) + ([bundled_traces_path()] if args.bundled else [])
    if not paths:
        parser.error("give --traces PATH... or --bundled")
    traces = load_traces(paths)
    train, evals, _ = split_by_task(traces, eval_fraction=0.5, seed=0)
    tr, ev = stream_steps(train), stream_steps(evals)
    t0 = time.perf_counter()
    kw = KeywordRouter.fit(tr)
    fit_kw = time.perf_counter() - t0
    t0 = time.perf_counter()
    tf = TfidfRouter.fit(tr)
    fit_tf = time.perf_counter() - t0
    markov = MarkovPrefetcher()
    markov.fit(train)
    parse = ParseRouter()
    routers = {
        "keyword": kw,
        "tfidf": tf,
        "parse": parse,
        "union": Assembly([kw, tf]),
        "union+parse": Assembly([kw, tf, parse], prior=markov, min_prior=0.3, name="union+parse"),
    }
    results: dict[str, Any] = {
        "paths": [str(p) for p in paths],
        "train_steps": len(tr),
        "eval_steps": len(ev),
        "fit_s": {"keyword": round(fit_kw, 3), "tfidf": round(fit_tf, 3)},
        "tfidf_documents": len(tf.labels),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "routers": {},
    }
    for name, router in routers.items():
        runs = [_per_token(router, ev, args.limit) for _ in range(max(1, args.repeat))]
        results["routers"][name] = min(runs, key=lambda r: r["us_mean"])
    results["tfidf_rescore_whole_stream"] = _rescore_from_scratch(tf, ev, args.limit)
    if args.json:
        print(json.dumps(results))
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"Router cost per streamed token ({len(ev)} eval steps, load {results['load_average']})")
    for c in ("router", "tokens", "mean µs", "p50 µs", "p99 µs", "CPU µs"):
        t.add_column(c, justify="left" if c == "router" else "right")
    for name, r in results["routers"].items():
        t.add_row(name, str(r["tokens"]), str(r["us_mean"]), str(r["us_p50"]), str(r["us_p99"]), str(r["cpu_us_mean"]))
    Console().print(t)
    print(
        f"TF-IDF from-scratch re-scoring of a whole stream: {results['tfidf_rescore_whole_stream']['us_mean']} µs; "
        f"fit: keyword {fit_kw:.2f} s, TF-IDF {fit_tf:.2f} s ({len(tf.labels)} documents)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
