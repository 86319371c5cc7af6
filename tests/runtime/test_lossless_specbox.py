"""Losslessness through the SpecBox layer a live run uses (scripts/check_lossless.py
--specbox): the speculative run goes through CachedSandbox(PooledSandbox(sandbox)) with the
deterministic-reads predicate, a parse router on the actor's stream and a routed action
drafter, and must still equal serial execution; the layer must have been exercised (cache
hits, routed forks, pool forks) and leave nothing behind."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from aospec.live.specbox_layer import deterministic_reads
from aospec.runtime.lossless import CaseOutcome, LosslessCase, SpeculationLayer, check_case, make_case

from aospec.types import Action

ROOT = Path(__file__).resolve().parents[2]


def _script_module() -> Any:
    spec = importlib.util.spec_from_file_location("_aospec_check_lossless", ROOT / "scripts" / "check_lossless.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def specbox_layer() -> Any:
    return _script_module().specbox_layer()


async def _check(seed: int, config: str, state: Path, layer: Any) -> CaseOutcome:
    for _ in range(3):  # inconclusive: a millisecond command timed out on a loaded machine
        outcome, _ = await check_case(make_case(seed, config, layered=True), state_root=state, layer=layer)
        if outcome.kind != "inconclusive":
            break
    return outcome


@pytest.mark.root
def test_speculative_runs_through_the_specbox_layer_equal_serial_runs(
    overlay: str, runtime_dirs: dict[str, Path]
) -> None:
    layer = specbox_layer()

    async def main() -> list[CaseOutcome]:
        runs = [(seed, "memory") for seed in range(1, 7)] + [(7, "compact"), (4, "durable")]
        return [await _check(seed, config, runtime_dirs["state"], layer) for seed, config in runs]

    outcomes = anyio.run(main)
    failed = [o.summary() for o in outcomes if not o.ok]
    assert not failed, "\n".join(failed)
    total: Counter[str] = Counter()
    for o in outcomes:
        total.update(o.counts)
    assert total["cache_hits"] > 0, f"the cache never served a committed step: the check proves nothing ({total})"
    assert total["routed_forks_launched"] > total["routed_forks_reused"] > 0, total
    assert total["pool_served"] > 0 and total["pool_stale_discarded"] > 0, total
    assert total["cache_violations"] == 0, total
    # A guess starved at background priority until its timeout is a speculative failure by
    # design on a loaded host (its result is not used: runtime/_session.py); any other is a bug.
    failures = [
        f"seed {o.case.seed} [{o.case.config}]: {f}"
        for o in outcomes
        for f in o.failures
        if "limit at background priority" not in f
    ]
    assert not failures, failures


class _VersionBlindCache:
    """A result cache that keys on the action alone, not on the version: it serves a read
    from before a write. The bug the check must catch."""

    def __init__(self, inner: Any, memo: dict[str, str]) -> None:
        self.inner, self.memo = inner, memo
        self.deterministic = deterministic_reads()

    @property
    def version(self) -> str:
        return self.inner.version

    async def execute(self, action: Action) -> str:
        if not self.deterministic(action):
            return await self.inner.execute(action)
        if action.key not in self.memo:
            self.memo[action.key] = await self.inner.execute(action)
        return self.memo[action.key]

    async def fork(self) -> _VersionBlindCache:
        return _VersionBlindCache(await self.inner.fork(), self.memo)

    async def commit(self, fork: _VersionBlindCache) -> None:
        await self.inner.commit(fork.inner)

    async def discard(self) -> None:
        await self.inner.discard()


@asynccontextmanager
async def _version_blind(sandbox: Any) -> AsyncIterator[SpeculationLayer]:
    yield SpeculationLayer(_VersionBlindCache(sandbox, {}))


@pytest.mark.root
def test_the_check_catches_a_cache_that_serves_a_read_from_before_a_write(
    overlay: str, runtime_dirs: dict[str, Path]
) -> None:
    async def main() -> list[CaseOutcome]:
        return [await _check(seed, "memory", runtime_dirs["state"], _version_blind) for seed in range(1, 7)]

    outcomes = anyio.run(main)
    caught = [o for o in outcomes if o.kind == "divergence" and o.where == "speculative vs serial"]
    assert caught, "a version-blind cache went unnoticed: " + "; ".join(o.kind for o in outcomes)


@pytest.mark.root
def test_a_layer_that_leaves_a_process_and_a_state_entry_behind_is_a_leak(
    overlay: str, runtime_dirs: dict[str, Path], tmp_path: Path
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    pids: list[int] = []

    @asynccontextmanager
    async def leaky(sandbox: Any) -> AsyncIterator[SpeculationLayer]:
        pids.append(subprocess.Popen(["sleep", "60"]).pid)
        (state / "stray").mkdir()
        yield SpeculationLayer(sandbox)

    try:
        outcome, _ = anyio.run(lambda: check_case(make_case(2, "memory", layered=True), state_root=state, layer=leaky))
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert (outcome.kind, outcome.where) == ("leak", "speculative run"), outcome.summary()
    assert f"process {pids[0]}: sleep 60" in outcome.details[0]
    assert str(state / "stray") in outcome.details[0]


def test_a_layered_case_is_its_plain_case_with_repeated_reads_and_a_decoding_actor() -> None:
    reads = deterministic_reads()
    for seed in range(20):
        plain, layered = make_case(seed, "memory"), make_case(seed, "memory", layered=True)
        assert layered == make_case(seed, "memory", layered=True)
        assert LosslessCase.from_json(json.loads(json.dumps(layered.to_json()))) == layered
        extra = Counter(layered.pool) - Counter(plain.pool)
        repeated_reads = {c for c, n in extra.items() if n >= 2 and reads(Action.bash(c))}
        appends = {c for c in extra if " >> /w/" in c and not reads(Action.bash(c))}
        assert len(repeated_reads) >= 1 and len(appends) >= 2 and set(extra) <= repeated_reads | appends, extra
        assert layered.actor_delay_ms > 0 and layered.steps > plain.steps
        assert {k: v for k, v in layered.engine.items() if k != "routed_width"} == dict(plain.engine)


@pytest.mark.root
def test_check_lossless_script_reports_the_layer_with_specbox(overlay: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            *(sys.executable, str(ROOT / "scripts" / "check_lossless.py"), "--runs", "2", "--seed", "7"),
            *("--configs", "memory,compact", "--specbox", "--json", "--out", str(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["specbox"] is True and doc["failures"] == []
    assert set(doc["layer"]) == {"memory", "compact"}
    assert sum(c["pool_served"] for c in doc["layer"].values()) > 0
    assert sum(c["routes_fired"] for c in doc["layer"].values()) > 0
