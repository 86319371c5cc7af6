"""Intent routers: read the actor's token stream and name the tool it is about to call,
before the call is complete, so that a consumer (a prewarm pool, action drafting) can
start on it early.

A router is fitted on traces (never on the traces it is evaluated on) and read through a
:class:`RouterSession`, one per decode::

    session = router.session()
    session.subscribe(pool.prewarm)              # optional: called with each RouteEvent
    for delta in stream:                         # str text, ToolCallDelta, or an OpenAI chunk
        for event in session.feed(delta):        # RouteEvent(tool, confidence, position, router)
            ...

Routers:

- :class:`KeywordRouter`: per-tool keyword profiles learned from traces (words whose
  occurrence in a step's stream points at one tool: support and purity thresholds) plus
  optional declared keywords; fires a tool once ``gamma`` distinct keywords of it have
  streamed (default 2, SpecBox's gamma). Incremental: each delta costs a regex scan of the
  delta and one dict lookup per completed word.
- :class:`TfidfRouter`: TF-IDF over word 1-2-grams and character 3-5-grams (scikit-learn,
  ``char_wb``) with top-N neighbour voting over the training streams. The query vector is
  kept incrementally (each completed word adds its n-grams; the similarity to every
  training stream is updated by one sparse product), so re-scoring on every delta is cheap
  and equals a from-scratch ``transform`` of the prefix up to its last complete word.
- :class:`ParseRouter`: exact, not learned: the label of a fenced ```` ```bash ```` block's
  command once no more text can change it, or the function name of an OpenAI tool-call delta.
- :class:`Assembly`: ``union`` (default; fires a tool when any member does), ``intersection``
  (when every member has) or ``weighted`` (when the weighted sum of the members' current
  scores reaches a threshold); with a ``prior`` (a Markov next-tool model) and a session
  opened with ``router.session(context)`` (the trajectory's earlier labels), learned guesses
  of implausible next tools are dropped.

Labels ("tools"): a bash action's label is its program (:func:`tool_label`, i.e.
:func:`aospec.shell.program_label`: the program of the first simple command that is not a
setup command such as ``cd``, ``export`` or ``source``, so ``cd /app && make test`` is
``make`` and ``cd /app`` alone is ``cd``); any other action's label is its tool name
(tau-bench: the function name). ``respond`` and ``none`` are not calls:
routers learn from those steps (as counter-examples) but never fire them.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from aospec.errors import ConfigError
from aospec.shell import streamed_program_label
from aospec.streams import step_stream as step_stream_of
from aospec.streams import tokenize, tool_label
from aospec.types import NO_ACTION_TOOL, History, Step, Trace

__all__ = [
    "NON_CALLS",
    "Assembly",
    "KeywordRouter",
    "ParseRouter",
    "RouteEvent",
    "Router",
    "RouterScore",
    "RouterSession",
    "StreamStep",
    "TfidfRouter",
    "ToolCallDelta",
    "delta_text",
    "evaluate_router",
    "parse_chunk",
    "step_stream",
    "stream_steps",
    "tokenize",
    "tool_label",
]

#: Labels of steps that call no tool: never fired.
NON_CALLS = frozenset({NO_ACTION_TOOL, "respond"})


# ------------------------------------------------------------------ labels and streams


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """One streamed piece of an OpenAI tool call: the function ``name`` (in the call's first
    chunk) and/or a piece of its ``arguments`` JSON."""

    name: str | None = None
    arguments: str = ""
    index: int = 0


Delta = str | ToolCallDelta


def parse_chunk(chunk: Any) -> list[Delta]:
    """The deltas of one streamed chat-completions item: a ``str`` (content text), a
    :class:`ToolCallDelta`, a ``delta`` object (``{"content": ..., "tool_calls": [...]}``) or a
    whole chunk (``{"choices": [{"delta": ...}]}``, a dict or its JSON text starting with
    ``{``). Raises ConfigError on anything else."""
    if isinstance(chunk, ToolCallDelta):
        return [chunk]
    if isinstance(chunk, str):
        if chunk.startswith("{") and '"choices"' in chunk:
            try:
                chunk = json.loads(chunk)
            except ValueError:
                return [chunk]
        else:
            return [chunk]
    if not isinstance(chunk, Mapping):
        raise ConfigError(
            f"a stream delta must be text, a ToolCallDelta or a chat-completions chunk, got {type(chunk).__name__}"
        )
    if "choices" in chunk:
        out: list[Delta] = []
        for choice in chunk.get("choices") or ():
            if isinstance(choice, Mapping) and isinstance(choice.get("delta"), Mapping):
                out.extend(parse_chunk(choice["delta"]))
        return out
    out = []
    content = chunk.get("content")
    if isinstance(content, str) and content:
        out.append(content)
    for call in chunk.get("tool_calls") or ():
        if not isinstance(call, Mapping):
            raise ConfigError("a tool_calls entry must be an object")
        fn = call.get("function") or {}
        if not isinstance(fn, Mapping):
            raise ConfigError("a tool call's 'function' must be an object")
        name = fn.get("name")
        args = fn.get("arguments") or ""
        if (name is not None and not isinstance(name, str)) or not isinstance(args, str):
            raise ConfigError("a tool call's function name and arguments must be strings")
        index = call.get("index", 0)
        out.append(ToolCallDelta(name or None, args, index if isinstance(index, int) else 0))
    return out


@dataclass(frozen=True, slots=True)
class StreamStep:
    """One step as the router sees it: its stream (deltas, in order), its label, and
    whether it is a call (label not in NON_CALLS)."""

    deltas: tuple[Delta, ...]
    label: str
    task: str
    #: The labels of the steps before it in its trace (what a session's ``context`` is).
    context: tuple[str, ...] = ()

    @property
    def is_call(self) -> bool:
        return self.label not in NON_CALLS


def step_stream(step: Step) -> list[Delta]:
    """The stream the actor decoded for ``step``, cut at the end of its action
    (:func:`aospec.streams.step_stream`; tool-call pieces as :class:`ToolCallDelta`s):
    a shell step's reply text up to the end of its command (else the command as a fenced
    bash block); another tool's reply text, then the name delta, then its arguments JSON in
    tokens (tau-bench); ``respond``'s content; ``none``'s reply text."""
    return step_stream_of(step, ToolCallDelta)  # type: ignore[return-value]


def stream_steps(traces: Iterable[Trace]) -> list[StreamStep]:
    """Every step of ``traces`` as a :class:`StreamStep` (:func:`step_stream`; a tau-bench
    call after the first of a reply has no reply text, so its stream is the call alone), with
    the labels of the trace's earlier steps as its ``context``."""
    out: list[StreamStep] = []
    for trace in traces:
        labels = [tool_label(step.action) for step in trace.steps]
        for i, step in enumerate(trace.steps):
            out.append(StreamStep(tuple(step_stream(step)), labels[i], trace.task, tuple(labels[:i])))
    return out


