"""aospec.live.chat.StreamFeed directly, across the attempts of one request: a retry whose content
falls short of what was already fed and then streams tool calls diverges (its calls would
follow text the reply does not have), while one whose content catches up exactly feeds only
the calls beyond what was fed."""

from __future__ import annotations

from aospec.live.chat import StreamFeed, tool_call_chunk


def _call(name: str = "", args: str = "", index: int = 0) -> dict[str, object]:
    function: dict[str, str] = {"arguments": args}
    if name:
        function["name"] = name
    return {"index": index, "function": function}


def test_a_retry_whose_text_stops_short_of_the_fed_text_then_calls_a_tool_diverges() -> None:
    seen: list[object] = []
    feed = StreamFeed(seen.append)
    feed.attempt()
    feed.content("THOUGHT: look ")
    feed.content("around")  # cut here
    feed.attempt()
    feed.content("THOUGHT: look ")  # a strict prefix of what was fed ...
    feed.tool_call(_call("bash", '{"command": "ls"}'))  # ... then a tool call
    assert feed.diverged
    assert seen == ["THOUGHT: look ", "around"]  # nothing of the retry's call
    feed.tool_call(_call("", "more"))
    feed.content("x")
    assert seen == ["THOUGHT: look ", "around"]


def test_a_retry_without_text_after_fed_text_then_calls_a_tool_diverges() -> None:
    seen: list[object] = []
    feed = StreamFeed(seen.append)
    feed.attempt()
    feed.content("THOUGHT: look")
    feed.attempt()
    feed.tool_call(_call("bash", "{}"))
    assert feed.diverged and seen == ["THOUGHT: look"]


def test_a_retry_whose_text_equals_the_fed_text_feeds_only_the_new_part_of_its_calls() -> None:
    seen: list[object] = []
    feed = StreamFeed(seen.append)
    feed.attempt()
    feed.content("THOUGHT: look")
    feed.tool_call(_call("bash", '{"comm'))  # cut here
    feed.attempt()
    feed.content("THOUGHT: ")
    feed.content("look")  # caught up exactly, nothing beyond
    feed.tool_call(_call("bash", '{"command": "ls"}'))
    assert not feed.diverged
    assert seen == [
        "THOUGHT: look",
        tool_call_chunk(_call("bash", '{"comm')),
        tool_call_chunk(_call("", 'and": "ls"}')),
    ]
