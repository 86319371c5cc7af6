"""Issue 9, items 2 and 5: compaction keeps version = state (no whiteout survives in a
directory it can no longer hide anything in), and trees deeper than PATH_MAX are
versioned, copied, compacted, spilled and removed like any other."""

from __future__ import annotations

import contextlib
import hashlib
import os
import resource
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from aospec.runtime import SandboxConfig, _fs, open_sandbox
from aospec.runtime.versions import Layer, UpperTracker, tree_layer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
DEEP_NAME = "d" * 60
DEEP_LEVELS = 80  # 80 x 61 bytes: every path below the 67th level is longer than PATH_MAX
MAKE_DEEP = f"cd /tmp; n={DEEP_NAME}; for i in $(seq {DEEP_LEVELS}); do mkdir $n && cd $n; done"
TO_DEEP = f"cd /tmp; for i in $(seq {DEEP_LEVELS}); do cd {DEEP_NAME}; done"
# busybox's rm -r and find fail past PATH_MAX themselves: remove level by level, bottom up
REMOVE_DEEP = f"{TO_DEEP}; rm -f *; for i in $(seq {DEEP_LEVELS}); do cd .. && rmdir {DEEP_NAME} || exit 1; done"


def snapshot(root: str | Path) -> dict[str, tuple[Any, ...]]:
    """Paths, types, modes, owners, content hashes and symlink targets of a merged tree,
    read on the host (directory by directory, so any depth works) independently of
    runtime's own walking code; an entry that is listed but cannot be looked up (a
    visible whiteout) is recorded as such."""
    out: dict[str, tuple[Any, ...]] = {}

    def walk(dfd: int, rel: str) -> None:
        for name in sorted(os.listdir(dfd)):
            r = f"{rel}/{name}"
            try:
                s = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except OSError as exc:
                out[r] = ("unreadable", exc.errno)
                continue
            if stat.S_ISREG(s.st_mode):
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd)
                with open(fd, "rb") as f:
                    extra: Any = hashlib.sha256(f.read()).hexdigest()
            elif stat.S_ISLNK(s.st_mode):
                extra = os.readlink(name, dir_fd=dfd)
            else:
                extra = s.st_rdev
            out[r] = (stat.S_IFMT(s.st_mode), stat.S_IMODE(s.st_mode), s.st_uid, s.st_gid, extra)
            if stat.S_ISDIR(s.st_mode):
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
                try:
                    walk(sub, r)
                finally:
                    os.close(sub)

    top = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        walk(top, "")
    finally:
        os.close(top)
    return out


async def merged_snapshot(sb: Any) -> dict[str, tuple[Any, ...]]:
    """The snapshot of a sandbox's tree, read through a fork's merged root."""
    return (await fork_trees(sb))[0]


async def fork_trees(sb: Any) -> tuple[dict[str, tuple[Any, ...]], dict[bytes, bytes]]:
    """The snapshot and the full-tree records (``tree_layer``) of a sandbox's tree, read
    through a fork's merged root."""
    fork = await sb.fork()
    try:
        snap = snapshot(fork.root_path)
        if any(v[0] == "unreadable" for v in snap.values()):
            return snap, {}  # the snapshot comparison reports it
        return snap, {p: s for p, s in tree_layer(fork.root_path).records if s is not None}
    finally:
        await fork.discard()


# -- item 2: compaction ---------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("durable", [False, True])
async def test_compaction_drops_whiteouts_in_directories_new_in_the_merged_range(overlay: str, durable: bool) -> None:
    steps = ["echo 0 > /p0", "echo 1 > /p1", "echo 2 > /p2", "mkdir /n; echo f > /n/f", "rm /n/f"]
    async with (
        open_sandbox(SandboxConfig(backend=overlay, compact_at=4, durable=durable)) as compacted,
        open_sandbox(SandboxConfig(backend=overlay, compact_at=1000, durable=durable)) as plain,
    ):
        for s in steps:
            await compacted.run(s)
            await plain.run(s)
        assert compacted.statistics().compactions == 1
        check = "ls -a /n; find / -xdev > /dev/null; echo find=$?"
        assert (await compacted.run(check)).output == (await plain.run(check)).output == ".\n..\nfind=0\n"
        assert compacted.version == plain.version
        assert await merged_snapshot(compacted) == await merged_snapshot(plain)