def delta_text(delta: Delta) -> str:
    """What a learned router reads of a delta: content as is; a tool call's name followed by
    a space, and its argument text."""
    if isinstance(delta, str):
        return delta
    return (delta.name + " " if delta.name else "") + delta.arguments


# ------------------------------------------------------------------ events and sessions


@dataclass(frozen=True, slots=True)
class RouteEvent:
    """A router's bet that the call being decoded is of ``tool``: ``confidence`` in [0, 1],
    ``position`` the number of deltas fed when it fired (1 = after the first), ``router``
    the name of the router (or assembly) that fired."""

    tool: str
    confidence: float
    position: int
    router: str


class _Reader:
    """One router's state over one stream. ``feed`` returns (tool, confidence) pairs newly
    reached; ``scores`` is the current score of each tool in [0, 1]."""

    def feed(self, text: str, name: str | None) -> list[tuple[str, float]]:
        raise NotImplementedError

    def finish(self) -> list[tuple[str, float]]:
        return []

    def scores(self) -> dict[str, float]:
        raise NotImplementedError

    def ranking(self) -> list[str]:
        s = self.scores()
        return sorted(s, key=lambda t: (-s[t], t))


class Router:
    """Base of routers: ``name`` and ``reader()``; ``session()`` opens a RouterSession.

    ``session(context)`` takes what the caller knows of the trajectory so far: the labels of
    its earlier steps (oldest first; :func:`tool_label` of each action) or the
    :class:`aospec.types.History` itself (the engine passes the branch's), read as the labels
    of its actions; ``session()`` without it behaves as if nothing were known. Only an
    :class:`Assembly` with a ``prior`` reads it."""

    name: str = "router"

    def reader(self, context: Sequence[str] | None = None) -> _Reader:
        raise NotImplementedError

    def session(self, context: Sequence[str] | History | None = None) -> RouterSession:
        return RouterSession(self, context)


