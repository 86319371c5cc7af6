"""The eBPF read-set tracer (aospec.runtime.ebpf): its lines turned into strace's records,
the reader's framing (a newline in a path, bpftrace's own lines, chunks cut anywhere), what
makes a trace untracked, the BTF and tracefs readers, and, as root where bpftrace runs,
real commands in real sandboxes (paths with newlines, long paths, descriptors, marks only
from this process)."""

from __future__ import annotations

import io
import itertools
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import anyio
import pytest
from aospec.runtime import SandboxConfig, ebpf, open_sandbox, readsets
from aospec.runtime.readsets import EbpfCommandTrace, _accesses, _descendants, _ebpf_log, untracked_reason

from aospec.protocols import HostSnapshot
from aospec.types import Action

TOK = "0123456789abcdef"
CODES = {tp: i for i, tp in enumerate(ebpf._SPECS)}


def _line(kind: str, tid: int, ts: int, rest: str = "", ident: int = 1) -> bytes:
    return f"{ident} {ts} {tid} {kind}{' ' if rest else ''}{rest}".encode()


def R(tid: int, ts: int, tp: str, ret: int, ints: list[int], path: str | None = None, end: int | None = None) -> bytes:
    null = 1 if path is None and readsets._first_path_at_exit(ebpf._SPECS[tp]) else 0
    tail = "".join(f" {v}" for v in ints) + (f" {path}" if path is not None else (" " if null else ""))
    return _line("R", tid, ts, f"{end or ts + 5} {CODES[tp]} {ret} {null}{tail}")


def walk(tid: int, ts: int, *parts: str) -> list[bytes]:
    return [*(_line("C", tid, ts, f"{len(p.encode())} {p}") for p in reversed(parts)), _line("W", tid, ts, "1")]


# bwrap's init 100 forks the command's shell 101, which forks 102
HEAD = [
    R(100, 0, "setxattr", 0, [], "/x"),  # a call of the init's from before the mark: ignored
    _line("K", 100, 10, "101"),
    R(100, 9, "clone", 101, [0x11], end=12),
    _line("D", 100, 1000, "0"),
]


def _log(lines: list[bytes]) -> readsets._Log:
    return _ebpf_log(lines, 100)


def _acc(log: readsets._Log) -> list[tuple[str, bytes]]:
    pids = _descendants(log.children, 100)
    return [(a.kind, a.path) for a in _accesses(log, pids, b"/", False)]


def test_calls_become_strace_records_with_their_directories() -> None:
    lines = [
        *HEAD,
        *walk(101, 20, "w", "d"),
        R(101, 20, "openat", 3, [-100, 0], "a"),  # openat(AT_FDCWD, "a"): cwd walked
        R(101, 30, "newstat", 0, [], "/abs"),
        *walk(101, 40, "w"),
        R(101, 40, "getdents64", 0, [3]),
        _line("K", 101, 51, "102"),
        R(101, 50, "clone", 102, [0x200 | 0x11], end=55),  # CLONE_FS
        *walk(102, 60, "w", "d"),
        R(102, 60, "access", -2, [], "gone"),  # access: relative to the cwd, no dirfd
        _line("D", 102, 70, "0"),
        _line("D", 101, 80, "0"),
    ]
    log = _log(lines)
    assert log.problems == []
    assert log.children == {100: [101], 101: [102]} and log.exits[102] == "exited with 0"
    assert [r.name for r in log.records] == ["setxattr", "clone", "openat", "stat", "getdents64", "clone", "access"][1:]
    assert _acc(log) == [
        ("node", b"/w/d/a"),
        ("node", b"/abs"),
        ("list", b"/w"),
        ("lookup", b"/w/d/gone"),
    ]
    clone = log.records[4]
    assert clone.ret_pid == 102 and "CLONE_FS" in clone.args[0]


def test_strings_with_newlines_and_spaces_come_through_whole() -> None:
    name = "a b\nc"
    lines = [*HEAD, R(101, 20, "openat", 3, [-100, 0], f"/w/{name}"), _line("D", 101, 30, "0")]
    assert _acc(_log(lines)) == [("node", f"/w/{name}".encode())]


