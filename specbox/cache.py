"""The state-keyed result cache: reuse tool results exactly, or offer similar ones as drafts.

Two uses, both lossless:

- **Exact** (:class:`CachedSandbox`): the result of ``action`` on filesystem version ``v``
  is stored under ``(namespace, v, action.key)`` and served again when the same action
  (tool + canonical JSON arguments, :attr:`aospec.types.Action.key`) runs on the same
  version — only for actions the :class:`CachePolicy` declares *deterministic*. A stateful
  tool can never get a stale hit: the version is part of the key, and every state change
  makes a new version.
- **Semantic** (:class:`SemanticCacheDrafter`): for *idempotent read* tools, results of
  earlier actions whose canonical argument text is similar (>= ``threshold``, default
  ``0.8``) are offered as observation **drafts**. The engine verifies a draft like any
  other (a continuation survives only if its draft is byte-identical to the real
  observation), so a wrong guess costs decode work, never correctness.

What *deterministic* means here: **given the version, the action always returns the same
output and changes nothing** (no state change: the version after a run equals the version
before). A hit then leaves the sandbox exactly as running would have. Read-only is not
enough: ``date``, ``ls -l`` (mtimes are not part of a version, docs/runtime.md), ``ps`` or a
network fetch are read-only but not deterministic given the version. :class:`CachedSandbox`
checks the second half on every real run of a declared-deterministic action: if the
version changed, the declaration was wrong, the result is not cached, earlier entries of
that declaration are purged, the action (a shell command) or tool (any other tool) is never
cached again, the violation is counted (``CacheStats.violations``) and a warning is issued
once per tool.

Results that show an environmental failure (a timeout or a kill, :func:`storable`) are
never stored: they depend on the machine's load, not on the version.

The cache is bounded (entries and bytes, least recently used first out) and safe to use
from several threads and anyio tasks at once (one short non-blocking lock; nothing awaits
while holding it). Forks of a :class:`CachedSandbox` share its cache.
"""

from __future__ import annotations

import re
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Self

from aospec.effects import classify_command
from aospec.errors import SandboxError
from aospec.protocols import ObservationDraft, Sandbox
from aospec.shell import ShellSyntaxError, extract_substitutions, simple_commands, tokens
from aospec.types import Action, Effect, History, canonical_json
from aospec.wrappers import SandboxWrapper

__all__ = [
    "CachePolicy",
    "CacheStats",
    "CachedSandbox",
    "CacheEntry",
    "CacheViolationWarning",
    "Lookup",
    "ResultCache",
    "SemanticCacheDrafter",
    "action_text",
    "plain_simple_commands",
    "shell_commands",
    "similarity",
    "storable",
]


class CacheViolationWarning(UserWarning):
    """A tool declared deterministic changed the sandbox's version when it ran."""


# ---------------------------------------------------------------------------------------
# Policy: which actions are deterministic / idempotent reads


def plain_simple_commands(action: Action) -> list[Any] | None:
    """The simple commands of a ``bash`` action (``aospec.shell.simple_commands``), or None
    when it is not a plain command line: another tool, extra arguments, a command
    substitution, or text the lexer cannot follow. Predicates of deterministic commands
    start here (:func:`shell_commands`, ``aospec.live.specbox_layer.deterministic_reads``)."""
    cmd = action.command
    if cmd is None or set(action.args) != {"command"}:
        return None
    try:
        subs: list[str] = []
        rest = extract_substitutions(cmd, subs)
        if subs:
            return None
        cmds = list(simple_commands(tokens(rest)))
    except ShellSyntaxError:
        return None
    return cmds or None


def shell_commands(*names: str) -> Callable[[Action], bool]:
    """A predicate for ``bash`` actions made only of the simple commands ``names`` (e.g.
    ``shell_commands("cat", "wc", "ls")``), with no command substitution, and classified
    read-only by :func:`aospec.effects.classify_command` (so ``cat a > b`` is refused).

    Choose the names with care: the output must be a function of the filesystem version
    alone (``ls -l`` shows mtimes, which versions leave out; the predicate does not look at
    flags)."""
    allowed = frozenset(names)

    def predicate(action: Action) -> bool:
        cmds = plain_simple_commands(action)
        if cmds is None or any(not c.words or c.words[0] not in allowed for c in cmds):
            return False
        return classify_command(action.command) is Effect.READ_ONLY

    predicate.__name__ = f"shell_commands({', '.join(sorted(allowed))})"
    return predicate


