"""Losslessness, measured: the live engine on real sandboxes, serial against speculative.

One *case* is a pure function of ``(seed, config)`` (:func:`make_case`): a setup command,
a pool of random shell actions (write, append, remove, copy, move, hard and symbolic
links, chmod, mkdir/rmdir, FIFOs, failures, timeouts, background writes, reads whose
output depends on the state), an actor that picks from the pool by a hash of the whole
history (:meth:`aospec.testing.ScriptedActor.hashing`), a random engine configuration and
a sandbox configuration by name (:data:`SANDBOX_CONFIGS`).

:func:`check_case` runs it three ways on fresh sandboxes from the same base:

- *reference*: serial (no drafters) on the default in-memory sandbox configuration;
- *serial*: serial on the case's sandbox configuration;
- *speculative*: on the case's configuration, with drafters that mix right and wrong
  guesses: the observation drafter knows the serial run's observations (as if it had run
  the action beforehand and cached the result) and proposes the true one with some
  probability next to wrong ones; the action drafter proposes the serial run's actual
  future actions with some probability, at their true or at random step offsets, and
  random pool actions otherwise.

and compares the committed trajectories (actions and observations), the final versions and
a content snapshot of the final filesystem (:func:`snapshot_tree`: every path's type,
mode, owner, content hash, symlink target, device number and hard-link group, walked on
the host through a fresh fork's merged root with directory file descriptors). With
``durable`` the speculative state directory is reopened afterwards and must show the
same version and snapshot. Every run must leave nothing behind: no mount under the state
root, no process below this one, no new entry in the state root.

A *layer* (``check_case(..., layer=...)``: an async context manager around the speculative
run's sandbox that yields a :class:`SpeculationLayer`) puts more between the engine and the
sandbox for the speculative run alone: a wrapping sandbox (e.g. a result cache over a fork
pool, as scripts/check_lossless.py ``--specbox`` builds from ``specbox/`` and ``live/``) and
a stream router. With a router the actor streams its replies
(:class:`aospec.testing.StreamingScriptedActor`) and a routed action drafter joins, proposing
for each tool the router names the actor's true next action (with the case's odds) and
other pool actions of that tool and of others. The comparison stays the same; the run
also reports the engine's cache hits and routed forks and the layer's own counters.
``make_case(..., layered=True)`` gives cases for a layer: their pools also hold repeated
reads of the files the case writes, so a result cache is hit (and a stale entry would be
caught), and the actor never decodes instantly, so a router's events land mid-decode.

``make_case(..., readsets=True)`` gives cases for read-set validation (docs/engine.md, "Read
sets"): their pools also hold commands whose output depends on metadata, directory
listings and missing files (:data:`READSET_COMMANDS`: ``ls``, ``test -e``, ``find``, ``stat -c
%s``, globs, ``[ -d x ] || mkdir x``) and writes to a directory none of them reads
(:data:`UNRELATED_WRITES`) or to one they do, and the engine looks 2-4 steps ahead, so forks
launched before a state-changing step are reused after it (rebased) when it touched
nothing they read. Such a run also re-checks every rebase: the layer it commits must be the
one a fresh diff of the fork's changes against the committed state gives.

A minimised reproduction (:func:`minimise`) replaces the hashing actor by the serial run's
own action sequence (still a pure function of the history) and drops actions, steps and
speculation knobs while the same kind of failure persists.

Used by tests/runtime/test_lossless_property.py (CI) and scripts/check_lossless.py (long
runs).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import random
import stat
import tempfile
import traceback
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import xxhash
from aospec.runtime import _fs, open_sandbox
from aospec.runtime._state import default_state_root
from aospec.runtime.config import Limits, SandboxConfig

from aospec.engine import Engine
from aospec.engine_config import EngineConfig
from aospec.ledger import EventKind
from aospec.protocols import ActionDraft, ObservationDraft, Sandbox
from aospec.streams import tool_label
from aospec.testing import (
    ScriptedActionDrafter,
    ScriptedActor,
    ScriptedObservationDrafter,
    ScriptedRoutedActionDrafter,
    StreamingScriptedActor,
)
from aospec.types import Action, History, canonical_json

__all__ = [
    "SANDBOX_CONFIGS",
    "CaseOutcome",
    "LosslessCase",
    "RunRecord",
    "SpeculationLayer",
    "check_case",
    "compare_runs",
    "diff_snapshots",
    "make_case",
    "minimise",
    "run_engine",
    "snapshot_sandbox",
    "snapshot_tree",
]

#: Sandbox configurations under test, by name: keyword overrides of SandboxConfig.
#: ``durable`` also uses a persistent state directory, reopened after the run.
SANDBOX_CONFIGS: dict[str, dict[str, Any]] = {
    "memory": {},
    "disk": {"memory_layers_bytes": 0, "limits": Limits(disk_bytes=None)},
    "durable": {"durable": True},
    "compact": {"compact_at": 4},
}

#: The configuration the reference (serial) run uses.
REFERENCE_CONFIG = "memory"

#: Per-command timeout (seconds) of a case whose pool holds a command that sleeps past it
#: (SLEEP), and of every other case. Other commands take milliseconds; one that times out
#: all the same makes the case ``inconclusive`` (the machine was too loaded), not diverged.
SHORT_TIMEOUT_S = 0.5
TIMEOUT_S = 20.0
SLEEP = "sleep 30"

TASK = "lossless"

# Paths that ordinary commands write, link, move and read. Background writes use their own
# paths (RACE) so two writers never race on one file; the FIFO has its own path and is never
# opened (a read or write of a FIFO would block until the timeout).
PATHS = ("/w/a", "/w/b", "/w/c", "/w/d", "/w/d/e", "/w/d/f", "/w/h", "/w/l", "/tmp/t")
RACE = ("/w/r1", "/w/r2")
FIFO = "/w/p"
LINK_TARGETS = ("a", "d", "../nowhere", "/w/b", "/w/d/e", "l")
WORDS = ("one", "two", "x y", "", "3")
MODES = ("600", "644", "755", "000", "4755", "1777")

SETUP = (
    "mkdir -p /w/d && echo seed > /w/a && ln /w/a /w/h && echo e > /w/d/e "
    "&& ln -s a /w/l && echo b > /w/b && chmod 640 /w/b"
)


def _q(word: str) -> str:
    return "'" + word.replace("'", "'\\''") + "'"


def _race(rng: random.Random, p: str, q: str, w: str) -> str:
    r1, r2 = RACE if rng.random() < 0.5 else RACE[::-1]
    if rng.random() < 0.5:
        return f"echo {w} > {r1} & cat {p} > {r2} 2>&1 & wait; cat {r1} {r2}"
    return f"(for i in 1 2 3; do echo $i >> {r1}; done) & rm -f {r2} & wait; wc -l < {r1}"


# One template per kind of command: (rng, path, other path, quoted word) -> command.
TEMPLATES: tuple[Callable[[random.Random, str, str, str], str], ...] = (
    lambda r, p, q, w: f"echo {w} > {p}",
    lambda r, p, q, w: f"printf {w} > {p}",
    lambda r, p, q, w: f"echo {w} >> {p}",
    lambda r, p, q, w: f"rm {p}",
    lambda r, p, q, w: f"rm -rf {p}",
    lambda r, p, q, w: f"cp {p} {q}",
    lambda r, p, q, w: f"cp -a {p} {q}",
    lambda r, p, q, w: f"mv {p} {q}",
    lambda r, p, q, w: f"ln {p} {q}",
    lambda r, p, q, w: f"ln -sf {r.choice(LINK_TARGETS)} {q}",
    lambda r, p, q, w: f"chmod {r.choice(MODES)} {p}",
    lambda r, p, q, w: f"mkdir {p}",
    lambda r, p, q, w: f"mkdir -p {p}/x && echo {w} > {p}/x/y",
    lambda r, p, q, w: f"rmdir {p}",
    lambda r, p, q, w: f"mkfifo {FIFO}" if r.random() < 0.7 else f"rm {FIFO}",
    lambda r, p, q, w: f"touch {p}",
    lambda r, p, q, w: f"truncate -s {r.randrange(4)} {p}",
    lambda r, p, q, w: r.choice(["false", "exit 3", f"cat {p} && exit 4", f"echo {w} > {p}; exit 1", "ls /nowhere"]),
    _race,
    lambda r, p, q, w: f"cat {p}",
    lambda r, p, q, w: "ls -1F /w /w/d",
    lambda r, p, q, w: "find /w /tmp | sort",
    lambda r, p, q, w: f"stat -c '%n %F %a %u' {p} {q}",
    lambda r, p, q, w: f"test {p} -ef {q} && echo same || echo other",
    lambda r, p, q, w: f"md5sum {p}; wc -c < {p}",
    lambda r, p, q, w: f"test -s {p} && echo full || echo empty",
)


# Reads a result cache may serve (their output is a function of the version alone) of a
# path p that the setup writes: each layered case repeats a few of them, with appends to p.
WATCHED = ("/w/a", "/w/b", "/w/d/e", "/w/h", "/w/l")
READS: tuple[Callable[[random.Random, str, str, str], str], ...] = (
    lambda r, p, q, w: f"cat {p}",
    lambda r, p, q, w: f"cat {q} {p}",
    lambda r, p, q, w: f"wc -l {p}",
    lambda r, p, q, w: f"wc -c {p} {q}",
    lambda r, p, q, w: f"grep -c {w} {p}",
    lambda r, p, q, w: f"tail -n 2 {p}",
    lambda r, p, q, w: f"md5sum {p}",
    lambda r, p, q, w: f"ls -a {p} /w",
    lambda r, p, q, w: f"ls -aF /w /w/d; cat {p}",
)


# Read-set cases (make_case(..., readsets=True)): /v is read by the commands below, /u by none
# of them (its writes are unrelated), /w by both them and TEMPLATES.
READSET_SETUP = SETUP + " && mkdir -p /v /u && echo v > /v/a && echo log > /u/log"
READSET_PATHS = ("/w/a", "/w/d", "/w/x", "/v/a", "/v/b", "/v/d", "/w/l", "/w/nothere")
READSET_COMMANDS: tuple[Callable[[random.Random, str, str, str], str], ...] = (
    # (ls reports the entries it cannot stat in readdir order, which is the backing
    # filesystem's: tmpfs and ext4 differ; sorted, the output is the same on both)
    lambda r, p, q, w: r.choice(["ls /w", "ls -1F /v", "ls -a /w/d 2>&1 | sort", "ls /v /w/d 2>&1 | sort"]),
    lambda r, p, q, w: f"test -e {p} && echo yes || echo no",
    lambda r, p, q, w: r.choice(["find /w | sort", "find /v -type f | sort", "find /v /w/d -name '*' | sort"]),
    # a directory's size is the filesystem's (tmpfs or ext4): sizes of regular files only
    lambda r, p, q, w: f"for f in {p} {q}; do [ -f $f ] && stat -c '%n %s %a' $f || echo $f; done",
    lambda r, p, q, w: r.choice(["echo /v/*", "for f in /w/*; do echo $f; done", "ls -d /v/* /w/d/* 2>&1"]),
    lambda r, p, q, w: f"[ -d {p} ] || mkdir {p}; ls -d {p}",
    lambda r, p, q, w: f"[ -e {p} ] && cat {p} 2>&1 || echo none",
    lambda r, p, q, w: "test -L /w/l && readlink /w/l || echo nolink",
    lambda r, p, q, w: f"cat {p} 2>&1 | wc -c",
)
UNRELATED_WRITES: tuple[Callable[[random.Random, str], str], ...] = (
    lambda r, w: f"echo {w} >> /u/log",
    lambda r, w: f"mkdir -p /u/d{r.randrange(3)} && echo {w} > /u/d{r.randrange(3)}/f 2>&1; true",
    lambda r, w: f"rm -rf /u/d{r.randrange(3)}",
    lambda r, w: "touch /u/t",
    lambda r, w: "cp /u/log /u/log2",
    lambda r, w: f"echo {w} > /v/n{r.randrange(2)}",  # related: /v is read
    lambda r, w: f"rm -f /v/n{r.randrange(2)}",
)


def random_command(rng: random.Random) -> str:
    """One random shell command (see TEMPLATES)."""
    template = rng.choice(TEMPLATES)
    p, q, w = rng.choice(PATHS), rng.choice(PATHS), _q(rng.choice(WORDS))
    return template(rng, p, q, w)


def _timeout_command(rng: random.Random) -> str:
    return f"echo {_q(rng.choice(WORDS))} >> {rng.choice(PATHS)}; {SLEEP}"


@dataclass(frozen=True, slots=True)
class LosslessCase:
    """One randomized check: everything a run depends on (see the module docstring).

    ``script`` (a minimised reproduction) replaces the hashing actor: the actor emits
    ``script[len(history)]``. ``p_obs``/``p_action`` are how often the drafters propose the
    true observation / the true future action.
    """

    seed: int
    config: str
    pool: tuple[str, ...]
    steps: int
    engine: Mapping[str, Any]
    timeout_s: float = TIMEOUT_S
    setup: str = SETUP
    actor_delay_ms: int = 0
    draft_delay_ms: int = 0
    p_obs: float = 0.5
    p_action: float = 0.5
    script: tuple[str, ...] | None = None

    def engine_config(self) -> EngineConfig:
        return EngineConfig(**self.engine)

    def sandbox_config(self, config: str | None = None, state_dir: str | None = None) -> SandboxConfig:
        name = config or self.config
        if name not in SANDBOX_CONFIGS:
            raise ValueError(f"unknown sandbox configuration {name!r}; known: {', '.join(SANDBOX_CONFIGS)}")
        return SandboxConfig(
            backend="overlay", base="busybox", timeout_s=self.timeout_s, state_dir=state_dir,
            formatter="mini-swe-agent", **SANDBOX_CONFIGS[name]
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "config": self.config,
            "pool": list(self.pool),
            "steps": self.steps,
            "engine": dict(self.engine),
            "timeout_s": self.timeout_s,
            "setup": self.setup,
            "actor_delay_ms": self.actor_delay_ms,
            "draft_delay_ms": self.draft_delay_ms,
            "p_obs": self.p_obs,
            "p_action": self.p_action,
            "script": None if self.script is None else list(self.script),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LosslessCase:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise ValueError(f"lossless case: unknown keys {sorted(unknown)}")
        kw = dict(data)
        kw["pool"] = tuple(kw["pool"])
        if kw.get("script") is not None:
            kw["script"] = tuple(kw["script"])
        return cls(**kw)


def make_case(seed: int, config: str, *, layered: bool = False, readsets: bool = False) -> LosslessCase:
    """The case of ``seed`` on sandbox configuration ``config`` (the same seed gives the same
    pool, steps and engine configuration on every sandbox configuration).

    ``layered``: the case for a run through a :class:`SpeculationLayer`: the same case, its
    pool with 2-4 reads (:data:`READS`) of :data:`WATCHED` paths added two or three times
    each and one or two appends to each path read, an actor that takes 2-20 ms to decode (a
    stream router's events land mid-decode, while routed forks can still launch), a random
    ``routed_width`` and one to three more steps.

    ``readsets``: the case for read-set validation (module docstring): its pool with 4-8
    :data:`READSET_COMMANDS` and 3-6 :data:`UNRELATED_WRITES` added, lookahead 2-4, wider
    forks and three to six more steps."""
    if config not in SANDBOX_CONFIGS:
        raise ValueError(f"unknown sandbox configuration {config!r}; known: {', '.join(SANDBOX_CONFIGS)}")
    rng = random.Random(seed)
    pool = [random_command(rng) for _ in range(rng.randint(6, 14))]
    timeout_s = TIMEOUT_S
    if rng.random() < 0.1:
        pool.append(_timeout_command(rng))
        timeout_s = SHORT_TIMEOUT_S
    if rng.random() < 0.1:
        pool.append("")  # the actor's reply held no tool call: Action.none()
    branch_budget = rng.choice((0, 1, 2, 3))
    engine = {
        "branch_budget": branch_budget,
        "draft_candidates": rng.randint(branch_budget, branch_budget + 2),
        "obs_depth": rng.choice((1, 1, 2)),
        "rank": rng.choice(("evd", "likelihood", "tooltime")),
        "fork_width": rng.choice((0, 1, 2, 4)),
        "depth": rng.choice((1, 2, 3)),
        "provisional_targets": rng.random() < 0.7,
        "max_live_forks": rng.choice((1, 2, 4, 8)),
    }
    # drafting priced like a guess (docs/engine.md): a round's CPU fixed so that rounds not
    # worth it are skipped (there is no live host here to measure it); drawn apart, so the
    # rest of a seed's case is what it was
    drafting_cpu_s = _rng(seed, "drafting").choice((None, None, 0.002, 0.02))
    if drafting_cpu_s is not None:
        engine["drafting_cpu_s"] = drafting_cpu_s
    case = LosslessCase(
        seed=seed,
        config=config,
        pool=tuple(pool),
        steps=rng.randint(4, 9),
        engine=engine,
        timeout_s=timeout_s,
        actor_delay_ms=rng.choice((0, 2, 10)),
        draft_delay_ms=rng.choice((0, 1, 5)),
        p_obs=rng.choice((0.2, 0.5, 0.9)),
        p_action=rng.choice((0.2, 0.5, 0.9)),
    )
    if readsets:
        case = _readset_case(case)
    if not layered:
        return case
    # drawn apart, so that a layered case is its plain case with these additions
    lr = _rng(seed, "layered")
    pool = list(case.pool)
    for _ in range(lr.randint(2, 4)):
        # a read, repeated, and appends to what it reads: a repeat at the same version is a
        # cache hit, a repeat after an append must not be
        p = lr.choice(WATCHED)
        read = lr.choice(READS)(lr, p, lr.choice(PATHS), _q(lr.choice(WORDS)))
        appends = [f"echo {_q(lr.choice(WORDS))} >> {p}" for _ in range(lr.randint(1, 2))]
        for command in [read] * lr.randint(2, 3) + appends:
            pool.insert(lr.randrange(len(pool) + 1), command)
    return dataclasses.replace(
        case,
        pool=tuple(pool),
        steps=case.steps + lr.randint(1, 3),
        engine={**case.engine, "routed_width": lr.choice((1, 2, 3))},
        actor_delay_ms=lr.choice((2, 5, 10, 20)),
    )


def _readset_case(case: LosslessCase) -> LosslessCase:
    rr = _rng(case.seed, "readsets")
    pool = list(case.pool)
    for _ in range(rr.randint(4, 8)):
        p, q, w = rr.choice(READSET_PATHS), rr.choice(READSET_PATHS), _q(rr.choice(WORDS))
        pool.insert(rr.randrange(len(pool) + 1), rr.choice(READSET_COMMANDS)(rr, p, q, w))
    for _ in range(rr.randint(3, 6)):
        pool.insert(rr.randrange(len(pool) + 1), rr.choice(UNRELATED_WRITES)(rr, _q(rr.choice(WORDS))))
    engine = {
        **case.engine,
        "depth": rr.choice((2, 3, 4)),
        "fork_width": rr.choice((2, 4, 8)),
        "max_live_forks": rr.choice((4, 8, 16)),
        "read_sets": True,
    }
    return dataclasses.replace(
        case,
        pool=tuple(pool),
        setup=READSET_SETUP,
        steps=case.steps + rr.randint(3, 6),
        engine=engine,
        p_action=rr.choice((0.5, 0.9)),
    )


def _action(command: str) -> Action:
    return Action.bash(command) if command else Action.none()


# ---------------------------------------------------------------------------------- snapshots


def _entry(dirfd: int, name: str, st: os.stat_result) -> tuple[Any, ...]:
    fmt = stat.S_IFMT(st.st_mode)
    head = (stat.filemode(st.st_mode)[0], stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
    if fmt == stat.S_IFREG:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
        try:
            h = xxhash.xxh3_128()
            while chunk := os.read(fd, 1 << 20):
                h.update(chunk)
        finally:
            os.close(fd)
        return (*head, h.hexdigest())
    if fmt == stat.S_IFLNK:
        return (*head, os.readlink(name, dir_fd=dirfd))
    if fmt in (stat.S_IFCHR, stat.S_IFBLK):
        return (*head, os.major(st.st_rdev), os.minor(st.st_rdev))
    return head


def snapshot_tree(root: str | os.PathLike[str], *, links: bool = False) -> dict[str, tuple[Any, ...]]:
    """The content of the tree at ``root``: relative path -> (type, permission bits, uid,
    gid, content xxh3-128 | symlink target | device numbers[, hard-link group]).

    Hard-link groups are recorded only with ``links=True``: hard-link structure is not part
    of a sandbox's state (docs/runtime.md, Versions: overlayfs with ``index=off`` breaks a
    link on copy-up, e.g. on ``touch``, without changing the version), so the lossless
    check compares what versions promise.

    Never follows symlinks, never opens anything but regular files (FIFOs would block),
    walks with directory file descriptors (no path length limit), and records an entry
    the kernel lists but cannot stat (a stray whiteout) as ``("?", errno name)``. The
    hard-link group of a file with other names is the first of its names in sorted order;
    mtimes, inode numbers and link counts are left out, as in versions."""
    out: dict[str, tuple[Any, ...]] = {}
    inodes: dict[tuple[int, int], list[str]] = {}

    def walk(dirfd: int, prefix: str) -> None:
        with os.scandir(dirfd) as it:
            names = sorted(e.name for e in it)
        for name in names:
            rel = prefix + name
            try:
                st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            except OSError as exc:
                out[rel] = ("?", errno.errorcode.get(exc.errno or 0, str(exc.errno)))
                continue
            try:
                out[rel] = _entry(dirfd, name, st)
            except OSError as exc:
                out[rel] = ("?", errno.errorcode.get(exc.errno or 0, str(exc.errno)))
                continue
            if stat.S_ISDIR(st.st_mode):
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
                try:
                    walk(fd, rel + "/")
                finally:
                    os.close(fd)
            elif st.st_nlink > 1:
                inodes.setdefault((st.st_dev, st.st_ino), []).append(rel)

    top = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        walk(top, "")
    finally:
        os.close(top)
    for names in inodes.values() if links else ():
        if len(names) > 1:
            group = min(names)
            for name in names:
                out[name] = (*out[name], f"link:{group}")
    return out


def _snapshot_digest(snapshot: Mapping[str, tuple[Any, ...]]) -> str:
    return xxhash.xxh3_128_hexdigest(canonical_json(sorted(snapshot.items())).encode())


def diff_snapshots(a: Mapping[str, tuple[Any, ...]], b: Mapping[str, tuple[Any, ...]], limit: int = 8) -> list[str]:
    """Human-readable differences between two snapshots (the first ``limit``)."""
    lines = []
    for path in sorted(set(a) | set(b)):
        if a.get(path) != b.get(path):
            lines.append(f"/{path}: {a.get(path, 'absent')} != {b.get(path, 'absent')}")
    if len(lines) > limit:
        lines = [*lines[:limit], f"... and {len(lines) - limit} more"]
    return lines


async def snapshot_sandbox(sb: Any) -> dict[str, tuple[Any, ...]]:
    """Snapshot the committed sandbox through a fresh fork's merged root (a fork mounts
    it, and never changes the committed state)."""
    fork = await sb.fork()
    try:
        return await anyio.to_thread.run_sync(snapshot_tree, fork.root_path)
    finally:
        await fork.discard()


# ---------------------------------------------------------------------------------- runs


@dataclass(slots=True)
class RunRecord:
    """What one engine run committed and left."""

    trajectory: list[tuple[str, str]]
    version: str
    snapshot: dict[str, tuple[Any, ...]]
    forks_launched: int = 0
    forks_reused: int = 0
    drafts_hit: int = 0
    reopened: tuple[str, dict[str, tuple[Any, ...]]] | None = None
    #: the engine's routing and cache figures (0 without a layer), the layer's own counters
    counts: dict[str, int] = field(default_factory=dict)
    #: what each speculative failure said (the engine's ``fail`` events)
    failures: list[str] = field(default_factory=list)

    @property
    def digest(self) -> str:
        return _snapshot_digest(self.snapshot)


@dataclass(frozen=True, slots=True)
class SpeculationLayer:
    """What a speculative run goes through besides the case's drafters: yielded by the
    ``layer`` context manager :func:`check_case` opens around the run's sandbox (and closes
    before the committed state is snapshot, so everything the layer holds must be released
    by then).

    ``sandbox``: what the engine gets (wrapping the run's sandbox; the setup runs on it too).
    ``router``: a stream router (:class:`aospec.protocols.StreamRouter`) or None; with one,
    the actor streams and a routed action drafter joins. ``label``: the tool the router
    names for an action (the routed drafter proposes actions of that label as the right
    program). ``counts``: the layer's own counters, read once the run ends."""

    sandbox: Sandbox
    router: Any = None
    label: Callable[[Action], str] = tool_label
    counts: Callable[[], Mapping[str, int]] = dict


#: ``check_case``'s ``layer``: the run's sandbox -> an async context manager of the layer.
LayerFactory = Callable[[Sandbox], AbstractAsyncContextManager[SpeculationLayer]]

#: Engine figures a run records in ``RunRecord.counts`` (EngineStatistics fields).
ENGINE_COUNTS = (
    "forks_rebased",
    "routes_fired",
    "routed_forks_launched",
    "routed_forks_reused",
    "cache_hits",
    "speculative_failures",
    "drafting_skipped",
)


def _rng(*parts: object) -> random.Random:
    return random.Random(xxhash.xxh3_64_intdigest("\x1f".join(map(str, parts)).encode()))


def _history_digests(history: History) -> list[str]:
    """Running digests of a history's turns: ``[d0, d1, ...]``, ``d_k`` covering turns < k."""
    h = xxhash.xxh3_64()
    out = [h.hexdigest()]
    for t in history.turns:
        h.update(f"{t.action.key}\x1f{t.observation}\x1e".encode())
        out.append(h.hexdigest())
    return out


class _Truth:
    """The serial run's trajectory, for drafters that guess right part of the time."""

    def __init__(self, trajectory: History) -> None:
        self.turns = trajectory.turns
        self.prefix = _history_digests(trajectory)

    def position(self, history: History) -> int | None:
        """k when ``history`` equals the first k turns of the serial run, else None."""
        k = len(history)
        if k > len(self.turns) or _history_digests(history)[-1] != self.prefix[k]:
            return None
        return k


def _drafters(
    case: LosslessCase, truth: _Truth, pool: Sequence[Action]
) -> tuple[ScriptedObservationDrafter, ScriptedActionDrafter]:
    """Drafters that are pure functions of their inputs, right with the case's odds."""
    observations = sorted({t.observation for t in truth.turns})
    depth = case.engine_config().depth

    def observe(history: History, action: Action) -> list[ObservationDraft]:
        rng = _rng(case.seed, "obs", _history_digests(history)[-1], action.key)
        k = truth.position(history)
        true_obs = truth.turns[k].observation if k is not None and k < len(truth.turns) else None
        if true_obs is not None and truth.turns[k].action != action:
            true_obs = None
        drafts: list[ObservationDraft] = []
        if true_obs is not None and rng.random() < case.p_obs:
            drafts.append(ObservationDraft(true_obs, rng.random()))
        for _ in range(rng.randint(0, 3)):
            kind = rng.randrange(4)
            if kind == 0 and observations:
                text = rng.choice(observations)  # a real observation of some other step
            elif kind == 1 and true_obs is not None:
                text = true_obs + "\n"  # almost right
            elif kind == 2:
                text = f"<returncode>{rng.choice((0, 1))}</returncode>\n<output>\n</output>"
            else:
                text = f"<returncode>0</returncode>\n<output>\n{rng.choice(WORDS)}\n</output>"
            drafts.append(ObservationDraft(text, rng.random()))
        rng.shuffle(drafts)
        return drafts

    def propose(history: History) -> list[ActionDraft]:
        rng = _rng(case.seed, "act", _history_digests(history)[-1])
        k = truth.position(history)
        drafts: list[ActionDraft] = []
        if k is not None:
            for offset in range(depth):
                if k + offset < len(truth.turns) and rng.random() < case.p_action:
                    # the actual future action, mostly at its true offset
                    at = offset if rng.random() < 0.8 else rng.randrange(depth)
                    drafts.append(ActionDraft(truth.turns[k + offset].action, at, rng.random()))
        for _ in range(rng.randint(0, 3)):
            drafts.append(ActionDraft(rng.choice(pool), rng.randrange(depth), rng.random()))
        return drafts

    delay = case.draft_delay_ms / 1000
    return ScriptedObservationDrafter(observe, delay), ScriptedActionDrafter(propose, delay)


def _routed_drafter(
    case: LosslessCase, actor: ScriptedActor, pool: Sequence[Action], label: Callable[[Action], str]
) -> ScriptedRoutedActionDrafter:
    """For a tool the router names after ``history``: the action the actor will emit there
    (it is a pure function of the history) when it is of that tool, with the case's odds,
    then other pool actions of the same tool (right program, mostly wrong command) and
    sometimes of another tool; a pure function of (history, tool)."""
    by_label: dict[str, list[Action]] = {}
    for a in pool:
        by_label.setdefault(label(a), []).append(a)

    def routed(history: History, tool: str) -> list[ActionDraft]:
        rng = _rng(case.seed, "routed", _history_digests(history)[-1], tool)
        drafts: list[ActionDraft] = []
        true = actor.choose(history)
        if label(true) == tool and rng.random() < case.p_action:
            drafts.append(ActionDraft(true, 0, rng.random()))
        same = by_label.get(tool, [])
        for _ in range(rng.randint(0, 2) if same else 0):
            drafts.append(ActionDraft(rng.choice(same), 0, rng.random()))
        if rng.random() < 0.3:
            drafts.append(ActionDraft(rng.choice(pool), 0, rng.random()))
        rng.shuffle(drafts)
        return drafts

    return ScriptedRoutedActionDrafter(routed, delay_s=case.draft_delay_ms / 1000)


def _actor(case: LosslessCase, pool: Sequence[Action], *, streaming: bool = False) -> ScriptedActor:
    def delay(history: History) -> float:
        if not case.actor_delay_ms:
            return 0.0
        return _rng(case.seed, "delay", _history_digests(history)[-1]).random() * case.actor_delay_ms / 1000

    kind = StreamingScriptedActor if streaming else ScriptedActor
    if case.script is None:
        return kind.hashing(pool, seed=case.seed, delay_s=delay)
    script = tuple(_action(c) for c in case.script)

    def choose(history: History) -> Action:
        return script[len(history)] if len(history) < len(script) else Action.none()

    return kind(choose, delay)


async def run_engine(
    case: LosslessCase,
    *,
    config: str | None = None,
    truth: History | None = None,
    state_root: Path | None = None,
    layer: LayerFactory | None = None,
) -> RunRecord:
    """Run ``case`` once on a fresh sandbox of ``config`` (default: the case's): serial
    when ``truth`` is None, else speculative with drafters that know ``truth``, through
    ``layer`` when given (:class:`SpeculationLayer`)."""
    name = config or case.config
    pool = [_action(c) for c in case.pool]
    steps = case.steps if case.script is None else min(case.steps, len(case.script))
    state_dir = None
    if name == "durable":
        root = state_root or default_state_root()
        root.mkdir(parents=True, exist_ok=True)
        state_dir = tempfile.mkdtemp(prefix="lossless-", dir=root)
    sb_config = case.sandbox_config(name, state_dir)
    try:
        async with open_sandbox(sb_config) as sb:
            if truth is None:
                await sb.execute(Action.bash(case.setup))
                engine = Engine(_actor(case, pool), sb, config=case.engine_config())
                history = await engine.run(History(TASK), steps=steps)
                stats, counts, failures = engine.statistics(), {}, []
            else:
                async with _layer(layer, sb) as lay:
                    await lay.sandbox.execute(Action.bash(case.setup))
                    obs_drafter, action_drafter = _drafters(case, _Truth(truth), pool)
                    actor = _actor(case, pool, streaming=lay.router is not None)
                    drafters: list[Any] = [action_drafter]
                    if lay.router is not None:
                        drafters.append(_routed_drafter(case, actor, pool, lay.label))
                    engine = Engine(
                        actor,
                        lay.sandbox,
                        observation_drafters=[obs_drafter],
                        action_drafters=drafters,
                        config=case.engine_config(),
                        router=lay.router,
                    )
                    history = await engine.run(History(TASK), steps=steps)
                    stats = engine.statistics()
                    counts = {name: int(getattr(stats, name)) for name in ENGINE_COUNTS}
                    counts.update(lay.counts())
                    failures = [e.detail for e in engine.ledger.events if e.kind is EventKind.FAIL]
            # the layer is closed: what is snapshot is the committed state itself
            record = RunRecord(
                trajectory=[(t.action.key, t.observation) for t in history.turns],
                version=sb.version,
                snapshot=await snapshot_sandbox(sb),
                forks_launched=stats.forks_launched,
                forks_reused=stats.forks_reused,
                drafts_hit=stats.drafts_hit,
                counts=counts,
                failures=failures,
            )
        if state_dir is not None:
            async with open_sandbox(sb_config) as sb:
                record.reopened = (sb.version, await snapshot_sandbox(sb))
        return record
    finally:
        if state_dir is not None:
            await anyio.to_thread.run_sync(_fs.remove_tree, state_dir)


@asynccontextmanager
async def _layer(layer: LayerFactory | None, sb: Sandbox) -> AsyncIterator[SpeculationLayer]:
    if layer is None:
        yield SpeculationLayer(sb)
        return
    async with layer(sb) as lay:
        yield lay


def _history(record: RunRecord) -> History:
    history = History(TASK)
    for key, observation in record.trajectory:
        history = history.extend(Action.from_json(json.loads(key)), observation)
    return history


# ---------------------------------------------------------------------------------- checks


@dataclass(slots=True)
class CaseOutcome:
    """The verdict on one case: ``kind`` is ``ok``, ``divergence`` (``where`` says which
    comparison), ``aborted`` (a run raised; ``where`` names the run), ``leak`` (mounts,
    processes or state-root entries left behind) or ``inconclusive`` (a command that should take
    milliseconds timed out: the machine was too loaded to judge)."""

    case: LosslessCase
    kind: str = "ok"
    where: str = ""
    details: list[str] = field(default_factory=list)
    forks_launched: int = 0
    forks_reused: int = 0
    drafts_hit: int = 0
    serial_actions: list[str] = field(default_factory=list)
    #: the speculative run's RunRecord.counts (engine routing/cache figures, layer counters)
    counts: dict[str, int] = field(default_factory=dict)
    #: the speculative run's RunRecord.failures
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.kind == "ok"

    @property
    def signature(self) -> tuple[str, str]:
        return (self.kind, self.where)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "where": self.where,
            "details": self.details,
            "case": self.case.to_json(),
            "serial_actions": self.serial_actions,
            "forks_launched": self.forks_launched,
            "forks_reused": self.forks_reused,
            "drafts_hit": self.drafts_hit,
            "counts": self.counts,
            "failures": self.failures,
        }

    def summary(self) -> str:
        head = f"seed {self.case.seed} [{self.case.config}]: {self.kind}"
        if self.where:
            head += f" ({self.where})"
        return "\n".join([head, *("  " + d for d in self.details)])


