"""Versions: the layer the tracker reads off an overlay upper must equal the difference
of the whole filesystem before and after, for any sequence of changes."""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash
from aospec.runtime import _fs
from aospec.runtime.versions import Layer, UpperTracker, _TreeReader, base_version, chain_version, hash_file, tree_layer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

NAMES = ("a", "b", "c")
PATHS = [n for n in NAMES] + [f"{x}/{y}" for x in NAMES for y in NAMES] + [f"a/{y}/{z}" for y in NAMES for z in NAMES]


def _make_lower(root: Path) -> None:
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "c").mkdir()
    (root / "b").mkdir()
    (root / "a" / "a").write_text("lower a/a")
    (root / "a" / "b" / "a").write_text("lower a/b/a")
    (root / "a" / "b" / "b").write_text("x" * 70000)
    (root / "b" / "c").write_text("lower b/c")
    os.symlink("../a", root / "b" / "a")
    os.chmod(root / "a" / "c", 0o700)


def _snapshot(root: Path) -> dict[bytes, bytes]:
    reader = _TreeReader(os.fsencode(root))
    try:
        out = {}
        for rel in _fs.walk_names(os.fsencode(root)):
            state = reader.state(rel)
            if state is not None:
                out[rel] = state
        return out
    finally:
        reader.close()


def _real_dir_chain(root: Path, rel: str) -> bool:
    """Every ancestor of ``rel`` is a real directory (never write through a symlink)."""
    cur = root
    for part in rel.split("/")[:-1]:
        cur = cur / part
        try:
            if not stat.S_ISDIR(os.lstat(cur).st_mode):
                return False
        except FileNotFoundError:
            return False
    return True


def _apply(root: Path, op: tuple) -> None:
    kind, rel = op[0], op[1]
    if not _real_dir_chain(root, rel):
        return
    p = root / rel
    exists = os.path.lexists(p)
    is_dir = exists and stat.S_ISDIR(os.lstat(p).st_mode)
    if kind == "write" and not is_dir:
        if exists and os.path.islink(p):
            os.unlink(p)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        os.write(fd, op[2])
        os.close(fd)
    elif kind == "mkdir" and not exists:
        os.mkdir(p)
    elif kind == "remove" and exists:
        shutil.rmtree(p) if is_dir else os.unlink(p)
    elif kind == "replace_dir" and is_dir:
        shutil.rmtree(p)
        os.mkdir(p)
    elif kind == "symlink" and not exists:
        os.symlink(op[2], p)
    elif kind == "chmod" and exists and not os.path.islink(p):
        os.chmod(p, op[2])
    elif kind == "touch" and exists and not os.path.islink(p):
        os.utime(p, ns=(1, 1))
    elif kind == "rename" and exists and not is_dir:
        dst = root / op[2]
        if _real_dir_chain(root, op[2]) and not (
            os.path.lexists(dst) and os.path.isdir(dst) and not os.path.islink(dst)
        ):
            os.rename(p, dst)


path = st.sampled_from(PATHS)
ops = st.one_of(
    st.tuples(st.just("write"), path, st.sampled_from([b"", b"lower a/a", b"new", b"y" * 70000])),
    st.tuples(st.just("mkdir"), path),
    st.tuples(st.just("remove"), path),
    st.tuples(st.just("replace_dir"), path),
    st.tuples(st.just("symlink"), path, st.sampled_from(["a", "../b", "nowhere"])),
    st.tuples(st.just("chmod"), path, st.sampled_from([0o644, 0o600, 0o755])),
    st.tuples(st.just("touch"), path),
    st.tuples(st.just("rename"), path, path),
)


@pytest.fixture
def overlay_dirs(tmp_path: Path, overlay: str) -> Iterator[dict[str, Path]]:
    lower = tmp_path / "lower"
    lower.mkdir()
    _make_lower(lower)
    yield {"lower": lower, "work": tmp_path}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=st.lists(st.lists(ops, min_size=1, max_size=8), min_size=1, max_size=3))