@pytest.mark.parametrize(
    ("lines", "why"),
    [
        ([R(101, 20, "openat", 3, [-100, 0], "/" + "x" * 198)], "a path longer than the tracer reads"),
        ([R(101, 20, "openat", 3, [-100, 0], "rel")], "a relative path whose directory the tracer did not read"),
        ([_line("Z", 101, 20, "5")], "32-bit or x32"),
        ([_line("F", 102, 20)], "table of processes is full"),
        ([_line("X", 101, 20, "103")], "other than the leader ran exec"),
        ([R(101, 0, "openat", 3, [-100, 0], "/a")], "end without its start"),
        ([_line("K", 101, 20, "102")], "outside a clone call"),
        ([*walk(101, 20, "w"), _line("C", 101, 20, "300 short"), R(101, 20, "openat", 3, [-100, 0], "a")], "longer"),
        ([_line("W", 101, 20, "3"), R(101, 20, "openat", 3, [-100, 0], "a")], "deeper than the tracer walks"),
        ([_line("W", 101, 20, "2"), R(101, 20, "newstat", 0, [], "a")], "outside the sandbox's root"),
        ([R(101, 20, "openat2", 3, [-100], "/a")], "openat2 succeeded"),
        ([R(101, 20, "newstat", 0, [], "/a"), R(101, 20, "newstat", 0, [], "/a")], "two ends of one call"),
        ([R(101, 20, "newstat", -2, [], "")], "an empty stat path"),  # a string it could not read
        ([R(101, 20, "connect", 0, [16]), _line("A", 101, 20, "1 0 0")], "address the tracer could not read"),
        ([b"not a line"], "unreadable tracer line"),
    ],
)
def test_what_the_tracer_cannot_account_for_is_a_problem(lines: list[bytes], why: str) -> None:
    log = _log([*HEAD, *lines, _line("D", 101, 900, "0")])
    assert log.problems and why in log.problems[0], log.problems


def test_a_call_cut_short_by_its_process_end_is_dropped_and_signals_are_read() -> None:
    lines = [*HEAD, *walk(101, 20, "w"), _line("D", 101, 30, str(13))]  # killed by SIGPIPE mid-call
    log = _log(lines)
    assert log.problems == [] and log.records[1:] == [] and log.exits[101] == "killed by SIGPIPE"
    assert readsets._signal_text(0x80 | 11) == "killed by SIGSEGV (core dumped)"
    assert readsets._signal_text(3 << 8) == "exited with 3"


def test_two_paths_one_walk_a_unix_socket_and_a_descriptor_without_a_path() -> None:
    lines = [
        *HEAD,
        *walk(101, 20, "w"),
        R(101, 20, "renameat2", 0, [-100, -100], "a"),
        _line("P", 101, 20, "1 b"),
        R(101, 30, "connect", 0, [17], None),
        # the address length (17) keeps 15 bytes of the sun_path the tracer read
        _line("P", 101, 30, "0 /run/sock0123456789"),
        _line("D", 101, 50, "0"),
    ]
    log = _log(lines)
    assert log.problems == []
    assert _acc(log) == [("tree", b"/w/a"), ("tree", b"/w/b"), ("node", b"/run/sock012345")]
    # fd 0 is a pipe: a listing of it names no directory
    log = _log([*HEAD, _line("W", 101, 40, "2"), R(101, 40, "getdents64", 0, [0]), _line("D", 101, 50, "0")])
    assert log.problems == [] and log.records[-1].args[0] == "0"
    with pytest.raises(readsets.Untracked, match="descriptor whose path the trace does not name"):
        _acc(log)


def test_a_symlinks_target_is_not_resolved_its_link_is_relative_to_its_descriptor() -> None:
    # ln -s ../data d: openat(AT_FDCWD, "d", O_PATH) = 3; symlinkat("../data", 3, "data")
    lines = [
        *HEAD,
        *walk(101, 20, "w", "d"),  # descriptor 3's directory
        R(101, 20, "symlinkat", 0, [3], "../data"),
        _line("P", 101, 20, "1 data"),
        _line("D", 101, 50, "0"),
    ]
    log = _log(lines)
    assert log.problems == []
    (access,) = [a for a in _accesses(log, _descendants(log.children, 100), b"/", False) if a.kind == "symlink"]
    assert _acc(log)[0] == ("lookup", b"/w/d/data") and (access.path, access.base) == (b"../data", b"/w/d")