def compare_runs(a: RunRecord, b: RunRecord, label: str) -> list[str]:
    """What differs between two runs that must be equal (empty: nothing)."""
    out: list[str] = []
    for i, (x, y) in enumerate(zip(a.trajectory, b.trajectory, strict=False)):
        if x != y:
            which = "action" if x[0] != y[0] else "observation"
            out.append(f"{label}: trajectories differ at step {i} ({which}): {x!r} != {y!r}")
            break
    else:
        if len(a.trajectory) != len(b.trajectory):
            out.append(f"{label}: trajectory lengths differ: {len(a.trajectory)} != {len(b.trajectory)}")
    if a.version != b.version:
        out.append(f"{label}: versions differ: {a.version} != {b.version}")
    if a.digest != b.digest:
        out.append(f"{label}: filesystem contents differ:")
        out.extend("    " + line for line in diff_snapshots(a.snapshot, b.snapshot))
    return out


def _reopen_problems(record: RunRecord, label: str) -> list[str]:
    if record.reopened is None:
        return []
    version, snap = record.reopened
    out = []
    if version != record.version:
        out.append(f"{label}: reopened state has version {version}, not {record.version}")
    if _snapshot_digest(snap) != record.digest:
        out.append(f"{label}: reopened state's contents differ from the closed state's:")
        out.extend("    " + line for line in diff_snapshots(record.snapshot, snap))
    return out