@dataclass(frozen=True)
class CachePolicy:
    """Which actions may be served from the cache.

    ``deterministic_tools`` / ``deterministic``: tools (by name) or a predicate over actions
    whose result is a function of (arguments, version) and which change nothing: served
    exactly by :class:`CachedSandbox`. ``idempotent_tools`` / ``idempotent``: read tools whose
    similar calls are offered as drafts by :class:`SemanticCacheDrafter`; every deterministic
    action is an idempotent read too.
    """

    deterministic_tools: frozenset[str] = frozenset()
    deterministic: Callable[[Action], bool] | None = None
    idempotent_tools: frozenset[str] = frozenset()
    idempotent: Callable[[Action], bool] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "deterministic_tools", frozenset(self.deterministic_tools))
        object.__setattr__(self, "idempotent_tools", frozenset(self.idempotent_tools))

    @classmethod
    def from_annotations(cls, tools: Mapping[str, Mapping[str, Any]]) -> CachePolicy:
        """A policy from MCP-style tool annotations (``{tool: {"readOnlyHint": ..., ...}}``).

        Deterministic: ``readOnlyHint`` and ``idempotentHint`` true and ``openWorldHint``
        false (the tool sees nothing outside the sandbox), or an explicit
        ``"deterministic": true``. Idempotent read: ``readOnlyHint`` and ``idempotentHint``
        true. Missing hints count as false (MCP's own defaults are not safe to cache)."""
        det, idem = set(), set()
        for name, ann in tools.items():
            read = ann.get("readOnlyHint") is True
            idempotent = ann.get("idempotentHint") is True
            closed = ann.get("openWorldHint") is False
            if ann.get("deterministic") is True or (read and idempotent and closed):
                det.add(name)
            if read and idempotent:
                idem.add(name)
        return cls(deterministic_tools=frozenset(det), idempotent_tools=frozenset(idem))

    def is_deterministic(self, action: Action) -> bool:
        if action.is_none:
            return False
        if action.tool in self.deterministic_tools:
            return True
        return bool(self.deterministic is not None and self.deterministic(action))

    def is_idempotent(self, action: Action) -> bool:
        if self.is_deterministic(action) or action.tool in self.idempotent_tools:
            return True
        return bool(self.idempotent is not None and self.idempotent(action))


# ---------------------------------------------------------------------------------------
# The cache


