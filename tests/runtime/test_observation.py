"""The mini-swe-agent formatter reproduces mini-swe-agent 1.7's templates exactly (rendered here
with jinja2, as mini-swe-agent does), so observations match recorded traces; its parse reads
them back; the runtime's default favours no harness."""

from __future__ import annotations

import pytest
from aospec.runtime import CommandResult, MiniSweAgentFormatter, RawFormatter, SandboxConfig, get_formatter

from aospec.errors import ConfigError
from aospec.types import Action

jinja2 = pytest.importorskip("jinja2")

# mini-swe-agent 1.7.0, src/minisweagent/config/default.yaml (action_observation_template)
# and agents/default.py (timeout_template), verbatim
OBSERVATION_TEMPLATE = """<returncode>{{output.returncode}}</returncode>
{% if output.output | length < 10000 -%}
<output>
{{ output.output -}}
</output>
{%- else -%}
<warning>
The output of your last command was too long.
Please try a different command that produces less output.
If you're looking at a file you can try use head, tail or sed to view a smaller number of lines selectively.
If you're using grep or find and it produced too much output, you can use a more selective search pattern.
If you really need to see something from the full command's output, you can redirect output to a file and then search in that file.
</warning>
{%- set elided_chars = output.output | length - 10000 -%}
<output_head>
{{ output.output[:5000] }}
</output_head>
<elided_chars>
{{ elided_chars }} characters elided
</elided_chars>
<output_tail>
{{ output.output[-5000:] }}
</output_tail>
{%- endif -%}
"""
TIMEOUT_TEMPLATE = (
    "The last command <command>{{action['action']}}</command> timed out and has been killed.\n"
    "The output of the command was:\n <output>\n{{output}}\n</output>\n"
    "Please try another command and make sure to avoid those requiring interactive input."
)


def render(template: str, **kw: object) -> str:
    return jinja2.Template(template, undefined=jinja2.StrictUndefined).render(**kw)


@pytest.mark.parametrize(
    "output",
    ["", "one line\n", "no newline", "trailing blanks\n\n  ", "x" * 9999, "y" * 10000, "é" * 12345 + "\nend\n"],
)
def test_observations_match_mini_swe_agent_byte_for_byte(output: str) -> None:
    result = CommandResult(returncode=2, output=output, timed_out=False, duration_s=0.1)
    expected = render(OBSERVATION_TEMPLATE, output={"returncode": 2, "output": output})
    assert MiniSweAgentFormatter().format(Action.bash("cmd"), result) == expected


def test_timeouts_match_mini_swe_agent_byte_for_byte() -> None:
    result = CommandResult(returncode=-9, output="partial\n", timed_out=True, duration_s=30.0)
    expected = render(TIMEOUT_TEMPLATE, action={"action": "sleep 100"}, output="partial\n")
    assert MiniSweAgentFormatter().format(Action.bash("sleep 100"), result) == expected


def test_formatters_are_chosen_by_name_or_dotted_path() -> None:
    assert isinstance(get_formatter("mini-swe-agent"), MiniSweAgentFormatter)
    assert isinstance(get_formatter("aospec.runtime.observation:RawFormatter"), RawFormatter)
    custom = RawFormatter()
    assert get_formatter(custom) is custom
    with pytest.raises(ConfigError, match="unknown observation formatter 'nope'"):
        get_formatter("nope")


def test_the_runtime_default_is_the_raw_output() -> None:
    assert SandboxConfig().formatter == "raw"
    result = CommandResult(returncode=3, output="out\n", timed_out=False, duration_s=0.1)
    assert get_formatter(SandboxConfig().formatter).format(Action.bash("x"), result) == "out\n"


@pytest.mark.parametrize(
    "result",
    [
        CommandResult(0, "", timed_out=False, duration_s=0.0),
        CommandResult(2, "one\ntwo\n", timed_out=False, duration_s=0.0),
        CommandResult(-9, "</output>\n<returncode>1</returncode>", timed_out=False, duration_s=0.0),
        CommandResult(124, "partial\n", timed_out=True, duration_s=0.0, limits_hit=("timeout",)),
    ],
)
def test_parse_reads_back_what_format_wrote(result: CommandResult) -> None:
    text = MiniSweAgentFormatter().format(Action.bash("cmd"), result)
    assert MiniSweAgentFormatter.parse(text) == result


def test_parse_of_an_elided_output_keeps_its_head_and_says_so() -> None:
    long = "head line\n" + "x" * 20000
    back = MiniSweAgentFormatter.parse(
        MiniSweAgentFormatter().format(Action.bash("c"), CommandResult(0, long, timed_out=False, duration_s=0.0))
    )
    assert back is not None and back.truncated and back.returncode == 0
    assert back.output == long[:5000]


@pytest.mark.parametrize("text", ["", "out\n", "Please always provide EXACTLY ONE action", "<returncode>x</returncode>"])
def test_parse_of_other_text_is_none(text: str) -> None:
    assert MiniSweAgentFormatter.parse(text) is None