def _leaks(state_root: Path) -> list[str]:
    return _fs.mounts_under(str(state_root)) if state_root.exists() else []


def _descendants() -> dict[int, str]:
    """The live processes below this one: pid -> command line (zombies and the read-set
    tracer left out)."""
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="utf-8", errors="replace") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if state != "Z":
            parents[int(name)] = int(ppid)
    from aospec.runtime.ebpf import service_pids

    for pid in service_pids():  # the process's read-set tracer, kept on purpose
        parents.pop(pid, None)
    found: set[int] = set()
    frontier = {os.getpid()}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    out = {}
    for pid in found:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out[pid] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
    return out


def _entries(state_root: Path) -> set[str]:
    return set(os.listdir(state_root)) if state_root.exists() else set()


async def _left_behind(state_root: Path, processes: Mapping[int, str], entries: set[str]) -> list[str]:
    """What a run left that was not there before it: mounts under the state root, processes
    below this one, entries in the state root. Processes and entries get two seconds to go
    (a killed process is reaped, a store removed, in the background)."""
    out = [f"mount {m}" for m in _leaks(state_root)[:4]]
    for _ in range(40):
        procs = {pid: cmd for pid, cmd in _descendants().items() if processes.get(pid) != cmd}
        new = _entries(state_root) - entries
        if not procs and not new:
            break
        await anyio.sleep(0.05)
    out += [f"process {pid}: {cmd[:80]}" for pid, cmd in sorted(procs.items())[:4]]
    out += [f"entry {state_root / e}" for e in sorted(new)[:4]]
    return out