def test_the_script_takes_a_calls_exit_only_after_its_entry_and_follows_exec() -> None:
    fields = {tp: [f"f{i}" for i in range(len(roles))] for tp, (_, roles) in ebpf._SPECS.items()}
    text = ebpf.script(TOK, 12345, 42, 32, fields)
    code = CODES["newstat"] + 1
    (exit_line,) = [x for x in text.splitlines() if x.startswith("tracepoint:syscalls:sys_exit_newstat ")]
    assert f"@sc[tid] == {code}/" in exit_line  # a call seccomp refused has no entry: no line
    (enter_line,) = [x for x in text.splitlines() if x.startswith("tracepoint:syscalls:sys_enter_newstat ")]
    assert f"@sc[tid] = {code};" in enter_line
    (exec_line,) = [x for x in text.splitlines() if x.startswith("tracepoint:sched:sched_process_exec ")]
    assert "@t[args->old_pid]" in exec_line and "delete(@t[args->old_pid])" in exec_line


def test_two_relative_paths_in_different_directories_are_a_problem() -> None:
    lines = [*HEAD, *walk(101, 20, "w"), R(101, 20, "renameat", 0, [-100, 5], "a"), _line("P", 101, 20, "1 b")]
    log = _log([*lines, _line("D", 101, 30, "0")])
    assert log.problems and "different directories" in log.problems[0]


class _Proc:
    def __init__(self, chunks: list[bytes]) -> None:
        self.stdout = _Chunks(chunks)
        self.pid = -1

    def wait(self) -> int:
        return 0

    def poll(self) -> int:
        return 0


