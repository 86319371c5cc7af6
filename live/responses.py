"""OpenAI Responses API conversations (``POST /v1/responses``), as serve-trace serves them and
``aospec proxy`` reads them (docs/integrations.md, "The Responses API").

A Responses conversation is the request's ``input``: a list of items. The model's replies
are runs of *reply items* (assistant ``message`` items, ``function_call`` items,
``reasoning`` items) that the harness appends back, each followed by what the harness
answers: a ``function_call_output`` item per tool call, or a ``user`` message. A string
``input`` is one user message.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = [
    "REPLY_ITEM_TYPES",
    "as_items",
    "call_of",
    "is_reply_item",
    "item_text",
    "replies",
    "reply_count",
    "task_text",
]

#: Item types only the model produces.
REPLY_ITEM_TYPES = frozenset({"function_call", "reasoning"})


def as_items(value: Any) -> list[Any] | None:
    """The items of an ``input``: a string is one user message; None for anything but a
    string or a list."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    return value if isinstance(value, list) else None


def is_reply_item(item: Any) -> bool:
    """Whether ``item`` is part of a model reply (an assistant message, a tool call, a
    reasoning item)."""
    if not isinstance(item, Mapping):
        return False
    kind = item.get("type", "message")
    return kind in REPLY_ITEM_TYPES or (kind == "message" and item.get("role") == "assistant")


def item_text(item: Any) -> str | None:
    """The text of a message item (its ``content`` string, or its text parts joined), of a
    ``function_call_output`` (its ``output`` string); None for other items."""
    if not isinstance(item, Mapping):
        return None
    kind = item.get("type", "message")
    if kind == "function_call_output":
        out = item.get("output")
        return out if isinstance(out, str) else None
    if kind != "message":
        return None
    content = item.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    return None


def replies(items: Sequence[Any]) -> Iterator[tuple[list[Any], Any | None]]:
    """Each reply (a maximal run of reply items) and the item that follows it (None at the
    end)."""
    i = 0
    while i < len(items):
        if not is_reply_item(items[i]):
            i += 1
            continue
        j = i
        while j < len(items) and is_reply_item(items[j]):
            j += 1
        yield list(items[i:j]), items[j] if j < len(items) else None
        i = j


def reply_count(items: Sequence[Any]) -> int:
    """How many replies ``items`` already holds."""
    return sum(1 for _ in replies(items))


def task_text(items: Sequence[Any]) -> str:
    """The user's text before the first reply (every user message's, one per line)."""
    out = []
    for item in items:
        if is_reply_item(item):
            break
        if isinstance(item, Mapping) and item.get("role") == "user":
            text = item_text(item)
            if text:
                out.append(text)
    return "\n".join(out)


def call_of(item: Mapping[str, Any]) -> dict[str, Any]:
    """A ``function_call`` item as a chat-completions tool call (``id`` is its ``call_id``)."""
    return {
        "id": item.get("call_id"),
        "type": "function",
        "function": {"name": item.get("name"), "arguments": item.get("arguments")},
    }