async def check_case(
    case: LosslessCase,
    *,
    reference: RunRecord | None = None,
    state_root: Path | None = None,
    layer: LayerFactory | None = None,
) -> tuple[CaseOutcome, RunRecord | None]:
    """Run the reference (unless given: it depends on the seed only), serial and
    speculative runs of ``case`` and compare them; returns the outcome and the reference
    record (to reuse for the same seed on other configurations). ``layer``: the
    speculative run goes through it (:class:`SpeculationLayer`); the serial runs never do."""
    root = state_root or default_state_root()
    outcome = CaseOutcome(case)

    async def run(name: str, **kw: Any) -> RunRecord | None:
        processes, entries = _descendants(), _entries(root)
        try:
            record = await run_engine(case, state_root=root, **kw)
        except Exception as exc:  # whatever the engine or a sandbox raises is the finding
            tb = traceback.extract_tb(exc.__traceback__)
            if tb and tb[-1].filename == __file__:
                raise  # a fault of this check itself, not of what it checks
            outcome.kind, outcome.where = "aborted", f"{name} run"
            outcome.details = [
                f"{type(exc).__name__}: {exc}",
                *(f"at {f.filename}:{f.lineno} in {f.name}" for f in tb[-3:]),
            ]
            return None
        leaked = await _left_behind(root, processes, entries)
        if leaked:
            outcome.kind, outcome.where = "leak", f"{name} run"
            outcome.details = [f"left behind under {root} or below this process: {', '.join(leaked)}"]
            _fs.unmount_all_under(str(root))
            return None
        return record

    if reference is None:
        reference = await run("reference", config=REFERENCE_CONFIG)
        if reference is None:
            return outcome, None
    serial = reference if case.config == REFERENCE_CONFIG else await run("serial")
    if serial is None:
        return outcome, reference
    spec = await run("speculative", truth=_history(serial), layer=layer)
    if spec is None:
        return outcome, reference
    outcome.serial_actions = [_command_of(key) for key, _ in serial.trajectory]
    outcome.forks_launched, outcome.forks_reused = spec.forks_launched, spec.forks_reused
    outcome.drafts_hit = spec.drafts_hit
    outcome.counts = dict(spec.counts)
    outcome.failures = list(spec.failures)
    slow = sorted({cmd for r in (reference, serial, spec) for cmd in _spurious_timeouts(r)})
    if slow:
        outcome.kind, outcome.where = "inconclusive", "timeouts"
        outcome.details = [f"timed out although it takes milliseconds: {cmd!r}" for cmd in slow]
        return outcome, reference
    checks = [
        ("speculative vs serial", compare_runs(serial, spec, "speculative vs serial")),
        (
            f"{case.config} vs {REFERENCE_CONFIG}",
            compare_runs(reference, serial, f"serial on {case.config} vs serial on {REFERENCE_CONFIG}"),
        ),
        ("reopen", _reopen_problems(spec, "speculative") + _reopen_problems(serial, "serial")),
    ]
    for where, problems in checks:
        if problems:
            outcome.kind, outcome.where, outcome.details = "divergence", where, problems
            break
    return outcome, reference


