"""Read-set validation: the rule (hypothesis, against a model filesystem), the validator's
chain of write sets, and the engine reusing forks across unrelated commits losslessly."""

from __future__ import annotations

import functools
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aospec.engine import Engine
from aospec.engine_config import EngineConfig
from aospec.host import StaticHostMonitor
from aospec.protocols import ActionDraft, HostSnapshot, ReadSetSandbox, SandboxCapabilities
from aospec.readsets import ReadSet, ReadSetValidator, WriteSet, conflict, fork_conflict
from aospec.testing import InMemorySandbox, ReadSetInMemorySandbox, ScriptedActionDrafter, ScriptedActor
from aospec.types import Action, History
from aospec.wrappers import SandboxWrapper

# ---------------------------------------------------------------------------------- a model
# A filesystem is {path: entry}: ("d", mode, mtime) or ("f", mode, content, mtime), paths
# relative ("" the root, always a directory), every parent a directory.

NAMES = ("a", "b", "c")
PATHS = [""] + [f"{x}" for x in NAMES] + [f"{x}/{y}" for x in NAMES for y in NAMES]
PATHS += [f"{x}/{y}/{z}" for x in NAMES[:2] for y in NAMES[:2] for z in NAMES[:2]]
Fs = dict[str, tuple[Any, ...]]


def parent(p: str) -> str:
    return p.rpartition("/")[0]


def children(fs: Fs, d: str) -> list[str]:
    return sorted(p for p in fs if p and parent(p) == d)


def below(fs: Fs, d: str) -> list[str]:
    return sorted(p for p in fs if d == "" or p == d or p.startswith(d + "/"))