class RouterSession:
    """One decode's stream through one router (or assembly).

    ``feed(delta)`` takes text, a :class:`ToolCallDelta` or a chat-completions chunk
    (:func:`parse_chunk`) and returns the :class:`RouteEvent` s it caused, each tool at most
    once per session; subscribers (``subscribe(callback)``) are called with each event as
    well. ``ranking()`` lists tools by the router's current score (best first).
    """

    __slots__ = ("_fired", "_reader", "_subscribers", "closed", "name", "position")

    def __init__(self, router: Router, context: Sequence[str] | History | None = None) -> None:
        self.name = router.name
        if isinstance(context, History):
            context = [tool_label(turn.action) for turn in context.turns]
        self._reader = router.reader() if context is None else router.reader(context)
        self._fired: set[str] = set()
        self._subscribers: list[Callable[[RouteEvent], Any]] = []
        self.position = 0
        self.closed = False

    def subscribe(self, callback: Callable[[RouteEvent], Any]) -> None:
        self._subscribers.append(callback)

    def feed(self, delta: Any) -> list[RouteEvent]:
        if self.closed:
            raise ConfigError("this router session is closed")
        if isinstance(delta, str):
            self.position += 1
            return self._emit(self._reader.feed(delta, None))
        if isinstance(delta, ToolCallDelta):
            self.position += 1
            return self._emit(self._reader.feed(delta_text(delta), delta.name))
        events: list[RouteEvent] = []
        for d in parse_chunk(delta):
            events.extend(self.feed(d))
        return events

    def close(self) -> list[RouteEvent]:
        """The stream ended: words still pending are read (their events are returned)."""
        if self.closed:
            return []
        events = self._emit(self._reader.finish())
        self.closed = True
        return events

    def ranking(self) -> list[str]:
        return [t for t in self._reader.ranking() if t not in NON_CALLS]

    def scores(self) -> dict[str, float]:
        return self._reader.scores()

    @property
    def fired(self) -> frozenset[str]:
        return frozenset(self._fired)

    def _emit(self, hits: list[tuple[str, float]]) -> list[RouteEvent]:
        if not hits:
            return []
        events = []
        for tool, conf in hits:
            if tool in self._fired or tool in NON_CALLS:
                continue
            self._fired.add(tool)
            ev = RouteEvent(tool, float(conf), self.position, self.name)
            events.append(ev)
            for cb in self._subscribers:
                cb(ev)
        return events


# ------------------------------------------------------------------ keyword router

#: A word of the keyword router: a run of word characters, dots, dashes and slashes,
#: lowercased; a trailing dot is dropped (sentence ends).
_WORD = re.compile(r"[\w][\w.\-/+]*")
_NAME_WORD = re.compile(r"\w+")


def _words(text: str) -> list[str]:
    return [w.lower().rstrip(".") for w in _WORD.findall(text)]


@dataclass(frozen=True, slots=True)
class Keyword:
    tool: str
    purity: float  # P(tool | word in stream), on the training streams
    support: int  # training streams of the tool that contain the word


class KeywordRouter(Router):
    """Fires a tool once ``gamma`` distinct keywords of its profile have streamed.

    ``profiles`` maps each keyword (lowercase) to its :class:`Keyword`. :meth:`fit` learns
    them: a word is a keyword of tool T when at least ``min_support`` training streams of
    T contain it and at least ``min_purity`` of all training streams containing it are
    T's (streams of ``respond``/``none`` steps count against every tool); the
    ``max_keywords`` best per tool by purity * log(1 + support) are kept. ``declared``
    adds user keywords per tool (purity 1). The confidence of an event is the mean purity
    of the matched keywords.
    """

    name = "keyword"

    def __init__(self, profiles: Mapping[str, Keyword], *, gamma: int = 2, name: str = "keyword") -> None:
        if not isinstance(gamma, int) or gamma < 1:
            raise ConfigError(f"gamma must be a positive integer, got {gamma!r}")
        self.profiles = dict(profiles)
        self.gamma = gamma
        self.name = name

    @classmethod
    def fit(
        cls,
        steps: Sequence[StreamStep] | Sequence[Trace],
        *,
        gamma: int = 2,
        min_support: int = 2,
        min_purity: float = 0.9,
        max_keywords: int = 64,
        declared: Mapping[str, Iterable[str]] | None = None,
    ) -> KeywordRouter:
        steps = _as_steps(steps)
        df: dict[str, Counter[str]] = defaultdict(Counter)
        for s in steps:
            words = set(_words("".join(delta_text(d) for d in s.deltas)))
            for w in words:
                df[w][s.label] += 1
        best: dict[str, list[tuple[float, str, Keyword]]] = defaultdict(list)
        for w, counts in df.items():
            total = sum(counts.values())
            tool, n = counts.most_common(1)[0]
            if tool in NON_CALLS or n < min_support:
                continue
            purity = n / total
            if purity < min_purity:
                continue
            best[tool].append((purity * math.log1p(n), w, Keyword(tool, purity, n)))
        profiles: dict[str, Keyword] = {}
        for _tool, cands in best.items():
            cands.sort(key=lambda c: (-c[0], c[1]))
            for _, w, kw in cands[:max_keywords]:
                profiles[w] = kw
        for tool, words in (declared or {}).items():
            for w in words:
                profiles[w.lower()] = Keyword(tool, 1.0, 0)
        return cls(profiles, gamma=gamma)

    def with_gamma(self, gamma: int) -> KeywordRouter:
        return KeywordRouter(self.profiles, gamma=gamma, name=self.name)

    def reader(self, context: Sequence[str] | None = None) -> _Reader:
        return _KeywordReader(self)

    def keywords(self, tool: str) -> list[str]:
        return sorted(w for w, k in self.profiles.items() if k.tool == tool)


