"""The state-keyed result cache (specbox/cache.py): exact hits only at the same version,
never stale, on the in-memory sandbox and on real overlay sandboxes; violations of a
determinism declaration; bounds; semantic drafts."""

from __future__ import annotations

import threading
import warnings

import anyio
import pytest
from aospec.specbox.cache import (
    CachedSandbox,
    CachePolicy,
    CacheViolationWarning,
    ResultCache,
    SemanticCacheDrafter,
    action_text,
    shell_commands,
    similarity,
    storable,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aospec.errors import SandboxError
from aospec.protocols import ObservationDrafter, Sandbox
from aospec.testing import InMemorySandbox
from aospec.types import Action, History

READS = shell_commands("cat", "ls", "wc")


def run(fn, *args):  # type: ignore[no-untyped-def]
    return anyio.run(fn, *args)


# -- policy ------------------------------------------------------------------------------


def test_shell_predicate_accepts_only_the_named_read_only_commands() -> None:
    assert READS(Action.bash("cat a"))
    assert READS(Action.bash("cat a && ls"))
    assert READS(Action.bash("cat a | wc -l"))
    assert not READS(Action.bash("cat a > b"))  # writes
    assert not READS(Action.bash("grep x a"))  # not named
    assert not READS(Action.bash("cat $(ls)"))  # substitution
    assert not READS(Action.bash("cat 'a"))  # unparsable
    assert not READS(Action("bash", {"command": "cat a", "timeout": 3}))
    assert not READS(Action("read_file", {"path": "a"}))


def test_policy_from_mcp_annotations() -> None:
    policy = CachePolicy.from_annotations(
        {
            "read_file": {"readOnlyHint": True, "idempotentHint": True, "openWorldHint": False},
            "fetch_url": {"readOnlyHint": True, "idempotentHint": True},  # open world: not deterministic
            "write_file": {"readOnlyHint": False, "idempotentHint": True, "openWorldHint": False},
            "clock": {"readOnlyHint": True},
        }
    )
    assert policy.deterministic_tools == {"read_file"}
    assert policy.idempotent_tools == {"read_file", "fetch_url"}
    assert policy.is_idempotent(Action("fetch_url", {"url": "x"}))
    assert not policy.is_deterministic(Action("fetch_url", {"url": "x"}))
    assert not policy.is_deterministic(Action.none())


# -- the table ---------------------------------------------------------------------------


def test_key_is_action_and_version_and_namespace() -> None:
    cache = ResultCache()
    a = Action("read_file", {"path": "a", "lines": [1, 2]})
    cache.put(a, "v1", "one")
    assert cache.get(Action("read_file", {"lines": [1, 2], "path": "a"}), "v1") == "one"  # canonical JSON
    assert cache.get(a, "v2") is None
    assert cache.get(a, "v1", namespace="other") is None
    s = cache.stats
    assert (s.hits, s.misses, s.stale_avoided) == (1, 2, 1)


def test_bounds_evict_least_recently_used() -> None:
    cache = ResultCache(max_entries=2)
    a, b, c = (Action("t", {"x": i}) for i in range(3))
    cache.put(a, "v", "A")
    cache.put(b, "v", "B")
    assert cache.get(a, "v") == "A"  # a is now the most recent
    cache.put(c, "v", "C")
    assert cache.get(b, "v") is None and cache.get(a, "v") == "A" and cache.get(c, "v") == "C"
    assert cache.stats.evictions == 1 and len(cache) == 2

    small = ResultCache(max_bytes=1000)
    assert not small.put(a, "v", "x" * 2000)  # larger than the whole cache
    for i in range(20):
        small.put(Action("t", {"x": i}), "v", "y" * 200)
    assert small.stats.bytes <= 1000 and len(small) < 20


def test_concurrent_threads_keep_the_table_consistent() -> None:
    cache = ResultCache(max_entries=50)

    errors: list[str] = []

    def worker(k: int) -> None:
        for i in range(300):
            a = Action("t", {"x": (i * 7 + k) % 80})
            got = cache.get(a, "v")
            if got is None:
                cache.put(a, "v", f"r{a.args['x']}")
            elif got != f"r{a.args['x']}":
                errors.append(f"{a!r}: {got!r}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s = cache.stats
    assert s.entries == len(cache) <= 50
    assert s.hits + s.misses >= 1200


# -- the sandbox wrapper -----------------------------------------------------------------


def test_cached_sandbox_is_a_sandbox_and_forks_share_the_cache() -> None:
    async def main() -> None:
        sb = CachedSandbox(InMemorySandbox({"a": "1\n"}), deterministic=READS)
        assert isinstance(sb, Sandbox)
        first = await sb.execute(Action.bash("cat a"))
        fork = await sb.fork()
        assert fork.cache is sb.cache and fork.version == sb.version
        assert await fork.execute(Action.bash("cat a")) == first
        assert sb.cache.stats.hits == 1
        await fork.execute(Action.bash("echo 2 > a"))
        assert await fork.execute(Action.bash("cat a")) != first  # new version: no stale hit
        await sb.commit(fork)
        assert await sb.execute(Action.bash("cat a")) == "<returncode>0</returncode>\n<output>\n2\n</output>"
        assert sb.cache.stats.hits == 2  # the fork's read at that version
        assert sb.live_forks == 0  # other attributes are the inner sandbox's
        with pytest.raises(SandboxError):
            await sb.commit(await InMemorySandbox().fork())  # type: ignore[arg-type]

    run(main)


def test_last_cache_hit_ns_says_what_the_last_execute_saved_and_counts_are_shared() -> None:
    async def main() -> None:
        sb = CachedSandbox(InMemorySandbox({"a": "1\n"}, op_delay_s=0.01), deterministic=READS)
        assert sb.last_cache_hit_ns is None  # nothing ran yet
        await sb.execute(Action.bash("cat a"))
        assert sb.last_cache_hit_ns is None  # a miss: it ran
        (entry,) = sb.cache.recent("bash")
        assert entry.duration_ns > 0
        fork = await sb.fork()
        await fork.execute(Action.bash("cat a"))
        assert fork.last_cache_hit_ns == entry.duration_ns  # the recorded run time, saved
        assert sb.last_cache_hit_ns is None  # per sandbox, not per cache
        await fork.execute(Action.bash("echo 2 > a"))
        assert fork.last_cache_hit_ns is None  # a bypass ran
        await fork.execute(Action.bash("cat a"))
        assert fork.last_cache_hit_ns is None  # new version: a miss, it ran
        await fork.discard()
        counts = sb.cache_counts()
        assert counts == fork.cache_counts()  # one cache for the sandbox and its forks
        assert {k: counts[k] for k in ("hits", "misses", "bypasses", "stale_avoided", "stores")} == {
            "hits": 1,
            "misses": 2,
            "bypasses": 1,
            "stale_avoided": 1,
            "stores": 2,
        }
        assert counts["hit_saved_ns"] == entry.duration_ns
        assert all(isinstance(v, int) for v in counts.values())
        assert {"stale_differed", "violations", "evictions"} <= set(counts)

    run(main)


def test_non_deterministic_actions_bypass() -> None:
    async def main() -> None:
        sb = CachedSandbox(InMemorySandbox(), deterministic={"read_file"})
        for _ in range(2):
            await sb.execute(Action.bash("ls"))
        s = sb.cache.stats
        assert (s.bypasses, s.hits, s.misses, s.entries) == (2, 0, 0, 0)

    run(main)


def test_a_wrong_declaration_is_caught_counted_and_warned_once() -> None:
    async def main() -> None:
        liar = shell_commands("cat", "rm")  # rm is read-only by no stretch; the classifier already refuses it
        assert not liar(Action.bash("rm a"))
        # declare a writing command deterministic by tool predicate: the wrapper finds out
        sb = CachedSandbox(InMemorySandbox({"a": "x"}), deterministic=lambda a: a.tool == "bash")
        await sb.execute(Action.bash("cat a"))  # cached
        with pytest.warns(CacheViolationWarning):
            await sb.execute(Action.bash("echo y >> a"))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            v = sb.version
            await sb.execute(Action.bash("echo y >> a"))  # runs again (not cached), no second warning
            assert sb.version != v
            await sb.execute(Action.bash("echo z > b"))  # another violation of the same tool: counted only
        s = sb.cache.stats
        assert s.violations == 2 and s.bypasses == 1
        assert not sb.cacheable(Action.bash("echo y >> a"))
        assert sb.cacheable(Action.bash("cat a"))  # a shell violation disables that command line only

    run(main)


def test_a_violating_tool_is_purged_and_disabled_whole() -> None:
    class Counter:
        """A tool sandbox whose 'peek' tool bumps the version on its third call."""

        def __init__(self) -> None:
            self.version = "v0"
            self.calls = 0

        async def execute(self, action: Action) -> str:
            self.calls += 1
            if self.calls == 3:
                self.version = "v1"
            return f"peek {action.args['n']}"

        async def fork(self) -> Counter:
            return self

        async def commit(self, fork: Counter) -> None:
            pass

        async def discard(self) -> None:
            pass

    async def main() -> None:
        inner = Counter()
        sb = CachedSandbox(inner, deterministic={"peek"})  # type: ignore[arg-type]
        await sb.execute(Action("peek", {"n": 1}))
        await sb.execute(Action("peek", {"n": 2}))
        assert len(sb.cache) == 2
        with pytest.warns(CacheViolationWarning):
            await sb.execute(Action("peek", {"n": 3}))
        assert len(sb.cache) == 0  # earlier entries of the tool are gone: a hit would skip a change
        await sb.execute(Action("peek", {"n": 1}))
        assert inner.calls == 4

    run(main)


# -- never stale: random sequences on real state --------------------------------------

PATHS = ("a", "b")
MEM_READS = [Action.bash(c) for c in ("cat a", "cat b", "ls", "cat a && cat b", "ls && cat a")]
MEM_WRITES = [
    Action.bash(c) for c in ("echo 1 > a", "echo 2 > a", "echo 3 >> b", "rm a", "rm b", "echo 1 > a && rm b", "true")
]

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("exec"), st.integers(0, 3), st.sampled_from(MEM_READS + MEM_WRITES)),
        st.tuples(st.just("fork"), st.integers(0, 3), st.none()),
        st.tuples(st.just("commit"), st.integers(1, 3), st.none()),
        st.tuples(st.just("discard"), st.integers(1, 3), st.none()),
    ),
    min_size=1,
    max_size=30,
)