def versioned(entry: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """What a version covers: type, mode, content (never times)."""
    return None if entry is None else entry[:-1]


@st.composite
def filesystems(draw: st.DrawFn) -> Fs:
    fs: Fs = {"": ("d", 0o755, 0)}
    for p in PATHS[1:]:
        if parent(p) in fs and fs[parent(p)][0] == "d" and draw(st.booleans()):
            if draw(st.booleans()):
                fs[p] = ("d", draw(st.sampled_from((0o755, 0o700))), 0)
            else:
                fs[p] = ("f", 0o644, draw(st.sampled_from(("x", "y"))), 0)
    return fs


def mutate(fs: Fs, ops: list[tuple[str, str, int]]) -> Fs:
    """A committed step: each op on a path, as a shell would do it (a directory's time
    moves when its entries change)."""
    out = dict(fs)
    clock = 1
    for op, p, n in ops:
        clock += 1
        if not p:
            continue
        par = parent(p)
        if par not in out or out[par][0] != "d":
            continue  # the shell's command fails: nothing changes
        had = p in out
        if op == "write" and (not had or out[p][0] == "f"):
            out[p] = ("f", out[p][1] if had else 0o644, "xyz"[n % 3], clock)
        elif op == "chmod" and had:
            e = out[p]
            out[p] = (e[0], (0o755, 0o700, 0o600)[n % 3], *e[2:-1], clock)
        elif op == "touch" and had:
            out[p] = (*out[p][:-1], clock)
        elif op == "rm" and had:
            for q in below(out, p):
                del out[q]
        elif op == "mkdir" and not had:
            out[p] = ("d", 0o755, clock)
        else:
            continue
        if had != (p in out):
            out[par] = (*out[par][:-1], clock)  # an entry came or went
    return out


def write_set(s0: Fs, s1: Fs) -> WriteSet:
    """What the runtime records for s0 -> s1 (runtime/readsets.py write_set, from a layer):
    records below a removed directory are dropped, the directory stands for them."""
    changed, gone = set(), set()
    for p in sorted(set(s0) | set(s1), key=lambda p: p.split("/")):
        if any(p.startswith(g + "/") for g in gone if g):
            continue
        if versioned(s0.get(p)) != versioned(s1.get(p)):
            changed.add(p)
            if p not in s1 or s1[p][0] != "d":
                gone.add(p)
    touched = {
        p for p in set(s0) | set(s1) if s0.get(p) != s1.get(p) and "d" not in (s0.get(p, "?")[0], s1.get(p, "?")[0])
    }
    entries = set()
    for d in set(s0) | set(s1):
        if (s0.get(d) or s1.get(d))[0] != "d":
            continue
        kids0 = [(q, s0[q][0]) for q in children(s0, d)] if s0.get(d, ("?",))[0] == "d" else None
        kids1 = [(q, s1[q][0]) for q in children(s1, d)] if s1.get(d, ("?",))[0] == "d" else None
        if kids0 != kids1 or s0.get(d) != s1.get(d):
            entries.add(d)
    return WriteSet(frozenset(changed), frozenset(touched), frozenset(entries))


KINDS = ("lookup", "node", "list", "tree")


def answer(fs: Fs, kind: str, p: str) -> Any:
    """What a command learns from one query: resolution stops at the first ancestor that is
    missing or not a directory; a lookup sees the entry's versioned state, a node also its
    times (a directory's: and its entries), a listing its entries' names and types, a
    tree everything below."""
    parts = p.split("/") if p else []
    for i in range(len(parts)):
        a = "/".join(parts[:i])
        if a not in fs or fs[a][0] != "d":
            return ("stopped", a, versioned(fs.get(a)))
    chain = tuple(versioned(fs.get("/".join(parts[:i]))) for i in range(len(parts) + 1))
    e = fs.get(p)
    if kind == "lookup" or e is None:
        return chain
    if kind == "node":
        return chain, e, [(q, fs[q][0]) for q in children(fs, p)] if e[0] == "d" else None
    if kind == "list":
        return chain, [(q, fs[q][0]) for q in children(fs, p)] if e[0] == "d" else None
    return chain, [(q, fs[q]) for q in below(fs, p)]


def reads_of(fs: Fs, queries: list[tuple[str, str]]) -> ReadSet:
    """The read set the tracer records for ``queries`` run on ``fs``: the first missing or
    non-directory component as a lookup, else the path with the query's kind."""
    out: dict[str, set[str]] = {k: set() for k in KINDS}
    for kind, p in queries:
        parts = p.split("/") if p else []
        for i in range(len(parts)):
            a = "/".join(parts[:i])
            if a not in fs or fs[a][0] != "d":
                out["lookup"].add(a)
                break
        else:
            out[kind].add(p)
    return ReadSet(*(frozenset(out[k]) for k in KINDS))


ops = st.lists(
    st.tuples(st.sampled_from(("write", "chmod", "touch", "rm", "mkdir")), st.sampled_from(PATHS), st.integers(0, 5)),
    min_size=1,
    max_size=4,
)
queries = st.lists(st.tuples(st.sampled_from(KINDS), st.sampled_from(PATHS)), min_size=1, max_size=6)


@settings(max_examples=1500, suppress_health_check=[HealthCheck.too_slow])
@given(filesystems(), ops, queries)
def test_a_read_set_disjoint_from_a_write_set_means_every_read_gives_the_same_answer(
    s0: Fs, step: list[tuple[str, str, int]], qs: list[tuple[str, str]]
) -> None:
    s1 = mutate(s0, step)
    reads = reads_of(s0, qs)
    if conflict(reads, write_set(s0, s1)) is None:
        for kind, p in qs:
            assert answer(s0, kind, p) == answer(s1, kind, p), (kind, p)


@settings(max_examples=400)
@given(filesystems(), ops, queries)
def test_a_changed_answer_is_always_caught(s0: Fs, step: list[tuple[str, str, int]], qs: list[tuple[str, str]]) -> None:
    # the contrapositive, stated the way the engine relies on it
    s1 = mutate(s0, step)
    if any(answer(s0, k, p) != answer(s1, k, p) for k, p in qs):
        assert conflict(reads_of(s0, qs), write_set(s0, s1)) is not None


def test_the_rule_by_example() -> None:
    w = WriteSet(changed=frozenset({"w/log"}), touched=frozenset({"w/log"}), entries=frozenset())
    assert conflict(ReadSet(nodes=frozenset({"w/a"}), lists=frozenset({"w"})), w) is None  # a log line elsewhere
    assert conflict(ReadSet(nodes=frozenset({"w/log"})), w) == "node /w/log"
    created = WriteSet(frozenset({"w/new"}), frozenset({"w/new"}), frozenset({"w"}))
    assert conflict(ReadSet(lists=frozenset({"w"})), created) == "list /w"  # ls sees the new entry
    assert conflict(ReadSet(lookups=frozenset({"w/new"})), created) == "lookup /w/new"  # test -e saw it missing
    assert conflict(ReadSet(lookups=frozenset({"w"})), created) is None  # cd w: unchanged
    assert conflict(ReadSet(trees=frozenset({"w"})), created) == "tree /w"  # mv w elsewhere moved it too
    removed = WriteSet(frozenset({"d"}), frozenset(), frozenset({""}))
    assert conflict(ReadSet(lookups=frozenset({"d/x/y"})), removed) == "lookup /d/x/y"  # below a removed dir
    touched = WriteSet(frozenset(), frozenset({"src.c"}), frozenset())  # touch: the version is unchanged
    assert conflict(ReadSet(nodes=frozenset({"src.c"})), touched) == "node /src.c"  # make saw its time
    assert conflict(ReadSet(lookups=frozenset({"src.c"})), touched) is None


def test_a_fork_cannot_be_rebased_over_a_change_to_what_it_wrote() -> None:
    committed = WriteSet(frozenset({"w/a"}), frozenset({"w/a"}), frozenset())
    assert fork_conflict(WriteSet(frozenset({"w/a"}), frozenset({"w/a"}), frozenset()), committed) == "write /w/a"
    below_removed = WriteSet(frozenset({"w"}), frozenset(), frozenset({""}))
    assert fork_conflict(WriteSet(frozenset({"w/x"}), frozenset({"w/x"}), frozenset({"w"})), below_removed)
    # two steps adding entries to one directory merge
    both = WriteSet(frozenset({"w/b"}), frozenset({"w/b"}), frozenset({"w"}))
    assert fork_conflict(WriteSet(frozenset({"w/c"}), frozenset({"w/c"}), frozenset({"w"})), both) is None


def op_reads(fs: Fs, fork_ops: list[tuple[str, str, int]]) -> list[tuple[str, str]]:
    """What ``mutate``'s ops look at, as queries: whether the path exists, its type, mode and
    content (kept by write and chmod); ``rm`` everything below."""
    return [("tree" if op == "rm" else "lookup", p) for op, p, _ in fork_ops]


def rebased(s1: Fs, sf: Fs, fork: WriteSet) -> Fs:
    """The committed state ``s1`` with a fork's changes on top, as an overlay upper holds
    them: each path the fork changed or touched takes its state in the fork (gone: with
    everything below it)."""
    out = dict(s1)
    for p in sorted(fork.changed | fork.touched, key=lambda p: p.split("/")):
        if p in sf:
            if sf[p][0] != "d":
                # a non-directory in an upper hides everything below it in the lowers
                for q in below(out, p):
                    del out[q]
            out[p] = sf[p]
        else:
            for q in below(out, p):
                del out[q]
    return out


@st.composite
def step_and_fork(draw: st.DrawFn) -> tuple[Fs, list[tuple[str, str, int]], list[tuple[str, str, int]]]:
    """A filesystem, a committed step and a fork's command, on paths whose parent is a
    directory there (so that most ops change something)."""
    s0 = draw(filesystems())
    where = st.sampled_from([p for p in PATHS[1:] if s0.get(parent(p), ("?",))[0] == "d"])
    some = st.lists(st.tuples(st.sampled_from(("write", "chmod", "touch", "rm", "mkdir")), where, st.integers(0, 5)),
                    min_size=1, max_size=4)  # fmt: skip
    return s0, draw(some), draw(some)


@settings(max_examples=800, suppress_health_check=[HealthCheck.too_slow])
@given(step_and_fork())
def test_a_fork_that_passes_the_check_rebases_to_what_running_it_there_gives(
    case: tuple[Fs, list[tuple[str, str, int]], list[tuple[str, str, int]]],
) -> None:
    s0, step, fork_ops = case
    s1, sf = mutate(s0, step), mutate(s0, fork_ops)
    qs = op_reads(s0, fork_ops)
    reads = reads_of(s0, qs)
    reads = ReadSet(*(a | b for a, b in zip(
        (reads.lookups, reads.nodes, reads.lists, reads.trees), _kinds(reads_of(sf, qs)), strict=True
    )))  # fmt: skip
    v = ReadSetValidator("v0")
    v.committed("v0", "v1", write_set(s0, s1))
    if v.check("v0", reads, write_set(s0, sf)) is None:
        want, got = mutate(s1, fork_ops), rebased(s1, sf, write_set(s0, sf))
        assert {p: versioned(e) for p, e in got.items()} == {p: versioned(e) for p, e in want.items()}


def _kinds(r: ReadSet) -> tuple[frozenset[str], ...]:
    return r.lookups, r.nodes, r.lists, r.trees


paths = st.frozensets(st.sampled_from(PATHS), max_size=4)
read_sets = st.builds(ReadSet, paths, paths, paths, paths)
write_sets = st.builds(WriteSet, paths, paths, paths)


@given(read_sets, read_sets, write_sets, write_sets)
def test_more_reads_or_more_writes_never_remove_a_conflict(
    r1: ReadSet, r2: ReadSet, w1: WriteSet, w2: WriteSet
) -> None:
    if conflict(r1, w1) is not None:
        assert conflict(r1, w1.union(w2)) is not None
        bigger = ReadSet(*(getattr(r1, k) | getattr(r2, k) for k in ("lookups", "nodes", "lists", "trees")))
        assert conflict(bigger, w1) is not None
    assert conflict(r1, WriteSet()) is None


@given(read_sets, write_sets)
def test_read_and_write_sets_survive_json(r: ReadSet, w: WriteSet) -> None:
    assert ReadSet.from_json(r.to_json()) == r and WriteSet.from_json(w.to_json()) == w
    with pytest.raises(ValueError, match="unknown keys"):
        ReadSet.from_json({"opened": []})
    with pytest.raises(ValueError, match="list of paths"):
        WriteSet.from_json({"changed": "w/a"})


@given(st.lists(st.one_of(st.none(), write_sets), max_size=6), st.integers(0, 6))
def test_the_validator_unions_what_was_committed_since_an_origin(steps: list[WriteSet | None], start: int) -> None:
    v = ReadSetValidator("v0")
    for i, ws in enumerate(steps):
        v.committed(f"v{i}", f"v{i + 1}", ws)
    if start > len(steps):
        assert v.writes_since(f"v{start}") is None  # never committed: unknown
        return
    since = steps[start:]
    got = v.writes_since(f"v{start}")
    if any(ws is None for ws in since):
        assert got is None
    else:
        want = WriteSet()
        for ws in since:
            want = want.union(ws)  # type: ignore[arg-type]
        assert got == want


def test_a_step_that_only_touched_times_keeps_the_version_but_counts() -> None:
    v = ReadSetValidator("v0")
    v.committed("v0", "v1", WriteSet())
    v.committed("v1", "v1", WriteSet(touched=frozenset({"src.c"})))  # touch src.c
    assert v.check("v0", ReadSet(nodes=frozenset({"src.c"})), WriteSet()) == "node /src.c"
    assert v.check("v0", ReadSet(nodes=frozenset({"other"})), WriteSet()) is None
    assert v.check("v0", None, WriteSet()) == "its reads were not tracked"
    v.reset("v1")
    assert v.check("v0", ReadSet(), WriteSet()) == "a write set since its origin is unknown"


# ---------------------------------------------------------------------------------- the engine

SCRIPT = [
    "echo 1 > a",
    "echo log >> notes",
    "sleep 0.2 && cat a",
    "echo 2 >> b",
    "sleep 0.2 && cat a",
    "echo 3 > a",
    "sleep 0.2 && cat a",
    "ls",
]


def _lookahead(script: list[str], depth: int = 3) -> ScriptedActionDrafter:
    def propose(history: History) -> list[ActionDraft]:
        n = len(history)
        return [ActionDraft(Action.bash(script[n + k]), k, 0.9) for k in range(depth) if n + k < len(script)]

    return ScriptedActionDrafter(propose)


async def _run(sandbox: InMemorySandbox, script: list[str], **config: Any) -> tuple[list[str], str, Any]:
    actor = ScriptedActor(lambda h: Action.bash(script[len(h)]) if len(h) < len(script) else Action.none(), 0.02)
    engine = Engine(
        actor, sandbox, action_drafters=[_lookahead(script)], config=EngineConfig(branch_budget=0, **config)
    )
    history = await engine.run(History("t"), steps=len(script))
    return [t.observation for t in history.turns], sandbox.version, engine.statistics()


def test_forks_are_reused_across_unrelated_commits_and_the_result_is_serial_execution() -> None:
    serial = anyio.run(functools.partial(_run, InMemorySandbox({"notes": "x\n"}), SCRIPT, depth=1, fork_width=0))
    jasv_sb = InMemorySandbox({"notes": "x\n"}, op_delay_s=0.01)
    rs_sb = ReadSetInMemorySandbox({"notes": "x\n"}, op_delay_s=0.01)
    jasv = anyio.run(functools.partial(_run, jasv_sb, SCRIPT, depth=3))
    rs = anyio.run(functools.partial(_run, rs_sb, SCRIPT, depth=3))
    assert jasv[:2] == serial[:2] == rs[:2]
    assert rs_sb.files == jasv_sb.files and rs_sb.live_forks == 0
    st_jasv, st_rs = jasv[2], rs[2]
    assert st_jasv.forks_rebased == 0 and st_rs.forks_rebased >= 2  # `cat a` across `echo >> notes`, `echo >> b`
    assert st_rs.forks_rebased == rs_sb.rebased
    # never across `echo 3 > a`: the `cat a` after it ran afresh or from a fork of its own state
    assert st_rs.forks_wasted < st_jasv.forks_wasted


def test_read_sets_off_is_plain_jasv() -> None:
    sb = ReadSetInMemorySandbox({"notes": "x\n"}, op_delay_s=0.01)
    _, _, stats = anyio.run(functools.partial(_run, sb, SCRIPT, depth=3, read_sets=False))
    assert stats.forks_rebased == 0 and sb.rebased == 0


def test_the_capability_passes_through_wrappers_and_is_absent_on_the_plain_sandbox() -> None:
    class Passing(SandboxWrapper):
        async def fork(self) -> Passing:
            return Passing(await self.inner.fork())

    assert SandboxCapabilities.of(ReadSetInMemorySandbox()).read_sets
    assert not SandboxCapabilities.of(InMemorySandbox()).read_sets
    assert isinstance(Passing(ReadSetInMemorySandbox()), ReadSetSandbox)
    assert not isinstance(Passing(InMemorySandbox()), ReadSetSandbox)


POOL = ["echo 1 > a", "echo 2 >> a", "cat a", "rm a", "echo x >> log", "cat log", "ls", "sleep 0.05 && cat a", "true"]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from(POOL), min_size=2, max_size=8), st.integers(2, 4), st.floats(0.0, 1.0))
def test_speculating_with_read_sets_equals_serial_execution(script: list[str], depth: int, p_right: float) -> None:
    def propose(history: History) -> list[ActionDraft]:
        n = len(history)
        out = []
        for k in range(depth):
            if n + k < len(script):
                right = (hash((n, k, tuple(script))) % 100) / 100 < p_right
                out.append(ActionDraft(Action.bash(script[n + k] if right else POOL[(n + k) % len(POOL)]), k, 0.5))
        return out

    async def run(sandbox: InMemorySandbox, speculate: bool) -> tuple[list[str], str, dict[str, str]]:
        actor = ScriptedActor(lambda h: Action.bash(script[len(h)]) if len(h) < len(script) else Action.none(), 0.005)
        drafters = [ScriptedActionDrafter(propose)] if speculate else []
        engine = Engine(actor, sandbox, action_drafters=drafters, config=EngineConfig(branch_budget=0, depth=depth))
        history = await engine.run(History("t"), steps=len(script))
        assert sandbox.live_forks == 0
        return [t.observation for t in history.turns], sandbox.version, sandbox.files

    serial = anyio.run(run, InMemorySandbox({"log": "0\n"}), False)
    speculative = anyio.run(run, ReadSetInMemorySandbox({"log": "0\n"}, op_delay_s=0.002), True)
    assert speculative == serial


