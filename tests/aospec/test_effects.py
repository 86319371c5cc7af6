"""The effect classifier: conservative (unsure -> MAY_CHANGE), checked on tables, properties,
and by running the commands it calls read-only in a real shell."""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from aospec.effects import classify_action, classify_command, step_effect
from aospec.types import Action, Effect, Step

RO, MC = Effect.READ_ONLY, Effect.MAY_CHANGE

READ_ONLY_COMMANDS = [
    "ls -la",
    "cat a.txt b.txt",
    "head -n 20 f && tail -5 f",
    "grep -rn 'def main' src/ | head",
    "rg -n foo",
    "wc -l < data.csv",
    "find . -name '*.py' -type f",
    "find / -maxdepth 2 -name x 2>/dev/null",
    "pwd; echo hi",
    "which python3 || type python3",
    "file a.bin && stat a.bin",
    "du -sh . && df -h",
    "tree -L 2",
    "sort data | uniq -c | sort -rn | head",
    "cut -d, -f1 data.csv | nl",
    "awk '{print $1}' f",
    "awk -F: 'NR>1 {print $2}' /etc/passwd",
    "diff a b; cmp a b",
    "md5sum f && sha256sum f",
    "env | sort",
    "printenv PATH",
    "whoami; id; uname -a; date",
    "ps aux | grep python | grep -v grep",
    "git status",
    "git diff HEAD~1 -- src/",
    "git log --oneline -5",
    "git show HEAD:README.md",
    "git branch -a",
    "git rev-parse HEAD && git ls-files",
    "git --no-pager -C repo log -1",
    "sed -n '1,20p' f",
    "sed -n '/start/,/end/p' f",
    "sed 's/a/b/g' f",
    "sed -e 's|x|y|' -e '3q' f",
    "ls >/dev/null 2>&1",
    "ls 2>&1 | head",
    "echo hi 1>&2",
    "cat <<< 'here string'",
    "echo $(ls) `pwd`",
    'echo "today is $(date)"',
    "diff <(sort a) <(sort b)",
    "cd /tmp && ls",
    "(cd sub && ls -la)",
    "for f in *.txt; do wc -l $f; done",
    "if [ -f x ]; then cat x; else echo missing; fi",
    "while read l; do echo $l; done < f",
    "FOO=1 BAR=2 env",
    "env -i PATH=/bin ls",
    "timeout 5 cat f",
    "nice -n 10 grep x f",
    "find . -name '*.log' | xargs -I{} grep -l ERROR {}",
    "command -v python3",
    "/usr/bin/ls -l",
    "echo $((1 + 2))",
    "echo ${HOME}/x",
    "grep '>' f",
    "grep '|' f",
    "echo 'rm -rf / > x'",
    "sleep 1 & wait",
    "true",
    "",
    "echo a \\\n  b",
    "export X=1; echo $X",
    "hostname",
    "od -c f | head; hexdump -C f | head",
]

MAY_CHANGE_COMMANDS = [
    "echo hi > f",
    "echo hi >> f",
    "ls > listing.txt",
    "cat a > b",
    "echo hi &> f",
    "echo hi >& f",
    "echo hi >| f",
    "cat f <> g",
    "(ls) > f",
    "{ ls; } > f",
    "exec > log",
    "cat <<EOF > f\nhello\nEOF",
    "cat <<'EOF'\nhello\nEOF",
    "python - <<EOF\nprint(1)\nEOF",
    "ls | tee out.txt",
    "tee f",
    "sed -i 's/a/b/' f",
    "sed -i.bak 's/a/b/' f",
    "sed -ni 'p' f",
    "sed --in-place 's/a/b/' f",
    "sed 's/a/b/w out' f",
    "sed -n 'w out' f",
    "sed -e 'e ls' f",
    "sed -f script.sed f",
    "sed -l 5 'w x' f",
    "find . -delete",
    "find . -name '*.pyc' -exec rm {} +",
    "find . -execdir touch x \\;",
    "find . -ok rm {} \\;",
    "find . -fprint out",
    "find . | xargs rm",
    "git commit -am x",
    "git checkout main",
    "git branch new-feature",
    "git branch -D old",
    "git stash",
    "git -c diff.external=./x diff",
    "git diff --output=patch.diff",
    "python script.py",
    "python3 -c 'print(1)'",
    "pip install requests",
    "pip list",
    "make",
    "npm test",
    "rm -rf build",
    "mkdir -p out",
    "touch x",
    "cp a b",
    "mv a b",
    "chmod +x run.sh",
    "./run.sh",
    "bash script.sh",
    "source venv/bin/activate",
    "curl -s http://localhost:8000/",
    "wget http://x/y",
    "echo $(rm -rf x)",
    'echo "$(touch x)"',
    "echo `rm x`",
    "x=$(mkdir d)",
    "echo ${X:-$(rm x)}",
    "diff <(touch x) a",
    "ls; rm x",
    "ls && rm x",
    "ls || touch x",
    "ls | xargs -0 rm",
    "ls\nrm x",
    "awk '{print $1 > \"out\"}' f",
    "awk '{print | \"sort\"}' f",
    "awk 'BEGIN { system(\"rm x\") }'",
    "awk -i inplace '{print}' f",
    "awk -f prog.awk f",
    "sort -o out in",
    "sort --output=out in",
    "uniq in out",
    "tree -o out.txt",
    "file -C -m magic",
    "date -s '2020-01-01'",
    "hostname newname",
    "rg --pre ./decompress x",
    "timeout 5 python x.py",
    "env FOO=1 python x.py",
    "nohup ls",
    "sudo rm x",
    "ls 'unclosed",
    'echo "unclosed',
    "echo $(ls",
    "case x in a) rm y;; esac",
    "f() { rm x; }; f",
    "tmux send-keys 'ls' Enter",
    "apt-get install -y jq",
    "kill -9 1234",
]