async def _check_never_stale(root: CachedSandbox, ops: list[tuple[str, int, Action | None]]) -> int:
    """Play ``ops`` on ``root`` and its forks; every deterministic result must equal what a
    real run at that moment returns (a fork of the inner sandbox runs it for reference).
    Forks are taken from the root; one is committed only if the root has not moved since it
    was taken (as JASV does), else discarded. Returns the number of hits served."""
    forks: list[tuple[CachedSandbox, str]] = []  # (fork, root version when taken)
    try:
        for kind, i, action in ops:
            if kind == "exec":
                assert action is not None
                sb = root if i == 0 or not forks else forks[(i - 1) % len(forks)][0]
                reference = None
                if root.cacheable(action):
                    probe = await sb.inner.fork()
                    try:
                        reference = await probe.execute(action)
                    finally:
                        await probe.discard()
                before = sb.version
                got = await sb.execute(action)
                if reference is not None:
                    assert got == reference, f"{action!r} at {before}: served {got!r}, running gives {reference!r}"
                    assert sb.version == before
            elif kind == "fork":
                forks.append((await root.fork(), root.version))
            elif forks:
                child, origin = forks.pop((i - 1) % len(forks))
                if kind == "commit" and origin == root.version:
                    await root.commit(child)
                else:
                    await child.discard()
    finally:
        for child, _ in forks:
            await child.discard()
    return root.cache.stats.hits


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_in_memory_results_from_the_cache_are_never_stale(ops: list[tuple[str, int, Action | None]]) -> None:
    async def main() -> None:
        root = CachedSandbox(InMemorySandbox({"a": "0\n"}), ResultCache(max_entries=8), deterministic=READS)
        await _check_never_stale(root, ops)

    run(main)


