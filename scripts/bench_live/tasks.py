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
            (
                "I need to fix a failing test about the bulk discount in the inventory package. Before changing anything I want to understand how the project is organised: where the package code lives, where the tests are and how they are run. Let me list the project directory first.",
                f"cd {W}/inventory && ls -la",
            ),
            (
                "There is a README, a run_tests.sh script, the inventory package and a tests directory. The README should state the intended pricing rules, which I need in order to know what the correct behaviour at exactly 100 units is. Let me read it.",
                f"cd {W}/inventory && cat README.md",
            ),
            (
                "The README says orders of at least 100 units get 10% off and at least 1000 units get 15% off. So 100 units must be discounted. Let me run the test suite to see exactly which tests fail and with what message.",
                f"cd {W}/inventory && ./run_tests.sh",
            ),
            (
                "One test fails: test_bulk_threshold_is_inclusive, where discount_percent(100) returns 0 instead of 10. The other tests pass. Let me search the package for the bulk threshold and the discount logic to find the comparison.",
                f"cd {W}/inventory && grep -rn 'BULK\\|discount' inventory/",
            ),
            (
                "The discount logic is in inventory/pricing.py, which defines BULK = 100 and WHOLESALE = 1000 and the function discount_percent. Let me read the whole module to see the comparisons and how unit_price and order_total use them.",
                f"cd {W}/inventory && cat inventory/pricing.py",
            ),
            (
                "I found the bug: discount_percent checks `quantity >= WHOLESALE` for the wholesale tier but "
                "`quantity > BULK` for the bulk tier, so an order of exactly 100 units falls through and gets no "
                "discount. The README says at least 100 units, so the comparison must be inclusive. I'll change `>` "
                "to `>=` with sed.",
                f"cd {W}/inventory && sed -i 's/if quantity > BULK:/if quantity >= BULK:/' inventory/pricing.py",
            ),
            (
                "Let me verify that the sed substitution was applied and that the line now reads `if quantity >= BULK:`, without touching anything else in the file.",
                f"cd {W}/inventory && grep -n 'BULK' inventory/pricing.py",
            ),
            (
                "The comparison is now inclusive. Let me run the full test suite again to confirm that the threshold test passes and that nothing else broke, including the slower randomised test.",
                f"cd {W}/inventory && ./run_tests.sh",
            ),
            (
                "All 7 tests pass now. To be thorough, let me run the suite once more in verbose mode and count the passing tests, so I can be sure every test ran and reported ok.",
                f"cd {W}/inventory && ./run_tests.sh -v 2>&1 | grep -c ok",
            ),
            (
                "The bulk discount now applies from exactly 100 units, as the README specifies, and the whole test suite passes. The change is a one-character fix in inventory/pricing.py. I'm done, so I'll submit.",
                SUBMIT,
            ),
        ],
    ),
    _t(
        "wordfreq-case",
        "a",
        "wordfreq",
        "wordfreq should count words case-insensitively, but `make test` fails. Fix the C program.",
        [
            (
                "The task is to make wordfreq count words case-insensitively so that `make test` passes. Let me first see how the project is laid out: the Makefile, the sources in src/ and the expected output file.",
                f"cd {W}/wordfreq && ls -la && ls src",
            ),
            (
                "There is a Makefile, a corpus generator script, an expected_top5.txt file and four C files plus a header in src/. Let me read the Makefile to understand the build and what exactly `make test` compares.",
                f"cd {W}/wordfreq && cat Makefile",
            ),
            (
                "The Makefile compiles the four objects with -O2 and links wordfreq; `make test` generates corpus.txt, runs the top-5 query on it and diffs the result against expected_top5.txt. Let me build it first to check it compiles cleanly.",
                f"cd {W}/wordfreq && make 2>&1 | tail -20",
            ),
            (
                "The build succeeds without warnings. Now let me run the test to see how the actual top-5 output differs from the expected one.",
                f"cd {W}/wordfreq && make test 2>&1 | tail -20",
            ),
            (
                "The diff shows `The` and `the` counted separately, and `Dog` as its own word, while the expected output has a single lower-case `the` with the combined count. So words are not normalised to lower case. Let me find where the tokenizer stores characters.",
                f"cd {W}/wordfreq && grep -n 'isalpha\\|tolower\\|buf\\[' src/*.c",
            ),
            (
                "The tokenizer in src/tokenize.c uses isalpha and copies characters into buf, and there is no call to tolower anywhere. Let me read the whole file to see the loop that stores each character.",
                f"cd {W}/wordfreq && cat src/tokenize.c",
            ),
            (
                "next_word stores each alphabetic character unchanged with `buf[n++] = (char)c;`. The README says counting is case-insensitive, so the simplest correct fix is to lower-case each character as it is stored. ctype.h is already included. I'll apply the change with sed and show the line.",
                f"cd {W}/wordfreq && sed -i 's/buf\\[n++\\] = (char)c;/buf[n++] = (char)tolower(c);/' src/tokenize.c"
                " && grep -n tolower src/tokenize.c",
            ),
            (
                "The tokenizer now lower-cases characters. Let me rebuild (only tokenize.o should be recompiled and the binary relinked) and run the test again.",
                f"cd {W}/wordfreq && make 2>&1 | tail -5 && make test 2>&1 | tail -5",
            ),
            (
                "`make test` now reports that the test passed. Let me look at the produced top5.txt once to make sure the counts look sensible.",
                f"cd {W}/wordfreq && cat top5.txt",
            ),
            (
                "The output matches the expected top 5 exactly: the, dog, fox, lazy and while with combined counts. The fix is a single line in src/tokenize.c. I'll submit.",
                SUBMIT,
            ),
        ],
    ),
    _t(
        "shipping-install",
        "a",
        "shipping",
        "Produce quotes.txt with the quote of every parcel (python quote.py parcels.csv). "
        "There is no network; the packages it needs are in the wheelhouse.",
        [
            (
                "I need to produce quotes.txt by running quote.py on parcels.csv. The README may explain the dependencies. Let me list the project and read the README.",
                f"cd {W}/shipping && ls -la && cat README.md",
            ),
            (
                "quote.py needs the tariff package, which depends on units; both are in packages/ and built wheels should be in wheelhouse/. There is no network. Let me first try running the script with the system python to see what is missing.",
                f"cd {W}/shipping && python3 quote.py parcels.csv 2>&1 | tail -5",
            ),
            (
                "As expected, the import of tariff fails with ModuleNotFoundError. Let me look at the wheelhouse to see which wheels and versions are available locally.",
                f"cd {W}/shipping && ls wheelhouse",
            ),
            (
                "The wheelhouse has tariff-0.4.1 and units-1.2.0 wheels. The system python is externally managed, so I'll create a virtual environment in .venv and install into it rather than into the system.",
                f"cd {W}/shipping && python3 -m venv .venv && ls .venv/bin",
            ),
            (
                "The venv is created with pip available. Now I'll install tariff from the local wheelhouse only, with --no-index so pip never tries the network; pip should resolve units from the same directory.",
                f"cd {W}/shipping && .venv/bin/pip install --no-index --find-links wheelhouse tariff 2>&1 | tail -5",
            ),
            (
                "The install reports success. Let me check with pip list that both tariff and units are installed in the venv with the expected versions.",
                f"cd {W}/shipping && .venv/bin/pip list 2>/dev/null | grep -i 'tariff\\|units'",
            ),
            (
                "Both packages are installed. Now I'll run quote.py with the venv's python, write the output to quotes.txt and show the last lines, which include the total.",
                f"cd {W}/shipping && .venv/bin/python quote.py parcels.csv > quotes.txt && tail -3 quotes.txt",
            ),
            (
                "quotes.txt has the per-parcel quotes and a total. Let me compare its line count with parcels.csv: there should be one quote per parcel plus the total line, and the CSV has one header line.",
                f"cd {W}/shipping && wc -l quotes.txt parcels.csv",
            ),
            (
                "quotes.txt has one line per parcel plus the total, matching parcels.csv. The packages came from the local wheelhouse into a venv. I'll submit.",
                SUBMIT,
            ),
        ],
        build_wheelhouse,
    ),
    _t(
        "sales-report",
        "a",
        "sales",
        "Generate the sales data and write the per-region summary to report.txt.",
        [
            (
                "I need to generate the sales data and write a per-region summary to report.txt. Let me list the project and read the README to see how the scripts are meant to be used.",
                f"cd {W}/sales && ls -la && cat README.md",
            ),
            (
                "The README says gen_data.py writes data/sales.csv and summarize.py prints the revenue per region and the top products. Let me generate the data first and check the file was written.",
                f"cd {W}/sales && python3 gen_data.py && ls data && wc -c data/sales.csv",
            ),
            (
                "The data file is written. Before running the summary, let me look at the header and a few rows to understand the columns and their formats, and count the rows.",
                f"cd {W}/sales && head -5 data/sales.csv && wc -l data/sales.csv",
            ),
            (
                "The columns are date, region, product, quantity and unit_price, with unit prices as decimals. Let me run the summary script on the data and look at the end of its output.",
                f"cd {W}/sales && python3 summarize.py data/sales.csv 2>&1 | tail -5",
            ),
            (
                "The script crashes with `invalid literal for int() with base 10: '76.29'`: it parses unit_price with int(), but prices have cents. Let me find the parsing line.",
                f"cd {W}/sales && grep -n 'int(row' summarize.py",
            ),
            (
                "The amount is computed as int(quantity) * int(unit_price). The quantity is an integer, but the unit price must be parsed as a float. I'll change only the unit_price parsing with sed and show the lines that mention unit_price.",
                f'cd {W}/sales && sed -i \'s/int(row\\["unit_price"\\])/float(row["unit_price"])/\' summarize.py'
                " && grep -n 'unit_price' summarize.py",
            ),
            (
                "Now the price is parsed as a float. Let me run the summary again, write it to report.txt and print the report.",
                f"cd {W}/sales && python3 summarize.py data/sales.csv > report.txt && cat report.txt",
            ),
            (
                "The report lists the five regions with totals and best months, and the top products. Let me cross-check the grand total independently with awk, summing quantity times price over all rows; it should equal the sum of the region totals.",
                f"cd {W}/sales && awk -F, 'NR>1 {{s += $4 * $5}} END {{printf \"%.2f\\n\", s}}' data/sales.csv",
            ),
            (
                "The awk total matches the sum of the five region totals, so the report is consistent. report.txt is written. I'll submit.",
                SUBMIT,
            ),
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
