"""The host's speculation budget: one cgroup for every session's background commands, with
a CPU quota and a memory limit the kernel enforces; an impossible budget is one line."""

from __future__ import annotations

import os
from collections.abc import Iterator

import anyio
import pytest
from aospec.runtime import (
    SandboxConfig,
    clear_speculation_budget,
    open_sandbox,
    set_speculation_budget,
    speculation_budget,
)
from aospec.runtime.cgroups import POOL
from aospec.runtime.host import host_support

from aospec.errors import ConfigError

pytestmark = [pytest.mark.root]

_SPIN = "i=0; while [ $i -lt 2000000 ]; do i=$((i+1)); done"


@pytest.fixture
def host_budget() -> Iterator[None]:
    """Leave the host's budget as it was (it is shared by every session on the host)."""
    _, cgroups = host_support()
    if cgroups is None or not ({"cpu", "memory"} & set(cgroups.roots)):
        pytest.skip("no writable cpu or memory cgroup on this host")
    before = speculation_budget()
    yield
    if before is None:
        clear_speculation_budget()
    else:
        set_speculation_budget(cores=before.cores, memory_bytes=before.memory_bytes)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "give cores, memory_bytes or both"),
        ({"cores": 0}, "cores=0 cannot be met"),
        ({"cores": -1.0}, "cannot be met"),
        ({"cores": float("nan")}, "must be a number"),
        ({"cores": (os.cpu_count() or 1) + 1}, "cannot be met"),
        ({"memory_bytes": 1 << 20}, "cannot be met: give between"),
        ({"memory_bytes": 1 << 60}, "cannot be met"),
        ({"memory_bytes": 1.5e9}, "whole number of bytes"),
        ({"cores": True}, "must be a number"),
    ],
)
def test_an_impossible_budget_is_one_line(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        set_speculation_budget(**kwargs)
    assert "\n" not in str(info.value)


def test_a_budget_is_set_read_and_cleared_host_wide(host_budget: None) -> None:
    budget = set_speculation_budget(cores=0.5, memory_bytes=512 << 20)
    _, cgroups = host_support()
    assert cgroups is not None
    for what in ("cpu", "memory"):
        if what in cgroups.roots:
            assert what in budget.enforced
            assert (cgroups.roots[what] / POOL).is_dir()
    if "cpu" in budget.enforced:
        assert budget.cores == 0.5
    if "memory" in budget.enforced:
        assert budget.memory_bytes == 512 << 20
    assert budget.note == ("" if set(budget.enforced) == {"cpu", "memory"} else budget.note)
    # what another process reads is the same (it lives in cgroupfs)
    assert speculation_budget() == budget or speculation_budget().cores == budget.cores  # type: ignore[union-attr]
    # None: that resource unlimited
    assert set_speculation_budget(cores=1.0).memory_bytes is None
    clear_speculation_budget()
    assert speculation_budget() is None


@pytest.mark.anyio
async def test_background_commands_run_in_the_budget_and_leave_it_when_raised(host_budget: None) -> None:
    _, cgroups = host_support()
    assert cgroups is not None
    if "cpu" not in cgroups.roots:
        pytest.skip("no cpu controller")
    set_speculation_budget(cores=0.1)
    pool = cgroups.roots["cpu"] / POOL
    async with open_sandbox(SandboxConfig(backend="overlay", timeout_s=60)) as sb:
        fork = await sb.fork()
        await fork.set_priority(foreground=False)
        async with anyio.create_task_group() as tg:
            tg.start_soon(fork.run, _SPIN)
            with anyio.fail_after(20):
                while not any(p.name.startswith(f"aospec-{sb.store.id}-{fork.sid}-") for p in pool.iterdir()):
                    await anyio.sleep(0.02)
            start_cpu, start = fork.cpu_ns, anyio.current_time()
            await anyio.sleep(1.5)
            rate = (fork.cpu_ns - start_cpu) / 1e9 / (anyio.current_time() - start)
            # the kernel's quota: 0.1 of a core (scheduling granularity aside)
            assert rate < 0.25, rate
            used_in_pool = fork.cpu_ns
            await fork.set_priority(foreground=True)  # the step now waits on it
            assert not any(p.name.startswith(f"aospec-{sb.store.id}-{fork.sid}-") for p in pool.iterdir())
            assert fork.cpu_ns >= used_in_pool  # what it used in the pool stays counted
            tg.cancel_scope.cancel()
        # a foreground sandbox's commands never enter the pool
        other = await sb.fork()
        async with anyio.create_task_group() as tg:
            tg.start_soon(other.run, "sleep 30")
            await anyio.sleep(0.5)
            assert not any(p.name.startswith(f"aospec-{sb.store.id}-{other.sid}-") for p in pool.iterdir())
            tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_the_pool_a_cleared_budget_leaves_is_not_a_budget(host_budget: None) -> None:
    """Clearing the budget while a background command runs leaves the pool's cgroups (they
    hold that command, unlimited) after it ends: a pool without limits read as a budget of
    nothing (cores and memory None), which made the next `aospec run` report one and a
    test's restore of the budget fail."""
    set_speculation_budget(cores=1)
    async with open_sandbox(SandboxConfig(backend="overlay", timeout_s=60)) as sb:
        fork = await sb.fork()
        await fork.set_priority(foreground=False)
        async with anyio.create_task_group() as tg:
            tg.start_soon(fork.run, "sleep 1")
            await anyio.sleep(0.3)
            clear_speculation_budget()
        await fork.discard()
    assert speculation_budget() is None