class _Chunks(io.RawIOBase):
    """bpftrace's stdout: the chunks, then end of file once ``done`` is set."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = list(chunks)
        self.read_all = threading.Event()
        self.done = threading.Event()

    def read1(self, n: int = -1) -> bytes:
        if self.chunks:
            return self.chunks.pop(0)
        self.read_all.set()
        self.done.wait(30)
        return b""


def _read(t: ebpf.EbpfTracer, chunks: list[bytes]) -> _Chunks:
    proc = _Proc(chunks)
    t._proc = proc  # type: ignore[assignment]
    threading.Thread(target=t._read_stdout, daemon=True).start()
    assert proc.stdout.read_all.wait(30)
    return proc.stdout


def _framed(*records: bytes) -> bytes:
    return b"".join(f"{TOK} ".encode() + r + f"|{TOK}\n".encode() for r in records)


def test_the_reader_keeps_records_whole_across_chunks_and_notes_lost_events() -> None:
    t = ebpf.EbpfTracer("bpftrace", "/sys/kernel/tracing", 32)
    t.token = TOK
    t._tok, t._end = f"{TOK} ".encode(), f"|{TOK}\n".encode()
    trace = ebpf.EbpfTrace(7, 100, 0)
    other = ebpf.EbpfTrace(8, 200, 0)
    t._traces = {7: trace, 8: other}
    data = b"Attaching 183 probes...\n" + _framed(
        b"7 1 101 R 2 9 3 0 -100 0 /w/a\nb",  # a path with a newline
        b"8 1 201 R 2 9 3 0 -100 0 /other",
        b"0 5 1 B 1 0",
        b"7 2 101 D 0",
    )
    cuts = [0, 7, 30, 31, 60, len(data)]
    t._flushes = {1: set()}
    out = _read(t, [data[a:b] for a, b in itertools.pairwise(cuts)])
    with t._cond:
        assert t._flushes[1] == {0}
    lines, why = t._take(trace)
    assert why is None and lines == [b"7 1 101 R 2 9 3 0 -100 0 /w/a\nb", b"7 2 101 D 0"]
    out.done.set()  # bpftrace ends: a trace in flight is incomplete
    for _ in range(300):
        if other.problem:
            break
        time.sleep(0.01)
    assert t._take(other) == ([], "the tracer stopped")
    # a line of bpftrace's own between records: the traces in flight are incomplete
    t2 = ebpf.EbpfTracer("bpftrace", "/sys/kernel/tracing", 32)
    t2.token, t2._tok, t2._end = TOK, t._tok, t._end
    lost = ebpf.EbpfTrace(3, 100, 0)
    t2._traces = {3: lost}
    out = _read(t2, [_framed(b"3 1 101 D 0") + b"Lost 12 events\n" + _framed(b"3 2 101 D 0")])
    assert t2._take(lost) == ([], "the tracer lost events")
    out.done.set()
    assert t2._chunks == []  # nothing kept once no trace needs it


def test_the_btf_reader_finds_member_offsets_and_tracefs_formats_are_read(tmp_path: Path) -> None:
    if not os.access(ebpf._BTF, os.R_OK):
        pytest.skip("no kernel BTF here")
    assert ebpf.btf_member_offset(ebpf._BTF, "list_head", "next") == 0
    assert ebpf.btf_member_offset(ebpf._BTF, "list_head", "prev") == 8
    with pytest.raises(ValueError, match="has no member"):
        ebpf.btf_member_offset(ebpf._BTF, "list_head", "nope")
    fmt = tmp_path / "events" / "syscalls" / "sys_enter_openat"
    fmt.mkdir(parents=True)
    (fmt / "format").write_text(
        "name: sys_enter_openat\nformat:\n\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;\n"
        "\tfield:int __syscall_nr;\toffset:8;\tsize:4;\tsigned:1;\n"
        "\tfield:int dfd;\toffset:16;\tsize:8;\tsigned:0;\n"
        "\tfield:const char * filename;\toffset:24;\tsize:8;\tsigned:0;\n"
        "\tfield:int flags;\toffset:32;\tsize:8;\tsigned:0;\n"
        "\tfield:umode_t mode;\toffset:40;\tsize:8;\tsigned:0;\n"
    )
    assert ebpf.syscall_fields(str(tmp_path)) == {"openat": ["dfd", "filename", "flags", "mode"]}


def test_the_script_has_a_probe_for_every_call_and_the_flush_probe_last() -> None:
    fields = {tp: [f"f{i}" for i in range(len(roles))] for tp, (_, roles) in ebpf._SPECS.items()}
    fields |= {tp: [] for tp, _ in ebpf._OPAQUE}
    text = ebpf.script(TOK, 12345, 42, 32, fields)
    for tp in [*ebpf._SPECS, *(t for t, _ in ebpf._OPAQUE)]:
        assert f"sys_exit_{tp} " in text, tp
    last = text.strip().splitlines()[-1]
    assert "args->which == 12346" in last and "pid == 42" in last
    assert text.count("args->which == 12345") == 1
    with pytest.raises(RuntimeError, match="the tracer expects"):
        ebpf.script(TOK, 1, 1, 32, {"openat": ["dfd"]})


# ------------------------------------------------------------------------ real sandboxes


def _ebpf_or_skip() -> None:
    from aospec.runtime.host import host_support

    problems = host_support()[0].problems()
    support = readsets.tracer_support()
    if problems or support.kind != "ebpf":
        pytest.skip(f"the eBPF tracer does not run here: {'; '.join(problems) or support.detail}")
    readsets.wait_for_tracer()


async def _traced(command: str, setup: str = "mkdir -p /w/d && echo a > /w/a") -> tuple[str, object, str | None]:
    async with open_sandbox(SandboxConfig(timeout_s=20)) as sb:
        await sb.run(setup)
        fork = await sb.fork()
        await fork.trace_reads()
        obs = await fork.execute(Action.bash(command))
        reads = await fork.read_set()
        assert isinstance(fork._trace, EbpfCommandTrace)
        why = untracked_reason(fork._trace, views=[str(fork._merged)], cwd="/")
        await fork.discard()
        return str(obs), reads, why


@pytest.mark.root
def test_real_commands_paths_with_newlines_descriptors_and_long_paths(overlay: str) -> None:
    _ebpf_or_skip()
    _, reads, why = anyio.run(_traced, "cat '/w/new\nline' 2>/dev/null; cd /w && find . -name a; exec 3</w/a; cat <&3")
    assert why is None and reads is not None
    assert "w/new\nline" in reads.lookups and {"w", "w/d"} <= reads.lists and "w/a" in reads.nodes
    long = "/w/" + "d/" * 100 + "x"
    _, reads, why = anyio.run(_traced, f"test -e {long}")
    assert reads is None and why == "a path longer than the tracer reads"


@pytest.mark.root
def test_only_this_process_can_mark_a_process(overlay: str) -> None:
    _ebpf_or_skip()
    tracer = ebpf.tracer(readsets.tracer_support().ebpf)  # type: ignore[arg-type]
    victim = subprocess.Popen(
        ["sh", "-c", "read x; cat /etc/hostname"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL
    )
    try:
        fake = ebpf.EbpfTrace(999_999, victim.pid, tracer._base + len(tracer._chunks))
        with tracer._cond:
            tracer._traces[fake.id] = fake
        # another process makes the marker call with this tracer's magic and the fake id
        subprocess.run(
            [sys.executable, "-c", "import ctypes,sys; ctypes.CDLL(None).setpriority(*map(int, sys.argv[1:]))",
             str(tracer.magic), str(victim.pid), str(fake.id)],
            check=True,
        )  # fmt: skip
        victim.communicate(b"go\n", timeout=30)
        lines, why = tracer.collect(fake)
        assert why is None and lines == []
    finally:
        victim.kill()
        victim.wait()
    assert tracer._proc is not None and ebpf.service_pids() == {tracer._proc.pid}


@pytest.mark.root
def test_the_tracer_stops_and_a_traced_fork_starts_it_again(overlay: str) -> None:
    _ebpf_or_skip()
    (old,) = ebpf.service_pids()
    assert ebpf.stop_tracer() and ebpf.service_pids() == set()
    assert not Path(f"/proc/{old}").exists()  # reaped, its probes detached
    assert not ebpf.stop_tracer()  # nothing runs: nothing to stop
    readsets.wait_for_tracer()
    (new,) = ebpf.service_pids()
    assert new != old
    _, reads, why = anyio.run(_traced, "cat /w/a")
    assert why is None and reads is not None and "w/a" in reads.nodes


# ---------------------------------------------------------------- bpftrace's start


def test_the_events_snapshot_holds_the_lines_the_script_names(tmp_path: Path) -> None:
    fields = {tp: [f"f{i}" for i in range(len(roles))] for tp, (_, roles) in ebpf._SPECS.items()}
    text = ebpf.script(TOK, 12345, 42, 32, fields)
    named = {f"{c}:{n}" for c, n in ebpf._PROBE.findall(text)}
    # every probe of the script is named (one per line), and only probes
    assert len(named) == len({line.split(" /")[0].split(" {")[0] for line in text.splitlines() if line})
    assert {"raw_syscalls:sys_enter", "sched:sched_process_fork", "syscalls:sys_exit_openat"} <= named
    have = [*sorted(named - {"syscalls:sys_enter_creat"}), "initcall:initcall_start", "syscalls:sys_enter_getpid"]
    (tmp_path / "available_events").write_text("".join(f"{e}\n" for e in have))
    snap = ebpf.events_snapshot(text, str(tmp_path)).decode().splitlines()
    # what the kernel has and the script names; a probe the kernel lacks stays missing
    assert snap == sorted(named - {"syscalls:sys_enter_creat"})


def test_without_a_snapshot_bpftrace_runs_plainly() -> None:
    assert ebpf._launch("/usr/bin/bpftrace", ["-e", "x"], None) == ["/usr/bin/bpftrace", "-e", "x"]


MOUNTINFO = """\
20 1 8:1 / / rw - ext4 /dev/sda1 rw
21 20 0:5 / /proc rw - proc proc rw
22 20 0:6 / /sys rw - sysfs sysfs rw
23 22 0:7 / /sys/kernel/tracing rw - tracefs tracefs rw
24 20 0:8 / /dev rw - devtmpfs udev rw
25 20 8:2 / /usr rw - ext4 /dev/sda2 rw
26 20 0:9 / /var/tmp/aospec/s rw - tmpfs tmpfs rw
27 26 0:10 / /var/tmp/aospec/s/ab12/rw rw - tmpfs tmpfs rw
28 26 0:11 / /var/tmp/aospec/s/ab12/m rw - overlay overlay rw
29 20 0:12 / /srv/my\\040data rw - ext4 /dev/sdb1 rw
30 20 0:13 / /opt/tools rw - ext4 /dev/sdc1 rw
31 28 0:14 / /var/tmp/aospec/s/ab12/m/proc rw - proc proc rw
32 27 0:15 / /var/tmp/aospec/s/ab12/rw rw - tmpfs tmpfs rw
"""


def test_bpftraces_namespace_keeps_only_what_it_needs() -> None:
    from aospec.runtime import _mntns

    mounts = _mntns.parse_mountinfo(MOUNTINFO)
    assert mounts[9] == (29, 20, "/srv/my data")  # escapes undone
    drop, stuck = _mntns.to_drop(mounts, ["/", "/usr", "/opt/tools/bin/bpftrace", "/tmp"])
    # kept: /, /proc, /sys and below, /dev, /usr, the program's own mount; dropped: the
    # sandboxes' mounts (deepest first; two stacked on one point: the top one first) and
    # the host's other filesystems
    assert drop == [
        "/var/tmp/aospec/s/ab12/m/proc",
        "/var/tmp/aospec/s/ab12/rw",
        "/var/tmp/aospec/s/ab12/m",
        "/var/tmp/aospec/s/ab12/rw",
        "/var/tmp/aospec/s",
        "/srv/my data",
    ]
    assert stuck == []
    # a mount point that is not UTF-8 (read with surrogateescape) is unmounted by its bytes
    odd = _mntns.parse_mountinfo("34 20 0:16 / /srv/x\udcff rw - tmpfs tmpfs rw\n")
    (point,), _ = _mntns.to_drop([*mounts[:1], *odd], ["/"])
    assert os.fsencode(point) == b"/srv/x\xff"
    # a mount it must drop under one it keeps on the same point cannot be reached
    over = [*mounts, (33, 20, "/var/tmp/aospec/s")]
    _, stuck = _mntns.to_drop(over, ["/var/tmp/aospec/s/x"])
    assert stuck == ["/var/tmp/aospec/s"]


@pytest.mark.root
def test_the_launch_shows_the_snapshot_to_bpftrace_only(tmp_path: Path) -> None:
    events = next((os.path.join(t, "available_events") for t in ebpf._TRACEFS
                   if os.path.exists(os.path.join(t, "available_events"))), None)  # fmt: skip
    if events is None or not ebpf._namespaces_work():
        pytest.skip("no tracefs or no mount namespaces here")
    before = Path("/proc/self/mountinfo").read_text()
    # a stand-in for bpftrace that prints what it reads there, and where it runs
    sh = subprocess.run(["sh", "-c", "command -v sh"], capture_output=True, text=True).stdout.strip()
    script = 'cat "$1" && pwd && grep -c " /tmp " /proc/self/mountinfo || true'
    out = subprocess.run(
        ebpf._launch(sh, ["-c", script, "sh", events], "sched:sched_process_fork\n"),
        capture_output=True,
        check=True,
        timeout=30,
        cwd=tmp_path,
    )
    # the snapshot; in /, not in a directory of ours; its scratch tmpfs over /tmp detached
    assert out.stdout.decode().splitlines() == ["sched:sched_process_fork", "/", "0"] and out.stderr == b""
    assert Path("/proc/self/mountinfo").read_text() == before  # nothing mounted here
    assert len(Path(events).read_bytes().splitlines()) > 1  # the kernel's own file, untouched
    # a program it cannot run: the helper's own exit status, nothing run
    bad = subprocess.run(ebpf._launch(str(tmp_path / "none"), [], "x\n"), capture_output=True, timeout=30)
    assert bad.returncode == 97 and b"cannot run" in bad.stderr


@pytest.mark.root
def test_bpftrace_holds_no_copy_of_a_sandbox_mount(overlay: str, tmp_path: Path) -> None:
    """The bug that withdrew the snapshot once: bpftrace's namespace, a copy of this one
    made while a sandbox's tmpfs upper and overlay were mounted, kept them alive after they
    were unmounted here, so an overlay commit's read-only remount of the upper failed
    (EBUSY). Its namespace now drops every mount bpftrace does not need."""
    _ebpf_or_skip()
    if ebpf.namespace_problem():
        pytest.skip(f"bpftrace starts plainly here: {ebpf.namespace_problem()}")
    ebpf.stop_tracer()
    rw, merged, low = tmp_path / "rw", tmp_path / "m", tmp_path / "low"
    for d in (rw, merged, low):
        d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(rw)], check=True)
    try:
        (rw / "u").mkdir()
        (rw / "w").mkdir()
        opts = f"lowerdir={low},upperdir={rw / 'u'},workdir={rw / 'w'}"
        subprocess.run(["mount", "-t", "overlay", "-o", opts, "overlay", str(merged)], check=True)
        (merged / "f").write_text("x")
        here = os.getcwd()
        os.chdir(merged)  # a working directory in the overlay: bpftrace's must not hold it
        try:
            readsets.wait_for_tracer()  # started while both are mounted
        finally:
            os.chdir(here)
        (pid,) = ebpf.service_pids()
        tracer = ebpf.tracer(readsets.tracer_support().ebpf)  # type: ignore[arg-type]
        assert tracer.snapshotted and tracer._proc is not None and tracer._proc.pid == pid
        assert "starts on an available_events snapshot" in readsets.tracer_support().detail  # sandbox info says so
        theirs = Path(f"/proc/{pid}/mountinfo").read_text()
        assert "/available_events " in theirs and str(tmp_path) not in theirs
        assert os.readlink(f"/proc/{pid}/cwd") == "/"
        assert "/available_events " not in Path("/proc/self/mountinfo").read_text()
        assert not list(Path(tempfile.gettempdir()).glob("aospec-bpftrace-events-*"))  # removed once started
        subprocess.run(["umount", str(merged)], check=True)
        # as an overlay commit does: the upper's tmpfs, read-only (EBUSY while an overlay
        # on it lives on in another namespace)
        subprocess.run(["mount", "-o", "remount,ro", str(rw)], check=True, capture_output=True)
    finally:
        subprocess.run(["umount", "-l", str(merged)], capture_output=True)
        subprocess.run(["umount", "-l", str(rw)], capture_output=True)
    _, reads, why = anyio.run(_traced, "cat /w/a")
    assert why is None and reads is not None and "w/a" in reads.nodes


@pytest.mark.root
def test_the_probe_says_why_bpftrace_cannot_start_in_a_namespace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ebpf, "_namespaced", None)
    if ebpf.namespace_problem():
        pytest.skip(f"no mount namespaces here: {ebpf.namespace_problem()}")
    broken = tmp_path / "helper.py"
    broken.write_text("import sys\nprint('aospec: 1 mounts left in bpftrace', file=sys.stderr)\nsys.exit(97)\n")
    monkeypatch.setattr(ebpf, "_NS_HELPER", str(broken))
    monkeypatch.setattr(ebpf, "_namespaced", None)
    assert ebpf.namespace_problem() == "aospec: 1 mounts left in bpftrace"
    assert not ebpf._namespaces_work()


@pytest.mark.root
def test_a_namespace_that_cannot_be_set_up_starts_bpftrace_plainly(
    overlay: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _ebpf_or_skip()
    ebpf.stop_tracer()
    broken = tmp_path / "helper.py"
    broken.write_text("import sys\nprint('aospec: 1 mounts left', file=sys.stderr)\nsys.exit(97)\n")
    monkeypatch.setattr(ebpf, "_NS_HELPER", str(broken))
    monkeypatch.setattr(ebpf, "_namespaced", "")  # the probe passed; the start then fails
    try:
        tracer = ebpf.tracer(readsets.tracer_support().ebpf)  # type: ignore[arg-type]
        assert not tracer.snapshotted and tracer._dead is None
        assert "a start in one failed" in ebpf.namespace_problem()  # later starts go plainly
        (pid,) = ebpf.service_pids()
        assert os.readlink(f"/proc/{pid}/ns/mnt") == os.readlink("/proc/self/ns/mnt")  # ours
        _, reads, why = anyio.run(_traced, "cat /w/a")
        assert why is None and reads is not None and "w/a" in reads.nodes
    finally:
        ebpf.stop_tracer()  # the next test starts one on a snapshot again


@pytest.mark.root
def test_a_committed_sandbox_commits_after_bpftrace_started(overlay: str) -> None:
    """A sandbox open when bpftrace starts keeps committing (each commit remounts its upper
    read-only) and is released once closed, and bpftrace's namespace never held it."""
    from aospec.runtime._state import default_state_root

    _ebpf_or_skip()

    async def run() -> list[str]:
        ebpf.stop_tracer()
        async with open_sandbox(SandboxConfig(timeout_s=20)) as sb:
            await sb.run("echo a > /w")
            fork = await sb.fork()
            readsets.wait_for_tracer()  # starts now, with the sandbox and its fork mounted
            (pid,) = ebpf.service_pids()
            state = str(default_state_root())
            held = [ln.split()[4] for ln in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()]
            for i in range(3):
                await sb.run(f"echo {i} >> /w")
            assert (await sb.run("cat /w")).output == "a\n0\n1\n2\n"
            await fork.discard()
        return [m for m in held if m.startswith(state)]

    assert anyio.run(run) == []


