"""MovesActionDrafter: the harness's recurring moves (write -> run, edit -> re-run the
check, build -> run, list -> read) and routed completions from what the history names."""

from __future__ import annotations

import anyio
from aospec.drafters.moves import MovesActionDrafter

from aospec.streams import tool_label
from aospec.types import Action, History, Step, Trace

EMPTY = "<returncode>0</returncode>\n<output>\n</output>"
FAIL = "<returncode>1</returncode>\n<output>\nAssertionError\n</output>"
LISTING = (
    "<returncode>0</returncode>\n<output>\ntotal 12\n"
    "drwxr-xr-x 2 root root 4096 Mar 28 04:43 .\n"
    "drwxr-xr-x 1 root root 4096 Aug  8 08:11 ..\n"
    "-rw-r--r-- 1 root root  341 Aug  2 22:10 run.py\n"
    "drwxr-xr-x 2 root root 4096 Aug  2 22:10 data\n"
    "-rw-r--r-- 1 root root 9341 Aug  2 22:10 model.pth\n</output>"
)


def history(*turns: tuple[str, str], task: str = "task") -> History:
    h = History(task)
    for cmd, obs in turns:
        h = h.extend(Action.bash(cmd), obs)
    return h


def targets(d: MovesActionDrafter, h: History, depth: int = 1) -> list[str]:
    return [p.action.command or "" for p in anyio.run(d.propose, h, 32, depth) if p.offset == 0]


def routed(d: MovesActionDrafter, h: History, tool: str) -> list[str]:
    return [p.action.command or "" for p in anyio.run(d.propose_routed, h, tool, 8)]


def test_a_written_script_is_run_the_way_this_trajectory_runs_scripts() -> None:
    d = MovesActionDrafter()
    h = history(("cat <<'EOF' > train.py\nprint(1)\nEOF", EMPTY))
    assert targets(d, h)[0] == "python train.py"  # the default form
    h2 = history(
        ("cat <<'EOF' > a.py\nprint(1)\nEOF", EMPTY),
        ("timeout 60 python3 a.py", EMPTY),
        ("cat <<'EOF' > b.py\nprint(2)\nEOF", EMPTY),
    )
    assert targets(d, h2)[0] == "timeout 60 python3 b.py"


def test_after_an_edit_the_failing_check_is_run_again() -> None:
    d = MovesActionDrafter()
    h = history(
        ("cat <<'EOF' > lib.py\nx = 1\nEOF", EMPTY),
        ("python test_lib.py", FAIL),
        ("sed -i 's/x = 1/x = 2/' lib.py", EMPTY),
    )
    assert "python test_lib.py" in targets(d, h)


def test_a_successful_build_is_followed_by_running_what_it_built() -> None:
    d = MovesActionDrafter()
    h = history(("gcc -o app main.c -lm", EMPTY))
    assert "./app" in targets(d, h)
    failed = history(("gcc -o app main.c -lm", FAIL))
    assert "./app" not in targets(d, failed)


def test_a_listing_is_followed_by_reading_its_text_files_and_listing_its_directories() -> None:
    d = MovesActionDrafter()
    h = history(("ls -la /app", LISTING))
    got = targets(d, h)
    assert "cat /app/run.py" in got and "ls -la /app/data/" in got
    assert "cat /app/model.pth" not in got  # not a text file


def test_files_the_task_names_are_read() -> None:
    d = MovesActionDrafter()
    h = history(task='Make sure that your agent is a class called "Agent" in the "/app/agent.py" file.')
    assert targets(d, h) == ["cat /app/agent.py", "ls -la /app"]  # the file, then the directory it lives in
    seen = history(("ls -la /app", EMPTY), task=h.task)
    assert targets(d, seen) == ["cat /app/agent.py"]  # a directory already listed is not listed again


def test_a_directory_the_task_names_is_listed_or_created() -> None:
    d = MovesActionDrafter()
    h = history(task="1. Create a directory at `/app/ssl/` to store all files")
    assert {"ls -la /app/ssl", "mkdir -p /app/ssl"} <= set(targets(d, h))
    made = history(("mkdir -p /app/ssl", EMPTY), task=h.task)
    assert not {"ls -la /app/ssl", "mkdir -p /app/ssl"} & set(targets(d, made))


