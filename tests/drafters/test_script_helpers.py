"""The trajectory drafters' helpers: command structure (_script), sed -i (_sed) and
python -c evaluation (_pyeval)."""

from __future__ import annotations

import re

from aospec.drafters._pyeval import python_output, remembered_values
from aospec.drafters._script import Redirect, parse_script
from aospec.drafters._sed import sed_edit
from hypothesis import given, settings
from hypothesis import strategies as st


def test_scripts_keep_their_lists_pipelines_redirections_and_heredocs() -> None:
    s = parse_script("cd /app && python x.py 2>&1 | tail -5; echo done > log")
    assert s is not None and s.literal and s.ops == ("&&", ";")
    assert [c.words for c in s.commands] == [("cd", "/app"), ("python", "x.py"), ("tail", "-5"), ("echo", "done")]
    assert s.pipelines[1].commands[0].redirects == (Redirect(2, ">&", "1"),)
    assert s.commands[-1].redirects == (Redirect(1, ">", "log"),)
    h = parse_script("cat <<'EOF' > a.py\nprint('$HOME')\nEOF\npython a.py")
    assert h is not None and h.commands[0].heredoc == "print('$HOME')\n" and h.commands[0].heredoc_literal
    assert h.ops == (";",) and h.commands[1].words == ("python", "a.py")
    expanding = parse_script("cat > a <<EOF\n$HOME\nEOF")
    assert expanding is not None and not expanding.commands[0].heredoc_literal


def test_what_depends_on_the_running_shell_is_marked_not_literal() -> None:
    for cmd in ("ls *.py", "echo $HOME", "cat ~/x", "echo $(date)", "python x.py &", "for i in 1; do echo; done"):
        s = parse_script(cmd)
        assert s is not None and not s.literal, cmd
    assert parse_script("echo '$HOME *'").literal  # type: ignore[union-attr]


def test_what_cannot_be_followed_is_none() -> None:
    for cmd in ("echo 'unclosed", "cat <<EOF\nno end", "(cd x && ls)", "a ;; b"):
        assert parse_script(cmd) is None, cmd


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab $'\"\\|&;<>()*\n2EOF-", max_size=40))
def test_parsing_never_raises(text: str) -> None:
    parse_script(text)


def test_sed_substitutions_deletions_and_addresses() -> None:
    text = "a = 1\nb = 2\nc = 3\n"
    assert sed_edit("s/= 1/= 10/", text) == "a = 10\nb = 2\nc = 3\n"
    assert sed_edit("2d", text) == "a = 1\nc = 3\n"
    assert sed_edit("/b/d", text) == "a = 1\nc = 3\n"
    assert sed_edit("$s/3/30/", text) == "a = 1\nb = 2\nc = 30\n"
    assert sed_edit("1,2s/ = /=/", text) == "a=1\nb=2\nc = 3\n"
    assert sed_edit(r"s/\([a-z]\) = \([0-9]\)/\2 = \1/", text) == "1 = a\n2 = b\n3 = c\n"
    assert sed_edit("s/[[:digit:]]/N/g", "x1y22\n") == "xNyNN\n"
    assert sed_edit("s|/usr|/opt|", "/usr/bin\n") == "/opt/bin\n"
    assert sed_edit(r"s/x\+/X/", "xxx\n") == "X\n"
    assert sed_edit("s/(a)/b/", "(a)\n", extended=False) == "b\n"
    assert sed_edit("s/no newline/ok/", "no newline") == "ok"


def test_sed_scripts_it_cannot_follow_are_refused() -> None:
    for script in ("s/a\\|b/c/", "s/a/\\U&/", "y/ab/cd/", "s/a/b/w out", "1!d", "N;s/\\n//"):
        assert sed_edit(script, "ab\n") is None, script


@settings(max_examples=200, deadline=None)
@given(
    st.text(alphabet="abc xy\n", max_size=40),
    st.text(alphabet="abc", min_size=1, max_size=3),
    st.text(alphabet="xyz", max_size=3),
    st.booleans(),
)
def test_literal_substitutions_match_a_line_by_line_replace(text: str, old: str, new: str, every: bool) -> None:
    got = sed_edit(f"s/{old}/{new}/{'g' if every else ''}", text)
    lines = text.split("\n")
    want = "\n".join(line.replace(old, new) if every else line.replace(old, new, 1) for line in lines)
    assert got == want


def test_python_programs_of_literals_print_what_python_prints() -> None:
    code = "import sys\nx = 'a'\nn = 2 * 3\nprint(x, n, sep='-')\nprint(f'{n:03d}|{x!r}', end='')\nprint(0.1 + 0.2)"
    out, uses, imports = python_output(code, {})  # type: ignore[misc]
    assert out == "a-6\n006|'a'" + str(0.1 + 0.2) + "\n"
    assert not uses and imports == {"sys"}
    assert python_output("import mteb\nprint(mteb.__version__)", {"mteb.__version__": "1.3"})[0] == "1.3\n"  # type: ignore[index]
    for code in ("print(open('x').read())", "import os\nprint(os.getcwd())", "print(*[1])", "print(mteb.x)", "x = "):
        assert python_output(code, {"mteb.x": "1"}) is None, code


def test_values_are_read_off_prints_that_line_up_with_the_output() -> None:
    code = "import mteb, torch\nprint(mteb.__version__)\nprint(f'cuda: {torch.cuda.is_available()}')\nprint('done')"
    assert remembered_values(code, "1.36.8\ncuda: False\ndone\n") == [
        ("mteb.__version__", "1.36.8"),
        ("torch.cuda.is_available()", "False"),
    ]
    assert remembered_values(code, "1.36.8\n") == []  # the lines do not line up
    assert remembered_values("x = f()\nprint(x)", "3\n") == []  # a local name means nothing later


def test_regex_metacharacters_in_sed_replacements_are_literal() -> None:
    assert sed_edit(r"s/a/\&b/", "a\n") == "&b\n"
    assert re.escape("x") == "x"