@pytest.mark.parametrize("cmd", READ_ONLY_COMMANDS)
def test_read_only_commands(cmd: str) -> None:
    assert classify_command(cmd) is RO


@pytest.mark.parametrize("cmd", MAY_CHANGE_COMMANDS)
def test_may_change_commands(cmd: str) -> None:
    assert classify_command(cmd) is MC


@pytest.mark.parametrize(
    ("action", "effect"),
    [
        (Action.none(), RO),
        (Action("respond", {"content": "Hello"}), RO),
        (Action("get_user_details", {"user_id": "x"}), RO),
        (Action("search_direct_flight", {"origin": "JFK"}), RO),
        (Action("list_all_airports"), RO),
        (Action("calculate", {"expression": "1+2"}), RO),
        (Action("think", {"thought": "hm"}), RO),
        (Action("book_reservation", {"user_id": "x"}), MC),
        (Action("cancel_reservation", {}), MC),
        (Action("transfer_to_human_agents", {}), MC),
        (Action("str_replace_editor", {"command": "view"}), MC),
        (Action.bash("ls"), RO),
        (Action.bash("rm x"), MC),
        (Action("bash", {"command": "ls", "timeout": 5}), MC),
        (Action("bash", {"cmd": "ls"}), MC),
    ],
)
def test_classify_action(action: Action, effect: Effect) -> None:
    assert classify_action(action) is effect


def test_recorded_knowledge_wins_over_the_classifier() -> None:
    ls, rm = Action.bash("ls"), Action.bash("rm x")
    assert step_effect(Step(rm, "", 1, state_changed=False)) is RO
    assert step_effect(Step(ls, "", 1, state_changed=True)) is MC
    assert step_effect(Step(rm, "", 1, version_before="v1", version_after="v1")) is RO
    assert step_effect(Step(ls, "", 1, version_before="v1", version_after="v2")) is MC
    assert step_effect(Step(ls, "", 1, version_before="v1", version_after="v2", state_changed=False)) is RO
    assert step_effect(Step(ls, "", 1)) is RO
    assert step_effect(Step(rm, "", 1)) is MC


# ---------------------------------------------------------------- properties

_ro = st.sampled_from([c for c in READ_ONLY_COMMANDS if c and "\n" not in c])
_mc = st.sampled_from([c for c in MAY_CHANGE_COMMANDS if "'unclosed" not in c and '"unclosed' not in c])
_sep = st.sampled_from(["; ", " && ", " || ", " | ", "\n", " & "])


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
@example("$(((((")
@example("`")
@example("echo \\")
@example("env " * 3000 + "ls")
@example("$(" * 3000 + "ls" + ")" * 3000)
def test_any_text_classifies_without_error(cmd: str) -> None:
    assert classify_command(cmd) in (RO, MC)


@settings(max_examples=150, deadline=None)
@given(st.lists(_ro, min_size=1, max_size=4), st.lists(_sep, min_size=3, max_size=3))
def test_read_only_commands_joined_stay_read_only(parts: list[str], seps: list[str]) -> None:
    cmd = parts[0]
    for sep, part in zip(seps, parts[1:], strict=False):
        cmd += sep + part
    assert classify_command(cmd) is RO