# /w/a, /opt/d and their files come from an early layer, /etc from the base, /n is new:
# whiteouts land in directories of every origin; "m" is a file in one place and a
# directory in another, and the type changes both ways
D = st.sampled_from(["/n", "/n/m", "/w/a", "/etc", "/opt/d"])  # new ones first: shrink to them
L = st.sampled_from(["f", "m"])
P = st.one_of(D, st.builds(lambda d, name: f"{d}/{name}", D, L))
FILE = st.builds(lambda d, name: f"{d}/{name}", D, L)
write = st.builds(lambda d, name, c: f"mkdir -p {d} && printf {c} > {d}/{name}", D, L, st.sampled_from(["", "1", "2"]))
OPS = st.one_of(
    write,
    st.builds(lambda p: f"rm -f {p}", FILE),
    write,
    st.builds(lambda p: f"rm -f {p}", FILE),
    st.builds(lambda p: f"printf x >> {p}", FILE),
    st.builds(lambda p: f"rm -rf {p}", P),
    st.builds(lambda p: f"mkdir -p {p}", P),
    st.builds(lambda p: f"rm -rf {p}; printf y > {p}", P),  # anything -> file
    st.builds(lambda p: f"rm -rf {p}; mkdir {p}", P),  # anything -> (opaque) directory
    st.builds(lambda p, q: f"mv {p} {q}", P, P),
    st.builds(lambda p, q: f"cp -a {p} {q}", P, P),
    st.builds(lambda p, q: f"ln {p} {q}", FILE, FILE),
    st.builds(lambda p, t: f"ln -sfn {t} {p}", FILE, st.sampled_from(["../a", "/etc/hosts", "f"])),
    st.builds(lambda p, m: f"chmod {m} {p}", P, st.sampled_from(["700", "644", "4755"])),
)
COMMANDS = st.builds(lambda ops: "; ".join(f"{op} 2>/dev/null" for op in ops) + "; true", st.lists(OPS, min_size=1, max_size=3))
SEED = "mkdir -p /w/a/m /opt/d && echo a > /w/a/f && echo c > /w/a/m/f && echo d > /opt/d/f"


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    steps=st.lists(st.tuples(COMMANDS, st.booleans()), min_size=5, max_size=10),
    compact_at=st.integers(4, 5),
    memory_layers_bytes=st.sampled_from([0, None]),
    durable=st.booleans(),
)
def test_compacted_stacks_show_the_same_tree_and_version_as_uncompacted_ones(
    overlay: str, steps: list[tuple[str, bool]], compact_at: int, memory_layers_bytes: int | None, durable: bool
) -> None:
    """Random changes (files, directories, renames, copies, hard and symbolic links,
    modes, type changes both ways), some committed from forks, with a small compact_at:
    after every step the merged tree equals the same steps run without compaction, and
    so does the version; and the version equals the full-tree difference's."""
    extra = {} if memory_layers_bytes is None else {"memory_layers_bytes": memory_layers_bytes}
    config = SandboxConfig(backend=overlay, durable=durable, **extra)

    async def main() -> None:
        async with (
            open_sandbox(config.replace(compact_at=compact_at)) as compacted,
            open_sandbox(config.replace(compact_at=1000)) as plain,
        ):
            await compacted.run(SEED)
            await plain.run(SEED)
            tree = (await fork_trees(compacted))[1]
            for command, via_fork in steps:
                before = compacted.version
                if via_fork:
                    fork = await compacted.fork()
                    await fork.run(command)
                    await compacted.commit(fork)
                else:
                    await compacted.run(command)
                await plain.run(command)
                (snap_c, after), snap_p = await fork_trees(compacted), await merged_snapshot(plain)
                assert snap_c == snap_p, command
                assert compacted.version == plain.version, command
                assert compacted.version == Layer.between(tree, after).apply_to(before), command
                tree = after
            assert compacted.stack_depth <= compact_at + 1

    anyio.run(main)