def test_a_written_script_is_also_offered_in_the_other_forms_scripts_run_in() -> None:
    d = MovesActionDrafter()
    h = history(
        ("cat <<'EOF' > a.py\nprint(1)\nEOF", EMPTY),
        ("timeout 60 python a.py", EMPTY),
        ("sed -i '1d' a.py", EMPTY),  # names the script but does not run it: not a form
        ("cat <<'EOF' > b.py\nprint(2)\nEOF", EMPTY),
    )
    got = targets(d, h)
    assert got[0] == "timeout 60 python b.py"  # the trajectory's last run of a script
    assert not any("sed" in c for c in got)
    fitted = MovesActionDrafter()
    fitted.fit(
        [
            _trace("t1", [("cat <<'EOF' > x.py\nprint(1)\nEOF", EMPTY), ("timeout 300 python x.py", EMPTY)]),
            _trace("t2", [("cat <<'EOF' > y.py\nprint(1)\nEOF", EMPTY), ("python3 y.py", EMPTY)]),
        ]
    )
    got = targets(fitted, history(("cat <<'EOF' > z.py\nprint(1)\nEOF", EMPTY)))
    assert {"python3 z.py", "timeout 300 python z.py"} <= set(got)  # the training traces' forms
    assert not any("sed" in c for c in got)
    assert targets(fitted, history(("cat <<'EOF' > notes.txt\nhi\nEOF", EMPTY))) == ["cat notes.txt"]  # not a script


def test_a_missing_module_is_installed_the_way_this_trajectory_runs_pip() -> None:
    d = MovesActionDrafter()
    missing = (
        "<returncode>1</returncode>\n<output>\nModuleNotFoundError: No module named 'sklearn.linear_model'\n</output>"
    )
    h = history(("pip3 install pandas", EMPTY), ("python3 train.py", missing))
    assert targets(d, h)[0] == "pip3 install scikit-learn"  # the distribution, not the module
    lib = "<returncode>1</returncode>\n<output>\nAlbertTokenizer requires the SentencePiece library but it was not found in your environment.\n</output>"
    assert "pip install sentencepiece" in targets(d, history(("python3 cache.py", lib)))
    says = "<returncode>0</returncode>\n<output>\nFastText not available, need to install\n</output>"
    probe = 'python3 -c "import fasttext; print(1)" 2>/dev/null || echo "FastText not available, need to install"'
    assert "pip install fasttext" in targets(d, history((probe, says)))
    # abstentions: nothing missing, a module only the standard library has, a step later
    fine = "<returncode>0</returncode>\n<output>\n1\n</output>"
    assert not any("install" in c for c in targets(d, history(('python3 -c "import fasttext; print(1)"', fine))))
    nope = "<returncode>1</returncode>\n<output>\njson not found\n</output>"
    assert not any("install" in c for c in targets(d, history(('python3 -c "import json"', nope))))
    later = history(("python3 train.py", missing), ("ls", EMPTY))
    assert not any("install" in c for c in targets(d, later))


def test_a_failed_install_of_several_packages_is_retried_one_by_one() -> None:
    d = MovesActionDrafter()
    timeout = "<returncode>-1</returncode>\n<output>\nDownloading flask\n</output>"
    h = history(("pip install flask solana requests", timeout))
    assert targets(d, h)[:3] == ["pip install flask", "pip install solana", "pip install requests"]
    h = h.extend(Action.bash("pip install flask"), EMPTY)
    assert targets(d, h)[:2] == ["pip install solana", "pip install requests"]
    moved_on = h.extend(Action.bash("python3 server.py"), EMPTY)
    assert not any("install" in c for c in targets(d, moved_on))
    assert targets(d, history(("pip install flask solana", EMPTY))) == []  # it worked: nothing to retry


def test_after_a_script_runs_the_code_it_tested_and_the_task_s_outputs_are_shown() -> None:
    d = MovesActionDrafter()
    task = "Generate a file called 'organization.json' from the CSV files (departments.csv)."
    h = history(
        ("cat departments.csv", "<returncode>0</returncode>\n<output>\nid\n</output>"),
        ("cat <<'EOF' > processor.py\nprint(1)\nEOF", EMPTY),
        ("cat <<'EOF' > test_processor.py\nprint(2)\nEOF", EMPTY),
        ("python3 test_processor.py", EMPTY),
        task=task,
    )
    got = targets(d, h)
    assert "cat processor.py" in got and "cat test_processor.py" not in got  # not the script that ran
    assert got.index("cat organization.json") < got.index("cat departments.csv")  # not shown yet first
    listed = history(*[(c, o) for c, o in [("cat <<'EOF' > p.py\nprint(1)\nEOF", EMPTY), ("ls", EMPTY)]], task=task)
    assert not any(c.startswith("cat") for c in targets(d, listed))  # no script ran: nothing to show


