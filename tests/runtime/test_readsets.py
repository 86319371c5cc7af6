"""Read sets on the overlay backend: the strace log parser, read sets of real commands
resolved in real sandboxes, what makes a command untracked, and rebasing a fork onto
unrelated commits giving exactly what running it there gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from aospec.runtime import Bind, SandboxConfig, open_sandbox
from aospec.runtime.overlay import OverlaySandbox, ReadSetOverlaySandbox, read_sets_on
from aospec.runtime.readsets import CommandTrace, read_set, tracer_support, untracked_reason

from aospec.errors import SandboxError
from aospec.protocols import ReadSetSandbox
from aospec.readsets import ReadSet, conflict, fork_conflict
from aospec.types import Action

ROOT = Path(__file__).resolve().parents[2]


def _hex(path: str) -> str:
    return "".join(f"\\x{b:02x}" for b in path.encode())


def _trace(tmp_path: Path, lines: list[str], child: int = 100) -> CommandTrace:
    t = CommandTrace(tmp_path / "t", "strace")
    t.log.write_text("".join(line + "\n" for line in lines))
    t.diag.write_text("")
    t.child_pid = child
    return t


def _tree(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "w" / "d").mkdir(parents=True)
    (root / "w" / "a").write_text("a\n")
    (root / "w" / "l").symlink_to("d")
    (root / "bin").mkdir()
    (root / "bin" / "tool").write_text("#!/bin/interp -x\n")
    return root


# One command in the sandbox: bwrap (99) starts its child 100, which forks the shell 101
# (namespace pid 2), which forks 102 (namespace pid 3).
HEAD = [
    "99  clone(child_stack=NULL, flags=CLONE_NEWPID|SIGCHLD) = 100",
    "100  clone(child_stack=NULL, flags=SIGCHLD) = 2",
    f'101  execve("{_hex("/bin/tool")}", 0x1, 0x2) = 0',
]
TAIL = ["101  +++ exited with 0 +++"]


def test_the_parser_reads_calls_their_directories_and_the_processes_of_the_command(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    lines = [
        '99  openat(AT_FDCWD<\\x2f>, "\\x2f\\x65\\x74\\x63", O_RDONLY) = 3',  # bwrap itself: not the command
        *HEAD,
        f'101  newfstatat(AT_FDCWD<{_hex("/w")}>, "{_hex("a")}", 0x7ff, 0) = 0',
        f'101  openat(AT_FDCWD<{_hex("/w")}>, "{_hex("l/x")}", O_RDONLY <unfinished ...>',
        "101  <... openat resumed>) = -1 ENOENT (No such file or directory)",
        f'101  openat(AT_FDCWD<{_hex("/w")}>, "{_hex("d")}", O_RDONLY|O_DIRECTORY) = 3<{_hex("/w/d")}>',
        f"101  getdents64(3<{_hex('/w/d')}>, 0x55, 32768) = 48",
        "101  clone(child_stack=NULL, flags=SIGCHLD) = 3",
        f'102  access("{_hex("nothere")}", F_OK) = -1 ENOENT (No such file or directory)',  # relative, inherited cwd
        f'102  rename("{_hex("/w/a")}", "{_hex("/w/b")}") = 0',
        "102  +++ exited with 0 +++",
        *TAIL,
    ]
    reads = read_set(_trace(tmp_path, lines), views=[str(root)], cwd="/")
    assert reads is not None
    assert reads.nodes >= {"w/a", "w/d"} and "etc" not in reads.nodes
    assert "w/l" in reads.lookups and "w/d/x" in reads.lookups  # through the link, then missing
    assert reads.lists == {"w/d"}
    assert "w/nothere" in reads.lookups
    assert reads.trees == {"w/a"} and "w/b" in reads.lookups  # a missing target is a lookup
    assert {"bin/tool", "bin/interp"} <= reads.lookups  # the kernel reads the #! interpreter


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ([], "still running"),  # 102 never exits: a process outlived the command
        # strace let 102 go in the middle of a call: the sandbox was killed under it
        ([f'102  newfstatat(AT_FDCWD<\\x2f>, "{_hex("/bin/sleep")}",  <detached ...>'], "still running"),
        (["102  +++ killed by SIGKILL +++"], "killed by SIGKILL"),
        ([f'102  openat(AT_FDCWD<\\x2f>, "{_hex("/proc/self/cwd/x")}", O_RDONLY) = -1 ENOENT (x)'], "/proc/self/cwd"),
        ([f'102  newfstatat(AT_FDCWD<\\x2f>, "{_hex("/rw/f")}", 0x1, 0) = 0'], "writable bind /rw"),
        (['102  inotify_add_watch(3, "\\x2f", IN_MODIFY) = 1'], "inotify_add_watch"),
        ([f'102  openat(AT_FDCWD<\\x2f>, "{_hex("/w/a")}"..., O_RDONLY) = 3'], "longer than the tracer"),
        (["102  openat(AT_FDCWD<\\x2f>, garbage"], "unreadable"),
    ],
)
def test_what_the_read_set_cannot_account_for_is_untracked(tmp_path: Path, extra: list[str], why: str) -> None:
    root = _tree(tmp_path)
    lines = [*HEAD, "101  clone(child_stack=NULL, flags=SIGCHLD) = 3", *extra, *TAIL]
    if not any("+++" in e or "detached" in e for e in extra):
        lines.append("102  +++ exited with 0 +++" if why != "still running" else "")
    trace = _trace(tmp_path, [x for x in lines if x])
    binds = [Bind(str(tmp_path), "/rw", writable=True)]
    assert read_set(trace, views=[str(root)], cwd="/", binds=binds) is None
    assert why in (untracked_reason(trace, views=[str(root)], cwd="/", binds=binds) or "")


# 101 forks 102 (namespace pid 3), which forks 103 (pid 4) before 101's clone returns in the
# log: the parser pairs the namespace's pids with the host's in the order they were made
RELATIVE = [f'103  access("{_hex("gone")}", F_OK) = -1 ENOENT (x)']
FORKS = [
    *HEAD,
    "101  clone(child_stack=NULL, flags=SIGCHLD <unfinished ...>",
    "102  clone(child_stack=NULL, flags=SIGCHLD) = 4",
    "101  <... clone resumed>) = 3",
    "102  +++ exited with 0 +++",
    "103  +++ exited with 0 +++",
    *TAIL,
]


@pytest.mark.parametrize(
    ("lines", "why"),
    [
        (FORKS[1:], "does not show bwrap starting"),
        ([*FORKS[:-3], *FORKS[-2:]], "still running"),  # 102 never shows
        ([*FORKS[:-1], "104  +++ exited with 0 +++", *TAIL], "do not match its clone calls"),
        ([x.replace("101 ", "91 ").replace("102 ", "92 ").replace("103 ", "93 ") for x in FORKS], "wrapped"),
        # 100 makes 103 while 101's clone makes 102: the two allocations may have raced, and
        # 102 and 103 swapped, so neither's directory is known until the trace names it
        (
            [*FORKS[:4], "100  clone(child_stack=NULL, flags=SIGCHLD) = 4", *FORKS[5:7], *RELATIVE, *FORKS[7:]],
            "a relative path whose directory the trace does not name",
        ),
        ([*FORKS[:4], "100  clone(child_stack=NULL, flags=CLONE_FS|CLONE_VM) = 4", *FORKS[5:]], "threads"),
    ],
)
def test_processes_the_log_does_not_pair_with_their_clones_are_untracked(
    tmp_path: Path, lines: list[str], why: str
) -> None:
    root = _tree(tmp_path)
    assert why in (untracked_reason(_trace(tmp_path, lines), views=[str(root)], cwd="/") or "")


def test_clones_at_the_same_time_leave_their_processes_unsure_whoever_made_them(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    # 102 (made by 101's clone) clones while that clone is still in the log: unsure too, since
    # which process descends from which is read off the same pairing
    nested = [*FORKS[:-3], *RELATIVE, *FORKS[-3:]]
    assert "relative path" in (untracked_reason(_trace(tmp_path, nested), views=[str(root)], cwd="/w") or "")
    assert read_set(_trace(tmp_path, FORKS), views=[str(root)], cwd="/w") is not None  # no relative path
    # made by another process at the same time: tracked while it names no relative path
    raced = [*FORKS[:4], "100  clone(child_stack=NULL, flags=SIGCHLD) = 4", *FORKS[5:]]
    assert read_set(_trace(tmp_path, raced), views=[str(root)], cwd="/w") is not None


def test_a_clone_whose_host_pid_comes_after_later_clones_never_gives_the_wrong_directory(tmp_path: Path) -> None:
    """The kernel may give a new process its namespace pid, sleep, and its host pid after
    other clones are done: 102's child (namespace pid 4) is host 105 and reads ``secret`` in
    /u, not in 103's /w."""
    root = _tree(tmp_path)
    (root / "u").mkdir()
    (root / "u" / "secret").write_text("s")
    lines = [
        "99  clone(child_stack=NULL, flags=CLONE_NEWPID|SIGCHLD) = 100",
        "100  clone(child_stack=NULL, flags=SIGCHLD) = 2",
        f'101  execve("{_hex("/bin/tool")}", 0x1, 0x2) = 0',
        "101  clone(child_stack=NULL, flags=SIGCHLD) = 3",
        f'102  chdir("{_hex("/u")}") = 0',
        "102  clone(child_stack=NULL, flags=SIGCHLD <unfinished ...>",
        "101  clone(child_stack=NULL, flags=SIGCHLD) = 5",
        f'103  newfstatat(AT_FDCWD<{_hex("/w")}>, "{_hex("a")}", 0x1, 0) = 0',
        "103  clone(child_stack=NULL, flags=SIGCHLD) = 6",
        "102  <... clone resumed>) = 4",
        f'105  access("{_hex("secret")}", F_OK) = 0',
        *[f"{p}  +++ exited with 0 +++" for p in (105, 104, 103, 102, 101)],
    ]
    trace = _trace(tmp_path, lines)
    reads = read_set(trace, views=[str(root)], cwd="/w")
    assert reads is None or "u/secret" in reads.lookups | reads.nodes
    assert "relative path" in (untracked_reason(trace, views=[str(root)], cwd="/w") or "")


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        (["101  clone(child_stack=NULL, flags=CLONE_UNTRACED|SIGCHLD) = 3"], "CLONE_UNTRACED"),
        # 103's line comes before the clone that made it started
        (["103  getcwd(0x1, 4096) = 2", "101  clone(child_stack=NULL, flags=SIGCHLD) = 3"], "ran before it was made"),
    ],
)
def test_a_process_the_tracer_may_not_follow_or_that_ran_before_its_clone_is_untracked(
    tmp_path: Path, extra: list[str], why: str
) -> None:
    root = _tree(tmp_path)
    lines = [*HEAD, *extra, "103  +++ exited with 0 +++", *TAIL]
    assert why in (untracked_reason(_trace(tmp_path, lines), views=[str(root)], cwd="/") or "")


