"""TrajectoryDrafter: exact outputs of deterministic commands from the trajectory's view of
the filesystem, and abstention whenever anything is unknown."""

from __future__ import annotations

import anyio
from aospec.drafters.trajectory import FileView, TrajectoryDrafter, parse_observation, written_paths
from hypothesis import given, settings
from hypothesis import strategies as st

from aospec.types import Action, History, Step, Trace

EMPTY = "<returncode>0</returncode>\n<output>\n</output>"


def ok(output: str, rc: int = 0) -> str:
    return f"<returncode>{rc}</returncode>\n<output>\n{output}</output>"


def history(*turns: tuple[str, str]) -> History:
    h = History("task")
    for cmd, obs in turns:
        h = h.extend(Action.bash(cmd), obs)
    return h


def drafts(drafter: TrajectoryDrafter, h: History, cmd: str) -> list[str]:
    return [d.text for d in anyio.run(drafter.draft, h, Action.bash(cmd), 5)]


WRITE_A = ("cat <<'EOF' > a.py\nimport sys\nprint('hi')\nx = 1\nEOF", EMPTY)


def test_reads_of_a_file_the_agent_wrote_are_drafted_byte_for_byte() -> None:
    d = TrajectoryDrafter()
    h = history(WRITE_A)
    body = "import sys\nprint('hi')\nx = 1\n"
    assert drafts(d, h, "cat a.py") == [ok(body)]
    assert drafts(d, h, "head -n 1 a.py") == [ok("import sys\n")]
    assert drafts(d, h, "head -2 a.py") == [ok("import sys\nprint('hi')\n")]
    assert drafts(d, h, "tail -n 1 a.py") == [ok("x = 1\n")]
    assert drafts(d, h, "wc -l a.py") == [ok("3 a.py\n")]
    assert drafts(d, h, "cat a.py | wc -l") == [ok("3\n")]
    assert drafts(d, h, "grep -n print a.py") == [ok("2:print('hi')\n")]
    assert drafts(d, h, "grep -c nothing a.py") == [ok("0\n", 1)]
    assert drafts(d, h, "sed -n '2,3p' a.py") == [ok("print('hi')\nx = 1\n")]
    assert drafts(d, h, "test -f a.py && echo yes || echo no") == [ok("yes\n")]
    assert drafts(d, h, "ls a.py") == [ok("a.py\n")]


def test_writes_are_followed_through_copies_moves_edits_and_redirections() -> None:
    d = TrajectoryDrafter()
    h = history(
        WRITE_A,
        ("mkdir -p out && cp a.py out/b.py", EMPTY),
        ("sed -i 's/hi/hello/' a.py", EMPTY),
        ("echo first > log.txt && echo second >> log.txt", EMPTY),
        ("mv log.txt done.txt", EMPTY),
    )
    assert drafts(d, h, "cat out/b.py") == [ok("import sys\nprint('hi')\nx = 1\n")]
    assert drafts(d, h, "cat a.py") == [ok("import sys\nprint('hello')\nx = 1\n")]
    assert drafts(d, h, "cat done.txt") == [ok("first\nsecond\n")]
    assert drafts(d, h, "cat log.txt") == [ok("cat: log.txt: No such file or directory\n", 1)]
    assert drafts(d, h, "test -d out && echo dir") == [ok("dir\n")]
    # a write and a read in the same command
    assert drafts(d, h, "printf 'x\\n' > n.txt && cat n.txt") == [ok("x\n")]
    # a write whose words expand: what it wrote is unknown
    assert drafts(d, history(("echo $HOME > home.txt", EMPTY)), "cat home.txt") == []


def test_files_read_with_cat_are_known_afterwards() -> None:
    d = TrajectoryDrafter()
    h = history(("cat config.ini", ok("[a]\nb = 1\n")), ("sed -i 's/1/2/' config.ini", EMPTY))
    assert drafts(d, h, "cat config.ini") == [ok("[a]\nb = 2\n")]


