"""How an actor talks to a chat model: replies, the chat format, and what every actor shares.

A :class:`History` holds the task and the (action, observation) turns; a chat model sees
messages. :class:`ChatFormat` turns one into the other and parses a reply back into an
:class:`~aospec.types.Action`:

- the system message is ``system_template``; the first user message is
  ``instance_template`` with ``{task}`` replaced by the task (only that placeholder is
  replaced, so templates may hold other braces);
- turn *k* is an assistant message, the *reply text* that decoded it, then the observation
  verbatim (a user message; with ``action_format="tools"`` a ``tool`` message answering the
  assistant's tool call, whose id ``call_<k>`` depends only on the step index, so the same
  history gives a byte-identical request in every run);
- the History does not carry reply texts, so every actor keeps a :class:`ReplyMemo` of the
  decodes it finished (history digest -> :class:`Reply`) and renders earlier turns from it.
  A turn whose reply is unknown (a history taken from a recorded trace) is rendered from
  its action: a canonical ```` ```bash ```` block, or a tool call with canonical JSON
  arguments.

The memo also makes each history's reply unique within a run: a history decoded once
returns the memoised action without a new request, so the verified path and an adopted
provisional branch always agree.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, Self

from aospec.errors import AospecError, ConfigError
from aospec.types import Action, History, canonical_json, version_hash

__all__ = [
    "BASH_TOOL",
    "DEFAULT_FORMAT_ERROR",
    "DEFAULT_INSTANCE_TEMPLATE",
    "DEFAULT_SYSTEM_TEMPLATE",
    "ActorError",
    "ActorStats",
    "ChatFormat",
    "DeterminismReport",
    "MemoActor",
    "Reply",
    "ReplyMemo",
    "StreamFeed",
    "estimate_tokens",
    "history_digests",
    "history_key",
    "tool_call_id",
]

DEFAULT_SYSTEM_TEMPLATE = """\
You are a helpful assistant that can interact with a computer shell to solve tasks.

Your response must contain exactly ONE bash code block with ONE command (or commands \
connected with && or ||). Include a THOUGHT section before your command where you explain \
your reasoning.

<format_example>
THOUGHT: Your reasoning and analysis here

```bash
your_command_here
```
</format_example>

