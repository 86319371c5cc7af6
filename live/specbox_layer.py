"""The SpecBox layer under a live run (``aospec run --cache/--pool-depth/--router``).

:func:`open_specbox` wraps the runtime sandbox of a run so that the engine sees

    FormatErrorSandbox(CachedSandbox(PooledSandbox(runtime sandbox)))

- **Pool inside the cache.** ``CachedSandbox.fork()`` forks its inner sandbox, the
  :class:`aospec.specbox.pool.PooledSandbox`, so every fork the engine asks for comes from the
  pool's ready queue (made ahead, handed out only at the committed version), and wraps it
  in a ``CachedSandbox`` of the same cache, so every ``execute`` — the committed path's and
  every speculative fork's — goes through the cache. The other order, a pool of cached
  sandboxes, sees every execute too, but then the outermost sandbox is the pool, which does
  not carry the cache's ``last_cache_hit_ns`` (the engine reads it from the sandbox that ran
  the step to count ``cache_hits``), and a cache hit on the committed path would still take
  the pool's lock.
- **Cache** ``reads`` (:func:`deterministic_reads`): only commands whose output is a
  function of the filesystem version alone; everything else bypasses it.
- **Router** ``parse`` (:class:`aospec.specbox.routers.ParseRouter`, exact) or ``trained`` (the
  union of a keyword, a TF-IDF and the parse router fitted on the training traces).
- **Markov** (:class:`aospec.specbox.markov.MarkovPrefetcher`): fitted on the training traces,
  added as an action drafter (its ``propose_routed`` answers router events), and told each
  committed step (:meth:`SpecBoxRun.observe`).
"""

from __future__ import annotations

import posixpath
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any, Literal

from aospec.effects import classify_command
from aospec.errors import ConfigError
from aospec.protocols import Sandbox
from aospec.types import Action, Effect, Trace

__all__ = [
    "READ_PROGRAMS",
    "SpecBoxOptions",
    "SpecBoxRun",
    "build_router",
    "deterministic_reads",
    "open_specbox",
]

#: The programs ``--cache reads`` serves from the cache: their output is a function of the
#: files they read and their arguments. Left out on purpose: ``stat``, ``find``, ``du``,
#: ``date``, ``ps`` (times, block counts, the clock, processes: none is in a version),
#: ``sed``/``awk`` (may write), ``python`` and the like (anything goes).
READ_PROGRAMS = (
    "cat",
    "head",
    "tail",
    "wc",
    "grep",
    "egrep",
    "fgrep",
    "nl",
    "sort",
    "uniq",
    "cut",
    "tr",
    "diff",
    "cmp",
    "md5sum",
    "sha1sum",
    "sha256sum",
    "basename",
    "dirname",
    "ls",
    "cd",
    "pwd",
)

#: Top-level directories that are mounts of their own in a sandbox, outside every version.
_UNVERSIONED = frozenset({"proc", "sys", "dev"})
#: ``ls`` options whose output holds nothing but names (no times, sizes of blocks, inodes,
#: owners): -a -A -d -F -p -R -r -1.
_LS_SAFE = frozenset("aAdFpRr1")
_LS_SAFE_LONG = frozenset({"--all", "--almost-all", "--directory", "--classify", "--recursive", "--reverse"})
_GLOB = frozenset("*?[")


def _ls_ok(words: Sequence[str]) -> bool:
    for w in words[1:]:
        if w.startswith("--"):
            if w not in _LS_SAFE_LONG:
                return False
        elif w.startswith("-") and len(w) > 1 and not set(w[1:]) <= _LS_SAFE:
            return False
    return True


def _options_ok(prog: str, words: Sequence[str]) -> bool:
    opts = [w for w in words[1:] if w.startswith("-") and len(w) > 1]
    if prog == "ls":
        return _ls_ok(words)
    if prog == "diff":  # -u/-c (and their long forms) print the files' modification times
        return not any(
            o.startswith(("--unified", "--context")) or (not o.startswith("--") and set(o[1:]) & set("uUcC"))
            for o in opts
        )
    if prog == "sort":  # -R / --random-sort: a random order
        return not any(o.startswith("--random") or (not o.startswith("--") and "R" in o) for o in opts)
    return True


def _recursive(prog: str, words: Sequence[str]) -> bool:
    for w in words[1:]:
        if w in ("--recursive", "--dereference-recursive") or w.startswith("--directories=recurse"):
            return True
        if (
            w.startswith("-")
            and not w.startswith("--")
            and (("R" in w) or (prog in ("grep", "egrep", "fgrep") and "r" in w))
        ):
            return True
    return False