def test_writes_themselves_are_drafted_silent() -> None:
    d = TrajectoryDrafter()
    assert drafts(d, history(WRITE_A), "mkdir -p build && touch build/x") == [EMPTY]
    assert drafts(d, History("t"), "cat <<'EOF' > new.py\nprint(1)\nEOF") == [EMPTY]


def test_python_c_printing_literals_and_remembered_values() -> None:
    d = TrajectoryDrafter()
    h = history(('python -c "import mteb; print(mteb.__version__)"', ok("1.36.8\n")))
    assert drafts(d, h, "python3 -c \"print('a', 1 + 2); x = 'y'; print(f'v={x}')\"") == [ok("a 3\nv=y\n")]
    assert drafts(d, h, "python -c \"import mteb; print(f'MTEB version: {mteb.__version__}')\"") == [
        ok("MTEB version: 1.36.8\n")
    ]
    # the value is only known where its module is imported
    assert drafts(d, h, 'python -c "print(mteb.__version__)"') == []


def test_a_rerun_with_nothing_written_since_repeats_the_last_output() -> None:
    d = TrajectoryDrafter()
    h = history(("python train.py", ok("loss 0.5\n")), ("ls", ok("train.py\n")))
    assert drafts(d, h, "python train.py") == [ok("loss 0.5\n")]


def test_it_abstains_on_what_it_cannot_know() -> None:
    d = TrajectoryDrafter()
    h = history(WRITE_A)
    for cmd in (
        "cat b.py",  # never seen
        "cat *.py",  # a glob
        "cat $FILE",  # an expansion
        "cat a.py && python a.py",  # an unmodelled program
        "echo -e 'a\\tb'",  # sh and bash differ
        "ls",  # a directory listing
        "ls -la a.py",  # sizes, owners and times
        "cat a.py &",  # a background job
        "cat a.py; cat missing 2>&1",  # stdout and stderr interleaved
        "wc a.py",  # several padded counts
        "python -c 'import os; print(os.getcwd())'",  # a value never shown
        "diff a.py other.py",
    ):
        assert drafts(d, h, cmd) == [], cmd


def test_it_abstains_without_the_observation_format_it_knows() -> None:
    d = TrajectoryDrafter()
    h = history(("cat <<'EOF' > a\nx\nEOF", "(no output)"))  # another harness's format
    assert drafts(d, h, "cat a") == []


def test_long_lines_are_not_drafted_when_the_terminal_may_wrap_them() -> None:
    d = TrajectoryDrafter(max_line_chars=20)
    h = history(("cat <<'EOF' > a\n" + "x" * 30 + "\nEOF", EMPTY))
    assert drafts(d, h, "cat a") == []
    assert drafts(TrajectoryDrafter(), h, "cat a") == [ok("x" * 30 + "\n")]


def test_an_unmodelled_write_makes_knowledge_stale_and_fit_prices_that() -> None:
    def trace(task: str, stale_hit: bool) -> Trace:
        pairs = [
            WRITE_A,
            ("python a.py", ok("hi\n")),  # may have written anything
            ("cat a.py", ok("import sys\nprint('hi')\nx = 1\n" if stale_hit else "rewritten\n")),
            ("cat a.py", ok("import sys\nprint('hi')\nx = 1\n" if stale_hit else "rewritten\n")),
        ]
        steps = tuple(Step(Action.bash(c), o, output_tokens=5, tool_duration_s=0.1) for c, o in pairs)
        return Trace(task, task, "mini-swe-agent", "m", "s", steps)

    d = TrajectoryDrafter()
    d.fit([trace("t1", False), trace("t2", False), trace("t3", True)])
    assert d.rule_counts[("file", "stale")] == (1, 3)  # the third step of each trace
    assert d.rule_counts[("file", "fresh")] == (3, 3)  # the fourth: what the third step showed
    h = history(WRITE_A, ("python a.py", ok("hi\n")))
    (draft,) = anyio.run(d.draft, h, Action.bash("cat a.py"), 5)
    assert draft.probability == d.probability("file", False, Action.bash("cat a.py")) < 0.5
    fresh = anyio.run(d.draft, history(WRITE_A), Action.bash("cat a.py"), 5)[0]
    assert fresh.probability > draft.probability


