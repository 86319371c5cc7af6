"""The shell lexer shared by the effect rules and the drafters' command features."""

from __future__ import annotations

import pytest

from aospec.shell import (
    FD_MARK,
    SUBSTITUTION,
    ShellSyntaxError,
    extract_substitutions,
    first_line,
    loose_segments,
    loose_words,
    program_label,
    redirection,
    simple_commands,
    streamed_program_label,
    tokens,
)


def _commands(line: str) -> list[tuple[list[str], list[tuple[str, tuple[str, bool] | None]]]]:
    subs: list[str] = []
    return [(c.words, c.redirects) for c in simple_commands(tokens(extract_substitutions(line, subs)))]


def test_quoted_operators_stay_words_and_words_are_unquoted() -> None:
    assert list(tokens("grep 'a|b' \"x y\" | wc -l")) == [
        ("grep", False), ("a|b", False), ("x y", False), ("|", True), ("wc", False), ("-l", False),
    ]  # fmt: skip


def test_simple_commands_split_on_separators_and_keep_redirections() -> None:
    assert _commands("cd /src && ls -la > out.txt 2>&1; cat < in") == [
        (["cd", "/src"], []),
        (["ls", "-la"], [(">", ("out.txt", False)), (">&", ("1", False))]),
        (["cat"], [("<", ("in", False))]),
    ]


def test_a_redirection_at_the_end_of_the_line_has_no_target() -> None:
    assert _commands("echo hi >") == [(["echo", "hi"], [(">", None)])]


def test_substitutions_become_one_word_and_are_collected() -> None:
    subs: list[str] = []
    flat = extract_substitutions('echo "$(date +%s)" `whoami` $((1 + 2)) 2>/dev/null', subs)
    assert subs == ["date +%s", "whoami"]
    words = [t for t, op in tokens(flat) if not op]
    assert words == ["echo", SUBSTITUTION, SUBSTITUTION, "0", FD_MARK, "/dev/null"]


@pytest.mark.parametrize("line", ["echo 'unclosed", 'echo "unclosed', "cat <<EOF > f", "echo `a\\`b`", "x $(ls"])
def test_what_the_lexer_cannot_follow_is_an_error(line: str) -> None:
    with pytest.raises(ShellSyntaxError):
        _commands(line)


def test_redirection_drops_leading_separators_only() -> None:
    assert redirection(";>") == ">"
    assert redirection(")<") == "<"
    assert redirection("&>") == "&>"


def test_loose_splitting_never_fails_and_keeps_quotes() -> None:
    line = first_line('python -c "import os\nprint(1)"')
    assert line == 'python -c "import os'
    assert loose_segments("cd x && grep 'a|b' f | wc") == ["cd x", "grep 'a", "b' f", "wc"]
    assert loose_words(line) == ["python", "-c", '"import', "os"]


def test_program_label_skips_setup_commands_and_assignments() -> None:
    assert program_label("cd /work/proj && make test") == "make"
    assert program_label("cd /x; ls") == "ls"
    assert program_label("cd /x || make") == "make"
    assert program_label("pushd /x && export A=1 && . env.sh && set -e; umask 022; pytest -q") == "pytest"
    assert program_label('cd "/a && b" && ls') == "ls"  # quoted operators are words
    assert program_label("FOO=1 cd /x && BAR=2 python3 x.py | head") == "python3"
    assert program_label("cd /x && grep -r foo . | wc -l") == "grep"  # the pipeline's first program
    assert program_label("(cd /x && npm test)") == "npm"
    assert program_label("cd /x && {\n  echo a\n  echo b\n} > out.txt") == "echo"  # a brace group
    assert program_label("! grep -q x f") == "grep"
    assert program_label("cd /x\nsource v/bin/activate\npython run.py") == "python"
    assert program_label('cd /x && python -c "unbalanced') == "python"  # lexer fails: loose split


def test_program_label_of_setup_commands_only_is_the_first_program() -> None:
    assert program_label("cd /x") == "cd"
    assert program_label("export A=1 && cd /x") == "export"
    assert program_label("A=1 B=2") == "bash"
    assert program_label("") == "bash"