@dataclass(frozen=True)
class CacheStats:
    """Counts of a :class:`ResultCache` (a snapshot; ``ResultCache.stats`` makes a new one).

    - ``hits``: results served from the cache (tool runs skipped); ``hit_saved_ns`` sums the
      tool time each hit's entry took when it really ran.
    - ``misses``: deterministic actions looked up and not found (then run and stored).
    - ``bypasses``: actions not declared deterministic (or disabled after a violation): run,
      never looked up.
    - ``stale_avoided``: misses where the same action had a cached result at *another*
      version — a cache keyed without the version would have served it;
      ``stale_differed``: of those, the ones whose fresh result really differed (a stale
      result that would have been wrong).
    - ``violations``: declared-deterministic runs that changed the version (not cached).
    - ``refused``: deterministic runs whose result was not stored because it shows an
      environmental failure (a timeout or a kill: see :func:`storable`).
    - ``stores``, ``evictions``, ``entries``, ``bytes``: the table itself.
    - ``semantic_lookups``, ``semantic_drafts``: drafter calls and drafts offered.
    """

    hits: int = 0
    misses: int = 0
    bypasses: int = 0
    stale_avoided: int = 0
    stale_differed: int = 0
    violations: int = 0
    refused: int = 0
    stores: int = 0
    evictions: int = 0
    entries: int = 0
    bytes: int = 0
    hit_saved_ns: int = 0
    semantic_lookups: int = 0
    semantic_drafts: int = 0

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses): of the deterministic lookups, how many were served."""
        looked = self.hits + self.misses
        return self.hits / looked if looked else 0.0


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """One stored result: ``action`` run on ``version`` returned ``result`` in ``duration_ns``."""

    action: Action
    version: str
    result: str
    duration_ns: int = 0
    namespace: str = ""

    @property
    def size(self) -> int:
        return len(self.result.encode("utf-8", "surrogatepass")) + len(self.action.key) + len(self.version) + 64


@dataclass(frozen=True, slots=True)
class Lookup:
    """What a lookup found: ``hit`` at the asked version, else (``stale``) the latest entry
    of the same action at another version, if any."""

    hit: CacheEntry | None
    stale: CacheEntry | None = None


_Key = tuple[str, str, str]  # namespace, version, action key


class ResultCache:
    """A bounded LRU table ``(namespace, version, action) -> result`` (see module doc).

    ``max_entries`` and ``max_bytes`` bound the table; an entry larger than ``max_bytes``
    is never stored. ``semantic_per_tool`` bounds how many recent distinct actions per tool
    the semantic drafter compares with.
    """

    def __init__(self, *, max_entries: int = 4096, max_bytes: int = 64 << 20, semantic_per_tool: int = 256) -> None:
        if max_entries < 1 or max_bytes < 1 or semantic_per_tool < 0:
            raise ValueError("max_entries and max_bytes must be >= 1, semantic_per_tool >= 0")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.semantic_per_tool = semantic_per_tool
        self._lock = threading.Lock()
        self._table: OrderedDict[_Key, CacheEntry] = OrderedDict()
        self._latest: dict[tuple[str, str], CacheEntry] = {}  # (namespace, action key) -> newest entry
        self._recent: dict[tuple[str, str], OrderedDict[str, CacheEntry]] = {}  # (namespace, tool) -> by action key
        self._bytes = 0
        self._stats = CacheStats()

    # -- table --------------------------------------------------------------------------

    def lookup(self, action: Action, version: str, namespace: str = "") -> Lookup:
        """Find ``action`` at ``version`` (counts a hit, or a miss and maybe a stale-avoided)."""
        key = (namespace, version, action.key)
        with self._lock:
            entry = self._table.get(key)
            if entry is not None:
                self._table.move_to_end(key)
                self._bump(hits=1, hit_saved_ns=entry.duration_ns)
                return Lookup(entry)
            latest = self._latest.get((namespace, action.key))
            stale = latest if latest is not None and latest.version != version else None
            self._bump(misses=1, stale_avoided=int(stale is not None))
            return Lookup(None, stale)

    def get(self, action: Action, version: str, namespace: str = "") -> str | None:
        """The cached result of ``action`` at ``version``, or None (counted like ``lookup``)."""
        found = self.lookup(action, version, namespace).hit
        return None if found is None else found.result

    def put(self, action: Action, version: str, result: str, *, duration_ns: int = 0, namespace: str = "") -> bool:
        """Store a result; False when it is larger than the whole cache (not stored)."""
        entry = CacheEntry(action, version, result, duration_ns, namespace)
        size = entry.size
        if size > self.max_bytes:
            return False
        key = (namespace, version, action.key)
        with self._lock:
            old = self._table.pop(key, None)
            if old is not None:
                self._bytes -= old.size
            self._table[key] = entry
            self._bytes += size
            self._latest[(namespace, action.key)] = entry
            if self.semantic_per_tool:
                recent = self._recent.setdefault((namespace, action.tool), OrderedDict())
                recent.pop(action.key, None)
                recent[action.key] = entry
                while len(recent) > self.semantic_per_tool:
                    recent.popitem(last=False)
            evicted = 0
            while len(self._table) > self.max_entries or self._bytes > self.max_bytes:
                _, gone = self._table.popitem(last=False)
                self._bytes -= gone.size
                evicted += 1
            self._bump(stores=1, evictions=evicted)
        return True

    def purge(self, predicate: Callable[[CacheEntry], bool]) -> int:
        """Drop every entry for which ``predicate`` is true; returns how many."""
        with self._lock:
            doomed = [k for k, e in self._table.items() if predicate(e)]
            for k in doomed:
                self._bytes -= self._table.pop(k).size
            for k in [k for k, e in self._latest.items() if predicate(e)]:
                del self._latest[k]
            for recent in self._recent.values():
                for k in [k for k, e in recent.items() if predicate(e)]:
                    del recent[k]
            return len(doomed)

    def clear(self) -> None:
        """Drop every entry (the counts stay)."""
        with self._lock:
            self._table.clear()
            self._latest.clear()
            self._recent.clear()
            self._bytes = 0

    def recent(self, tool: str, namespace: str = "") -> list[CacheEntry]:
        """The latest entry of each recently stored distinct action of ``tool``, oldest first."""
        with self._lock:
            return list(self._recent.get((namespace, tool), {}).values())

    def __len__(self) -> int:
        return len(self._table)

    # -- counts -------------------------------------------------------------------------

    @property
    def stats(self) -> CacheStats:
        with self._lock:
            return replace(self._stats, entries=len(self._table), bytes=self._bytes)

    def count(self, **deltas: int) -> None:
        """Add to the counts (used by the wrappers: ``bypasses``, ``violations``, ...)."""
        with self._lock:
            self._bump(**deltas)

    def _bump(self, **deltas: int) -> None:
        s = self._stats
        self._stats = replace(s, **{k: getattr(s, k) + v for k, v in deltas.items() if v})


# ---------------------------------------------------------------------------------------
# The sandbox wrapper

_KILLED = re.compile(r"<returncode>(124|137)</returncode>|timed out and has been killed|\[timed out\]\s*$")


def storable(action: Action, result: str) -> bool:
    """The default check before a deterministic result is stored: not when it shows a
    timeout or a kill (return code 124 or 137, the runtime's timeout markers), which depend
    on the machine's load, not on the version. A refused result is simply run again."""
    return _KILLED.search(result) is None


@dataclass
class _Shared:
    """What a CachedSandbox and all its forks share besides the cache."""

    disabled: set[str] = field(default_factory=set)  # action keys (bash) or tool names
    warned: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)