def test_the_never_stale_check_sees_hits() -> None:
    ops = [("exec", 0, MEM_READS[0]), ("fork", 0, None), ("exec", 1, MEM_READS[0]), ("exec", 0, MEM_WRITES[0])]
    ops += [("exec", 0, MEM_READS[0]), ("commit", 1, None), ("exec", 0, MEM_READS[0])]

    async def main() -> int:
        root = CachedSandbox(InMemorySandbox({"a": "0\n"}), deterministic=READS)
        hits = await _check_never_stale(root, ops)  # type: ignore[arg-type]
        assert root.cache.stats.stale_avoided >= 1
        return hits

    assert run(main) >= 2


OV_READS = [Action.bash(c) for c in ("cat /w/a", "cat /w/b", "ls /w", "wc -c /w/a", "cat /w/a /w/b")]
OV_WRITES = [
    Action.bash(c)
    for c in ("echo 1 > /w/a", "echo 2 >> /w/a", "echo 3 > /w/b", "rm -f /w/a", "rm -f /w/b", "touch /w/a", "true")
]
OV_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("exec"), st.integers(0, 2), st.sampled_from(OV_READS + OV_WRITES)),
        st.tuples(st.just("fork"), st.integers(0, 0), st.none()),
        st.tuples(st.just("commit"), st.integers(1, 2), st.none()),
        st.tuples(st.just("discard"), st.integers(1, 2), st.none()),
    ),
    min_size=1,
    max_size=14,
)