def test_fchdir_to_a_directory_the_trace_does_not_name_makes_the_directory_unknown(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    lines = [*HEAD, "101  fchdir(7) = 0", f'101  access("{_hex("gone")}", F_OK) = -1 ENOENT (x)', *TAIL]
    assert "relative path" in (untracked_reason(_trace(tmp_path, lines), views=[str(root)], cwd="/") or "")


def test_sigpipe_is_no_reason_for_a_reader_but_is_for_a_writer(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    reader = [*HEAD, "101  +++ killed by SIGPIPE +++"]
    assert read_set(_trace(tmp_path, reader), views=[str(root)], cwd="/") is not None
    writer = [*HEAD, f'101  unlink("{_hex("/w/a")}") = 0', "101  +++ killed by SIGPIPE +++"]
    assert read_set(_trace(tmp_path, writer), views=[str(root)], cwd="/") is None


def test_a_tracer_message_or_a_timeout_makes_it_untracked(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    t = _trace(tmp_path, [*HEAD, *TAIL])
    assert read_set(t, views=[str(root)], cwd="/") is not None
    t.diag.write_text("strace: ptrace(PTRACE_SEIZE, 5): Operation not permitted\n")
    assert "Operation not permitted" in (untracked_reason(t, views=[str(root)], cwd="/") or "")
    t.diag.write_text("")
    t.timed_out = True
    assert untracked_reason(t, views=[str(root)], cwd="/") == "the command timed out"


# ---------------------------------------------------------------------------------- real sandboxes

SETUP = "mkdir -p /w/d /u && echo a > /w/a && echo b > /w/b && ln -s a /w/l && echo log > /u/log"
COMMANDS = [
    "ls /w",
    "test -e /w/x && echo yes || echo no",
    "find /w | sort",
    "stat -c '%n %s' /w/a",
    "echo /w/*",
    "[ -d /w/x ] || mkdir /w/x; ls -d /w/x",
    "cat /w/l",
]
WRITES = [
    "echo more >> /u/log",  # unrelated to every command
    "echo new > /w/new",  # a new entry in /w
    "echo more >> /w/a",  # /w/a's content and size
    "mkdir /w/x",
    "ln -sf b /w/l",
    "echo e > /w/d/e",
]


@pytest.fixture(params=["ebpf", "strace"])
def tracer(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test with each tracer: bpftrace on the syscall tracepoints, and strace
    (``AOSPEC_READ_SETS=strace``); skipped where that one does not work."""
    from aospec.runtime import readsets

    monkeypatch.setenv("AOSPEC_READ_SETS", "strace" if request.param == "strace" else "auto")
    monkeypatch.setattr(readsets, "_support", None)
    support = tracer_support()
    if not support.ok or support.kind != request.param:
        pytest.skip(f"the {request.param} tracer: {support.detail}")
    readsets.wait_for_tracer()  # (it starts in the background otherwise)
    return str(request.param)


async def _run(sb: ReadSetOverlaySandbox, command: str, *, trace: bool) -> tuple[str, str, ReadSet | None, object]:
    fork = await sb.fork()
    if trace:
        await fork.trace_reads()
    obs = await fork.execute(Action.bash(command))
    return obs, fork.version, (await fork.read_set()) if trace else None, fork


@pytest.mark.root
def test_a_fork_valid_by_its_read_set_gives_what_running_it_after_the_commits_gives(overlay: str, tracer: str) -> None:

    async def main() -> list[tuple[str, str, bool]]:
        seen = []
        for command in COMMANDS:
            for write in WRITES:
                async with open_sandbox(SandboxConfig(timeout_s=20)) as sb:
                    assert isinstance(sb, ReadSetOverlaySandbox)
                    await sb.run(SETUP)
                    obs0, _, reads, fork = await _run(sb, command, trace=True)
                    assert reads is not None, (
                        command,
                        untracked_reason(fork._trace, views=[str(fork._merged)], cwd="/"),
                    )
                    fork_writes = await fork.write_set()
                    _, _, _, step = await _run(sb, write, trace=False)
                    writes = await step.write_set()
                    await sb.commit(step)
                    problem = conflict(reads, writes) or fork_conflict(fork_writes, writes)
                    # what serial execution gives: the command run after the commit
                    obs1, version1, _, again = await _run(sb, command, trace=False)
                    await again.discard()
                    if problem is None:
                        assert obs0 == obs1, (command, write)
                        await sb.rebase(fork)
                        assert sb.version == version1, (command, write)
                    else:
                        await fork.discard()
                    seen.append((command, write, problem is None))
        return seen

    seen = anyio.run(main)
    valid = {(c, w) for c, w, ok in seen if ok}
    # the rule is not vacuous either way: unrelated writes pass, related ones do not
    assert all((c, WRITES[0]) in valid for c in COMMANDS)
    for c, w in [
        ("ls /w", "echo new > /w/new"),
        ("test -e /w/x && echo yes || echo no", "mkdir /w/x"),
        ("stat -c '%n %s' /w/a", "echo more >> /w/a"),
        ("echo /w/*", "echo new > /w/new"),
        ("cat /w/l", "ln -sf b /w/l"),
        ("cat /w/l", "echo more >> /w/a"),
        ("find /w | sort", "echo e > /w/d/e"),
    ]:
        assert (c, w) not in valid, (c, w)
    assert ("cat /w/l", "echo new > /w/new") in valid  # a new name next to what it read
    assert ("test -e /w/x && echo yes || echo no", "echo new > /w/new") in valid
    assert ("ls /w", "echo e > /w/d/e") not in valid  # ls stat'ed /w/d, whose link count and time moved


@pytest.mark.root
def test_each_process_reads_relative_paths_in_the_directory_it_inherited(overlay: str, tracer: str) -> None:
    # the parser pairs the sandbox's pids with the host's itself: children forked before
    # their parent changes directory, in pipelines, subshells and in the background, many
    # at once, each resolve relative paths where their parent was when it forked them
    command = (
        "cd /w && (sleep 0.2; cat a; test -e gone1) & cd /u && cat log; "
        "(cd /w/d && test -e gone2) | (test -e gone3; cat log); "
        "for i in 1 2 3 4 5 6 7 8; do (test -e gone4-$i) & done; wait"
    )

    async def main() -> tuple[str, ReadSet | None]:
        async with open_sandbox(SandboxConfig(timeout_s=20)) as sb:
            await sb.run(SETUP)
            obs, _, reads, fork = await _run(sb, command, trace=True)
            await fork.discard()
            return str(obs), reads

    obs, reads = anyio.run(main)
    assert reads is not None, obs
    assert {"w/a", "u/log"} <= reads.nodes
    assert {"w/gone1", "w/d/gone2", "u/gone3"} | {f"u/gone4-{i}" for i in range(1, 9)} <= reads.lookups
    assert not {"u/gone1", "u/gone2", "w/gone3", "w/gone4-1"} & reads.lookups


@pytest.mark.root
def test_a_rebase_keeps_the_serial_order_of_modification_times(overlay: str, tracer: str) -> None:

    async def main() -> str:
        async with open_sandbox(SandboxConfig(timeout_s=20)) as sb:
            await sb.run(SETUP)
            fork = (await _run(sb, "echo f > /w/f", trace=True))[3]
            await anyio.sleep(0.05)
            _, _, _, step = await _run(sb, "echo g > /u/g", trace=False)
            await sb.commit(step)
            await sb.rebase(fork)
            return (await sb.run("stat -c %y /w/f /u/g")).output

    # serially /u/g was written first, so /w/f is the newer (%y: nanoseconds, sortable)
    f_time, g_time = anyio.run(main).splitlines()
    assert f_time > g_time


@pytest.mark.root
@pytest.mark.parametrize(
    ("command", "why"),
    # a process left running is killed with the sandbox: the eBPF tracer sees that
    [("sleep 30 & echo started", "still running|killed by SIGKILL"), ("cat /rw/x", "writable bind")],
)
def test_a_command_the_tracer_cannot_account_for_has_no_read_set(
    overlay: str, tracer: str, tmp_path: Path, command: str, why: str
) -> None:
    (tmp_path / "x").write_text("x\n")

    async def main() -> tuple[ReadSet | None, str | None]:
        cfg = SandboxConfig(timeout_s=2, binds=(Bind(str(tmp_path), "/rw", writable=True),))
        async with open_sandbox(cfg) as sb:
            fork = await sb.fork()
            await fork.trace_reads()
            await fork.execute(Action.bash(command))
            reads = await fork.read_set()
            reason = untracked_reason(fork._trace, views=[str(fork._merged)], cwd="/", binds=cfg.binds)
            await fork.discard()
            return reads, reason

    reads, reason = anyio.run(main)
    assert reads is None and any(w in (reason or "") for w in why.split("|")), reason


@pytest.mark.root
def test_a_traced_guess_that_times_out_offers_no_result(overlay: str, tracer: str) -> None:

    async def main() -> str:
        async with open_sandbox(SandboxConfig(timeout_s=1)) as sb:
            fork = await sb.fork()
            await fork.trace_reads()
            with pytest.raises(SandboxError, match="timed out: its result is not used") as err:
                await fork.execute(Action.bash("sleep 5"))
            await fork.discard()
            # the same command, not a guess, times out as usual
            return (await sb.run("sleep 5")).output + str(err.value)

    assert "timed out" in anyio.run(main)


@pytest.mark.root
def test_only_a_fork_asked_to_trace_runs_under_the_tracer(overlay: str, tracer: str) -> None:

    async def main() -> tuple[object, object, str]:
        async with open_sandbox(SandboxConfig(timeout_s=20)) as sb:
            plain = await sb.fork()
            await plain.execute(Action.bash("true"))
            _, _, traced, fork = await _run(sb, "true", trace=True)
            await fork.discard()
            return await plain.read_set(), traced, type(sb).__name__

    untraced, traced, cls = anyio.run(main)
    assert untraced is None and traced is not None and cls == "ReadSetOverlaySandbox"


@pytest.mark.root
def test_read_sets_off_gives_the_plain_overlay_sandbox(overlay: str) -> None:
    async def main() -> tuple[bool, bool]:
        async with (
            open_sandbox(SandboxConfig(read_sets="off")) as off,
            open_sandbox(SandboxConfig(network=True)) as networked,
        ):
            return isinstance(off, ReadSetSandbox), isinstance(networked, ReadSetSandbox)

    assert anyio.run(main) == (False, False)
    assert read_sets_on(SandboxConfig(network=True)) == (
        False,
        "off: the sandbox has network access, which the tracer does not follow",
    )
    assert not issubclass(OverlaySandbox, ReadSetOverlaySandbox)
    with pytest.raises(ValueError, match="read_sets must be auto, off or all"):
        SandboxConfig(read_sets="sometimes")


@pytest.mark.root
def test_sandbox_info_says_whether_read_sets_are_on(overlay: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "aospec", "sandbox", "info", "--format", "json"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    line = json.loads(proc.stdout)["read_sets"]
    assert line == tracer_support().detail and line.startswith(("on: bpftrace", "on: strace", "off: "))
    off = subprocess.run(
        [sys.executable, "-m", "aospec", "sandbox", "info"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "AOSPEC_READ_SETS": "off"},
        timeout=120,
    )
    assert "read_sets            off: AOSPEC_READ_SETS=off" in off.stdout