#: The counters :meth:`CachedSandbox.cache_counts` reports (fields of CacheStats).
_COUNTS = (
    "hits",
    "misses",
    "bypasses",
    "stale_avoided",
    "stale_differed",
    "violations",
    "refused",
    "stores",
    "evictions",
    "entries",
    "hit_saved_ns",
)


def _unit(action: Action) -> str:
    """What a violation disables: one command line of a shell, else the whole tool."""
    return action.key if action.tool == "bash" else f"tool:{action.tool}"


class CachedSandbox(SandboxWrapper):
    """A :class:`aospec.protocols.Sandbox` that serves deterministic actions from a
    :class:`ResultCache` (see module doc); everything else goes to ``inner``.

    ``execute(action)`` on version ``v``: when ``policy`` declares ``action`` deterministic,
    the cached result for ``(namespace, v, action)`` is returned without running; otherwise
    the action runs and, if the version did not change, its result is stored. Forks wrap
    the inner sandbox's forks and share the cache and policy. ``namespace`` separates
    sandboxes whose equal versions could still run differently (a different environment,
    working directory or tool set); versions already name the filesystem exactly.

    A :class:`aospec.wrappers.SandboxWrapper` that implements
    :class:`aospec.protocols.CachingSandbox` itself: the inner sandbox's priority capability
    passes through when it has one, and its other attributes (``run``, ``aclose``, ...) are
    readable here.
    """

    def __init__(
        self,
        inner: Sandbox,
        cache: ResultCache | None = None,
        policy: CachePolicy | None = None,
        *,
        deterministic: Iterable[str] | Callable[[Action], bool] | None = None,
        namespace: str = "",
        store_if: Callable[[Action, str], bool] = storable,
        _shared: _Shared | None = None,
    ) -> None:
        if policy is None:
            if callable(deterministic):
                policy = CachePolicy(deterministic=deterministic)
            else:
                policy = CachePolicy(deterministic_tools=frozenset(deterministic or ()))
        elif deterministic is not None:
            raise ValueError("give either policy or deterministic, not both")
        super().__init__(inner)
        self.cache = cache if cache is not None else ResultCache()
        self.policy = policy
        self.namespace = namespace
        self.store_if = store_if
        self._shared = _shared if _shared is not None else _Shared()
        self._consumed = False
        self._last_hit_ns: int | None = None

    @property
    def version(self) -> str:
        return self.inner.version

    @property
    def last_cache_hit_ns(self) -> int | None:
        """None when this sandbox's last ``execute`` ran the action (or none ran yet), else
        the tool time the cache saved: the stored entry's recorded run time in ns
        (:class:`aospec.protocols.CachingSandbox`)."""
        return self._last_hit_ns

    def cache_counts(self) -> dict[str, int]:
        """The shared cache's counters (every fork's lookups together): ``hits``,
        ``misses``, ``bypasses``, ``stale_avoided``, ``stale_differed``, ``violations``,
        ``refused``, ``stores``, ``evictions``, ``entries`` and ``hit_saved_ns``
        (:class:`CacheStats`)."""
        s = self.cache.stats
        return {name: int(getattr(s, name)) for name in _COUNTS}

    def cacheable(self, action: Action) -> bool:
        """Whether ``execute(action)`` may be served from the cache."""
        if not self.policy.is_deterministic(action):
            return False
        with self._shared.lock:
            return _unit(action) not in self._shared.disabled and f"tool:{action.tool}" not in self._shared.disabled

    def _check(self) -> None:
        if self._consumed:
            raise SandboxError("the sandbox was already discarded or committed")

    async def execute(self, action: Action) -> str:
        self._check()
        self._last_hit_ns = None
        if not self.cacheable(action):
            self.cache.count(bypasses=1)
            return await self.inner.execute(action)
        before = self.inner.version
        found = self.cache.lookup(action, before, self.namespace)
        if found.hit is not None:
            self._last_hit_ns = found.hit.duration_ns
            return found.hit.result
        t0 = time.monotonic_ns()
        result = await self.inner.execute(action)
        duration = time.monotonic_ns() - t0
        if self.inner.version != before:
            self._violated(action, before)
            return result
        if found.stale is not None and found.stale.result != result:
            self.cache.count(stale_differed=1)
        if not self.store_if(action, result):
            self.cache.count(refused=1)
            return result
        self.cache.put(action, before, result, duration_ns=duration, namespace=self.namespace)
        return result

    def _violated(self, action: Action, version: str) -> None:
        unit = _unit(action)
        with self._shared.lock:
            self._shared.disabled.add(unit)
            first = action.tool not in self._shared.warned
            self._shared.warned.add(action.tool)
        if unit.startswith("tool:"):
            self.cache.purge(lambda e: e.action.tool == action.tool)
        else:
            self.cache.purge(lambda e: e.action.key == action.key)
        self.cache.count(violations=1)
        if first:
            warnings.warn(
                f"{action!r} was declared deterministic but changed the sandbox's version "
                f"(from {version[:12]}): it is not cached (further violations of tool {action.tool!r} are only counted)",
                CacheViolationWarning,
                stacklevel=3,
            )

    async def fork(self) -> Self:
        self._check()
        child = await self.inner.fork()
        return type(self)(
            child, self.cache, self.policy, namespace=self.namespace, store_if=self.store_if, _shared=self._shared
        )

    async def commit(self, fork: Self) -> None:
        self._check()
        if not isinstance(fork, CachedSandbox) or fork.cache is not self.cache:
            raise SandboxError("commit: the fork is not a CachedSandbox of this cache")
        if fork._consumed:
            raise SandboxError("commit: the fork was already committed or discarded")
        await self.inner.commit(fork.inner)
        fork._consumed = True

    async def discard(self) -> None:
        self._consumed = True
        await self.inner.discard()