def deterministic_reads(workdir: str = "/") -> Callable[[Action], bool]:
    """The ``--cache reads`` predicate: a bash action is served from the cache only when
    its output depends on nothing but the sandbox's filesystem version.

    Every simple command is one of :data:`READ_PROGRAMS`, with no command substitution,
    no ``$`` (``$RANDOM``, ``$$``), classified read-only (no writes, no redirection into a
    file), and no word that reaches outside the version: a path whose first component is
    ``/proc``, ``/sys`` or ``/dev`` (resolved against ``workdir`` and every directory a
    ``cd`` may have moved to; ``/dev/null`` as a redirection target is fine), ``..``, or a
    glob in the first component. Options that print times are refused: ``ls`` only with
    ``-a -A -d -F -p -R -r -1`` (so ``ls -l``/``-la``, whose mtimes are not part of a
    version, always run), ``diff`` without ``-u``/``-c``, ``sort`` without ``-R``; a
    recursive ``grep``/``ls`` over ``/`` (or from ``/`` without a path) is refused too."""
    from aospec.specbox.cache import plain_simple_commands

    allowed = frozenset(READ_PROGRAMS)
    start = posixpath.normpath(workdir) if workdir.startswith("/") else "/"

    def reaches_out(word: str, cwds: Sequence[str]) -> bool:
        if ".." in word.split("/"):
            return True
        for cwd in cwds if not word.startswith("/") else ("/",):
            path = posixpath.normpath(posixpath.join(cwd, word))
            first = path.lstrip("/").split("/", 1)[0]
            if first in _UNVERSIONED or _GLOB & set(first):
                return True
        return False

    def predicate(action: Action) -> bool:
        cmd = action.command
        if cmd is None or "$" in cmd or "`" in cmd:
            return False
        cmds = plain_simple_commands(action)
        if cmds is None:
            return False
        cwds = [start]
        for c in cmds:
            if not c.words or c.words[0] not in allowed:
                return False
            prog, words = c.words[0], c.words
            if not _options_ok(prog, words):
                return False
            for _op, target in c.redirects:
                if target is None or target[1]:
                    return False
                if target[0] != "/dev/null" and reaches_out(target[0], cwds):
                    return False
            args = [w.split("=", 1)[1] if w.startswith("--") and "=" in w else w for w in words[1:]]
            if any(reaches_out(w, cwds) for w in args if w):
                return False
            if _recursive(prog, words):
                operands = [w for w in args if not w.startswith("-")]
                if any(posixpath.normpath(posixpath.join(cwd, w)) == "/" for w in operands for cwd in cwds):
                    return False
                if "/" in cwds and not any(w.startswith("/") for w in operands):
                    return False
            if prog == "cd":
                if len(words) != 2 or words[1] == "-":
                    return False
                cwds.append(posixpath.normpath(posixpath.join(cwds[-1], words[1])))
        return classify_command(cmd) is Effect.READ_ONLY

    predicate.__name__ = "deterministic_reads"
    return predicate


# -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpecBoxOptions:
    """What of the SpecBox layer a live run uses (``aospec run`` options).

    ``cache``: ``off`` or ``reads`` (a result cache for :func:`deterministic_reads`).
    ``pool_depth``: forks a :class:`aospec.specbox.pool.PooledSandbox` makes ahead (0: no pool).
    ``router``: ``off``, ``parse`` or ``trained`` (:func:`build_router`). ``markov``: add a
    fitted :class:`aospec.specbox.markov.MarkovPrefetcher` to the action drafters."""

    cache: Literal["off", "reads"] = "off"
    pool_depth: int = 0
    router: Literal["off", "parse", "trained"] = "off"
    markov: bool = False
    workdir: str = "/"

    def __post_init__(self) -> None:
        if self.cache not in ("off", "reads"):
            raise ConfigError(f"cache must be off or reads, got {self.cache!r}")
        if self.router not in ("off", "parse", "trained"):
            raise ConfigError(f"router must be off, parse or trained, got {self.router!r}")
        if not isinstance(self.pool_depth, int) or self.pool_depth < 0:
            raise ConfigError(f"pool depth must be an integer >= 0, got {self.pool_depth!r}")

    @property
    def enabled(self) -> bool:
        return self.cache != "off" or self.pool_depth > 0 or self.router != "off" or self.markov


#: The prior gate of the trained router (``aospec routers eval --min-prior``'s default,
#: chosen on the inner split of the training halves: docs/specbox.md, Routers).
TRAINED_MIN_PRIOR = 0.3