def test_written_paths_names_what_a_command_writes() -> None:
    assert written_paths("cat <<'EOF' > a.py\nx\nEOF") == ("a.py",)
    assert written_paths("mkdir -p d && echo x > d/f && sed -i 's/a/b/' g.txt") == ("d", "d/f", "g.txt")
    assert written_paths("python train.py > log.txt 2>&1") == ("log.txt",)
    assert written_paths("ls -la") == ()
    assert parse_observation(ok("x\n", 2)) == (2, "x\n") and parse_observation("other") is None


def test_reads_after_a_leading_cd_are_known_in_that_directory() -> None:
    """A harness that runs every command in a new shell: its agent writes ``cd DIR && ...``."""
    d = TrajectoryDrafter()
    code = "BULK = 100\n\ndef f(q):\n    if q > BULK:\n        return 10\n    return 0\n"
    h = history(
        ("cd /work/inv && cat inv/pricing.py", ok(code)),
        ("cd /work/inv && sed -i 's/if q > BULK:/if q >= BULK:/' inv/pricing.py", EMPTY),
    )
    assert drafts(d, h, "cd /work/inv && grep -n 'BULK' inv/pricing.py") == [ok("1:BULK = 100\n4:    if q >= BULK:\n")]
    assert drafts(d, h, "grep -n BULK /work/inv/inv/pricing.py") == [ok("1:BULK = 100\n4:    if q >= BULK:\n")]
    assert drafts(d, h, "grep -n BULK inv/pricing.py") == []  # the cwd of this shell is not /work/inv
    head = history(("cd /work/inv && head -n 1 inv/pricing.py", ok("BULK = 100\n")))
    assert drafts(d, head, "sed -n '1p' /work/inv/inv/pricing.py") == [ok("BULK = 100\n")]
    # abstentions: a cd it cannot follow, a cd that is not a prefix, a pwd after a cd
    for cmd in ("cd - && cat inv/pricing.py", "cd && cat inv/pricing.py", "cd /work/inv || cat inv/pricing.py"):
        assert drafts(d, history((cmd, ok(code))), "cat /work/inv/inv/pricing.py") == [], cmd
    moved = history(("cd /work/inv && pwd", ok("/work/inv\n")), WRITE_A)
    assert drafts(d, moved, "cat /work/inv/a.py") == []  # the cd did not move the next shell


def test_cd_edge_cases_never_put_knowledge_in_the_wrong_place() -> None:
    d = TrajectoryDrafter()
    # a step's writes after a cd into a directory not known to exist went there (if they ran)
    h = history(("cat f", ok("old\n")), ("cd sub && echo new > f", EMPTY))
    assert drafts(d, h, "cat f") == [ok("old\n")]
    assert written_paths("cd /app && echo x > out.txt") == ("/app/out.txt",)
    # through a symbolic link, ".." is not the logical parent: nothing learned, nothing drafted
    link = history(("cd /p/link && cat ../f", ok("REAL\n")))
    assert drafts(d, link, "cat /p/f") == []
    known = history(("cat /p/link/x", ok("1\n")), ("cat /p/f", ok("P\n")))
    assert drafts(d, known, "cd /p/link && cat ../f") == []
    # cd -L goes to $HOME, //x is kept as written: neither is followed
    assert drafts(d, history(("cd -L && cat f", ok("HOMEF\n"))), "cat ./-L/f") == []
    assert drafts(d, history(("cat /w/x", ok("1\n"))), "cd //w && pwd") == []
    # a directory moved away while unknown takes what was known under it along
    moved = history(("cat d/x", ok("X\n")), ("mv d e", EMPTY))
    assert drafts(d, moved, "cd d && cat x") == []
    stale = d.probability("rerun", False, Action.bash("cat d/x"))  # at most a stale re-run
    assert all(x.probability == stale for x in anyio.run(d.draft, moved, Action.bash("cat d/x"), 5))