def _spurious_timeouts(record: RunRecord) -> list[str]:
    """Commands of ``record`` that timed out without sleeping past the timeout."""
    return [
        cmd
        for key, obs in record.trajectory
        if obs.startswith("The last command <command>") and SLEEP not in (cmd := _command_of(key))
    ]


def _command_of(key: str) -> str:
    action = Action.from_json(json.loads(key))
    return action.command if action.command is not None else ""


# ---------------------------------------------------------------------------------- minimising


async def minimise(
    outcome: CaseOutcome,
    *,
    attempts: int = 2,
    budget: int = 40,
    state_root: Path | None = None,
    progress: Callable[[str], None] | None = None,
    layer: LayerFactory | None = None,
) -> CaseOutcome:
    """A smaller case failing the same way as ``outcome`` (same kind and comparison): the
    actor replays the serial run's actions (``script``), then steps, actions and
    speculation knobs are dropped one at a time while the failure persists (each candidate
    tried up to ``attempts`` times: some failures are races). At most ``budget`` checks,
    each through ``layer`` when given (as in :func:`check_case`)."""
    if outcome.ok:
        return outcome
    want = outcome.signature
    spent = 0

    async def fails(case: LosslessCase) -> CaseOutcome | None:
        nonlocal spent
        for _ in range(attempts):
            if spent >= budget:
                return None
            spent += 1
            got, _ = await check_case(case, state_root=state_root, layer=layer)
            if got.signature == want:
                return got
        return None

    best = outcome
    script = tuple(outcome.serial_actions) if outcome.serial_actions else None
    if script is not None:
        candidate = dataclasses.replace(outcome.case, script=script, steps=len(script))
        if (got := await fails(candidate)) is not None:
            best = got
    if best.case.script is not None:
        i = len(best.case.script) - 1
        while i >= 0 and spent < budget:
            script = best.case.script[:i] + best.case.script[i + 1 :]
            if script:
                candidate = dataclasses.replace(best.case, script=script, steps=len(script))
                if (got := await fails(candidate)) is not None:
                    best = got
                    if progress:
                        progress(f"minimise: {len(script)} actions")
            i -= 1
    for knob, value in (
        ("branch_budget", 0),
        ("fork_width", 0),
        ("provisional_targets", False),
        ("obs_depth", 1),
        ("depth", 1),
    ):
        if spent >= budget or best.case.engine.get(knob) == value:
            continue
        engine = {**best.case.engine, knob: value}
        if knob == "branch_budget":
            engine["draft_candidates"] = min(engine["draft_candidates"], 2)
        candidate = dataclasses.replace(best.case, engine=engine)
        if (got := await fails(candidate)) is not None:
            best = got
    return best