class _KeywordReader(_Reader):
    __slots__ = ("_gamma", "_matched", "_pending", "_profiles", "_purity")

    def __init__(self, router: KeywordRouter) -> None:
        self._profiles = router.profiles
        self._gamma = router.gamma
        self._matched: dict[str, set[str]] = {}
        self._purity: dict[str, float] = {}
        self._pending = ""

    def feed(self, text: str, name: str | None) -> list[tuple[str, float]]:
        buf = self._pending + text
        if not buf:
            return []
        # Words are complete once a character that cannot continue them follows.
        words = _WORD.findall(buf)
        if words and buf.endswith(words[-1]):
            self._pending = words.pop()
        else:
            self._pending = ""
        if name is not None:
            # A tool-call name is complete as delivered: its parts are words now.
            words.extend(_NAME_WORD.findall(name))
        return self._see(words) if words else []

    def finish(self) -> list[tuple[str, float]]:
        words, self._pending = [self._pending] if self._pending else [], ""
        return self._see(words)

    def _see(self, words: list[str]) -> list[tuple[str, float]]:
        hits = []
        profiles = self._profiles
        for raw in words:
            w = raw.lower().rstrip(".")
            kw = profiles.get(w)
            if kw is None:
                continue
            seen = self._matched.setdefault(kw.tool, set())
            if w in seen:
                continue
            seen.add(w)
            self._purity[kw.tool] = self._purity.get(kw.tool, 0.0) + kw.purity
            if len(seen) == self._gamma:
                hits.append((kw.tool, self._purity[kw.tool] / len(seen)))
        return hits

    def scores(self) -> dict[str, float]:
        return {t: min(1.0, len(s) / self._gamma) * (self._purity[t] / len(s)) for t, s in self._matched.items() if s}


# ------------------------------------------------------------------ TF-IDF router


class TfidfRouter(Router):
    """TF-IDF (word 1-2-grams + ``char_wb`` 3-5-grams, scikit-learn) nearest-neighbour router.

    Each training stream is a document labelled with its step's label (``respond`` and
    ``none`` included, so that prose votes against firing). A stream prefix is scored by
    cosine similarity (the mean of the word-block and character-block cosines) to every
    document; the ``top_n`` most similar vote with their similarity; the leading label's
    share of the vote is its score. A call label fires when its score reaches ``threshold``
    after at least ``min_words`` words (a tool-call name counts as enough), and at most
    ``max_fires`` tools fire per stream (default None: no limit; 1 did not help on the inner
    split, where later, right fires on tb1 outweigh later, wrong ones on tau-bench). With
    ``settle_on_call`` (default), once a tool-call name has streamed, a router that has fired
    fires nothing more: the argument text after the name only draws neighbours of other tools that take
    the same arguments (on the tau-bench inner split: 69 false positives without, 33 with;
    streams without a tool-call name, such as bash replies, are unaffected). The defaults
    (``threshold`` 0.9, ``min_words`` 3; keyword ``min_purity`` 0.9) were chosen on an inner
    split of the training half of each development set (tasks split again), never on the
    evaluation half. ``prefixes`` adds truncated copies of each training
    stream (fractions of its tokens) as documents, so early prefixes have neighbours of
    their own length.
    """

    name = "tfidf"

    def __init__(
        self,
        word_vec: Any,
        char_vec: Any,
        xw_t: Any,
        xc_t: Any,
        labels: Sequence[str],
        *,
        top_n: int = 5,
        threshold: float = 0.9,
        min_words: int = 3,
        max_fires: int | None = None,
        settle_on_call: bool = True,
        name: str = "tfidf",
    ) -> None:
        self.word_vec = word_vec
        self.char_vec = char_vec
        self.xw_t = xw_t  # features x documents (csr), rows l2-normalised per document
        self.xc_t = xc_t
        self.labels = list(labels)
        self.top_n = top_n
        self.threshold = threshold
        self.min_words = min_words
        self.max_fires = max_fires
        self.settle_on_call = settle_on_call
        self.name = name
        self._wvocab = word_vec.vocabulary_
        self._cvocab = char_vec.vocabulary_
        self._widf = word_vec.idf_
        self._cidf = char_vec.idf_
        self._canalyze = char_vec.build_analyzer()

    @classmethod
    def fit(
        cls,
        steps: Sequence[StreamStep] | Sequence[Trace],
        *,
        top_n: int = 5,
        threshold: float = 0.9,
        min_words: int = 3,
        max_fires: int | None = None,
        settle_on_call: bool = True,
        prefixes: Sequence[float] = (0.5, 1.0),
    ) -> TfidfRouter:
        try:
            from sklearn.feature_extraction.text import TfidfVectorizer
        except ImportError as exc:  # pragma: no cover - the specbox extra
            from aospec.errors import MissingDependencyError

            raise MissingDependencyError("the TF-IDF router needs scikit-learn: pip install 'aospec[specbox]'") from exc
        steps = _as_steps(steps)
        docs: list[str] = []
        labels: list[str] = []
        for s in steps:
            texts = [delta_text(d) for d in s.deltas]
            for frac in prefixes:
                k = max(1, math.ceil(frac * len(texts)))
                doc = "".join(texts[:k])
                if doc.strip():
                    docs.append(doc)
                    labels.append(s.label)
        if len(set(labels)) < 1 or not docs:
            raise ConfigError("the TF-IDF router needs training streams with text")
        word_vec = TfidfVectorizer(analyzer="word", ngram_range=(1, 2), lowercase=True)
        char_vec = TfidfVectorizer(analyzer="char_wb", ngram_range=(3, 5), lowercase=True)
        xw = word_vec.fit_transform(docs)
        xc = char_vec.fit_transform(docs)
        return cls(
            word_vec,
            char_vec,
            xw.T.tocsr(),
            xc.T.tocsr(),
            labels,
            top_n=top_n,
            threshold=threshold,
            min_words=min_words,
            max_fires=max_fires,
            settle_on_call=settle_on_call,
        )

    def reader(self, context: Sequence[str] | None = None) -> _Reader:
        return _TfidfReader(self)

    def with_params(self, **kw: Any) -> TfidfRouter:
        params = {
            "top_n": self.top_n,
            "threshold": self.threshold,
            "min_words": self.min_words,
            "max_fires": self.max_fires,
            "settle_on_call": self.settle_on_call,
            "name": self.name,
        }
        params.update(kw)
        return TfidfRouter(self.word_vec, self.char_vec, self.xw_t, self.xc_t, self.labels, **params)