Failure to follow these rules will cause your response to be rejected. When the task is \
done, run `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` as your only command."""

DEFAULT_INSTANCE_TEMPLATE = "{task}"

DEFAULT_FORMAT_ERROR = (
    "Please always provide EXACTLY ONE action in triple backticks (```bash ... ```), or exactly one tool call."
)

#: The bash tool of ``action_format="tools"`` (OpenAI function-calling schema).
BASH_TOOL: Mapping[str, Any] = MappingProxyType(
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run one shell command and return its exit status and output.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string", "description": "the command line"}},
                "required": ["command"],
            },
        },
    }
)

# mini-swe-agent's default action regex, also accepting ```sh/```shell blocks.
_BLOCK = re.compile(r"```(?:bash|sh|shell)[ \t]*\n(.*?)\n[ \t]*```", re.DOTALL)


class ActorError(AospecError):
    """A model endpoint or local model failed: names the URL (or model), the HTTP status
    when there was one, and an excerpt of what the server said."""

    def __init__(
        self, message: str, *, url: str | None = None, status: int | None = None, body: str | None = None
    ) -> None:
        self.url = url
        self.status = status
        self.body = body
        super().__init__(message)


def estimate_tokens(text: str) -> int:
    """The estimate used when an endpoint reports no usage: ceil(characters / 4)."""
    return math.ceil(len(text) / 4)


@dataclass(frozen=True, slots=True)
class Reply:
    """One finished decode.

    ``output_tokens`` comes from the endpoint's usage; only when it sent none is it
    ``ceil(len(text) / 4)`` and ``tokens_estimated`` True. ``latency_ns`` runs from the
    request's start to its last byte, ``first_token_ns`` to the first content (or tool
    call) byte, None when not streamed.
    """

    text: str
    action: Action
    output_tokens: int
    tokens_estimated: bool
    latency_ns: int
    first_token_ns: int | None
    tool_calls: tuple[Mapping[str, Any], ...] = ()
    finish_reason: str | None = None


def tool_call_id(step: int) -> str:
    """The tool-call id of turn ``step`` in requests (deterministic, so requests repeat)."""
    return f"call_{step}"


@dataclass(frozen=True)
class ChatFormat:
    """How a History becomes chat messages and a reply becomes an Action.

    ``action_format`` is ``"bash"`` (the reply holds exactly one ```` ```bash ```` block,
    ```` ```sh ```` and ```` ```shell ```` also accepted; its stripped content is the
    command) or ``"tools"`` (the reply makes exactly one tool call, sent with ``tools``).
    A reply that does not is ``Action.none()``; the harness answers it with
    ``format_error`` (the observation of that turn).
    """

    system_template: str = DEFAULT_SYSTEM_TEMPLATE
    instance_template: str = DEFAULT_INSTANCE_TEMPLATE
    action_format: Literal["bash", "tools"] = "bash"
    format_error: str = DEFAULT_FORMAT_ERROR
    tools: tuple[Mapping[str, Any], ...] = field(default=(BASH_TOOL,), hash=False)

    def __post_init__(self) -> None:
        if self.action_format not in ("bash", "tools"):
            raise ConfigError(f"action_format must be 'bash' or 'tools', got {self.action_format!r}")

    @classmethod
    def from_files(cls, system: str | Path | None = None, instance: str | Path | None = None, **kw: Any) -> ChatFormat:
        """Templates read from files (a ``str`` is a path too); None keeps the default."""
        sys_t = DEFAULT_SYSTEM_TEMPLATE if system is None else Path(system).read_text(encoding="utf-8")
        inst_t = DEFAULT_INSTANCE_TEMPLATE if instance is None else Path(instance).read_text(encoding="utf-8")
        if "{task}" not in inst_t:
            raise ConfigError(f"instance template {instance} has no {{task}} placeholder")
        return cls(system_template=sys_t, instance_template=inst_t, **kw)

    # -- rendering ---------------------------------------------------------------------

    def instance(self, task: str) -> str:
        """The first user message for ``task``."""
        return self.instance_template.replace("{task}", task)

    def render_action(self, action: Action) -> str:
        """The canonical reply text of an action whose reply is unknown."""
        if action.is_none:
            return ""
        if action.command is not None and len(action.args) == 1:
            return f"```bash\n{action.command}\n```"
        return f"```{action.tool}\n{canonical_json(action.to_json()['args'])}\n```"

    def tool_request_bodies(self) -> dict[str, Any]:
        """Extra request fields of this format (``tools`` for the tool-call format)."""
        if self.action_format != "tools":
            return {}
        return {"tools": [json.loads(json.dumps(dict(t), default=dict)) for t in self.tools]}

    def messages(self, history: History, replies: Sequence[Reply | None] = ()) -> list[dict[str, Any]]:
        """The chat messages that ask for the action after ``history``.

        ``replies[k]`` is the reply that decoded turn ``k`` (None or missing: unknown,
        rendered from the action).
        """
        out: list[dict[str, Any]] = [
            {"role": "system", "content": self.system_template},
            {"role": "user", "content": self.instance(history.task)},
        ]
        for k, turn in enumerate(history.turns):
            reply = replies[k] if k < len(replies) else None
            if self.action_format == "tools" and not turn.action.is_none:
                cid = tool_call_id(k)
                args = None
                if reply is not None and len(reply.tool_calls) == 1:
                    fn = reply.tool_calls[0].get("function") or {}
                    if isinstance(fn.get("arguments"), str):
                        args = fn["arguments"]
                if args is None:
                    args = canonical_json(turn.action.to_json()["args"])
                out.append(
                    {
                        "role": "assistant",
                        "content": reply.text if reply is not None else "",
                        "tool_calls": [
                            {"id": cid, "type": "function", "function": {"name": turn.action.tool, "arguments": args}}
                        ],
                    }
                )
                out.append({"role": "tool", "tool_call_id": cid, "content": turn.observation})
                continue
            text = reply.text if reply is not None else self.render_action(turn.action)
            out.append({"role": "assistant", "content": text})
            out.append({"role": "user", "content": turn.observation})
        return out

    # -- parsing -------------------------------------------------------------------------

    def parse(self, text: str, tool_calls: Sequence[Mapping[str, Any]] = ()) -> Action:
        """The action of a reply; ``Action.none()`` unless it holds exactly one action."""
        if self.action_format == "tools":
            if len(tool_calls) != 1:
                return Action.none()
            fn = tool_calls[0].get("function") or {}
            name, raw = fn.get("name"), fn.get("arguments") or "{}"
            if not isinstance(name, str) or not name or not isinstance(raw, str):
                return Action.none()
            try:
                args = json.loads(raw) if raw.strip() else {}
            except ValueError:
                return Action.none()
            if not isinstance(args, dict):
                return Action.none()
            if name == "bash" and isinstance(args.get("command"), str) and len(args) == 1:
                return Action.bash(args["command"].strip())
            try:
                return Action(name, args)
            except (TypeError, ValueError):
                return Action.none()
        found = _BLOCK.findall(text)
        if len(found) != 1:
            return Action.none()
        return Action.bash(found[0].strip())


def history_digests(history: History) -> Iterator[str]:
    """The digest of every prefix of ``history``: turns 0, 1, ..., len (chained, so all of
    them cost one pass)."""
    d = version_hash("history", history.task)
    yield d
    for turn in history.turns:
        d = version_hash(d, turn.action.key, turn.observation)
        yield d


def history_key(history: History) -> str:
    """The digest of a whole history (task, actions and observations, exactly)."""
    d = ""
    for d in history_digests(history):  # noqa: B007
        pass
    return d


@dataclass
class ActorStats:
    """Counters of one actor (requests includes retries; cancelled_requests the decodes
    cancelled while a request was in flight; memo_hits the decodes answered from the memo;
    duplicate_replies the finished decodes of a history another decode had already
    answered, whose reply was dropped for the memoised one)."""

    requests: int = 0
    retries: int = 0
    cancelled_requests: int = 0
    failed_requests: int = 0
    memo_hits: int = 0
    duplicate_replies: int = 0
    replies: int = 0
    output_tokens: int = 0
    estimated_replies: int = 0
    latency_ns: int = 0

    def to_json(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True, slots=True)
class DeterminismReport:
    """Two requests for the same history, sent without the memo: ``identical`` when the
    replies agree byte for byte (text and tool calls). ``differs_at`` is the first
    character where the texts differ (None when they agree)."""

    identical: bool
    first: Reply
    second: Reply
    differs_at: int | None = None

    @classmethod
    def compare(cls, first: Reply, second: Reply) -> DeterminismReport:
        same = first.text == second.text and _calls(first) == _calls(second)
        at = None
        if first.text != second.text:
            at = next(
                (i for i, (a, b) in enumerate(zip(first.text, second.text, strict=False)) if a != b),
                min(len(first.text), len(second.text)),
            )
        return cls(same, first, second, at)


def _calls(reply: Reply) -> list[tuple[Any, Any]]:
    return [
        ((c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments")) for c in reply.tool_calls
    ]


@dataclass
class ReplyMemo:
    """History digest -> the Reply that decoded it, for one actor in one run.

    ``settle`` keeps the first reply of a history and returns the one kept: when two
    decodes of the same history finish (a verified decode and a provisional branch), both
    get the same action.
    """

    _replies: dict[str, Reply] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._replies)

    def get(self, history: History) -> Reply | None:
        return self._replies.get(history_key(history))

    def settle(self, history: History, reply: Reply) -> Reply:
        return self._replies.setdefault(history_key(history), reply)

    def replies_for(self, history: History) -> list[Reply | None]:
        """The known reply of every turn of ``history`` (None when unknown)."""
        digests = list(history_digests(history))
        return [self._replies.get(d) for d in digests[:-1]]

    def clear(self) -> None:
        self._replies.clear()


OnDelta = Callable[[object], None]


def tool_call_chunk(call: Mapping[str, Any]) -> dict[str, Any]:
    """A chat-completions chunk carrying one tool-call delta (what ``on_delta`` gets)."""
    return {"choices": [{"index": 0, "delta": {"tool_calls": [dict(call)]}}]}


class StreamFeed:
    """What ``on_delta`` sees of one streaming decode, across the request's attempts: every
    piece of the reply once, in order.

    Content arrives as ``str`` deltas, tool calls as chunk dicts
    (``{"choices": [{"delta": {"tool_calls": [...]}}]}``, :func:`tool_call_chunk`). When a
    request is retried (a 5xx, a timeout, a stream cut mid-way), the new attempt streams the
    reply from its start again; the feed passes on only what goes beyond what was already fed
    (a deterministic server repeats the same prefix), so a router never reads the start of
    the reply twice. If the retried attempt *differs* from what was fed, the feed stops: the
    router has read a prefix of a reply that will not be the result, and nothing of the new
    one is fed after it (``diverged``; its events so far were bets, which speculation may
    lose but never commits). A reply known at once (the memo, a server that answers
    ``stream: true`` with one JSON body) is fed whole (:meth:`whole`): its text in one
    delta, then one chunk per tool call.
    """

    __slots__ = ("_calls", "_fed_calls", "_synced", "_text", "diverged", "fed", "on_delta")

    def __init__(self, on_delta: OnDelta) -> None:
        self.on_delta = on_delta
        self.fed = ""  # content passed on, over all attempts
        self.diverged = False
        self._fed_calls: dict[int, list[str]] = {}  # index -> [name, arguments] passed on
        self._text = ""  # this attempt's content, kept only until it has caught up with ``fed``
        self._calls: dict[int, list[str]] = {}
        self._synced = True  # this attempt's content has caught up with ``fed``

    def attempt(self) -> None:
        """A new attempt of the request starts (from the reply's start)."""
        self._text = ""
        self._calls = {}
        self._synced = not self.fed

    def content(self, piece: str) -> None:
        if not piece or self.diverged:
            return
        if self._synced:
            self.fed += piece
            self.on_delta(piece)
            return
        self._text += piece
        n = len(self.fed)
        if len(self._text) <= n:
            if not self.fed.startswith(self._text):
                self.diverged = True
            return
        if not self._text.startswith(self.fed):
            self.diverged = True
            return
        self._synced = True
        new, self.fed = self._text[n:], self._text
        self.on_delta(new)

    def tool_call(self, call: Mapping[str, Any]) -> None:
        """One entry of a chunk's ``delta.tool_calls``."""
        if self.diverged:
            return
        if not self._synced:
            if self._text != self.fed:
                # this attempt's content stopped short of what was fed: the reply has not the
                # text the router read, so its tool calls must not follow that text
                self.diverged = True
                return
            self._synced = True
        index = call.get("index", 0)
        index = index if isinstance(index, int) else 0
        fn = call.get("function") or {}
        name = fn.get("name") or "" if isinstance(fn, Mapping) else ""
        args = fn.get("arguments") or "" if isinstance(fn, Mapping) else ""
        mine = self._calls.setdefault(index, ["", ""])
        fed = self._fed_calls.setdefault(index, ["", ""])
        mine[0] += name
        mine[1] += args
        new: list[str] = []
        for k in (0, 1):
            if len(mine[k]) <= len(fed[k]):
                if not fed[k].startswith(mine[k]):
                    self.diverged = True
                new.append("")
            elif not mine[k].startswith(fed[k]):
                self.diverged = True
                new.append("")
            else:
                new.append(mine[k][len(fed[k]) :])
        if self.diverged:
            return
        if (new[0], new[1]) == (name, args):
            fed[0], fed[1] = mine[0], mine[1]
            if name or args or call.get("id"):
                self.on_delta(tool_call_chunk(call))
            return
        if not (new[0] or new[1]):
            return  # a retry repeating what was fed
        fed[0], fed[1] = mine[0], mine[1]
        function: dict[str, str] = {"arguments": new[1]}
        if new[0]:
            function["name"] = new[0]
        self.on_delta(tool_call_chunk({"index": index, "function": function}))

    def whole(self, reply: Reply) -> None:
        """A reply known at once: fed as one attempt streaming it in one piece."""
        self.attempt()
        self.content(reply.text)
        for i, call in enumerate(reply.tool_calls):
            entry = {k: v for k, v in call.items() if k in ("id", "type", "function")}
            self.tool_call({"index": i, **entry})


class MemoActor:
    """What every actor shares: the memo, the counters, ``decode``/``reply``/``reply_for``,
    the messages of a history and the determinism check. A subclass implements
    ``_generate(messages) -> Reply`` (one fresh generation, cancel-safe)."""

    chat_format: ChatFormat

    def __init__(self, chat_format: ChatFormat | None = None) -> None:
        self.chat_format = chat_format or ChatFormat()
        self.memo = ReplyMemo()
        self.stats = ActorStats()

    async def _generate(self, messages: list[dict[str, Any]]) -> Reply:
        raise NotImplementedError

    async def _generate_streaming(self, messages: list[dict[str, Any]], feed: StreamFeed) -> Reply:
        """``_generate`` that also feeds the reply's pieces to ``feed`` as they arrive. This
        default feeds the whole reply once it is done; actors that stream override it."""
        reply = await self._generate(messages)
        feed.whole(reply)
        return reply

    async def decode(self, history: History) -> Action:
        """The action after ``history`` (the memoised one when decoded before)."""
        return (await self.reply(history)).action

    async def decode_streaming(self, history: History, on_delta: OnDelta) -> Action:
        """:meth:`decode`, reporting the reply as it streams
        (:class:`aospec.protocols.StreamingActor`): ``on_delta`` gets each content delta as
        a ``str`` and each tool-call delta as a chat-completions chunk dict, each piece of
        the reply once also when the request is retried (:class:`StreamFeed`). A reply
        already in the memo is fed whole at once, so routers still see it."""
        return (await self.reply(history, on_delta=on_delta)).action

    async def reply(self, history: History, *, on_delta: OnDelta | None = None) -> Reply:
        """The Reply that decodes ``history`` (from the memo when decoded before). When two
        decodes of one history overlap, the first to finish is kept and both return it.
        ``on_delta``: see :meth:`decode_streaming`."""
        known = self.memo.get(history)
        if known is not None:
            self.stats.memo_hits += 1
            if on_delta is not None:
                StreamFeed(on_delta).whole(known)
            return known
        messages = self.messages_for(history)
        if on_delta is None:
            reply = await self._generate(messages)
        else:
            reply = await self._generate_streaming(messages, StreamFeed(on_delta))
        kept = self.memo.settle(history, reply)
        if kept is not reply:
            self.stats.duplicate_replies += 1
            return kept
        self.stats.replies += 1
        self.stats.output_tokens += reply.output_tokens
        self.stats.estimated_replies += int(reply.tokens_estimated)
        self.stats.latency_ns += reply.latency_ns
        return reply

    def reply_for(self, history: History) -> Reply | None:
        """The Reply that ``decode(history)`` produced (None if none finished)."""
        return self.memo.get(history)

    def messages_for(self, history: History) -> list[dict[str, Any]]:
        """The chat messages a decode of ``history`` sends (earlier turns from the memo)."""
        return self.chat_format.messages(history, self.memo.replies_for(history))

    async def check_determinism(self, history: History) -> DeterminismReport:
        """Generate the reply of ``history`` twice, bypassing the memo, and compare."""
        messages = self.messages_for(history)
        first = await self._generate(messages)
        second = await self._generate(messages)
        return DeterminismReport.compare(first, second)

    async def aclose(self) -> None:
        """Release what the actor holds (nothing here)."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