def test_only_forks_a_read_set_can_serve_are_traced() -> None:
    """A target for the action being decoded, launched from a committed state nothing runs
    on, is checked at its own origin when emitted: it runs untraced (a hit must not make the
    agent wait for the tracer). Targets past it (offset > 0) are traced."""
    script = ["echo 1 > a", "sleep 0.05 && cat a", "echo 2 >> b", "sleep 0.05 && cat a"]

    def at(offsets: tuple[int, ...]) -> ScriptedActionDrafter:
        def propose(history: History) -> list[ActionDraft]:
            n = len(history)
            return [ActionDraft(Action.bash(script[n + k]), k, 0.9) for k in offsets if n + k < len(script)]

        return ScriptedActionDrafter(propose)

    async def run(offsets: tuple[int, ...]) -> tuple[ReadSetInMemorySandbox, Any]:
        sb = ReadSetInMemorySandbox(op_delay_s=0.01)
        actor = ScriptedActor(lambda h: Action.bash(script[len(h)]) if len(h) < len(script) else Action.none(), 0.1)
        engine = Engine(actor, sb, action_drafters=[at(offsets)], config=EngineConfig(branch_budget=0, depth=2))
        await engine.run(History("t"), steps=len(script))
        return sb, engine.statistics()

    now, st_now = anyio.run(run, (0,))
    assert st_now.forks_reused >= 2 and now.traced == ()
    ahead, st_ahead = anyio.run(run, (1,))
    assert "sleep 0.05 && cat a" in ahead.traced and st_ahead.forks_rebased >= 1  # across `echo 2 >> b`