def test_install_moves_never_retry_an_option_value_or_a_standard_module() -> None:
    d = MovesActionDrafter()
    timeout = "<returncode>-1</returncode>\n<output>\nDownloading torch\n</output>"
    h = history(("pip install --extra-index-url https://x.org/cpu --timeout 60 torch torchvision", timeout))
    assert targets(d, h)[:2] == ["pip install torch", "pip install torchvision"]
    assert not any("https" in c or c.endswith(" 60") for c in targets(d, h))
    local = history(("pip install ./pkg requests", timeout))
    assert not any("install" in c for c in targets(d, local))  # a path: not retried one by one
    says = "<returncode>0</returncode>\n<output>\nPIL not installed\n</output>"
    probe = 'python3 -c "from PIL import Image; import sqlite3" || echo "PIL not installed"'
    got = [c for c in targets(d, history((probe, says))) if "install" in c]
    assert got == ["pip install pillow"]  # not "image", not the standard library's sqlite3


def test_a_versioned_compiler_builds_too() -> None:
    d = MovesActionDrafter()
    assert "./app" in targets(d, history(("gcc-12 -O2 -o app main.c", EMPTY)))
    assert "./app" in targets(d, history(("clang++-15 -o app main.cpp", EMPTY)))


def test_a_built_program_is_run_as_the_task_says() -> None:
    d = MovesActionDrafter()
    task = 'The tool should be programmed in C and called with "./cli_tool weights.json image.png".'
    h = history(("g++ -o cli_tool cli_tool.c lodepng.cpp -lm", EMPTY), task=task)
    assert {"./cli_tool", "./cli_tool weights.json image.png"} <= set(targets(d, h))
    other = history(("gcc -o other other.c", EMPTY), task=task)
    assert "./cli_tool weights.json image.png" not in targets(d, other)


def test_nothing_is_proposed_without_a_move_to_make() -> None:
    d = MovesActionDrafter()
    assert targets(d, history(("echo hello", "<returncode>0</returncode>\n<output>\nhello\n</output>"))) == []
    assert anyio.run(d.propose, History("t"), 0, 1) == []


def test_routed_completions_name_the_files_the_history_wrote_or_read() -> None:
    d = MovesActionDrafter(label=tool_label)
    h = history(
        ("cat <<'EOF' > solver.py\nprint(1)\nEOF", EMPTY),
        ("cat notes.txt", "<returncode>0</returncode>\n<output>\nhi\n</output>"),
        ("ls /tmp", EMPTY),
    )
    assert routed(d, h, "python") == ["python solver.py"]
    assert {"cat notes.txt", "cat solver.py"} <= set(routed(d, h, "cat"))
    assert routed(d, h, "ls") == ["ls /tmp"]  # an earlier command of that program


def test_lookahead_through_the_next_edit_is_opt_in() -> None:
    h = history(
        ("cat <<'EOF' > lib.py\nx = 1\nEOF", EMPTY),
        ("pytest -x", FAIL),
        ("cat lib.py", "<returncode>0</returncode>\n<output>\nx = 1\n</output>"),
    )
    plain = anyio.run(MovesActionDrafter().propose, h, 32, 4)
    assert all(p.offset == 0 for p in plain)
    deep = anyio.run(MovesActionDrafter(lookahead_writes=True).propose, h, 32, 4)
    assert {p.offset for p in deep if p.action.command == "pytest -x"} == {1, 2, 3}


def _trace(task: str, pairs: list[tuple[str, str]]) -> Trace:
    steps = tuple(Step(Action.bash(c), o, output_tokens=5, tool_duration_s=0.1) for c, o in pairs)
    return Trace(task, task, "mini-swe-agent", "m", "s", steps)


def test_fit_learns_how_often_each_move_is_taken_and_how_scripts_run() -> None:
    write_run = [("cat <<'EOF' > x.py\nprint(1)\nEOF", EMPTY), ("python3 x.py", EMPTY)]
    write_other = [("cat <<'EOF' > y.py\nprint(1)\nEOF", EMPTY), ("ls", EMPTY)]
    d = MovesActionDrafter(prior=1.0)
    d.fit([_trace("t1", write_run), _trace("t2", write_run), _trace("t3", write_other)])
    assert d.rule_counts[("run-written", 0)] == (2, 3)
    h = history(("cat <<'EOF' > z.py\nprint(1)\nEOF", EMPTY))
    (first, *_) = anyio.run(d.propose, h, 32, 1)
    assert first.action == Action.bash("python3 z.py")  # the training traces' form
    assert abs(first.probability - d._p("run-written", 0)) < 1e-12 and 0.5 < first.probability < 0.7
