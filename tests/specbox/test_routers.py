"""The intent routers: labels, streams, keyword firing at gamma, TF-IDF incremental scoring,
the exact parse router, assemblies, and fitting on training traces only."""

from __future__ import annotations

import json

import numpy as np
import pytest
from aospec.specbox.routers import (
    Assembly,
    Keyword,
    KeywordRouter,
    ParseRouter,
    RouteEvent,
    StreamStep,
    TfidfRouter,
    ToolCallDelta,
    evaluate_router,
    parse_chunk,
    step_stream,
    stream_steps,
    tokenize,
    tool_label,
)

from aospec.errors import ConfigError
from aospec.types import Action, History, Step, Trace


def _trace(task: str, steps: list[tuple[str | None, Action]]) -> Trace:
    return Trace(
        id=f"{task}/t",
        task=task,
        harness="test",
        actor_model="m",
        source="test",
        steps=tuple(Step(action=a, observation="ok", output_tokens=1, reply=r) for r, a in steps),
    )


def _bash_trace(task: str) -> Trace:
    return _trace(
        task,
        [
            ("THOUGHT: list the directory to see the files\n\n```bash\nls -la\n```", Action.bash("ls -la")),
            ("THOUGHT: read the source file contents\n\n```bash\ncat main.py\n```", Action.bash("cat main.py")),
            (
                "THOUGHT: run the test script with python\n\n```bash\npython3 test.py\n```",
                Action.bash("python3 test.py"),
            ),
        ],
    )


# ---------------------------------------------------------------- labels and streams


def test_tool_label_is_the_program_past_setup_commands() -> None:
    assert tool_label(Action.bash("cd /app && ls -la")) == "ls"
    assert tool_label(Action.bash("cd /app")) == "cd"
    assert tool_label(Action.bash("FOO=1 BAR=2 python3 x.py | head")) == "python3"
    assert tool_label(Action.bash("'my prog' arg")) == "my prog"
    assert tool_label(Action.bash('python -c "unbalanced')) == "python"  # lexer fails: loose split
    assert tool_label(Action("get_user_details", {"user_id": "x"})) == "get_user_details"
    assert tool_label(Action.none()) == "none"


def test_tokenize_round_trips_and_splits_words() -> None:
    text = "THOUGHT: run it\n\n```bash\npython3 -m pytest  tests/\n```"
    toks = tokenize(text)
    assert "".join(toks) == text
    assert " run" in toks and "python" in toks


def test_shell_stream_stops_at_the_end_of_the_command() -> None:
    step = Step(
        action=Action.bash("ls -la"), observation="", output_tokens=1, reply="look\n```bash\nls -la\n```\nafter"
    )
    assert "".join(step_stream(step)) == "look\n```bash\nls -la"
    bare = Step(action=Action.bash("ls"), observation="", output_tokens=1, reply=None)
    assert "".join(step_stream(bare)) == "```bash\nls"


def test_tool_call_stream_is_name_then_argument_tokens() -> None:
    step = Step(action=Action("cancel_reservation", {"reservation_id": "ABC"}), observation="", output_tokens=1)
    deltas = step_stream(step)
    assert deltas[0] == ToolCallDelta("cancel_reservation", "")
    assert all(isinstance(d, ToolCallDelta) and d.name is None for d in deltas[1:])
    assert json.loads("".join(d.arguments for d in deltas[1:])) == {"reservation_id": "ABC"}


def test_parse_chunk_reads_openai_deltas() -> None:
    chunk = {
        "choices": [
            {
                "delta": {
                    "tool_calls": [{"index": 0, "id": "c1", "function": {"name": "get_user_details", "arguments": ""}}]
                }
            }
        ]
    }
    assert parse_chunk(chunk) == [ToolCallDelta("get_user_details", "", 0)]
    assert parse_chunk(json.dumps(chunk)) == [ToolCallDelta("get_user_details", "", 0)]
    more = {"tool_calls": [{"index": 0, "function": {"arguments": '{"user'}}]}
    assert parse_chunk(more) == [ToolCallDelta(None, '{"user', 0)]
    assert parse_chunk({"content": "hi"}) == ["hi"]
    assert parse_chunk("plain text") == ["plain text"]
    with pytest.raises(ConfigError):
        parse_chunk(42)
    with pytest.raises(ConfigError):
        parse_chunk({"tool_calls": [{"function": {"name": 3}}]})


