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
    redirection,
    simple_commands,
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