def test_streamed_program_label_waits_until_nothing_can_change_it() -> None:
    assert streamed_program_label("cd /x && ma") is None
    assert streamed_program_label("cd /x && make") is None  # 'make' may still grow
    assert streamed_program_label("cd /x && make ") == "make"
    assert streamed_program_label("cd /x && make;") == "make"
    assert streamed_program_label('cd "/a b') is None  # an open quote
    assert streamed_program_label("FOO") is None and streamed_program_label("FOO=1 py ") == "py"
    assert streamed_program_label("cd /x") is None and streamed_program_label("cd /x\n") is None
    assert streamed_program_label("cd /x", final=True) == "cd"
    for cmd in ("cd /x && make test", "cd /x", 'cd /x && python -c "open', "A=1 ls -la"):
        assert streamed_program_label(cmd, final=True) == program_label(cmd)


def _shlex_tokens(s: str) -> list[tuple[str, bool]] | str:
    """What :func:`tokens` gave when it was stdlib shlex's two passes (the reference)."""
    import shlex

    lex = shlex.shlex(s, posix=False, punctuation_chars="();<>|&\n")
    lex.whitespace, lex.whitespace_split, lex.commenters = " \t\r", True, ""
    out = []
    try:
        for tok in lex:
            if set(tok) <= set("();<>|&\n"):
                out.append((tok, True))
            elif "'" in tok or '"' in tok or "\\" in tok:
                out.append(("".join(shlex.split(tok, comments=False, posix=True)), False))
            else:
                out.append((tok, False))
    except ValueError:
        return "error"
    return out


def test_tokens_are_stdlib_shlexs_on_random_lines() -> None:
    import random

    rng = random.Random(20)
    alphabet = list("ab \t\r\n'\"\\;|&<>()$#`{}=-x\uf8ff")
    for _ in range(20000):
        line = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        try:
            got: list[tuple[str, bool]] | str = list(tokens(line))
        except ShellSyntaxError:
            got = "error"
        assert got == _shlex_tokens(line), repr(line)


def _python_lines(fn: object, *args: object) -> int:
    """How many Python lines run during ``fn(*args)`` (a count of work, not a time)."""
    import sys

    count = 0

    def tracer(frame: object, event: str, arg: object) -> object:
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn(*args)  # type: ignore[operator]
    finally:
        sys.settrace(None)
    return count


@pytest.mark.parametrize(
    "shape", ["{w}", "'{w}'", '"{w}"', "x={w}", "'{w}'\"{w}\"", '"a\\\\{w}\\$"', "$(echo {w})", '"$(echo "{w}")"', "{e}"]
)
def test_lexing_work_does_not_grow_with_a_words_length(shape: str) -> None:
    """Issue 20: one 1 MiB word took 14 s (stdlib shlex grows a token a character at a time).
    The lexer now takes a constant number of Python steps per token, the characters being
    scanned by regular expressions and str methods (linear)."""
    from aospec.effects import classify_command

    def classify(n: int) -> int:
        line = "cat " + shape.format(w="a" * n, e="a\\\\b" * (n // 3)) + " | wc -l"
        return _python_lines(lambda: (classify_command.__wrapped__(line), program_label.__wrapped__(line)))

    classify(1 << 10)  # warm: a regular expression compiled (or evicted from re's cache) by other tests
    # The same work up to a few lines (a cache or the collector running in one call and not
    # the other); a lexer that steps per character would run some 60,000 lines more.
    small, big = classify(1 << 10), classify(1 << 16)
    assert big <= small + 64, (small, big)


def test_a_multi_mib_word_is_lexed_whole() -> None:
    from aospec.effects import classify_command
    from aospec.types import Effect

    word = "a" * (8 << 20)
    assert [t for t, _ in tokens(f"grep '{word}' f")] == ["grep", word, "f"]
    assert classify_command(f"cat {word} | wc -l") is Effect.READ_ONLY
    assert classify_command(f"echo {word} > f") is Effect.MAY_CHANGE