_WS = re.compile(r"\s+")
_TOKEN_PATTERN = re.compile(r"(?u)\b\w\w+\b")


class _TfidfReader(_Reader):
    """The query vector of a stream prefix, kept incrementally: complete whitespace-separated
    words (followed by whitespace) add their ``char_wb`` n-grams and their word tokens (and
    bigrams with the previous token); the dot products with every training document are
    updated by one sparse product per delta that completed a word."""

    def __init__(self, router: TfidfRouter) -> None:
        import numpy as np

        self.r = router
        n_docs = len(router.labels)
        self._dot_w = np.zeros(n_docs)
        self._dot_c = np.zeros(n_docs)
        self._cnt_w: dict[int, int] = {}
        self._cnt_c: dict[int, int] = {}
        self._sq_w = 0.0  # squared norm of the tf-idf query, word block
        self._sq_c = 0.0
        self._pending = ""
        self._last_token: str | None = None
        self._words = 0
        self._scores: dict[str, float] = {}
        self._fired: set[str] = set()
        self._named = False  # a tool-call name has streamed

    def feed(self, text: str, name: str | None) -> list[tuple[str, float]]:
        buf = self._pending + text
        parts = _WS.split(buf)
        # The last part is complete only when whitespace follows it.
        self._pending = parts.pop() if parts else ""
        words = [p for p in parts if p]
        if name is not None:
            # A tool-call name is evidence enough on its own (tool-call streams are short).
            self._words += self.r.min_words
            self._named = True
        if not words:
            return []
        self._add_words(words)
        return self._score()

    def finish(self) -> list[tuple[str, float]]:
        if not self._pending:
            return []
        words, self._pending = [self._pending], ""
        self._add_words(words)
        return self._score()

    def _add_words(self, words: list[str]) -> None:
        r = self.r
        wv, cv, canalyze = r._wvocab, r._cvocab, r._canalyze
        new_w: Counter[int] = Counter()
        new_c: Counter[int] = Counter()
        for word in words:
            w = word.lower()
            self._words += 1
            for gram in canalyze(w):
                j = cv.get(gram)
                if j is not None:
                    new_c[j] += 1
            for tok in _TOKEN_PATTERN.findall(w):
                j = wv.get(tok)
                if j is not None:
                    new_w[j] += 1
                if self._last_token is not None:
                    j = wv.get(self._last_token + " " + tok)
                    if j is not None:
                        new_w[j] += 1
                self._last_token = tok
        if new_w:
            self._sq_w += self._bump(new_w, self._cnt_w, r._widf, r.xw_t, self._dot_w)
        if new_c:
            self._sq_c += self._bump(new_c, self._cnt_c, r._cidf, r.xc_t, self._dot_c)

    @staticmethod
    def _bump(new: Counter[int], cnt: dict[int, int], idf: Any, xt: Any, dot: Any) -> float:
        import numpy as np

        idx = np.fromiter(new.keys(), dtype=np.int64, count=len(new))
        inc = np.fromiter(new.values(), dtype=float, count=len(new))
        w = idf[idx]
        old = np.fromiter((cnt.get(i, 0) for i in new), dtype=float, count=len(new))
        for i, c in new.items():
            cnt[i] = cnt.get(i, 0) + c
        # dot += sum_f (inc_f * idf_f) * X^T[f], straight from the CSR arrays (a scipy row
        # slice and product cost about 4x as much).
        starts = xt.indptr[idx]
        lens = xt.indptr[idx + 1] - starts
        total = int(lens.sum())
        if total:
            offs = np.repeat(starts - np.cumsum(lens) + lens, lens) + np.arange(total)
            dot += np.bincount(xt.indices[offs], weights=xt.data[offs] * np.repeat(inc * w, lens), minlength=len(dot))
        return float(np.sum(w * w * ((old + inc) ** 2 - old**2)))

    def _sims(self) -> Any:
        sims = 0.0
        if self._sq_w > 0:
            sims = sims + self._dot_w / math.sqrt(self._sq_w)
        if self._sq_c > 0:
            sims = sims + self._dot_c / math.sqrt(self._sq_c)
        return sims / 2.0

    def _score(self) -> list[tuple[str, float]]:
        import numpy as np

        r = self.r
        sims = self._sims()
        if isinstance(sims, float):
            return []
        n = min(r.top_n, len(sims))
        top = np.argpartition(-sims, n - 1)[:n] if n < len(sims) else np.arange(len(sims))
        votes: dict[str, float] = {}
        for d in top:
            s = float(sims[d])
            if s <= 0:
                continue
            lab = r.labels[d]
            votes[lab] = votes.get(lab, 0.0) + s
        total = sum(votes.values())
        self._scores = {lab: v / total for lab, v in votes.items()} if total > 0 else {}
        if self._words < r.min_words or not self._scores:
            return []
        if r.max_fires is not None and len(self._fired) >= r.max_fires:
            return []
        if r.settle_on_call and self._named and self._fired:
            return []
        hits = [(lab, s) for lab, s in self._scores.items() if s >= r.threshold and lab not in NON_CALLS]
        hits = [h for h in hits if h[0] not in self._fired]
        if r.max_fires is not None:
            hits = hits[: r.max_fires - len(self._fired)]
        self._fired.update(lab for lab, _ in hits)
        return hits

    def scores(self) -> dict[str, float]:
        return dict(self._scores)

    def query_sims(self) -> Any:
        """Cosine similarities of the current prefix to every training document (tests)."""
        return self._sims()


