"""``aospec run`` end to end: serve-trace on loopback as the model, real overlay sandboxes,
the recording read back by ``aospec traces stats`` and replayed by ``aospec replay``; usage
errors (exit 2), run failures (exit 1, one line) and Ctrl-C (exit 130, recording kept)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aospec.live.chat import ChatFormat
from aospec.replay import bundled_traces_path, read_jsonl
from aospec.runtime._fs import mounts_under
from aospec.runtime.host import host_support

from aospec.cli import main
from aospec.readsets import WriteSet
from aospec.types import Step, Trace

ROOT = Path(__file__).resolve().parents[2]

TASK = "Write /work/count.sh that prints the numbers 1 to 3, run it, save the output and submit."
REPLIES = [
    "THOUGHT: First, what is on this machine?\n\n```bash\nls /\n```",
    "THOUGHT: Create the work directory and the script.\n\n```bash\nmkdir -p /work && printf 'for i in 1 2 3; do echo $i; done\\n' > /work/count.sh\n```",
    "THOUGHT: Check what I wrote.\n\n```bash\ncat /work/count.sh\n```",
    "THOUGHT: Run it, keep the output.\n\n```bash\nsh /work/count.sh > /work/out.txt && cat /work/out.txt\n```",
    "THOUGHT: Done.\n\n```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```",
]


def demo_trace() -> Trace:
    fmt = ChatFormat()
    steps = tuple(Step(action=fmt.parse(r), observation="", output_tokens=len(r) // 4, reply=r) for r in REPLIES)
    return Trace("count-demo", "count", "mini-swe-agent", "demo-model", "tests/live", steps, instruction=TASK)


@pytest.fixture
def overlay_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    support, _ = host_support()
    if support.problems():
        pytest.skip(f"overlay backend cannot run here: {'; '.join(support.problems())}")
    state = tmp_path_factory.mktemp("run-state")
    mp = pytest.MonkeyPatch()
    mp.setenv("AOSPEC_STATE_ROOT", str(state))
    yield state
    mp.undo()
    assert not mounts_under(str(state)), "mounts leaked"


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["run", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.root
def test_run_speculative_and_serial_commit_the_same_and_the_recording_replays(
    overlay_state, serve_traces, capsys, tmp_path
) -> None:
    server = serve_traces([demo_trace()], tpot_ms=1.0)
    serial_rec, spec_rec = tmp_path / "serial.jsonl", tmp_path / "spec.jsonl"
    code, out, err = _run(
        capsys, TASK, "--model", server.base_url, "--no-speculate", "--record", str(serial_rec), "--format", "json"
    )
    assert code == 0, err
    serial = json.loads(out)
    assert serial["exit_reason"] == "submitted" and serial["steps"] == len(REPLIES)
    assert serial["forks_launched"] == serial["drafts_started"] == 0
    code, out, err = _run(
        capsys,
        TASK,
        "--model",
        server.base_url,
        "--speculate",
        "--train-traces",
        str(serial_rec),
        "--record",
        str(spec_rec),
        "--format",
        "json",
        "--check-determinism",
        "--progress",
    )
    assert code == 0, err
    spec = json.loads(out)
    assert spec["final_version"] == serial["final_version"] and spec["steps"] == serial["steps"]
    assert "warning" not in err  # serve-trace is deterministic
    assert err.count("step ") >= len(REPLIES)  # one progress line per step (stderr is no terminal)

    (a,) = read_jsonl(serial_rec)
    (b,) = read_jsonl(spec_rec)
    assert [(s.action, s.observation) for s in a.steps] == [(s.action, s.observation) for s in b.steps]
    assert "1\n2\n3\n" in b.steps[3].observation
    for t in (a, b):
        assert all(s.version_before and s.version_after for s in t.steps)
        assert all(x.version_after == y.version_before for x, y in zip(t.steps, t.steps[1:], strict=False))
        assert t.steps[-1].version_after == spec["final_version"]
        assert [s.state_changed for s in t.steps] == [False, True, False, True, False]
        assert [s.reply for s in t.steps] == REPLIES
        assert t.meta["exit_reason"] == "submitted"
    assert [(s.version_before, s.version_after) for s in a.steps] == [(s.version_before, s.version_after) for s in b.steps]

    assert main(["traces", "stats", str(spec_rec), "--format", "json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["steps"] == len(REPLIES) and stats["effects_recorded"] == len(REPLIES)

    code = main(
        ["replay", str(spec_rec), "--tpot-ms", "10", "--train", str(bundled_traces_path()), "--jobs", "1",
         "--no-progress", "--policies", "serial,aospec", "--format", "json"]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "state model: recorded" in err

    code, out, err = _run(capsys, TASK, "--model", server.base_url, "--step-limit", "2")
    assert code == 0, err
    assert "step_limit" in out and "final version" in out and "forks reused" in out


class _Alternating:
    """An endpoint that is not deterministic: successive requests are answered from two
    traces whose replies differ (serve-trace's X-Trace-Id header, set here)."""

    def __init__(self, inner: object, ids: tuple[str, str]) -> None:
        self.inner, self.ids, self.n = inner, ids, 0

    async def __call__(self, scope: dict, receive: object, send: object) -> None:
        if scope["type"] == "http" and scope["path"].endswith("/chat/completions"):
            trace_id = self.ids[self.n % 2]
            self.n += 1
            scope = dict(scope, headers=[*scope["headers"], (b"x-trace-id", trace_id.encode())])
        await self.inner(scope, receive, send)  # type: ignore[operator]


@pytest.mark.root
def test_check_determinism_warns_when_two_identical_requests_differ(overlay_state, serve_app, capsys) -> None:
    from aospec.live.serve_trace import serve_trace_app

    a = demo_trace()
    b = Trace("count-demo-2", "count", "mini-swe-agent", "m", "tests/live", (
        Step(action=a.steps[0].action, observation="", output_tokens=5, reply="THOUGHT: look.\n\n```bash\nls /\n```"),
    ), instruction=TASK)
    server = serve_app(_Alternating(serve_trace_app([a, b], 0.0), (a.id, b.id)))
    code, out, err = _run(capsys, TASK, "--model", server.base_url, "--check-determinism", "--step-limit", "1",
                          "--no-speculate", "--format", "json")
    assert code == 0, err
    assert "warning" in err and "not deterministic" in err
    assert json.loads(out)["steps"] == 1


def test_usage_errors_are_one_line_and_exit_2(serve_traces, capsys, tmp_path) -> None:
    url = "http://127.0.0.1:9/v1"
    for argv, needle in [
        ((TASK, "--model", url, "--step-limit", "-1"), "--step-limit"),
        ((TASK, "--model", str(tmp_path / "nope")), "neither an http(s) URL"),
        ((TASK, "--model", url, "--system-template", str(tmp_path / "missing.txt")), "--system-template"),
        ((TASK, "--model", url, "--api-key-env", "AOSPEC_TEST_UNSET_KEY"), "AOSPEC_TEST_UNSET_KEY"),
        ((TASK, "--model", url, "--train-traces", str(tmp_path / "none")), "none"),
        ((" ", "--model", url), "task is empty"),
    ]:
        code, _out, err = _run(capsys, *argv)
        assert code == 2, (argv, err)
        assert needle in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1, err
    (tmp_path / "instance.txt").write_text("no placeholder here")
    code, _, err = _run(capsys, TASK, "--model", url, "--instance-template", str(tmp_path / "instance.txt"))
    assert code == 2 and "{task}" in err


@pytest.mark.root
def test_an_unreachable_endpoint_fails_the_run_with_one_line(overlay_state, capsys, tmp_path) -> None:
    rec = tmp_path / "r.jsonl"
    code, _out, err = _run(capsys, TASK, "--model", "http://127.0.0.1:9/v1", "--retries", "0", "--record", str(rec))
    assert code == 1
    assert err.startswith("aospec: error: ") and "127.0.0.1:9" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    (t,) = read_jsonl(rec)
    assert t.steps == () and t.meta["exit_reason"] == "error"


@pytest.mark.root
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_ctrl_c_ends_cleanly_with_every_committed_step_recorded(overlay_state, serve_traces, tmp_path, sig) -> None:
    """SIGTERM and SIGHUP end a run exactly as Ctrl-C does (issue 20 #10: they killed it,
    leaving its mounts and an unfinished recording)."""
    # Slow replies (about 1 s each), so the run is mid-step when it is interrupted.
    server = serve_traces([demo_trace()], tpot_ms=60.0)
    rec = tmp_path / "r.jsonl"
    env = dict(os.environ, AOSPEC_STATE_ROOT=str(overlay_state))
    proc = subprocess.Popen(
        [sys.executable, "-m", "aospec", "run", TASK, "--model", server.base_url, "--record", str(rec)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120  # a hang guard, not a timing assertion
        while time.monotonic() < deadline and proc.poll() is None:
            if rec.exists() and len(read_jsonl(rec)[0].steps) >= 2:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(sig)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    (t,) = read_jsonl(rec)
    assert 2 <= len(t.steps) < len(REPLIES)
    assert t.meta["exit_reason"] == "interrupted"
    assert [s.reply for s in t.steps] == REPLIES[: len(t.steps)]
    assert not mounts_under(str(overlay_state))


def test_speculation_budget_and_calibration_usage_errors_are_one_line_and_exit_2(capsys, tmp_path) -> None:
    url = "http://127.0.0.1:9/v1"
    not_a_model = tmp_path / "notes.json"
    not_a_model.write_text('{"mine": true}')
    for argv, needle in [
        ((TASK, "--model", url, "--speculation-budget", "lots"), "CORES must be a number"),
        ((TASK, "--model", url, "--speculation-budget", "-1"), "CORES must be >= 0"),
        ((TASK, "--model", url, "--speculation-budget", "1,4 parsecs"), "MEMORY must be bytes"),
        ((TASK, "--model", url, "--no-speculate", "--speculation-budget", "1"), "needs speculation"),
        ((TASK, "--model", url, "--calibration", str(tmp_path)), "is a directory"),
        ((TASK, "--model", url, "--calibration", str(not_a_model)), "not an aospec admission model"),
    ]:
        code, _out, err = _run(capsys, *argv)
        assert code == 2, (argv, err)
        assert needle in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1, err
    assert not_a_model.read_text() == '{"mine": true}'  # never rewritten


def test_a_default_budget_that_is_no_budget_names_its_variable(capsys, monkeypatch) -> None:
    monkeypatch.setenv("AOSPEC_SPECULATION_BUDGET", "lots")
    code, _out, err = _run(capsys, TASK, "--model", "http://127.0.0.1:9/v1")
    assert code == 2 and "AOSPEC_SPECULATION_BUDGET 'lots': CORES must be a number" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.root
def test_run_reports_the_controller_and_keeps_its_calibration(overlay_state, serve_traces, capsys, tmp_path) -> None:
    server = serve_traces([demo_trace()], tpot_ms=1.0)
    serial_rec, spec_rec, model = tmp_path / "serial.jsonl", tmp_path / "spec.jsonl", tmp_path / "calibration.json"
    code, out, err = _run(capsys, TASK, "--model", server.base_url, "--no-speculate", "--record", str(serial_rec))
    assert code == 0, err
    args = (TASK, "--model", server.base_url, "--train-traces", str(serial_rec), "--calibration", str(model))
    code, out, err = _run(capsys, *args, "--speculation-budget", "1", "--record", str(spec_rec), "--format", "json")
    assert code == 0, err
    spec = json.loads(out)
    assert spec["exit_reason"] == "submitted"
    a = spec["admission"]
    assert set(a["refused"]) == {"price", "guard", "budget", "memory"}
    assert a["launched"] >= spec["forks_launched"]
    assert spec["wasted_cpu_s"] >= 0 and "efficiency" in spec and "forks_paused" in spec
    # the kernel held the budget for the run (one cgroup for the host's guesses), and the
    # run removed the budget it set
    from aospec.runtime import speculation_budget

    assert "Traceback" not in err and speculation_budget() is None
    # fitted on the training traces, then saved with what the run learned; the next run loads it
    from aospec.admission import AdmissionModel

    assert len(AdmissionModel.load(model).hits) > 0
    (b,) = read_jsonl(spec_rec)
    assert b.meta["result"]["admission"] == a and b.meta["speculation_budget"] == "1"
    code, out, err = _run(capsys, *args)
    assert code == 0, err
    assert "guesses launched / refused" in out and "wasted CPU" in out
@pytest.mark.root
def test_a_recording_with_read_sets_replays_under_the_readsets_state_model(
    overlay_state, serve_traces, capsys, tmp_path
) -> None:
    from aospec.runtime.readsets import tracer_support

    if not tracer_support().ok:
        pytest.skip(f"read sets are {tracer_support().detail}")
    server = serve_traces([demo_trace()], tpot_ms=1.0)
    rec = tmp_path / "rec.jsonl"
    code, _out, err = _run(capsys, TASK, "--model", server.base_url, "--record", str(rec), "--record-read-sets",
                          "--format", "json")  # fmt: skip
    assert code == 0, err
    assert "read-set validation" not in err  # on here: no note
    (t,) = read_jsonl(rec)
    assert all("read_set" in s.extra and "write_set" in s.extra for s in t.steps)
    assert "work/count.sh" in t.steps[1].extra["write_set"]["changed"]
    assert "work/count.sh" in t.steps[2].extra["read_set"]["nodes"]  # cat opened it
    assert not WriteSet.from_json(t.steps[0].extra["write_set"])  # ls / wrote nothing
    code = main(["replay", str(rec), "--tpot-ms", "10", "--state-model", "readsets", "--jobs", "1", "--no-progress",
                 "--policies", "serial,ceiling:depth=3", "--format", "json"])  # fmt: skip
    _out, err = capsys.readouterr()
    assert code == 0, err
    assert "state model: readsets" in err


def test_read_sets_off_is_one_line(serve_traces, capsys, tmp_path, monkeypatch) -> None:
    from aospec.runtime import readsets

    monkeypatch.setenv("AOSPEC_READ_SETS", "off")
    monkeypatch.setattr(readsets, "_support", None)  # probe again, with the variable
    url = "http://127.0.0.1:9/v1"
    for argv, needle in [
        ((TASK, "--model", url, "--record-read-sets"), "--record-read-sets needs --record FILE"),
        ((TASK, "--model", url, "--record", str(tmp_path / "r.jsonl"), "--record-read-sets"),
         "--record-read-sets: read sets are off: AOSPEC_READ_SETS=off"),
    ]:  # fmt: skip
        code, _out, err = _run(capsys, *argv)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    monkeypatch.setattr(readsets, "_support", None)