# -- item 5: deep trees -----------------------------------------------------------------------


def _make_deep(root: Path, levels: int, name: bytes = b"d") -> None:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(levels):
        os.mkdir(name, dir_fd=fd)
        nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    leaf = os.open(b"leaf", os.O_WRONLY | os.O_CREAT, 0o640, dir_fd=fd)
    os.write(leaf, b"deep")
    os.close(leaf)
    os.mknod(b"gone", stat.S_IFCHR, 0, dir_fd=fd)  # a whiteout, as an upper has them
    os.setxattr(fd, _fs.OPAQUE_XATTR, b"y")
    os.close(fd)


def _open_fds() -> set[tuple[int, int, int]]:
    """This process's descriptors, each as (number, device, inode): a test compares what it
    left open with what was open before (other tests' leftovers the collector closes
    meanwhile only shrink the set; a leaked one is new, even under a reused number)."""
    held = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            st = os.fstat(int(name))
            held.add((int(name), st.st_dev, st.st_ino))
    return held


def test_trees_deeper_than_path_max_and_the_recursion_limit_are_walked_copied_and_removed(tmp_path: Path) -> None:
    levels = max(3000, sys.getrecursionlimit() + 100)  # paths of 6000 bytes, more levels than fds kept
    src = tmp_path / "src"
    src.mkdir()
    try:
        _make_deep(src, levels)
        fds = _open_fds()

        names = list(_fs.walk_names(os.fsencode(src)))
        assert len(names) == levels + 2 and len(max(names, key=len)) > 4096
        layer = tree_layer(src)
        assert len(layer.records) == levels + 1  # the whiteout is a deletion of nothing: not recorded
        deepest = max(layer.records, key=lambda r: len(r[0]))
        assert deepest[0].endswith(b"/leaf") and deepest[1] is not None and deepest[1][:1] == b"f"

        _fs.copy_tree(src, tmp_path / "copy")
        assert tree_layer(tmp_path / "copy") == layer
        assert sorted(_fs.walk_names(os.fsencode(tmp_path / "copy"))) == sorted(names)  # whiteout and all
        _fs.sync_tree(tmp_path / "copy")

        tracker = UpperTracker(tmp_path / "copy", lambda: None)
        tracker.adopt()
        top = os.open(tmp_path / "copy", os.O_RDONLY)
        leaf_dir = _fs.open_dir_at(top, b"/".join([b"d"] * levels))
        os.close(top)
        try:
            fd = os.open(b"leaf", os.O_WRONLY | os.O_APPEND, dir_fd=leaf_dir)
            os.write(fd, b"er")
            os.close(fd)
        finally:
            os.close(leaf_dir)
        changed = tracker.diff()
        assert [p for p, _ in changed.records] == [deepest[0]]

        _fs.remove_tree(tmp_path / "copy")
        _fs.remove_tree(src)
        assert os.listdir(tmp_path) == []
        assert _open_fds() - fds == set()
    finally:  # pytest's own cleanup (shutil.rmtree) recurses once per level: too deep for it
        _fs.remove_tree(tmp_path / "copy")
        _fs.remove_tree(src)


