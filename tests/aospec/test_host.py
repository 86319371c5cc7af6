"""The host the controller prices guesses on (aospec/host.py): the live monitor reads
/proc (here a fake /proc, so the figures are exact), and the host's speculation budget is
shared by every session through flock slots."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from aospec.errors import ConfigError
from aospec.host import (
    BUDGET_ENV,
    DECODES,
    DecodeMeter,
    ProcHostMonitor,
    SpeculationBudget,
    auto_budget_cores,
    check_budget,
    host_budget,
    parse_budget,
    process_cores,
)
from aospec.protocols import HostMonitor


class FakeProc:
    """A /proc with just the files the monitor reads, and a clock the test moves."""

    def __init__(self, root: Path, *, psi: bool = True) -> None:
        self.root = root
        self.t = 100.0
        self.psi = psi
        (root / "pressure").mkdir(parents=True, exist_ok=True)
        self.write(busy=0, idle=0, cpu_stall_us=0, memory_stall_us=0, available_kb=4 << 20, load="1.50")

    def write(self, *, busy, idle, cpu_stall_us, memory_stall_us, available_kb, load="1.00") -> None:
        r = self.root
        # cpu user nice system idle iowait irq softirq steal; 4 CPUs
        r.joinpath("stat").write_text(
            f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 0\ncpu1 0\ncpu2 0\ncpu3 0\nintr 0\n"
        )
        if self.psi:
            r.joinpath("pressure", "cpu").write_text(
                f"some avg10=25.00 avg60=0.00 avg300=0.00 total={cpu_stall_us}\n"
                f"full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
            )
            r.joinpath("pressure", "memory").write_text(
                f"some avg10=0.00 avg60=0.00 avg300=0.00 total={memory_stall_us}\n"
            )
        r.joinpath("meminfo").write_text(f"MemTotal: 8000000 kB\nMemAvailable: {available_kb} kB\n")
        r.joinpath("loadavg").write_text(f"{load} 1.00 1.00 1/100 1\n")

    def clock(self) -> float:
        return self.t


def test_the_monitor_reads_busy_cores_and_pressure_over_its_window(tmp_path):
    proc = FakeProc(tmp_path / "proc")
    monitor = ProcHostMonitor(proc=proc.root, cgroup=tmp_path / "nocgroup", clock=proc.clock, window_s=0.25)
    assert isinstance(monitor, HostMonitor) and monitor.notes == []
    first = monitor.snapshot()  # no previous counters: the load average and PSI's avg10
    assert first.busy_cores == 1.5 and first.cpu_pressure == pytest.approx(0.25)
    assert first.memory_available_bytes == (4 << 20) * 1024
    # one second later: 3 of 4 CPUs busy, some task stalled on CPU 40% of the time
    proc.t += 1.0
    proc.write(busy=300, idle=100, cpu_stall_us=400_000, memory_stall_us=10_000, available_kb=1 << 20)
    snap = monitor.snapshot()
    assert snap.busy_cores == pytest.approx(3.0)
    assert snap.cpu_pressure == pytest.approx(0.4) and snap.memory_pressure == pytest.approx(0.01)
    assert snap.memory_available_bytes == 1 << 30
    assert snap.cores == process_cores(proc.root, tmp_path / "nocgroup")
    # within the window the same snapshot is returned: pricing every guess reads nothing
    proc.t += 0.1
    proc.write(busy=400, idle=100, cpu_stall_us=0, memory_stall_us=0, available_kb=1)
    assert monitor.snapshot() is snap


def test_a_host_without_psi_is_noted_once_and_priced_from_free_cores(tmp_path):
    proc = FakeProc(tmp_path / "proc", psi=False)
    monitor = ProcHostMonitor(proc=proc.root, cgroup=tmp_path / "nocgroup", clock=proc.clock)
    assert len(monitor.notes) == 1 and "no PSI" in monitor.notes[0]
    monitor.snapshot()
    proc.t += 1
    proc.write(busy=100, idle=300, cpu_stall_us=0, memory_stall_us=0, available_kb=1000)
    snap = monitor.snapshot()
    assert snap.cpu_pressure is None and snap.memory_pressure is None and snap.busy_cores == pytest.approx(1.0)


def test_the_cgroup_quota_caps_the_cores(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert process_cores(tmp_path, v2) == pytest.approx(min(1.5, process_cores(tmp_path, tmp_path / "none")))
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert process_cores(tmp_path, v1) == pytest.approx(0.5)


def test_the_live_monitor_reads_this_host_without_raising():
    snap = ProcHostMonitor().snapshot()
    assert snap.cores > 0 and snap.busy_cores >= 0 and snap.free_cores >= 0


def test_budgets_parse_with_one_clear_error():
    assert parse_budget("2") == (2.0, None)
    assert parse_budget("1.5,4G") == (1.5, 4 << 30)
    assert parse_budget("0,512m") == (0.0, 512 << 20)
    for bad, needle in [("x", "CORES must be a number"), ("-2", ">= 0"), ("1,4T", "MEMORY"), ("inf", ">= 0")]:
        with pytest.raises(ConfigError, match=needle):
            parse_budget(bad)


def test_the_default_budget_is_one_slot_per_two_cores_and_the_environment_sets_it(monkeypatch):
    monkeypatch.setattr("aospec.host.process_cores", lambda *a, **k: 5.0)
    assert auto_budget_cores() == 2.0 and auto_budget_cores(1) == 1.0 and auto_budget_cores(16) == 8.0
    assert host_budget(None, env={}).cores == 2.0  # auto where nothing is given
    assert host_budget(None, env={}, default="none") is None  # the proxy's default
    assert host_budget(None, env={BUDGET_ENV: "none"}) is None
    assert host_budget(None, env={BUDGET_ENV: "1"}).slots == 1
    assert host_budget("NONE", env={BUDGET_ENV: "2"}) is None  # the option beats the variable
    assert host_budget("auto", env={BUDGET_ENV: "none"}).cores == 2.0
    check_budget("auto")
    check_budget(None, env={BUDGET_ENV: "0.5,1G"})
    with pytest.raises(ConfigError, match=f"^{BUDGET_ENV} 'lots': CORES must be a number"):
        check_budget(None, env={BUDGET_ENV: "lots"})
    with pytest.raises(ConfigError, match=r"^--speculation-budget 'lots'"):
        check_budget("lots", env={BUDGET_ENV: "none"})


def test_a_budget_that_cannot_be_met_is_lowered_with_a_note(tmp_path):
    big = SpeculationBudget(64, directory=tmp_path, host_cores=2)
    assert big.cores == 2 and big.slots == 2 and "64 cores" in big.notes[0]
    tight = SpeculationBudget(4, 100 << 20, fork_memory_bytes=64 << 20, directory=tmp_path, host_cores=8)
    assert tight.slots == 1
    none = SpeculationBudget(1, 1 << 20, directory=tmp_path, host_cores=8)
    assert none.slots == 0 and "below one fork" in none.notes[0] and none.try_acquire() is None
    assert SpeculationBudget(0, directory=tmp_path, host_cores=8).slots == 0


def _hold_one(directory: str, ready: multiprocessing.synchronize.Event, done: multiprocessing.synchronize.Event) -> None:
    lease = SpeculationBudget(2, directory=directory, host_cores=8).try_acquire()
    assert lease is not None
    ready.set()
    done.wait(10)


def test_slots_are_shared_across_processes_and_die_with_their_holder(tmp_path):
    budget = SpeculationBudget(2, directory=tmp_path, host_cores=8)
    ctx = multiprocessing.get_context("fork")
    ready, done = ctx.Event(), ctx.Event()
    other = ctx.Process(target=_hold_one, args=(str(tmp_path), ready, done))
    other.start()
    try:
        assert ready.wait(10)
        assert budget.held() == 1
        mine = budget.try_acquire()
        assert mine is not None and budget.try_acquire() is None  # both slots held: one each
        mine.release()
        mine.release()  # idempotent
        assert budget.held() == 1
    finally:
        done.set()
        other.join(10)
    assert budget.held() == 0  # the other session's slot died with it


def test_the_decode_meter_integrates_open_streams_beside_the_process_cpu():
    now = {"t": 0, "cpu": 0}
    meter = DecodeMeter(clock=lambda: now["t"], cpu=lambda: now["cpu"])
    assert meter.sample() == (0, 0) and meter.open == 0
    with meter.streaming():
        now["t"] += 10**9  # one stream for 1 s
        with meter.streaming():
            assert meter.open == 2
            now["t"] += 2 * 10**9  # two streams for 2 s: 4 stream-seconds
            now["cpu"] += 10**9
        now["t"] += 10**9
    now["t"] += 5 * 10**9  # none open: no stream time
    assert meter.sample() == (10**9, 6 * 10**9) and meter.open == 0
    # a decode that raises still closes its stream
    with pytest.raises(RuntimeError), meter.streaming():
        raise RuntimeError("the actor failed")
    assert meter.open == 0
    # the live monitor carries this process's meter; the engine counts its decodes in it
    assert ProcHostMonitor().decodes is DECODES