def test_the_tracked_layer_equals_the_whole_tree_difference(overlay_dirs: dict[str, Path], batches: list) -> None:
    work = overlay_dirs["work"] / f"run-{os.urandom(4).hex()}"
    upper, wdir, merged = work / "u", work / "w", work / "m"
    for d in (upper, wdir, merged):
        d.mkdir(parents=True)
    opts = f"lowerdir={overlay_dirs['lower']},upperdir={upper},workdir={wdir},redirect_dir=off,metacopy=off,index=off,xino=off"
    _fs.mount("overlay", str(merged), "overlay", 0, opts)
    try:
        tracker = UpperTracker(upper, lambda: str(overlay_dirs["lower"]))
        for batch in batches:
            before = _snapshot(merged)
            for op in batch:
                _apply(merged, op)
            after = _snapshot(merged)
            assert tracker.diff() == Layer.between(before, after), batch
    finally:
        _fs.umount(str(merged))
        _fs.remove_tree(work)


def test_a_tree_version_ignores_mtimes_and_inode_numbers(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    _make_lower(one)
    shutil.copytree(one, two, symlinks=True)  # new inodes; mtimes differ below
    os.utime(two / "a" / "a", ns=(5, 5))
    assert tree_layer(one).digest == tree_layer(two).digest
    os.chmod(two / "a" / "a", 0o600)
    assert tree_layer(one).digest != tree_layer(two).digest


@pytest.mark.parametrize(
    "change",
    [
        lambda r: os.chown(r / "b" / "c", 1000, 1000),
        lambda r: (os.unlink(r / "b" / "a"), os.symlink("../c", r / "b" / "a")),
        lambda r: (r / "empty").mkdir(),
        lambda r: (r / "a" / "b" / "b").write_text("x" * 69999 + "y"),
        lambda r: os.mkfifo(r / "fifo"),
    ],
)
def test_every_kind_of_difference_changes_a_tree_version(tmp_path: Path, change) -> None:
    root = tmp_path / "t"
    root.mkdir()
    _make_lower(root)
    before = base_version(tree_layer(root).digest)
    change(root)
    assert base_version(tree_layer(root).digest) != before


def test_whiteouts_and_opaque_directories_in_an_upper_are_read_as_deletions(tmp_path: Path, overlay: str) -> None:
    lower, upper = tmp_path / "lower", tmp_path / "upper"
    lower.mkdir()
    _make_lower(lower)
    upper.mkdir()
    os.mknod(upper / "b", stat.S_IFCHR | 0o000, 0)  # whiteout: /b deleted
    (upper / "a").mkdir()
    (upper / "a" / "b").mkdir()
    os.setxattr(upper / "a" / "b", _fs.OPAQUE_XATTR, b"y")  # /a/b emptied...
    (upper / "a" / "b" / "a").write_text("lower a/b/a")  # ...but a/b/a recreated identically
    layer = UpperTracker(upper, lambda: str(lower)).diff()
    assert layer.describe() == [("/a/b/b", "deleted"), ("/b", "deleted")]


def test_restore_after_a_restart_records_only_real_changes(tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    upper.mkdir()
    (upper / "kept").write_text("same")
    (upper / "edited").write_text("before")
    tracker = UpperTracker(upper, lambda: None)
    tracker.diff()
    snapshot = tracker.snapshot()
    (upper / "edited").write_text("after!")
    (upper / "kept").write_text("same")  # rewritten, new mtime, same content
    again = UpperTracker(upper, lambda: None)
    again.restore(snapshot)
    assert again.diff().describe() == [("/edited", "file")]


def test_version_chaining_depends_on_order_and_content() -> None:
    v0 = "0" * 32
    a, b = xxhash.xxh3_128_digest(b"a"), xxhash.xxh3_128_digest(b"b")
    assert chain_version(chain_version(v0, a), b) != chain_version(chain_version(v0, b), a)
    assert chain_version(v0, a) == chain_version(v0, a)
    assert Layer(()).apply_to(v0) == v0


@pytest.mark.parametrize("size", [0, 1, 65535, 65536, 65537, (1 << 20) + 3, 3 << 20])
def test_hash_file_is_xxh3_128_of_the_content(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    f = tmp_path / "f"
    f.write_bytes(data)
    assert hash_file(f) == xxhash.xxh3_128_digest(data)