@pytest.mark.anyio
@pytest.mark.parametrize("durable", [False, True])
async def test_a_tree_deeper_than_path_max_is_versioned_forked_compacted_spilled_and_reopened(
    overlay: str, tmp_path: Path, durable: bool
) -> None:
    config = SandboxConfig(backend=overlay, compact_at=4, durable=durable, state_dir=str(tmp_path / "state"))
    async with open_sandbox(config) as sb:
        start = sb.version
        before = (await fork_trees(sb))[1]
        result = await sb.run(MAKE_DEEP)
        assert result.returncode == 0, result.output
        assert sb.version != start
        assert sb.version == Layer.between(before, (await fork_trees(sb))[1]).apply_to(start)
        fork = await sb.fork()
        assert fork.version == sb.version
        assert (await fork.run(f"{TO_DEEP}; echo forked > f")).returncode == 0
        await sb.commit(fork)
        forked = sb.version
        assert forked != start
        # the next commands work, and push the stack into compactions over the deep tree
        for i in range(4):
            assert (await sb.run(f"{TO_DEEP}; echo {i} > g{i % 2}; rm -f g{(i + 1) % 2}")).returncode == 0
        assert sb.statistics().compactions > 0
        listing = f"{TO_DEEP}; ls; cat f g1"
        expected = (await sb.run(listing)).output
        assert expected == "f\ng1\nforked\n3\n"
        version, snap = sb.version, await merged_snapshot(sb)
        assert len(max(snap, key=len)) > 4096
    async with open_sandbox(config) as sb:  # spilled to disk (and fsynced when durable)
        assert sb.version == version
        assert (await sb.run(listing)).output == expected
        assert await merged_snapshot(sb) == snap
        # whiteouts at every depth, then compacted over the deep tree below them
        start, tree = sb.version, (await fork_trees(sb))[1]
        result = await sb.run(REMOVE_DEEP)
        assert result.returncode == 0, result.output
        assert sb.version == Layer.between(tree, (await fork_trees(sb))[1]).apply_to(start)
        for i in range(4):
            await sb.run(f"echo {i} > /tmp/h{i}")
        assert sb.statistics().compactions > 0
        assert (await sb.run("ls -A /tmp")).output == "h0\nh1\nh2\nh3\n"
        assert [p for p in await merged_snapshot(sb) if p.startswith("/tmp/")] == [f"/tmp/h{i}" for i in range(4)]


def test_the_cli_runs_a_deep_tree_command_with_its_exit_status_and_no_traceback(overlay: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "aospec", "sandbox", "exec", "--", f"{MAKE_DEEP}; exit 3"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr and "exit 3" in proc.stderr


def test_changes_spread_over_more_directories_than_descriptors_are_tracked(tmp_path: Path) -> None:
    lower, upper = tmp_path / "lower", tmp_path / "upper"
    for i in range(600):
        (lower / f"d{i}").mkdir(parents=True)
        (lower / f"d{i}" / "f").write_text("old")
        (upper / f"d{i}").mkdir(parents=True)
        (upper / f"d{i}" / "f").write_text("new" if i % 2 else "old")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, len(os.listdir("/proc/self/fd")) + 300), hard))
    try:
        layer = UpperTracker(upper, lambda: str(lower)).diff()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert [p for p, _ in layer.records] == sorted((b"d%d/f" % i for i in range(1, 600, 2)), key=lambda p: p.split(b"/"))


@pytest.mark.anyio
@pytest.mark.parametrize("memory_layers_bytes", [0, 64 << 20])
async def test_compaction_keeps_the_hard_links_made_in_a_layer(overlay: str, memory_layers_bytes: int) -> None:
    """Issue 20, carried over: merging layers copied each name of a hard-linked file as a
    file of its own, so whether two names were one file depended on when compaction ran
    (it runs at different moments in a serial and a speculative run). Names that were one
    inode in a layer stay one inode in the merged layer, new directories included, also
    after a later command linked one of them again (a copy-up: every name comes up with
    it, as on a plain filesystem)."""
    cfg = SandboxConfig(backend=overlay, compact_at=4, memory_layers_bytes=memory_layers_bytes)
    async with open_sandbox(cfg) as sb:
        for i in range(4):  # the fifth layer is merged onto the fourth: applied, not copied whole
            await sb.run(f"echo {i} > /tmp/n{i}")
        await sb.run("echo a > /tmp/f && ln /tmp/f /tmp/g && mkdir /tmp/d && ln /tmp/f /tmp/d/h")
        assert sb.statistics().compactions == 1
        await sb.run("ln /tmp/f /tmp/k")  # copies f up, with g and h: four names, one file
        for i in range(4, 8):
            await sb.run(f"echo {i} > /tmp/n{i}")
        f, g, h, k = (await sb.run("stat -c %d:%i:%h /tmp/f /tmp/g /tmp/d/h /tmp/k")).output.split()
        assert f == g == h == k and f.endswith(":4")