# ------------------------------------------------------------------ exact parse


class ParseRouter(Router):
    """Exact, not learned: fires the label of a fenced ``bash`` block's command (the rule of
    :func:`tool_label`) as soon as no more text can change it (confidence 1): the first
    program past setup commands (``cd DIR &&``, ``export X=1;``, ...) once its word is
    complete; a command of setup programs only (``cd /x``) when the block closes or the
    stream ends (:meth:`RouterSession.close`). A tool call's function name fires as it
    arrives."""

    name = "parse"
    #: What it fires is certain: an assembly stops guessing once it has (Assembly).
    exact = True
    _FENCE = re.compile(r"```(?:bash|sh)[^\n]*\n")
    _CLOSE = re.compile(r"(?:^|\n)[ \t]*```")

    def reader(self, context: Sequence[str] | None = None) -> _Reader:
        return _ParseReader()


class _ParseReader(_Reader):
    def __init__(self) -> None:
        self._text = ""
        self._scan = 0
        self._body: int | None = None  # where the command starts, once the fence has streamed
        self._tool: str | None = None

    def feed(self, text: str, name: str | None) -> list[tuple[str, float]]:
        if self._tool is not None:
            return []
        if name is not None:
            self._tool = name
            return [(name, 1.0)]
        self._text += text
        return self._look(final=False)

    def finish(self) -> list[tuple[str, float]]:
        return [] if self._tool is not None else self._look(final=True)

    def _look(self, *, final: bool) -> list[tuple[str, float]]:
        if self._body is None:
            m = ParseRouter._FENCE.search(self._text, max(0, self._scan - 16))
            if m is None:
                self._scan = len(self._text)
                return []
            self._body = m.end()
        body = self._text[self._body :]
        close = ParseRouter._CLOSE.search(body)
        if close is not None:
            body, final = body[: close.start()], True
        if not body.strip():
            return []
        tool = streamed_program_label(body, final=final)
        if tool is None:
            return []
        self._tool = tool
        return [(tool, 1.0)]

    def scores(self) -> dict[str, float]:
        return {self._tool: 1.0} if self._tool else {}


