"""``aospec sweep`` streams its results: results.jsonl grows as traces finish (an
interrupted sweep leaves every finished trace on disk), ends in the same order and bytes as
the in-memory sweep, and the summary is the in-memory summary. A failed trace is retried
once, then reported by trace, policy and TPOT, on every local executor."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from aospec.replay import bundled_traces_path, load_traces
from aospec.replay.executors import InlineExecutor, LocalProcessExecutor, SweepTaskError
from aospec.replay.faults import InjectedFault
from aospec.replay.metrics import summarize
from aospec.replay.policies import parse_policies
from aospec.replay.report import ResultsFile, read_results
from aospec.replay.sweep import iter_sweep, run_sweep

from aospec.cli import main as cli_main
from aospec.errors import MissingDependencyError

FAULTY = "aospec.replay.faults.FaultyObservationDrafter"
FAULTY_POLICY = f"aospec:obs_drafter={FAULTY}"
LAST_TASK = "train-fasttext"  # the bundled sample's last task: its trace runs last with one worker


@pytest.fixture(scope="module")
def bundled():
    return load_traces([bundled_traces_path()])


@pytest.fixture(scope="module")
def reference(bundled):
    """The bundled sample swept in memory, serial and aospec at 10 ms."""
    return run_sweep(bundled, parse_policies("serial,aospec"), tpots_ms=[10.0], executor=InlineExecutor())


def _lines(results) -> list[str]:
    return [json.dumps(r.to_json()) for r in results]


def _sweep(tmp_path: Path, *args: str) -> int:
    return cli_main(["sweep", "--bundled", "--tpot-ms", "10", "--no-progress", "--out", str(tmp_path), *args])


def test_the_streamed_results_file_and_summary_equal_the_in_memory_sweep(tmp_path, reference, capsys):
    assert _sweep(tmp_path, "--policies", "serial,aospec", "--jobs", "2", "--format", "jsonl") == 0
    assert (tmp_path / "results.jsonl").read_text().splitlines() == _lines(reference)
    assert not (tmp_path / "results.jsonl.tmp").exists()
    summary = [json.loads(line) for line in (tmp_path / "summary.jsonl").read_text().splitlines()]
    expected = [s.to_json() for s in summarize(reference)]
    assert json.dumps(summary) == json.dumps(expected)  # NaN-safe, exact
    assert json.loads(capsys.readouterr().out.splitlines()[0]) == json.loads(json.dumps(expected[0]))
    assert "- executor: local (2 workers)\n" in (tmp_path / "summary.md").read_text()


def test_results_file_appends_as_traces_finish_then_sorts(tmp_path, reference):
    policies = parse_policies("serial,aospec")
    traces = load_traces([bundled_traces_path()])
    path = tmp_path / "results.jsonl"
    with ResultsFile(path) as out:
        stream = iter_sweep(traces, policies, tpots_ms=[10.0], executor=LocalProcessExecutor(2))
        seen = 0
        for index, results in stream:
            out.add(index, results)
            seen += len(results)
            on_disk = path.read_text().splitlines()  # flushed: every finished trace is there already
            assert len(on_disk) == seen and set(on_disk) <= set(_lines(reference))
        out.finish()
    assert path.read_text().splitlines() == _lines(reference)
    assert list(read_results(path)) == reference


def test_an_interrupted_sweep_leaves_the_finished_traces_on_disk(tmp_path, reference, capsys):
    options = json.dumps({FAULTY: {"fail_on_task": LAST_TASK}})
    code = _sweep(tmp_path, "--policies", f"serial,{FAULTY_POLICY}", "--jobs", "1", "--drafter-options", options)
    assert code == 2
    err = capsys.readouterr().err
    trace_id = next(t.trace_id for t in reference if t.task == LAST_TASK)
    assert f"trace {trace_id!r}, policy {FAULTY_POLICY}, TPOT 10 ms: failed 2 times: InjectedFault" in err
    on_disk = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    finished = {r["trace_id"] for r in on_disk}
    assert finished == {r.trace_id for r in reference} - {trace_id}  # the nine traces before it
    serial = {json.dumps(r.to_json()) for r in reference if r.policy == "serial"}
    assert {json.dumps(r) for r in on_disk if r["policy"] == "serial"} <= serial
    assert not (tmp_path / "summary.jsonl").exists()


@pytest.mark.parametrize("executor", [InlineExecutor(), LocalProcessExecutor(2)], ids=["inline", "processes"])
def test_a_failed_trace_is_retried_once(tmp_path, bundled, executor):
    marker = tmp_path / "faults"
    subset = [t for t in bundled if t.task in ("oom", "solana-data", LAST_TASK)]
    options = {FAULTY: {"fail_on_task": "oom", "times": 1, "marker": str(marker)}}
    policies = parse_policies(f"serial,{FAULTY_POLICY}")
    results = run_sweep(subset, policies, tpots_ms=[10.0], drafter_options=options, executor=executor)
    assert len(results) == 2 * len(subset)
    assert len(marker.read_text().splitlines()) == 1  # it failed once, and the retry went through
    # the same sweep without the fault: the same records
    clean = {FAULTY: {"fail_on_task": ""}}
    assert results == run_sweep(subset, policies, tpots_ms=[10.0], drafter_options=clean, executor=InlineExecutor())


@pytest.mark.parametrize("executor", [InlineExecutor(), LocalProcessExecutor(2)], ids=["inline", "processes"])
def test_a_trace_that_fails_twice_is_reported_by_trace_policy_and_tpot(tmp_path, bundled, executor):
    marker = tmp_path / "faults"
    subset = [t for t in bundled if t.task in ("oom", "solana-data")]
    options = {FAULTY: {"fail_on_task": "oom", "times": 2, "marker": str(marker)}}
    with pytest.raises(SweepTaskError) as info:
        run_sweep(subset, parse_policies(f"serial,{FAULTY_POLICY}"), tpots_ms=[5.0, 1.0], drafter_options=options,
                  executor=executor)
    err = info.value
    trace_id = next(t.id for t in subset if t.task == "oom")
    assert (err.trace_id, err.policies, err.tpots_ms, err.attempts) == (trace_id, [FAULTY_POLICY], [5.0], 2)
    assert str(err).startswith(f"trace {trace_id!r}, policy {FAULTY_POLICY}, TPOT 5 ms: failed 2 times: InjectedFault")
    assert isinstance(err.__cause__, InjectedFault)
    assert len(marker.read_text().splitlines()) == 2


def test_address_needs_the_ray_executor(tmp_path, capsys):
    assert _sweep(tmp_path, "--address", "auto") == 2
    assert "--address needs --executor ray" in capsys.readouterr().err
    assert not (tmp_path / "results.jsonl").exists()
    assert cli_main(["replay", "--bundled", "--address", "ray://h:10001", "--no-progress"]) == 2


def test_the_ray_executor_without_ray_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what an environment without Ray sees: ImportError
    from aospec.replay.executors_ray import require_ray

    with pytest.raises(MissingDependencyError, match=r"pip install 'aospec\[ray\]'"):
        require_ray()
    assert _sweep(tmp_path, "--executor", "ray") == 2
    assert "pip install 'aospec[ray]'" in capsys.readouterr().err


def test_the_cli_hands_the_executor_references_not_steps(tmp_path, bundled, monkeypatch, capsys):
    """The job a sweep sends to its workers carries each evaluation trace as a TraceRef
    (id, task, step count, file): no Step or Trace objects, a few hundred bytes a trace."""
    import io
    import pickle

    import aospec.replay.executors
    from aospec.replay.sweep import TraceRef

    from aospec.types import Step, Trace

    jobs = []

    class Recording(InlineExecutor):
        def map_unordered(self, job, items):
            jobs.append(job)
            return super().map_unordered(job, items)

    monkeypatch.setattr(aospec.replay.executors, "local_executor", lambda n, retries=1: Recording(retries))
    assert _sweep(tmp_path, "--policies", "serial,aospec", "--jobs", "1") == 0
    (job,) = jobs
    assert all(isinstance(r, TraceRef) for r in job.eval_traces)
    assert [r.id for r in job.eval_traces] == [t.id for t in bundled]
    assert [len(r) for r in job.eval_traces] == [len(t) for t in bundled]
    assert [r.load() for r in job.eval_traces] == list(bundled)
    seen: set[type] = set()

    class Types(pickle.Pickler):
        def reducer_override(self, obj):
            seen.add(type(obj))
            return NotImplemented

    buf = io.BytesIO()
    Types(buf).dump(job.eval_traces)
    assert Step not in seen and Trace not in seen
    assert len(buf.getvalue()) < 400 * len(bundled)
    job._folds.clear()
    buf = io.BytesIO()
    Types(buf).dump(job)
    assert Step not in seen and Trace not in seen