# ---------------------------------------------------------------------------------------
# Semantic drafts


def action_text(action: Action) -> str:
    """The text compared for similarity: a shell action's command, else its canonical JSON
    arguments (the tool name is not in it: only actions of the same tool are compared)."""
    cmd = action.command
    if cmd is not None and set(action.args) == {"command"}:
        return cmd
    return canonical_json(dict(action.to_json()["args"]))


def _grams(text: str, n: int = 3) -> frozenset[str]:
    padded = f" {text} "
    if len(padded) <= n:
        return frozenset((padded,))
    return frozenset(padded[i : i + n] for i in range(len(padded) - n + 1))


def similarity(a: str, b: str, *, n: int = 3) -> float:
    """Jaccard similarity of the character ``n``-gram sets of ``a`` and ``b`` (1.0 when equal)."""
    if a == b:
        return 1.0
    ga, gb = _grams(a, n), _grams(b, n)
    union = len(ga | gb)
    return len(ga & gb) / union if union else 0.0


def _tfidf_similarities(query: str, texts: Sequence[str]) -> list[float]:
    from sklearn.feature_extraction.text import TfidfVectorizer

    vec = TfidfVectorizer(analyzer="char_wb", ngram_range=(3, 5), lowercase=False)
    m = vec.fit_transform([query, *texts])
    return [float(x) for x in (m[1:] @ m[0].T).toarray().ravel()]