# ------------------------------------------------------------------ assemblies


class Assembly(Router):
    """Several routers over one stream. ``mode``:

    - ``union`` (default): a tool fires as soon as any member fires it (confidence: that
      member's);
    - ``intersection``: once every member has fired it (at the latest member's position;
      confidence: the members' minimum);
    - ``weighted``: once ``sum_k weights[k] * score_k(tool)`` reaches ``threshold``, each
      member's current score (:meth:`RouterSession.scores`); weights default to equal.

    Once an exact member (``exact = True``: :class:`ParseRouter`) has fired, the tool is
    known: the assembly passes that event on and fires nothing else for the rest of the
    stream (a later guess could only be a wasted prewarm).

    ``prior``: a next-tool model with ``distribution(labels) -> {tool: probability}`` (e.g. a
    fitted :class:`aospec.specbox.markov.MarkovPrefetcher`). When the session has a ``context`` (the
    trajectory's earlier labels: ``router.session(context)``), a learned member's guess of a
    tool is passed on only if ``P(tool | context) >= min_prior``: the stream must point at
    the tool and the tool must be a plausible next one. Exact members are never gated, and a
    session without a context is not gated either.
    """

    def __init__(
        self,
        members: Sequence[Router],
        mode: Literal["union", "intersection", "weighted"] = "union",
        *,
        weights: Sequence[float] | None = None,
        threshold: float = 0.5,
        name: str | None = None,
        prior: Any = None,
        min_prior: float = 0.0,
    ) -> None:
        if not members:
            raise ConfigError("an assembly needs at least one router")
        if mode not in ("union", "intersection", "weighted"):
            raise ConfigError(f"unknown assembly mode {mode!r} (union, intersection, weighted)")
        if weights is not None and len(weights) != len(members):
            raise ConfigError("one weight per member router")
        self.members = list(members)
        self.mode = mode
        self.weights = list(weights) if weights is not None else [1.0 / len(members)] * len(members)
        self.threshold = threshold
        self.name = name or mode
        if not 0.0 <= min_prior <= 1.0:
            raise ConfigError(f"min_prior must be in [0, 1], got {min_prior!r}")
        if min_prior > 0 and prior is None:
            raise ConfigError("min_prior needs a prior (a next-tool model with distribution(labels))")
        self.prior = prior
        self.min_prior = min_prior

    def reader(self, context: Sequence[str] | None = None) -> _Reader:
        return _AssemblyReader(self, context)


class _AssemblyReader(_Reader):
    def __init__(self, a: Assembly, context: Sequence[str] | None = None) -> None:
        self.a = a
        self.readers = [m.reader() for m in a.members]
        self.fired: list[dict[str, float]] = [{} for _ in a.members]
        self.exact = [bool(getattr(m, "exact", False)) for m in a.members]
        self.settled = False
        # P(next tool | the trajectory so far), computed once per stream.
        self.prior: dict[str, float] | None = None
        if a.prior is not None and a.min_prior > 0 and context is not None:
            self.prior = dict(a.prior.distribution(list(context)))

    def _collect(self, results: list[list[tuple[str, float]]]) -> list[tuple[str, float]]:
        a = self.a
        if self.settled:
            return []
        prior = self.prior
        if prior is not None:
            results = [
                hits if self.exact[k] else [h for h in hits if self._plausible(h[0])] for k, hits in enumerate(results)
            ]
        for k, hits in enumerate(results):
            for tool, conf in hits:
                self.fired[k].setdefault(tool, conf)
        certain = [h for k, hits in enumerate(results) if self.exact[k] for h in hits]
        if certain:
            # An exact member named the tool: any other bet from now on is a wasted prewarm.
            self.settled = True
            return certain
        if a.mode == "union":
            return [h for hits in results for h in hits]
        if a.mode == "intersection":
            out = []
            for hits in results:
                for tool, _ in hits:
                    if all(tool in f for f in self.fired):
                        out.append((tool, min(f[tool] for f in self.fired)))
            return out
        combined = self.scores()
        return [(t, s) for t, s in combined.items() if s >= a.threshold and self._plausible(t)]

    def _plausible(self, tool: str) -> bool:
        return self.prior is None or self.prior.get(tool, 0.0) >= self.a.min_prior

    def feed(self, text: str, name: str | None) -> list[tuple[str, float]]:
        return self._collect([r.feed(text, name) for r in self.readers])

    def finish(self) -> list[tuple[str, float]]:
        return self._collect([r.finish() for r in self.readers])

    def scores(self) -> dict[str, float]:
        a = self.a
        per = [r.scores() for r in self.readers]
        if a.mode == "weighted":
            tools = set().union(*per)
            return {t: sum(w * p.get(t, 0.0) for w, p in zip(a.weights, per, strict=True)) for t in tools}
        out: dict[str, float] = {}
        for p in per:
            for t, s in p.items():
                if a.mode == "union":
                    out[t] = max(out.get(t, 0.0), s)
        if a.mode == "intersection":
            tools = set(per[0]).intersection(*per[1:]) if per else set()
            out = {t: min(p[t] for p in per) for t in tools}
        return out


