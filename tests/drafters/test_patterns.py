"""PatternDrafter: mined templates, instantiated exactly, with calibrated probabilities."""

from __future__ import annotations

import anyio
from aospec.drafters.patterns import PatternDrafter, template_of

from aospec.evd import EVDEstimator, observation_pattern
from aospec.types import Action, History, Step, Trace

TIMEOUT = (
    "The last command <command>{}</command> timed out and has been killed.\n"
    "The output of the command was:\n <output>\n\n</output>\n"
    "Please try another command and make sure to avoid those requiring interactive input."
)
EMPTY = "<returncode>0</returncode>\n<output>\n</output>"


def _trace(pairs, task) -> Trace:
    steps = tuple(Step(action=Action.bash(c), observation=o, output_tokens=5, tool_duration_s=t) for c, o, t in pairs)
    return Trace(id=task, task=task, harness="h", actor_model="m", source="s", steps=steps)


TRAIN = [
    _trace(
        [
            ("python train.py", TIMEOUT.format("python train.py"), 30.0),
            ("cat > a.py <<'EOF'\nprint(1)\nEOF", EMPTY, 0.01),
            ("python a.py", "<returncode>0</returncode>\n<output>\n1\n</output>", 0.2),
        ],
        "t1",
    ),
    _trace(
        [
            ("python fit.py --epochs 3", TIMEOUT.format("python fit.py --epochs 3"), 30.0),
            ("cat > b.py <<'EOF'\nx = 2\nEOF", EMPTY, 0.01),
            ("python only_here.py", "<returncode>1</returncode>\n<output>\nunique error\n</output>", 0.1),
        ],
        "t2",
    ),
]


def _draft(drafter, history, cmd, n=5):
    return anyio.run(drafter.draft, history, Action.bash(cmd), n)


def test_templates_slot_the_echoed_command():
    assert template_of(TIMEOUT.format("ls -la"), "ls -la") == TIMEOUT.format("\x00CMD\x00")
    assert template_of("no echo here", "ls") == "no echo here"


def test_timeout_template_is_instantiated_exactly_for_a_new_command():
    d = PatternDrafter()
    d.fit(TRAIN)
    drafts = _draft(d, History("task"), "python evaluate.py")
    texts = [x.text for x in drafts]
    assert TIMEOUT.format("python evaluate.py") in texts
    assert "<returncode>1</returncode>\n<output>\nunique error\n</output>" not in texts  # one task only
    top = drafts[0]
    assert top.text == TIMEOUT.format("python evaluate.py")
    assert 0 < top.probability < 1
    assert top.template == observation_pattern(top.text, "python evaluate.py")


def test_context_decides_the_likely_template():
    d = PatternDrafter()
    d.fit(TRAIN)
    heredoc = _draft(d, History("task"), "cat > c.py <<'EOF'\ny = 3\nEOF")
    assert heredoc[0].text == EMPTY
    p_timeout_python = {x.text: x.probability for x in _draft(d, History("task"), "python run.py")}
    p_timeout_heredoc = {x.text: x.probability for x in heredoc}
    t_python = TIMEOUT.format("python run.py")
    t_heredoc = TIMEOUT.format("cat > c.py <<'EOF'\ny = 3\nEOF")
    assert p_timeout_python[t_python] > p_timeout_heredoc.get(t_heredoc, 0.0)


def test_the_trajectory_own_outcomes_raise_their_probability():
    d = PatternDrafter()
    d.fit(TRAIN)
    before = {x.text: x.probability for x in _draft(d, History("task"), "python go.py")}
    h = History("task").extend(Action.bash("python go.py"), TIMEOUT.format("python go.py"))
    after = {x.text: x.probability for x in _draft(d, h, "python go.py")}
    assert after[TIMEOUT.format("python go.py")] > before[TIMEOUT.format("python go.py")]


def test_drafts_group_with_their_history_under_the_pattern_kernel():
    d = PatternDrafter()
    d.fit(TRAIN)
    est = EVDEstimator()
    est.fit(TRAIN)
    top = _draft(d, History("task"), "python new.py")[0]
    assert est.tool_time(top) == 30.0