def build_router(kind: str, train: Sequence[Trace] = ()) -> Any:
    """The stream router ``kind`` names: None for ``off``; ``parse``: the exact
    :class:`~aospec.specbox.routers.ParseRouter`; ``trained``: the union of a keyword router
    (gamma 2), a TF-IDF router (scikit-learn) and the parse router, fitted on ``train``,
    with the prior gate of ``aospec routers eval``'s ``union+parse``: a learned guess fires
    only when a Markov model fitted on ``train`` gives it P(tool | previous tool) >=
    :data:`TRAINED_MIN_PRIOR` (the engine opens each decode's session with its history,
    which supplies the previous tools)."""
    if kind == "off":
        return None
    from aospec.specbox.routers import ParseRouter

    if kind == "parse":
        return ParseRouter()
    if kind != "trained":
        raise ConfigError(f"unknown router {kind!r} (off, parse, trained)")
    if not train:
        raise ConfigError("the trained router needs training traces (--train-traces)")
    try:
        import sklearn  # noqa: F401
    except ImportError:
        raise ConfigError(
            "the trained router needs scikit-learn (pip install 'aospec[specbox]'); --router parse needs nothing"
        ) from None
    from aospec.specbox.routers import Assembly, KeywordRouter, TfidfRouter, stream_steps

    steps = stream_steps(train)
    if not steps:
        raise ConfigError("the training traces hold no steps to fit the trained router on")
    return Assembly(
        [KeywordRouter.fit(steps, gamma=2), TfidfRouter.fit(steps), ParseRouter()],
        "union",
        prior=build_markov(train),
        min_prior=TRAINED_MIN_PRIOR,
        name="union+parse",
    )


def build_markov(train: Sequence[Trace]) -> Any:
    """A :class:`~aospec.specbox.markov.MarkovPrefetcher` (SpecBox's settings) fitted on ``train``."""
    from aospec.specbox.markov import MarkovPrefetcher

    markov = MarkovPrefetcher()
    markov.fit(list(train))
    return markov


@dataclass
class SpecBoxRun:
    """The layer of one run: ``sandbox`` is what the agent gets; ``router`` the engine's
    stream router (None: off); ``drafters`` the action drafters with the Markov drafter
    added. Figures: :meth:`summary`."""

    options: SpecBoxOptions
    sandbox: Sandbox
    router: Any = None
    markov: Any = None
    pooled: Any = None
    cached: Any = None

    def observe(self, action: Action) -> None:
        """A step was committed: the Markov model counts its transition online."""
        if self.markov is not None:
            from aospec.specbox.routers import tool_label

            self.markov.observe(tool_label(action), action)

    def with_drafters(self, drafters: Any) -> Any:
        """``drafters`` (aospec.live.agent.Drafters) with the Markov drafter added (when speculating
        with action drafters at all)."""
        if self.markov is None or not drafters.action:
            return drafters
        return replace(drafters, action=(*drafters.action, self.markov))

    def summary(self) -> dict[str, Any]:
        """The layer's own figures: the options, the pool's forks (``served``: handed out
        ready-made; ``made``, ``stale_discarded``, ``misses``: forked on demand)."""
        o = self.options
        out: dict[str, Any] = {
            "cache_mode": o.cache,
            "pool_depth": o.pool_depth,
            "router": o.router,
            "markov": self.markov is not None,
        }
        if self.pooled is not None:
            s = self.pooled.stats
            out["pool"] = {
                "served": s.handed_out,
                "made": s.made,
                "stale_discarded": s.stale_discarded,
                "misses": s.misses,
            }
        else:
            out["pool"] = None
        return out


@asynccontextmanager
async def open_specbox(
    sandbox: Sandbox, options: SpecBoxOptions, train: Sequence[Trace] = (), *, router: Any = None
) -> AsyncIterator[SpecBoxRun]:
    """``sandbox`` under the layer ``options`` asks for (see the module docstring); the
    pool's forks made ahead are discarded on exit. ``router``: one already built for
    ``options.router`` (else it is built here)."""
    if router is None:
        router = build_router(options.router, train)
    markov = build_markov(train) if options.markov else None
    if options.pool_depth > 0:
        from aospec.specbox.pool import PooledSandbox

        async with PooledSandbox.open(sandbox, depth=options.pool_depth) as pooled:
            yield _layer(options, pooled, router, markov, pooled)
    else:
        yield _layer(options, sandbox, router, markov, None)


def _layer(options: SpecBoxOptions, inner: Sandbox, router: Any, markov: Any, pooled: Any) -> SpecBoxRun:
    cached = None
    if options.cache == "reads":
        from aospec.specbox.cache import CachedSandbox, ResultCache

        cached = CachedSandbox(inner, ResultCache(), deterministic=deterministic_reads(options.workdir))
    return SpecBoxRun(options, cached if cached is not None else inner, router, markov, pooled, cached)