# ------------------------------------------------------------------ helpers


def _as_steps(items: Sequence[StreamStep] | Sequence[Trace]) -> list[StreamStep]:
    items = list(items)
    if items and isinstance(items[0], Trace):
        return stream_steps(items)  # type: ignore[arg-type]
    return items  # type: ignore[return-value]


# ------------------------------------------------------------------ evaluation


@dataclass(frozen=True, slots=True)
class RouterScore:
    """How a router did on a set of streams (each call judged on the events it fired before
    the last delta of its stream, i.e. before the action was complete).

    micro precision/recall/F1 over (step, tool) pairs: a fired tool that is the step's label
    is a true positive, any other fired tool (on a call or on a ``respond``/``none`` step) a
    false positive, an unfired label a false negative. ``top3_hit``: the label is among the
    router's three best-scored tools after the second-to-last delta. ``coverage``: the
    fraction of calls on which the router fired anything. Fire positions: where the label's
    event came, as a fraction of the stream's deltas (over the calls where it came).
    ``us_per_token``: wall time in ``feed`` per delta.
    """

    router: str
    calls: int
    non_calls: int
    tp: int
    fp: int
    fn: int
    top3: int
    covered: int
    fire_positions: tuple[float, ...]
    seconds: float
    deltas: int

    @property
    def precision(self) -> float:
        return self.tp / (self.tp + self.fp) if self.tp + self.fp else 0.0

    @property
    def recall(self) -> float:
        return self.tp / (self.tp + self.fn) if self.tp + self.fn else 0.0

    @property
    def micro_f1(self) -> float:
        p, r = self.precision, self.recall
        return 2 * p * r / (p + r) if p + r else 0.0

    def to_json(self) -> dict[str, Any]:
        import numpy as np

        pos = self.fire_positions
        return {
            "router": self.router,
            "calls": self.calls,
            "non_calls": self.non_calls,
            "micro_f1": round(self.micro_f1, 4),
            "precision": round(self.precision, 4),
            "recall": round(self.recall, 4),
            "top3_hit": round(self.top3 / self.calls, 4) if self.calls else None,
            "coverage": round(self.covered / self.calls, 4) if self.calls else None,
            "fire_position_mean": round(float(np.mean(pos)), 4) if pos else None,
            "fire_position_p50": round(float(np.median(pos)), 4) if pos else None,
            "us_per_token": round(1e6 * self.seconds / self.deltas, 2) if self.deltas else None,
        }


def evaluate_router(router: Router, steps: Sequence[StreamStep], *, name: str | None = None) -> RouterScore:
    """Stream every step of ``steps`` through a fresh session of ``router`` and score it
    (see :class:`RouterScore`)."""
    import time

    tp = fp = fn = top3 = covered = calls = non_calls = deltas_fed = 0
    positions: list[float] = []
    seconds = 0.0
    clock = time.perf_counter
    for s in steps:
        n = len(s.deltas)
        if n == 0:
            if s.is_call:
                calls += 1
                fn += 1
            else:
                non_calls += 1
            continue
        session = router.session(s.context)
        fired: dict[str, int] = {}
        ranking: list[str] = []
        feed = session.feed
        # All but the last delta: the action is not complete yet.
        t0 = clock()
        for d in s.deltas[:-1]:
            for ev in feed(d):
                fired.setdefault(ev.tool, ev.position)
        seconds += clock() - t0
        deltas_fed += n - 1
        if s.is_call:
            ranking = session.ranking()
            calls += 1
            if fired:
                covered += 1
            if s.label in fired:
                tp += 1
                positions.append(fired[s.label] / n)
            else:
                fn += 1
            fp += sum(1 for t in fired if t != s.label)
            top3 += s.label in ranking[:3]
        else:
            non_calls += 1
            fp += len(fired)
    return RouterScore(
        name or router.name, calls, non_calls, tp, fp, fn, top3, covered, tuple(positions), seconds, deltas_fed
    )