# ---------------------------------------------------------------- keyword router


def _kw(gamma: int = 2) -> KeywordRouter:
    profiles = {w: Keyword("grep", 1.0, 5) for w in ("search", "pattern", "matches")}
    profiles["directory"] = Keyword("ls", 0.5, 3)
    return KeywordRouter(profiles, gamma=gamma)


def test_keyword_fires_at_exactly_gamma_distinct_keywords() -> None:
    s = _kw(gamma=2).session()
    assert s.feed("let me search ") == []
    assert s.feed("search again ") == []  # a repeat is not a second keyword
    assert s.feed("Search. ") == []  # nor is it with other case or a full stop
    events = s.feed("for the pattern ")
    assert events == [RouteEvent("grep", 1.0, 4, "keyword")]
    assert s.feed("matches ") == []  # each tool fires once per session


def test_keyword_gamma_three_needs_three() -> None:
    s = _kw(gamma=3).session()
    assert s.feed("search pattern ") == []
    assert [e.tool for e in s.feed("matches ")] == ["grep"]


def test_keyword_words_split_across_deltas_and_complete_only_at_a_boundary() -> None:
    s = _kw(gamma=2).session()
    assert s.feed("sea") == []
    assert s.feed("rch patt") == []  # 'search' complete; 'patt' pending
    assert s.feed("ern") == []  # 'pattern' still pending (could go on)
    assert [e.tool for e in s.feed(",")] == ["grep"]
    s2 = _kw(gamma=2).session()
    s2.feed("search pattern")
    assert [e.tool for e in s2.close()] == ["grep"]  # the end of the stream completes it


def test_keyword_subscribers_receive_events() -> None:
    got: list[RouteEvent] = []
    s = _kw(gamma=1).session()
    s.subscribe(got.append)
    s.feed("search ")
    assert [e.tool for e in got] == ["grep"]


def test_keyword_fit_learns_discriminative_words_and_declared_ones() -> None:
    traces = [_bash_trace(f"task{i}") for i in range(3)]
    kw = KeywordRouter.fit(traces, min_support=2, min_purity=0.9, declared={"rg": ["ripgrep"]})
    assert "ls" in kw.keywords("ls") and "directory" in kw.keywords("ls")
    assert "thought" not in kw.profiles  # in every stream: not discriminative
    assert kw.profiles["ripgrep"] == Keyword("rg", 1.0, 0)
    with pytest.raises(ConfigError):
        KeywordRouter({}, gamma=0)


# ---------------------------------------------------------------- TF-IDF router


def test_tfidf_incremental_vector_equals_sklearn_transform_of_the_prefix() -> None:
    traces = [_bash_trace(f"task{i}") for i in range(3)]
    tf = TfidfRouter.fit(traces)
    reader = tf.reader()
    text = "THOUGHT: read the  source\tfile with cat now "
    for tok in tokenize(text):
        reader.feed(tok, None)
    # The trailing space completed every word.
    qw = tf.word_vec.transform([text])
    qc = tf.char_vec.transform([text])
    expected = (qw @ tf.xw_t).toarray()[0] + (qc @ tf.xc_t).toarray()[0]
    np.testing.assert_allclose(reader.query_sims(), expected / 2, rtol=1e-9, atol=1e-12)


def test_tfidf_routes_to_the_nearest_training_streams() -> None:
    traces = [_bash_trace(f"task{i}") for i in range(3)]
    tf = TfidfRouter.fit(traces, top_n=3, threshold=0.9, min_words=3)
    s = tf.session()
    events = [e for tok in tokenize("THOUGHT: run the test script with python ") for e in s.feed(tok)]
    assert [e.tool for e in events] == ["python3"]
    assert s.ranking()[0] == "python3"