def _overlay_reason() -> str | None:
    from aospec.runtime.host import host_support

    problems = host_support()[0].problems()
    return "; ".join(problems) if problems else None


@pytest.mark.root
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OV_OPS)
def test_overlay_results_from_the_cache_are_never_stale(ops: list[tuple[str, int, Action | None]]) -> None:
    reason = _overlay_reason()
    if reason:
        pytest.skip(f"overlay sandboxes cannot run here: {reason}")
    from aospec.runtime import open_sandbox

    async def main() -> None:
        async with open_sandbox(backend="overlay", timeout_s=20, formatter="mini-swe-agent") as inner:
            await inner.execute(Action.bash("mkdir -p /w && echo 0 > /w/a"))
            root = CachedSandbox(inner, deterministic=shell_commands("cat", "ls", "wc"))
            await _check_never_stale(root, [*ops, ("exec", 0, OV_READS[0]), ("exec", 0, OV_READS[0])])
            assert root.cache.stats.hits >= 1

    run(main)


# -- semantic drafts ---------------------------------------------------------------------


def test_similarity_and_action_text() -> None:
    assert similarity("cat /w/a.txt", "cat /w/a.txt") == 1.0
    assert similarity("cat src/module_a.py", "cat src/module_b.py") > 0.6
    assert similarity("cat src/module_a.py", "ls /") < 0.2
    assert action_text(Action.bash("ls -la")) == "ls -la"
    assert action_text(Action("read_file", {"path": "x", "n": 1})) == '{"n":1,"path":"x"}'