@settings(max_examples=200, deadline=None)
@given(st.lists(_ro, max_size=3), _mc, st.lists(_ro, max_size=3), _sep)
def test_one_writer_anywhere_makes_the_whole_line_may_change(
    before: list[str], bad: str, after: list[str], sep: str
) -> None:
    cmd = sep.join([*before, bad, *after])
    assert classify_command(cmd) is MC


@settings(max_examples=150, deadline=None)
@given(
    _ro, st.sampled_from([">", ">>", "1>", "2>", "&>", ">|"]), st.from_regex(r"[a-z][a-z0-9_.]{0,8}", fullmatch=True)
)
def test_redirecting_output_to_a_file_makes_it_may_change(cmd: str, op: str, target: str) -> None:
    assert classify_command(f"{cmd} {op} {target}") is MC
    assert classify_command(f"{cmd} {op} /dev/null") is RO


@settings(max_examples=150, deadline=None)
@given(_mc, st.sampled_from(["echo $({})", 'echo "$({})"', "echo `{}`", "cat <({})", "x=$({})", "ls $(echo $({}))"]))
def test_writers_inside_substitutions_are_found(bad: str, wrapper: str) -> None:
    if "`" in wrapper and ("`" in bad or "\\" in bad):
        return
    assert classify_command(wrapper.format(bad)) is MC


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_quoted_arguments_never_change_the_class(arg: str) -> None:
    assert classify_command(f"grep -n {shlex.quote(arg)} file.txt") is RO
    assert classify_command(f"grep -n {shlex.quote(arg)} file.txt > out") is MC


# ---------------------------------------------------------------- soundness in a real shell

# never /dev/null here: `rm -f /dev/null` or `mv b.txt /dev/null` would damage the host
_WORDS = ["a.txt", "b.txt", "sub", "'*.txt'", "out", "x"]
_SIMPLE = st.sampled_from(
    [
        "ls", "ls -la", "cat a.txt", "head -n 1 a.txt", "wc -l a.txt", "grep -r hello .", "find . -name {w}",
        "find . -name {w} -delete", "find . -type f -exec touch {{}} +", "sort a.txt", "sort -o {w} a.txt",
        "uniq a.txt", "uniq a.txt {w}", "tee {w}", "echo hi", "touch {w}", "mkdir -p {w}", "rm -f {w}",
        "cp a.txt {w}", "mv b.txt {w}", "sed -n 1p a.txt", "sed -i s/hello/bye/ a.txt", "sed -n 'w {w}' a.txt",
        "awk '{{print $1}}' a.txt", "awk '{{print $1 > \"{w}\"}}' a.txt", "cut -c1-3 a.txt", "nl a.txt",
        "tree -o {w}", "du -s .", "stat a.txt", "cat a.txt | tr a-z A-Z", "diff a.txt b.txt", "true",
        "xargs -a a.txt echo", "echo a.txt | xargs rm -f", "cd sub", "md5sum a.txt", "tac a.txt", "cmp a.txt b.txt",
    ]
)  # fmt: skip
_REDIR = st.sampled_from(["", "", "", " > {w}", " >> {w}", " 2>/dev/null", " > /dev/null 2>&1", " | tee {w}"])


@st.composite
def _shell_lines(draw: st.DrawFn) -> str:
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        simple = draw(_SIMPLE) + draw(_REDIR)
        parts.append(simple.format(w=draw(st.sampled_from(_WORDS))))
        parts.append(draw(st.sampled_from(["; ", " && ", " || ", " | "])))
    line = "".join(parts[:-1])
    if draw(st.booleans()):
        line = f"echo $({line})"
    return line


def _snapshot(root: Path) -> dict[str, tuple[str, int, str]]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st_ = p.lstat()
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
            out[str(p.relative_to(root))] = (oct(st_.st_mode), st_.st_size, digest)
    return out


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_shell_lines())
def test_commands_classified_read_only_leave_the_filesystem_unchanged(
    tmp_path_factory: pytest.TempPathFactory, line: str
) -> None:
    root = tmp_path_factory.mktemp("fs")
    (root / "a.txt").write_text("hello world\nsecond line\n")
    (root / "b.txt").write_text("other\n")
    (root / "sub").mkdir()
    (root / "sub" / "c.txt").write_text("c\n")
    before = _snapshot(root)
    subprocess.run(
        ["bash", "-c", line], cwd=root, stdin=subprocess.DEVNULL, capture_output=True, timeout=20, check=False
    )
    changed = _snapshot(root) != before
    if classify_command(line) is RO:
        assert not changed, f"classified read-only but changed the filesystem: {line!r}"
    shutil.rmtree(root)