def test_the_view_resolves_relative_paths_once_the_working_directory_is_known() -> None:
    d = TrajectoryDrafter()
    h = history(("pwd", ok("/app\n")), WRITE_A)
    assert drafts(d, h, "cat /app/a.py") == [ok("import sys\nprint('hi')\nx = 1\n")]
    view = FileView()
    assert view.resolve("../x") is None  # above an unknown working directory


# -------------------------------------------------------------------- the property

_NAMES = st.sampled_from(["a.txt", "b.txt", "d/c.txt", "e.txt"])
_TEXT = st.text(alphabet="abc xyz\n", max_size=30).map(lambda s: s if s.endswith("\n") or not s else s + "\n")


def _world_step(files: dict[str, str], op: tuple[str, str, str]) -> tuple[str, str]:
    """A command and the observation a real shell gives on ``files`` (a tiny exact world)."""
    kind, name, text = op
    if kind == "write":
        files[name] = text
        files["<made d>"] = "yes"
        return f"mkdir -p d && cat <<'EOF' > {name}\n{text}EOF", EMPTY
    if kind == "append":
        if name not in files:
            files[name] = ""
        files[name] += "z\n"
        files["<made d>"] = "yes"
        return f"mkdir -p d && echo z >> {name}", EMPTY
    if kind == "rm":
        files.pop(name, None)
        return f"rm -f {name}", EMPTY
    if kind == "cdcat":  # the same read from its directory, as a new-shell-per-command agent writes it
        where, _, base = name.rpartition("/")
        where = where or "."
        if where != "." and not files.get("<made d>"):
            return f"cd {where} && cat {base}", ok(f"bash: line 1: cd: {where}: No such file or directory\n", 1)
        if name in files:
            return f"cd {where} && cat {base}", ok(files[name])
        return f"cd {where} && cat {base}", ok(f"cat: {base}: No such file or directory\n", 1)
    if name in files:
        return f"cat {name}", ok(files[name])
    return f"cat {name}", ok(f"cat: {name}: No such file or directory\n", 1)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["write", "append", "rm", "cat", "cdcat"]), _NAMES, _TEXT), max_size=12))
def test_every_draft_on_an_exactly_modelled_world_is_the_real_observation(ops: list[tuple[str, str, str]]) -> None:
    """The drafter never drafts what it cannot know: on a world whose commands it models,
    whatever it drafts for a ``cat`` (fresh knowledge) is byte-identical to the truth, and it
    drafts every file it has seen written or read."""
    files: dict[str, str] = {}
    d = TrajectoryDrafter(max_line_chars=None)
    h = History("t")
    known: set[str] = set()
    stale: dict[str, str] = {}  # a command's last output, once something was written since
    last: dict[str, str] = {}
    for op in ops:
        cmd, obs = _world_step(files, op)
        if op[0] in ("write", "append", "rm"):
            stale.update(last)
        if op[0] in ("cat", "cdcat"):
            got = drafts(d, h, cmd)
            # a re-run after writes may repeat its last output, as stale knowledge (priced
            # lower); anything else it drafts is the truth
            assert all(g == obs or g == stale.get(cmd) for g in got)
            last[cmd] = obs
            stale.pop(cmd, None)
            if op[1] in known and (op[0] == "cat" or "/" not in op[1] or files.get("<made d>")):
                assert got == [obs]  # (a cd into a directory not known to exist is not followed)
        h = h.extend(Action.bash(cmd), obs)
        if op[0] in ("write", "cat", "rm"):
            known.add(op[1])
