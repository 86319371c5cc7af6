"""The paper's drafter figures in sweeps: observation exact hits by call length, action
accuracy by width and distance, time hidden per trial; memoised drafters; the
``drafters calibration`` verb."""

from __future__ import annotations

import json

import anyio
import pytest
from aospec.replay.accuracy import CALL_BUCKETS, DISTANCES, WIDTHS, action_accuracy, observation_accuracy
from aospec.replay.metrics import summarize
from aospec.replay.policies import DrafterSet, MemoizedObservationDrafter, parse_policies, parse_policy
from aospec.replay.report import drafter_sections, markdown_summary, read_results, write_report
from aospec.replay.sweep import run_sweep

from aospec.cli import main as cli_main
from aospec.protocols import ObservationDraft
from aospec.types import Action, History, Step, Trace

EMPTY = "<returncode>0</returncode>\n<output>\n</output>"


def _trace(task: str) -> Trace:
    pairs = [
        ("cat <<'EOF' > a.py\nprint(1)\nEOF", EMPTY, 0.05),
        ("python a.py", "<returncode>0</returncode>\n<output>\n1\n</output>", 12.0),
        ("cat a.py", "<returncode>0</returncode>\n<output>\nprint(1)\n</output>", 0.02),
        ("python a.py", "<returncode>0</returncode>\n<output>\n1\n</output>", 70.0),
    ]
    steps = tuple(Step(Action.bash(c), o, output_tokens=40, tool_duration_s=t) for c, o, t in pairs)
    return Trace(task, task, "mini-swe-agent", "m", "s", steps)


def test_counts_follow_the_policys_drafters_on_the_recorded_history() -> None:
    trace, train = _trace("eval"), [_trace("t1"), _trace("t2")]
    drafters = DrafterSet(train)
    calls, hits = observation_accuracy(trace, parse_policy("aospec"), drafters)
    assert len(calls) == len(CALL_BUCKETS) + 1 and calls == (2, 0, 1, 1)
    assert hits[0] == 2  # the heredoc's silence and the cat of what it wrote
    assert hits[3] == 1  # the re-run with nothing written since
    steps, by_width, targets, by_distance = action_accuracy(trace, parse_policy("aospec"), drafters)
    assert steps == 4 and len(by_width) == len(WIDTHS) and len(by_distance) == len(DISTANCES)
    assert list(by_width) == sorted(by_width)  # wider is never worse
    assert by_width[-1] >= 1  # `python a.py` right after writing a.py
    assert targets[0] == 4 and targets[1] == 3
    assert observation_accuracy(trace, parse_policy("serial"), drafters) == ((0, 0, 0, 0), (0, 0, 0, 0))
    assert action_accuracy(trace, parse_policy("ceiling"), drafters) == (0, (), (), ())


def test_sweep_results_and_summaries_carry_the_counts_and_the_report_shows_them(tmp_path) -> None:
    traces = [_trace("a"), _trace("b"), _trace("c")]
    policies = parse_policies("serial,aospec,aospec:rank=likelihood")
    results = run_sweep(traces, policies, tpots_ms=[20.0, 1.0], jobs=1)
    aospec_rows = [r for r in results if r.policy == "aospec"]
    assert all(sum(r.obs_calls_by_length) == 4 and r.action_steps == 4 for r in aospec_rows)
    assert len({(r.obs_exact_by_length, r.action_hits_by_width) for r in aospec_rows if r.trace_id == "a"}) == 1
    write_report(tmp_path, results, summarize(results), {})
    again = list(read_results(tmp_path / "results.jsonl"))
    assert again == results  # tuples survive the JSON round trip
    summaries = summarize(results)
    s = next(x for x in summaries if x.policy == "aospec" and x.tpot_ms == 20.0)
    assert len(s.obs_exact_by_length) == 4 and len(s.action_accuracy_by_width) == len(WIDTHS)
    assert s.hidden_s_per_trace == pytest.approx((s.hidden_tool_s + s.hidden_decode_s) / 3)
    serial = next(x for x in summaries if x.policy == "serial")
    assert serial.obs_exact_by_length == () and serial.action_accuracy_by_width == ()
    titles = [t for t, *_ in drafter_sections(summaries)]
    assert titles[0] == "Time hidden per trial (s)" and any("call length" in t for t in titles)
    md = markdown_summary(summaries, {})
    assert "## Action accuracy by width" in md and "| aospec:rank=likelihood |" in md
    record = json.loads((tmp_path / "summary.jsonl").read_text().splitlines()[0])
    assert "action_accuracy_by_distance" in record
    assert (tmp_path / "drafter_accuracy.png").read_bytes()[:4] == b"\x89PNG"


def test_a_memoised_drafter_drafts_each_history_once() -> None:
    class Counting:
        calls = 0

        async def draft(self, history, action, n):
            Counting.calls += 1
            return [ObservationDraft("x", 0.5)]

    memo = MemoizedObservationDrafter(Counting())
    h = History("t").extend(Action.bash("ls"), "a")
    same = History("t").extend(Action.bash("ls"), "a")  # equal, not identical
    for history in (h, same, h):
        assert anyio.run(memo.draft, history, Action.bash("pwd"), 5) == (ObservationDraft("x", 0.5),)
    assert Counting.calls == 1
    anyio.run(memo.draft, h, Action.bash("id"), 5)
    assert Counting.calls == 2


def test_the_calibration_verb_writes_a_calibration_table_and_plot(tmp_path, capsys) -> None:
    out = tmp_path / "cal"
    status = cli_main(
        ["drafters", "calibration", "--bundled", "--drafters", "patterns,moves", "--folds", "2", "--out", str(out),
         "--format", "json"]
    )
    assert status == 0
    summary = json.loads(capsys.readouterr().out)
    assert set(summary["outcomes"]) == {"patterns", "moves"} and summary["folds"] == 2
    assert {b["kind"] for b in summary["buckets"]} == {"raw", "calibrated"}
    from aospec.drafters.calibration import Calibration

    cal = Calibration.load(out)
    assert set(cal.drafters) <= {"patterns", "moves"} and cal.drafters
    assert (out / "calibration.png").read_bytes()[:4] == b"\x89PNG"
    assert cli_main(["drafters", "calibration", "--bundled", "--drafters", "psychic", "--out", str(out)]) == 2
