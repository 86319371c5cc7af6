"""One name per concept across the verbs, the old spellings kept (hidden, with a warning) for
one release; a mistyped option gets the verb's usage; an unwritable place is one line; the
sweep's table fits 100 columns; the saving plot's ticks are the TPOTs and no legend covers
a point (docs/cli.md)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
from aospec.replay import bundled_traces_path, load_traces
from aospec.replay.metrics import summarize
from aospec.replay.policies import parse_policies
from aospec.replay.report import saving_figure
from aospec.replay.sweep import run_sweep

from aospec.cli import add_alias, build_parser, main

AOSPEC = str(Path(sys.executable).parent / "aospec")

#: verb (and subcommand) -> (canonical option, its deprecated spellings)
RENAMES = {
    ("sweep",): {"--train-traces": ["--train"], "--tpot-ms": ["--tpots"]},
    ("replay",): {"--train-traces": ["--train"], "--tpot-ms": []},
    ("train",): {"--train-traces": ["--traces"]},
    ("routers", "eval"): {"--train-traces": ["--train"]},
    ("proxy",): {"--train-traces": ["--train"]},
    ("run",): {"--train-traces": [], "--backend": ["--sandbox"], "--command-timeout": []},
    ("mcp",): {"--train-traces": [], "--backend": [], "--command-timeout": ["--timeout"], "--state-dir": ["--state"]},
    ("sandbox", "exec"): {"--backend": [], "--command-timeout": ["--timeout"], "--state-dir": []},
    ("serve-trace",): {"--tpot-ms": []},
}


def _parser(path: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


@pytest.mark.parametrize("path", list(RENAMES), ids=" ".join)
def test_each_concept_has_one_name_and_the_old_ones_are_hidden(path: tuple[str, ...]) -> None:
    parser = _parser(path)
    help_text = parser.format_help()
    options = {s for a in parser._actions for s in a.option_strings}
    for canonical, old in RENAMES[path].items():
        assert canonical in options and canonical in help_text
        for spelling in old:
            assert spelling in options, f"{' '.join(path)}: {spelling} no longer accepted"
            assert f"{spelling} " not in help_text and f"{spelling}," not in help_text and f"{spelling}\n" not in help_text
    for concept_old in ("--train ", "--traces ", "--tpots ", "--sandbox ", "--state "):
        assert concept_old not in help_text


def test_an_old_spelling_means_the_new_one_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="aospec demo")
    parser.add_argument("--train-traces", dest="train", action="append", default=[])
    add_alias(parser, "--train", "--train-traces")
    args = parser.parse_args(["--train", "a", "--train-traces", "b"])
    assert args.train == ["a", "b"]
    assert capsys.readouterr().err == "aospec: warning: --train is deprecated, use --train-traces\n"
    assert parser.parse_args([]).train == []
    with pytest.raises(ValueError, match="no option --nope"):
        add_alias(parser, "--old", "--nope")


@pytest.mark.slow
def test_a_sweep_with_the_old_spellings_gives_the_same_results(tmp_path: Path) -> None:
    common = ["--bundled", "--policies", "serial,aospec", "--jobs", "1", "--no-progress", "--format", "jsonl"]
    new = subprocess.run([AOSPEC, "sweep", *common, "--tpot-ms", "10", "--out", str(tmp_path / "a")],
                         capture_output=True, text=True, timeout=600)
    old = subprocess.run([AOSPEC, "sweep", *common, "--tpots", "10", "--out", str(tmp_path / "b")],
                         capture_output=True, text=True, timeout=600)
    assert new.returncode == old.returncode == 0, old.stderr
    assert "--tpots is deprecated, use --tpot-ms" in old.stderr and "deprecated" not in new.stderr
    assert (tmp_path / "a" / "results.jsonl").read_bytes() == (tmp_path / "b" / "results.jsonl").read_bytes()


@pytest.mark.parametrize(
    ("argv", "usage", "bad"),
    [
        (["sweep", "--bundled", "--tpost", "10"], "usage: aospec sweep ", "--tpost"),
        (["sandbox", "exec", "--bogus", "--", "true"], "usage: aospec sandbox exec ", "--bogus"),
        (["traces", "stats", "--bundled", "--nope"], "usage: aospec traces stats ", "--nope"),
    ],
)
def test_a_mistyped_option_prints_the_verbs_usage(
    argv: list[str], usage: str, bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and f"unrecognized arguments: {bad}" in err
    assert "COMMAND" not in err.splitlines()[0]


def test_the_sweep_hint_for_a_mini_swe_agent_file_names_an_option_sweep_takes(tmp_path: Path) -> None:
    # a bare mini-swe-agent message list is read as tau-bench by its extension: the error
    # says to read it with --input-format mini-swe-agent, which sweep now accepts
    bad = tmp_path / "messages.json"
    bad.write_text('[{"role": "system", "content": "x"}]')
    proc = subprocess.run([AOSPEC, "sweep", str(bad), "--policies", "serial", "--no-progress", "--out",
                           str(tmp_path / "o")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--input-format mini-swe-agent" in proc.stderr
    assert "--input-format" in _parser(("sweep",)).format_help()
    again = subprocess.run([AOSPEC, "sweep", str(bad), "--input-format", "mini-swe-agent", "--policies", "serial",
                            "--no-progress", "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=300)
    assert "unrecognized arguments" not in again.stderr and "--input-format mini-swe-agent)" not in again.stderr


def _unwritable(tmp_path: Path) -> Path:
    """A working directory where nothing can be created: /sys for root (EPERM), else a
    directory without write permission."""
    if os.geteuid() == 0:
        return Path("/sys")
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    return d


def test_an_unwritable_working_directory_is_one_line_naming_the_path(tmp_path: Path) -> None:
    cwd = _unwritable(tmp_path)
    proc = subprocess.run([AOSPEC, "sweep", "--bundled", "--policies", "serial", "--tpot-ms", "10", "--no-progress"],
                          cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert errors == [errors[0]] and f"cannot access {cwd / 'results'}" in errors[0] and "--out" in errors[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_the_sweep_table_fits_100_columns(tmp_path: Path) -> None:
    proc = subprocess.run([AOSPEC, "sweep", "--bundled", "--jobs", "2", "--no-progress", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "aospec:rank=likelihood" in proc.stdout  # the default policies, the longest name among them
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)


def test_the_saving_plot_ticks_the_measured_tpots_and_its_legend_covers_no_point() -> None:
    traces = load_traces([bundled_traces_path()])[:3]
    tpots = [20.0, 7.0, 1.0]
    summaries = summarize(run_sweep(traces, parse_policies("serial,aospec,ceiling"), tpots_ms=tpots, jobs=1))
    fig = saving_figure(summaries)
    try:
        fig.canvas.draw()
        (ax,) = fig.axes
        assert sorted(ax.get_xticks()) == sorted(tpots)
        assert [t.get_text() for t in ax.get_xticklabels()] == ["20", "7", "1"]
        legend = ax.get_legend().get_window_extent()
        for line in ax.get_lines():
            for x, y in ax.transData.transform(line.get_xydata()):
                assert not legend.contains(x, y), f"the legend covers a point of {line.get_label()}"
        assert legend.x0 >= ax.get_window_extent().x1  # beside the plotting area, not on it
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