def test_tfidf_never_fires_non_calls() -> None:
    traces = [
        _trace(
            f"t{i}", [("hello, how can I help you today with your booking", Action("respond", {"content": "hello"}))]
        )
        for i in range(3)
    ] + [_bash_trace("b")]
    tf = TfidfRouter.fit(traces, threshold=0.5, min_words=1)
    s = tf.session()
    events = [e for tok in tokenize("hello, how can I help you today ") for e in s.feed(tok)]
    assert events == []
    assert "respond" not in s.ranking()


# ---------------------------------------------------------------- parse router


def test_parse_router_fires_when_the_program_word_completes() -> None:
    s = ParseRouter().session()
    assert s.feed("THOUGHT: x\n```bash\n") == []
    assert s.feed("FOO=1 pyth") == []
    assert s.feed("on3") == []
    assert [(e.tool, e.confidence) for e in s.feed(" x.py")] == [("python3", 1.0)]
    t = ParseRouter().session()
    assert [e.tool for e in t.feed(ToolCallDelta("book_reservation", ""))] == ["book_reservation"]


def _parse_events(deltas: list[str], *, close: bool = False) -> list[tuple[str, int]]:
    s = ParseRouter().session()
    got = [(e.tool, e.position) for d in deltas for e in s.feed(d)]
    return got + ([(e.tool, e.position) for e in s.close()] if close else [])


def test_parse_router_reads_past_cd_to_the_next_program() -> None:
    deltas = ["```bash\n", "cd", " /work", "/proj", " &&", " make", " test"]
    assert _parse_events(deltas) == [("make", 7)]  # 'make' is complete once ' test' streamed
    assert _parse_events(["```bash\n", "cd /x && ", "FOO=1 ", "py", "thon3", " -m"]) == [("python3", 6)]
    assert _parse_events(["```bash\n", 'cd "/a ', 'b" ;', " export A=1\n", "pytest", " -q"]) == [("pytest", 6)]
    # A cd alone: named when the block closes or the stream ends, not while more could follow.
    assert _parse_events(["```bash\n", "cd /x", "\n"]) == []
    assert _parse_events(["```bash\n", "cd /x", "\n", "```"]) == [("cd", 4)]
    assert _parse_events(["```bash\n", "cd", " /x"], close=True) == [("cd", 3)]
    assert _parse_events(["THOUGHT: x\n"], close=True) == []
    assert _parse_events(["```bash\n", "ls", " -la"]) == [("ls", 3)]  # no setup: as before


def test_parse_router_fires_the_label_of_the_whole_command() -> None:
    commands = [
        "cd /work/proj && make test",
        "cd /x; export A=1 && source .venv/bin/activate && pytest -q tests",
        "cd /x || exit 1",
        "pushd /x >/dev/null && git status | head",
        "cd /x",
        "FOO=1 BAR=2 python3 x.py | head",
        "(cd /x && npm test)",
        'cd /x && python -c "unbalanced',
    ]
    for cmd in commands:
        deltas = tokenize("```bash\n" + cmd + "\n```")
        s = ParseRouter().session()
        assert [e.tool for d in deltas for e in s.feed(d)] == [tool_label(Action.bash(cmd))], cmd


# ---------------------------------------------------------------- assemblies


class _Fixed:
    """A router that fires given tools after given deltas (1-based positions)."""

    def __init__(self, name: str, plan: dict[int, list[tuple[str, float]]]) -> None:
        self.name = name
        self.plan = plan

    def reader(self) -> object:
        plan = self.plan

        class R:
            def __init__(self) -> None:
                self.n = 0
                self.sc: dict[str, float] = {}

            def feed(self, text: str, name: str | None) -> list[tuple[str, float]]:
                self.n += 1
                hits = plan.get(self.n, [])
                self.sc = {**self.sc, **dict(hits)}
                return hits

            def finish(self) -> list[tuple[str, float]]:
                return []

            def scores(self) -> dict[str, float]:
                return dict(self.sc)

            def ranking(self) -> list[str]:
                return sorted(self.sc, key=lambda t: -self.sc[t])

        return R()


def _run(router: Assembly, n: int) -> list[tuple[str, int]]:
    s = router.session()
    return [(e.tool, e.position) for _ in range(n) for e in s.feed("x ")]