class SemanticCacheDrafter:
    """An :class:`aospec.protocols.ObservationDrafter` over a :class:`ResultCache`.

    For an idempotent read action (``policy.is_idempotent``), it drafts the results of
    cached actions of the same tool (and ``namespace``) whose :func:`action_text` is at
    least ``threshold`` similar: ``method="jaccard"`` (character 3-gram Jaccard, the
    default) or ``"tfidf"`` (cosine of character 3-5-gram TF-IDF vectors, scikit-learn).
    A draft's probability is the similarity, halved when the entry was stored at another
    version than ``version()`` (when that callable is given). Equal texts are merged (the
    highest probability is kept). Nothing is drafted for other actions.
    """

    def __init__(
        self,
        cache: ResultCache,
        policy: CachePolicy,
        *,
        threshold: float = 0.8,
        method: Literal["jaccard", "tfidf"] = "jaccard",
        version: Callable[[], str] | None = None,
        namespace: str = "",
    ) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError("threshold must be in [0, 1]")
        if method not in ("jaccard", "tfidf"):
            raise ValueError(f"unknown similarity method {method!r}")
        self.cache = cache
        self.policy = policy
        self.threshold = threshold
        self.method = method
        self.version = version
        self.namespace = namespace

    def candidates(self, action: Action) -> list[tuple[float, CacheEntry]]:
        """(similarity, entry) of the cached actions at or above the threshold, best first."""
        entries = self.cache.recent(action.tool, self.namespace)
        if not entries:
            return []
        query = action_text(action)
        texts = [action_text(e.action) for e in entries]
        tfidf = self.method == "tfidf"
        sims = _tfidf_similarities(query, texts) if tfidf else [similarity(query, t) for t in texts]
        found = [(s, e) for s, e in zip(sims, entries, strict=True) if s >= self.threshold]
        found.sort(key=lambda se: -se[0])
        return found

    async def draft(self, history: History, action: Action, n: int) -> Sequence[ObservationDraft]:
        if n <= 0 or not self.policy.is_idempotent(action):
            return []
        self.cache.count(semantic_lookups=1)
        now = self.version() if self.version is not None else None
        best: dict[str, float] = {}
        for sim, entry in self.candidates(action):
            p = sim if now is None or entry.version == now else sim / 2
            p = min(max(p, 0.0), 1.0)
            if p > best.get(entry.result, -1.0):
                best[entry.result] = p
        drafts = [ObservationDraft(text, p) for text, p in sorted(best.items(), key=lambda tp: -tp[1])[:n]]
        self.cache.count(semantic_drafts=len(drafts))
        return drafts