@pytest.mark.parametrize(("free_cores", "traced"), [(2.0, True), (0.5, False)])
def test_forks_are_traced_only_while_the_host_has_a_core_to_spare(free_cores: float, traced: bool) -> None:
    """The tracer multiplies a command's CPU: with less than a core free no speculative fork
    is traced (none rebased, the same result); with one free the same targets are, counted
    in ``forks_traced``."""
    script = ["echo 1 > a", "sleep 0.05 && cat a", "echo 2 >> b", "sleep 0.05 && cat a"]

    def propose(history: History) -> list[ActionDraft]:
        n = len(history)
        return [ActionDraft(Action.bash(script[n + 1]), 1, 0.9)] if n + 1 < len(script) else []

    host = StaticHostMonitor(HostSnapshot(cores=4.0, busy_cores=4.0 - free_cores, cpu_pressure=0.0))

    async def run(speculate: bool) -> tuple[ReadSetInMemorySandbox, Any, History]:
        sb = ReadSetInMemorySandbox(op_delay_s=0.01)
        actor = ScriptedActor(lambda h: Action.bash(script[len(h)]) if len(h) < len(script) else Action.none(), 0.1)
        drafters = [ScriptedActionDrafter(propose)] if speculate else []
        cfg = EngineConfig(branch_budget=0, depth=2, cpu_price=0.0)
        engine = Engine(actor, sb, action_drafters=drafters, config=cfg, host=host)
        history = await engine.run(History("t"), steps=len(script))
        return sb, engine.statistics(), history

    sb, st, history = anyio.run(run, True)
    ref_sb, _, ref = anyio.run(run, False)
    assert history == ref and sb.files == ref_sb.files
    assert st.forks_launched >= 2
    if traced:
        assert st.forks_traced >= 1 and sb.traced and st.forks_rebased >= 1
    else:
        assert st.forks_traced == 0 and sb.traced == () and st.forks_rebased == 0