def test_union_fires_on_the_first_member_intersection_on_the_last() -> None:
    a = _Fixed("a", {1: [("cat", 0.9)], 3: [("ls", 0.8)]})
    b = _Fixed("b", {2: [("cat", 0.7)], 4: [("grep", 0.6)]})
    assert _run(Assembly([a, b], "union"), 5) == [("cat", 1), ("ls", 3), ("grep", 4)]  # type: ignore[list-item]
    assert _run(Assembly([a, b], "intersection"), 5) == [("cat", 2)]  # type: ignore[list-item]
    s = Assembly([a, b], "intersection").session()  # type: ignore[list-item]
    s.feed("x")
    assert s.feed("x")[0].confidence == pytest.approx(0.7)


def test_weighted_fires_when_the_weighted_scores_reach_the_threshold() -> None:
    a = _Fixed("a", {1: [("cat", 0.9)]})
    b = _Fixed("b", {3: [("cat", 0.4)]})
    w = Assembly([a, b], "weighted", weights=[0.5, 0.5], threshold=0.6)  # type: ignore[list-item]
    assert _run(w, 4) == [("cat", 3)]  # 0.45 alone, 0.65 with b
    with pytest.raises(ConfigError):
        Assembly([a], "vote")  # type: ignore[list-item, arg-type]
    with pytest.raises(ConfigError):
        Assembly([])


# ---------------------------------------------------------------- fitting and scoring


def test_routers_fitted_on_train_never_see_eval_tasks() -> None:
    train = [_bash_trace("train-a"), _bash_trace("train-b")]
    held = _trace(
        "held", [("THOUGHT: compile the sources with gcc\n```bash\ngcc -O2 x.c\n```", Action.bash("gcc -O2 x.c"))]
    )
    kw = KeywordRouter.fit(train, min_support=1)
    tf = TfidfRouter.fit(train)
    assert "gcc" not in kw.profiles
    assert "gcc" not in set(tf.labels) and len(tf.labels) == 2 * 6  # 2 traces x 3 steps x 2 prefixes
    score = evaluate_router(Assembly([kw, tf]), stream_steps([held]))
    assert score.calls == 1 and score.tp == 0 and score.fn == 1


def test_evaluate_counts_only_events_before_the_last_delta() -> None:
    # The program word completes only with the last delta ('\n' after 'ls' is not there).
    step = StreamStep(("```bash\n", "ls"), "ls", "t")
    score = evaluate_router(ParseRouter(), [step])
    assert (score.tp, score.fn, score.covered) == (0, 1, 0)
    step2 = StreamStep(("```bash\n", "ls", " ", "-la"), "ls", "t")
    score2 = evaluate_router(ParseRouter(), [step2])
    assert (score2.tp, score2.fp, score2.covered) == (1, 0, 1)
    assert score2.fire_positions == (3 / 4,)
    assert score2.to_json()["micro_f1"] == 1.0


def test_false_positives_on_non_calls_count_against_precision() -> None:
    kw = KeywordRouter({"search": Keyword("grep", 1.0, 1)}, gamma=1)
    steps = [StreamStep(("we search ", "now"), "respond", "t"), StreamStep(("search ", "x"), "grep", "t")]
    j = evaluate_router(kw, steps).to_json()
    assert (j["precision"], j["recall"], j["non_calls"]) == (0.5, 1.0, 1)


def test_an_exact_fire_settles_the_assembly() -> None:
    learned = _Fixed("a", {1: [("cat", 0.9)], 4: [("grep", 0.9)]})
    union = Assembly([learned, ParseRouter()], "union")  # type: ignore[list-item]
    s = union.session()
    got = [(e.tool, e.position) for d in ("x ", "```bash\n", "ls ", "-la ", "/app") for e in s.feed(d)]
    # The learned guess before the program is known is passed on; after 'ls' nothing else.
    assert got == [("cat", 1), ("ls", 3)]


# ---------------------------------------------------------------- context, prior gate, settling


def test_stream_steps_carry_the_earlier_labels_as_context() -> None:
    steps = stream_steps([_bash_trace("a")])
    assert [s.context for s in steps] == [(), ("ls",), ("ls", "cat")]