@pytest.mark.parametrize("method", ["jaccard", "tfidf"])
def test_semantic_drafts_only_for_idempotent_reads_and_verified_as_drafts(method: str) -> None:
    async def main() -> None:
        policy = CachePolicy(deterministic_tools={"read_file"}, idempotent_tools={"search"})
        cache = ResultCache()
        sb = InMemorySandbox()
        drafter = SemanticCacheDrafter(cache, policy, threshold=0.5, method=method, version=lambda: sb.version)  # type: ignore[arg-type]
        assert isinstance(drafter, ObservationDrafter)
        cache.put(Action("search", {"query": "def parse_config"}), sb.version, "src/config.py:12")
        cache.put(Action("search", {"query": "def parse_args"}), "old", "src/cli.py:3")
        cache.put(Action("write_file", {"path": "x"}), sb.version, "ok")
        h = History("t")
        drafts = await drafter.draft(h, Action("search", {"query": "def parse_config("}), 3)
        assert drafts and drafts[0].text == "src/config.py:12"
        assert all(0 < d.probability <= 1 for d in drafts)
        assert await drafter.draft(h, Action("write_file", {"path": "y"}), 3) == []  # not an idempotent read
        assert await drafter.draft(h, Action("search", {"query": "zzzz qqqq"}), 3) == []  # below threshold
        strict = SemanticCacheDrafter(cache, policy)  # default tau_c = 0.8
        assert strict.threshold == 0.8
        assert cache.stats.semantic_drafts >= 1

    run(main)


# -- the engine, unchanged, on a cached sandbox -------------------------------------------


@pytest.mark.parametrize("speculate", [False, True])
def test_the_engine_runs_unchanged_on_a_cached_sandbox_and_stays_lossless(speculate: bool) -> None:
    from aospec.engine import Engine
    from aospec.engine_config import EngineConfig
    from aospec.protocols import ActionDraft, ObservationDraft
    from aospec.testing import ScriptedActionDrafter, ScriptedActor, ScriptedObservationDrafter

    pool = [Action.bash(c) for c in ("cat a", "ls", "cat a && cat b", "echo 1 >> a", "echo 2 > b", "rm b")]

    async def play(cached: bool) -> tuple[History, dict[str, str], ResultCache | None]:
        inner = InMemorySandbox({"a": "0\n"}, op_delay_s=0.01)
        sandbox = CachedSandbox(inner, deterministic=READS) if cached else inner
        drafters = {}
        if speculate:
            drafters = {
                "observation_drafters": [
                    ScriptedObservationDrafter(
                        lambda h, a: [ObservationDraft("<returncode>0</returncode>\n<output>\n</output>", 0.5)]
                    )
                ],
                "action_drafters": [ScriptedActionDrafter(lambda h: [ActionDraft(pool[len(h) % len(pool)], 0, 0.5)])],
            }
        engine = Engine(
            ScriptedActor.hashing(pool, seed=7, delay_s=0.005),
            sandbox,
            config=EngineConfig(branch_budget=2 if speculate else 0, fork_width=2 if speculate else 0),
            **drafters,  # type: ignore[arg-type]
        )
        verified = await engine.run(History("t"), steps=30)
        return verified, inner.files, sandbox.cache if cached else None  # type: ignore[union-attr]

    async def main() -> None:
        plain_history, plain_files, _ = await play(False)
        cached_history, cached_files, cache = await play(True)
        assert cached_history == plain_history and cached_files == plain_files
        assert cache is not None and cache.stats.hits > 0

    run(main)


def test_consumed_wrappers_refuse_use_and_timeouts_are_not_stored() -> None:
    async def main() -> None:
        sb = CachedSandbox(InMemorySandbox({"a": "1"}), deterministic=READS)
        await sb.execute(Action.bash("cat a"))
        fork = await sb.fork()
        await sb.commit(fork)
        with pytest.raises(SandboxError):
            await fork.execute(Action.bash("cat a"))  # a hit would be there: still refused
        with pytest.raises(SandboxError):
            await sb.commit(fork)
        other = await sb.fork()
        await other.discard()
        with pytest.raises(SandboxError):
            await other.execute(Action.bash("cat a"))

    run(main)
    assert not storable(Action.bash("cat a"), "<returncode>124</returncode>\n<output>\n</output>")
    assert not storable(Action.bash("cat a"), "partial\n[timed out]")
    assert storable(Action.bash("cat a"), "<returncode>1</returncode>\n<output>\nno such file\n</output>")
