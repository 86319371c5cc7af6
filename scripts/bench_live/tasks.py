"""The live benchmark's tasks and their scripted agent trajectories.

Each task is a project directory under ``projects/`` (copied into the sandbox at
``/work/<project>``) plus one or more trajectories: what a mini-swe-agent-style bash agent
replies, step by step (a THOUGHT and one ```bash block), exploring, running, editing,
re-running and submitting. The commands run for real in the sandbox; the observations
come from the sandbox, never from here.

``MEASURED`` are the benchmark's tasks; ``TRAINING`` are different projects with the same
kind of work, used only to fit the drafters, so nothing is tuned on the measured tasks.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

PROJECTS = Path(__file__).resolve().parent / "projects"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


@dataclass(frozen=True)
class Trajectory:
    """One scripted run of a task: ``steps`` are (thought, command) pairs."""

    task: str
    variant: str
    project: str
    instruction: str
    steps: tuple[tuple[str, str], ...]
    prepare: Callable[[Path], None] | None = field(default=None, compare=False)

    @property
    def id(self) -> str:
        return f"{self.task}.{self.variant}"

    def replies(self) -> list[str]:
        return [f"THOUGHT: {thought}\n\n```bash\n{command}\n```" for thought, command in self.steps]

    def output_tokens(self) -> list[int]:
        """Tokens of each reply (the usual estimate: ceil(characters / 4))."""
        return [math.ceil(len(r) / 4) for r in self.replies()]


def build_wheelhouse(project: Path) -> None:
    """``pip wheel`` every package under ``packages/`` into ``wheelhouse/`` (local, no
    network: setuptools from the running interpreter, no build isolation)."""
    out = project / "wheelhouse"
    out.mkdir(exist_ok=True)
    pkgs = sorted(str(p) for p in (project / "packages").iterdir() if (p / "pyproject.toml").exists())
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
    subprocess.run(
        [*pip, "-w", str(out), *pkgs],
        check=True,
        capture_output=True,
        env={"PATH": "/usr/bin:/bin", "SOURCE_DATE_EPOCH": "1700000000", "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    for p in (project / "packages").rglob("*"):  # setuptools leaves build/ and *.egg-info in the sources
        if p.is_dir() and (p.name == "build" or p.name.endswith(".egg-info")):
            subprocess.run(["rm", "-rf", str(p)], check=True)


def _t(task, variant, project, instruction, steps, prepare=None) -> Trajectory:
    return Trajectory(task, variant, project, instruction, tuple(steps), prepare)


W = "/work"

MEASURED: list[Trajectory] = [
    _t(
        "inventory-discount",
        "a",
        "inventory",
        "The inventory package's tests fail: an order of exactly 100 units gets no bulk discount. Fix it.",
        [
            ("Let me look at the project layout first.", f"cd {W}/inventory && ls -la"),
            ("Let me read the README to understand the pricing rules.", f"cd {W}/inventory && cat README.md"),
            ("Let me run the test suite to see what fails.", f"cd {W}/inventory && ./run_tests.sh"),
            (
                "The bulk threshold test fails. Let me find where the discount is computed.",
                f"cd {W}/inventory && grep -rn 'BULK\\|discount' inventory/",
            ),
            ("Let me read the pricing module.", f"cd {W}/inventory && cat inventory/pricing.py"),
            (
                "The comparison `quantity > BULK` excludes exactly 100 units; the README says at least 100. "
                "I'll make it inclusive.",
                f"cd {W}/inventory && sed -i 's/if quantity > BULK:/if quantity >= BULK:/' inventory/pricing.py",
            ),
            ("Let me check the edit.", f"cd {W}/inventory && grep -n 'BULK' inventory/pricing.py"),
            ("Now re-run the tests.", f"cd {W}/inventory && ./run_tests.sh"),
            (
                "All tests pass. Let me run the pricing tests verbosely once more to be sure.",
                f"cd {W}/inventory && ./run_tests.sh -v 2>&1 | grep -c ok",
            ),
            ("The fix is complete.", SUBMIT),
        ],
    ),
    _t(
        "wordfreq-case",
        "a",
        "wordfreq",
        "wordfreq should count words case-insensitively, but `make test` fails. Fix the C program.",
        [
            ("Let me see what is in the project.", f"cd {W}/wordfreq && ls -la && ls src"),
            ("Let me read the Makefile to see how it is built and tested.", f"cd {W}/wordfreq && cat Makefile"),
            ("Let me build it.", f"cd {W}/wordfreq && make 2>&1 | tail -20"),
            ("It builds. Now run the test.", f"cd {W}/wordfreq && make test 2>&1 | tail -20"),
            (
                "Upper- and lower-case words are counted apart. Let me find where words are read.",
                f"cd {W}/wordfreq && grep -n 'isalpha\\|tolower\\|buf\\[' src/*.c",
            ),
            ("Let me read the tokenizer.", f"cd {W}/wordfreq && cat src/tokenize.c"),
            (
                "Characters are stored as they are. I'll lower-case them as they are stored.",
                f"cd {W}/wordfreq && sed -i 's/buf\\[n++\\] = (char)c;/buf[n++] = (char)tolower(c);/' src/tokenize.c"
                " && grep -n tolower src/tokenize.c",
            ),
            ("Rebuild and run the test again.", f"cd {W}/wordfreq && make 2>&1 | tail -5 && make test 2>&1 | tail -5"),
            ("The test passes. Let me look at the output once.", f"cd {W}/wordfreq && cat top5.txt"),
            ("Done.", SUBMIT),
        ],
    ),
    _t(
        "shipping-install",
        "a",
        "shipping",
        "Produce quotes.txt with the quote of every parcel (python quote.py parcels.csv). "
        "There is no network; the packages it needs are in the wheelhouse.",
        [
            ("Let me look around.", f"cd {W}/shipping && ls -la && cat README.md"),
            ("Let me try running the script.", f"cd {W}/shipping && python3 quote.py parcels.csv 2>&1 | tail -5"),
            ("tariff is not installed. Let me see the wheelhouse.", f"cd {W}/shipping && ls wheelhouse"),
            ("I'll create a virtual environment.", f"cd {W}/shipping && python3 -m venv .venv && ls .venv/bin"),
            (
                "Install tariff (and its dependency units) from the local wheelhouse only.",
                f"cd {W}/shipping && .venv/bin/pip install --no-index --find-links wheelhouse tariff 2>&1 | tail -5",
            ),
            (
                "Let me check what got installed.",
                f"cd {W}/shipping && .venv/bin/pip list 2>/dev/null | grep -i 'tariff\\|units'",
            ),
            (
                "Now run the quotes with the venv's python.",
                f"cd {W}/shipping && .venv/bin/python quote.py parcels.csv > quotes.txt && tail -3 quotes.txt",
            ),
            ("Let me check the number of lines.", f"cd {W}/shipping && wc -l quotes.txt parcels.csv"),
            ("quotes.txt is written.", SUBMIT),
        ],
        build_wheelhouse,
    ),
    _t(
        "sales-report",
        "a",
        "sales",
        "Generate the sales data and write the per-region summary to report.txt.",
        [
            ("Let me see the project.", f"cd {W}/sales && ls -la && cat README.md"),
            ("Generate the data first.", f"cd {W}/sales && python3 gen_data.py && ls data && wc -c data/sales.csv"),
            ("Let me peek at the data.", f"cd {W}/sales && head -5 data/sales.csv && wc -l data/sales.csv"),
            ("Run the summary.", f"cd {W}/sales && python3 summarize.py data/sales.csv 2>&1 | tail -5"),
            (
                "unit_price is a decimal, parsed as int. Let me look at the parsing.",
                f"cd {W}/sales && grep -n 'int(row' summarize.py",
            ),
            (
                "I'll parse unit_price as a float.",
                f'cd {W}/sales && sed -i \'s/int(row\\["unit_price"\\])/float(row["unit_price"])/\' summarize.py'
                " && grep -n 'unit_price' summarize.py",
            ),
            (
                "Run it again and write the report.",
                f"cd {W}/sales && python3 summarize.py data/sales.csv > report.txt && cat report.txt",
            ),
            (
                "Let me double check the totals with awk.",
                f"cd {W}/sales && awk -F, 'NR>1 {{s += $4 * $5}} END {{printf \"%.2f\\n\", s}}' data/sales.csv",
            ),
            ("The report is written.", SUBMIT),
        ],
    ),
]

TRAINING: list[Trajectory] = [
    _t(
        "textkit-slug",
        "train",
        "textkit",
        "slugify should join words with single dashes; the tests fail. Fix it.",
        [
            ("Let me look at the project.", f"cd {W}/textkit && ls -la"),
            ("Read the README.", f"cd {W}/textkit && cat README.md"),
            ("Run the tests.", f"cd {W}/textkit && ./run_tests.sh"),
            ("Let me find slugify.", f"cd {W}/textkit && grep -rn 'def slugify' textkit/"),
            ("Read it.", f"cd {W}/textkit && cat textkit/slug.py"),
            (
                "Empty words come from repeated separators. Filter them out.",
                f'cd {W}/textkit && sed -i \'s/return "-".join(words)/return "-".join(w for w in words if w)/\' '
                "textkit/slug.py",
            ),
            ("Check the edit.", f"cd {W}/textkit && grep -n 'join' textkit/slug.py"),
            ("Re-run the tests.", f"cd {W}/textkit && ./run_tests.sh"),
            ("Tests pass.", SUBMIT),
        ],
    ),
    _t(
        "histo-mean",
        "train",
        "histo",
        "histo prints the wrong mean (make check fails). Fix it.",
        [
            ("Let me look at the project.", f"cd {W}/histo && ls -la && ls src"),
            ("Read the Makefile.", f"cd {W}/histo && cat Makefile"),
            ("Build it.", f"cd {W}/histo && make 2>&1 | tail -20"),
            ("Run the check.", f"cd {W}/histo && make check 2>&1 | tail -20"),
            ("The mean is off. Let me find it.", f"cd {W}/histo && grep -n 'mean' src/*.c"),
            ("Read stats.c.", f"cd {W}/histo && cat src/stats.c"),
            (
                "The loop starts at 1 and skips the first value.",
                f"cd {W}/histo && sed -i 's/for (long i = 1; i < n; i++) s += xs\\[i\\];/for (long i = 0; i < n; i++) "
                "s += xs[i];/' src/stats.c && grep -n 's += ' src/stats.c",
            ),
            ("Rebuild and check.", f"cd {W}/histo && make 2>&1 | tail -5 && make check 2>&1 | tail -5"),
            ("Fixed.", SUBMIT),
        ],
    ),
    _t(
        "logs-errors",
        "train",
        "logs",
        "errors.py should count status 500 and above as server errors. Generate the log and fix the script.",
        [
            ("Let me see the project.", f"cd {W}/logs && ls -la && cat README.md"),
            ("Generate the log.", f"cd {W}/logs && python3 gen_logs.py && ls"),
            ("Peek at the log.", f"cd {W}/logs && head -5 access.log && wc -l access.log"),
            ("Run the script.", f"cd {W}/logs && python3 errors.py access.log 2>&1 | tail -5"),
            ("No errors are counted. Let me look at the comparison.", f"cd {W}/logs && grep -n 'status' errors.py"),
            (
                "500 itself is excluded; make it inclusive.",
                f"cd {W}/logs && sed -i 's/if status > 500:/if status >= 500:/' errors.py && grep -n 'status >' errors.py",
            ),
            ("Run it again.", f"cd {W}/logs && python3 errors.py access.log > errors.txt && cat errors.txt"),
            ("Count the 5xx lines with awk to cross-check.", f"cd {W}/logs && awk '$9 >= 500' access.log | wc -l"),
            ("Done.", SUBMIT),
        ],
    ),
    _t(
        "histo-explore",
        "train2",
        "histo",
        "Report the histogram of 1..1000 in 4 bins.",
        [
            ("Let me look at the project.", f"cd {W}/histo && ls -la && cat README.md"),
            ("Build it.", f"cd {W}/histo && make 2>&1 | tail -20"),
            ("Run it.", f"cd {W}/histo && seq 1 1000 | ./histo 4"),
            ("Save the output.", f"cd {W}/histo && seq 1 1000 | ./histo 4 > hist.txt && cat hist.txt"),
            ("Done.", SUBMIT),
        ],
    ),
]

#: The ``--quick`` subset: one Python-test task and one build task.
QUICK = ("inventory-discount", "wordfreq-case")