class _Prior:
    """A next-tool model: 'cat' is likely after 'ls', nothing else is."""

    def distribution(self, labels: list[str]) -> dict[str, float]:
        return {"cat": 0.9, "grep": 0.1} if labels[-1:] == ["ls"] else {"cat": 0.1, "grep": 0.1}


def test_prior_gate_drops_implausible_learned_guesses_only_with_a_context() -> None:
    learned = _Fixed("a", {1: [("grep", 0.9)], 2: [("cat", 0.9)]})
    gated = Assembly([learned, ParseRouter()], prior=_Prior(), min_prior=0.5)  # type: ignore[list-item]
    s = gated.session(["ls"])
    got = [(e.tool, e.position) for d in ("x ", "y ", "```bash\n", "grep -r x") for e in s.feed(d)]
    # grep is implausible after ls as a guess, but the exact parse is never gated.
    assert got == [("cat", 2), ("grep", 4)]
    # Without a context (the engine's plain session()) nothing is gated.
    plain = gated.session()
    assert [e.tool for d in ("x ", "y ") for e in plain.feed(d)] == ["grep", "cat"]
    with pytest.raises(ConfigError):
        Assembly([learned], min_prior=0.5)  # type: ignore[list-item]


def test_a_session_takes_the_branch_history_as_its_labels() -> None:
    learned = _Fixed("a", {1: [("grep", 0.9)], 2: [("cat", 0.9)]})
    gated = Assembly([learned, ParseRouter()], prior=_Prior(), min_prior=0.5)  # type: ignore[list-item]
    history = History("t").extend(Action.bash("cd /app && ls -la"), "x")  # labelled 'ls'
    for context in (history, ["ls"]):
        s = gated.session(context)
        assert [e.tool for d in ("x ", "y ") for e in s.feed(d)] == ["cat"]
    empty = gated.session(History("t"))  # nothing known yet: P(. | start) gates both
    assert [e.tool for d in ("x ", "y ") for e in empty.feed(d)] == []
    plain = gated.session()
    assert [e.tool for d in ("x ", "y ") for e in plain.feed(d)] == ["grep", "cat"]


def test_evaluate_router_passes_each_steps_context() -> None:
    learned = _Fixed("a", {1: [("grep", 0.9)]})
    gated = Assembly([learned], prior=_Prior(), min_prior=0.5)  # type: ignore[list-item]
    after_ls = StreamStep(("x ", "y ", "z"), "grep", "t", ("ls",))
    first = StreamStep(("x ", "y ", "z"), "grep", "t", ())
    assert evaluate_router(gated, [after_ls]).tp == 0
    assert evaluate_router(gated, [first]).tp == 0  # P(grep | start) = 0.1 too
    assert evaluate_router(Assembly([learned]), [after_ls]).tp == 1  # type: ignore[list-item]


def _call_trace(task: str) -> Trace:
    return _trace(
        task,
        [
            (None, Action("get_user_details", {"user_id": "mia_li_3668"})),
            (None, Action("get_reservation_details", {"reservation_id": "ABC123"})),
            (None, Action("cancel_reservation", {"reservation_id": "ABC123"})),
        ],
    )


def test_tfidf_settles_after_a_tool_call_name() -> None:
    traces = [_call_trace(f"t{i}") for i in range(3)]
    settled = TfidfRouter.fit(traces, top_n=1, threshold=0.9, min_words=1)
    free = settled.with_params(settle_on_call=False)
    name = ToolCallDelta("get_reservation_details", "")
    # Argument text that reads like cancel_reservation's training stream.
    args = [ToolCallDelta(None, t) for t in tokenize('{"reservation_id": "ABC123"} ' + "cancel_reservation " * 8)]
    s_free, s_settled = free.session(), settled.session()
    many = [e.tool for d in [name, *args] for e in s_free.feed(d)]
    one = [e.tool for d in [name, *args] for e in s_settled.feed(d)]
    assert one == ["get_reservation_details"]
    assert many == ["get_reservation_details", "cancel_reservation"]