class _Host:
    """A host whose free cores are ``free`` (a list consumed one sample at a time; the last
    value stays)."""

    def __init__(self, *free: float, cores: float = 2.0) -> None:
        self.free = list(free)
        self.cores = cores
        self.samples = 0

    def snapshot(self) -> HostSnapshot:
        self.samples += 1
        f = self.free.pop(0) if len(self.free) > 1 else self.free[0]
        return HostSnapshot(cores=self.cores, busy_cores=self.cores - f)


def test_a_start_waits_for_a_core_free_over_the_whole_window() -> None:
    slept: list[float] = []
    host = _Host(0.0, 1.5, 1.5, 0.5, 1.0, 1.2, 1.9, 1.0, 0.0)
    assert ebpf.wait_for_quiet_host(host, quiet_s=1.0, sample_s=0.25, sleep=slept.append)
    # the busy sample at 4 restarts the count: four free samples in a row from the 5th on
    assert host.samples == 8 and slept == [0.25] * 8
    gone = iter([False, False, True])
    busy = _Host(0.0)
    assert not ebpf.wait_for_quiet_host(busy, give_up=lambda: next(gone), sleep=lambda s: None)
    assert busy.samples == 2


@pytest.mark.root
def test_a_forks_start_waits_for_the_host_and_a_stop_drops_it(overlay: str) -> None:
    _ebpf_or_skip()
    support = readsets.tracer_support().ebpf
    assert support is not None
    ebpf.stop_tracer()
    busy = _Host(0.0)
    assert ebpf.ready_tracer(support, monitor=busy) is None
    deadline = time.monotonic() + 5
    while busy.samples < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert busy.samples >= 4 and ebpf.service_pids() == set()  # no bpftrace on a busy host
    ebpf.stop_tracer()  # drops the waiting start
    starting = ebpf._starting
    assert starting is not None
    starting.join(timeout=5)
    assert not starting.is_alive() and ebpf.service_pids() == set()
    quiet = _Host(2.0)
    assert ebpf.ready_tracer(support, monitor=quiet) is None
    ebpf._starting.join(timeout=60)  # type: ignore[union-attr]
    assert ebpf.service_pids() and ebpf.ready_tracer(support) is not None
