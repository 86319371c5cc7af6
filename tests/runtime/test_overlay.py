"""The overlay backend: layer stacks, compaction, persistence, layer release, errors."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from aospec.runtime import Limits, SandboxConfig, open_base, open_sandbox
from aospec.runtime._fs import mounts_under
from aospec.runtime.host import HostSupport
from aospec.runtime.processes import marked_processes
from aospec.runtime.versions import Layer, base_version, chain_version, tree_layer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aospec.errors import ConfigError, SandboxError, SandboxUnavailableError

pytestmark = pytest.mark.anyio

P = st.sampled_from(["/w/a", "/w/b", "/w/a/x", "/w/a/y", "/w/b/x", "/etc/profile", "/etc"])
COMMANDS = st.one_of(
    st.builds(lambda p, c: f"printf '{c}' > {p}", P, st.sampled_from(["", "one", "two"])),
    st.builds(lambda p: f"mkdir {p}", P),
    st.builds(lambda p: f"rm -rf {p}", P),
    st.builds(lambda p: f"rm -rf {p} && mkdir {p}", P),
    st.builds(lambda p: f"ln -s ../nowhere {p}", P),
    st.builds(lambda p, m: f"chmod {m} {p}", P, st.sampled_from(["600", "755"])),
    st.builds(lambda p: f"touch {p}", P),
    st.builds(lambda p, q: f"mv {p} {q}", P, P),
)


async def _snapshot_version(sb, parent_version: str, before: dict) -> tuple[str, dict]:
    """The version a full-tree difference gives, from a fork's merged root."""
    fork = await sb.fork()
    try:
        after = {p: s for p, s in tree_layer(fork.root_path).records if not p.startswith((b"proc/", b"dev/"))}
    finally:
        await fork.discard()
    layer = Layer.between(before, after)
    return layer.apply_to(parent_version), after


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(commands=st.lists(COMMANDS, min_size=1, max_size=7))
def test_versions_over_frozen_layers_and_compaction_equal_full_tree_differences(
    overlay: str, commands: list[str]
) -> None:
    import anyio

    async def main() -> None:
        async with open_sandbox(SandboxConfig(backend=overlay, compact_at=4)) as sb:
            await sb.run("mkdir -p /w/a /w/b && echo seed > /w/a/x")
            expected, tree = await _snapshot_version(sb, sb.version, {})
            expected = sb.version
            for cmd in commands:
                await sb.run(f"{cmd} 2>/dev/null; true")
                expected, tree = await _snapshot_version(sb, expected, tree)
                assert sb.version == expected, cmd
                assert sb.stack_depth <= 5

    anyio.run(main)


async def test_compaction_keeps_the_version_and_the_tree(overlay: str) -> None:
    steps = [
        f"echo {i} > /tmp/f{i % 3}; rm -rf /tmp/d{i % 2}; mkdir /tmp/d{i % 2}; echo {i} > /tmp/d{i % 2}/x"
        for i in range(14)
    ]
    async with (
        open_sandbox(SandboxConfig(backend=overlay, compact_at=4)) as compacted,
        open_sandbox(SandboxConfig(backend=overlay, compact_at=1000)) as plain,
    ):
        for s in steps:
            await compacted.run(s)
            await plain.run(s)
        assert compacted.statistics().compactions > 0
        assert compacted.stack_depth <= 5 < plain.stack_depth
        assert compacted.version == plain.version
        listing = "find /tmp | sort | xargs -n1 sh -c 'echo $0; test -f $0 && cat $0'"
        assert (await compacted.run(listing)).output == (await plain.run(listing)).output
        assert len(compacted.store.layer_ids()) == compacted.stack_depth  # replaced layers were released


async def test_layers_are_released_when_forks_go(overlay: str) -> None:
    async with open_sandbox(SandboxConfig(backend=overlay)) as sb:
        for i in range(5):
            a = await sb.fork()
            await a.run(f"echo {i} > /tmp/a")
            b = await a.fork()  # freezes a's changes into a layer only a and b use
            await b.run(f"echo {i} > /tmp/b")
            if i % 2:
                await sb.commit(b)
            await a.discard()
            await b.discard()
        assert sb.store.layer_ids() == sorted(sb.store.head_layers)
        assert set(os.listdir(sb.store.path / "s")) <= {sb.sid}  # no fork left behind


async def test_a_persistent_state_dir_reopens_at_the_committed_version(overlay: str, tmp_path: Path) -> None:
    cfg = SandboxConfig(backend=overlay, state_dir=str(tmp_path / "state"))
    async with open_sandbox(cfg) as sb:
        await sb.run("echo kept > /tmp/kept")
        fork = await sb.fork()
        await fork.run("echo committed > /tmp/c")
        await sb.commit(fork)
        await sb.fork()  # left open: closing the session discards it
        version = sb.version
    assert not mounts_under(str(tmp_path))
    async with open_sandbox(cfg) as sb:
        assert sb.store.recovery.clean
        assert sb.version == version
        assert (await sb.run("cat /tmp/kept /tmp/c")).output == "kept\ncommitted\n"


async def test_a_state_dir_in_use_cannot_be_opened_twice(overlay: str, tmp_path: Path) -> None:
    cfg = SandboxConfig(backend=overlay, state_dir=str(tmp_path / "state"))
    async with open_sandbox(cfg):
        with pytest.raises(SandboxError, match="in use by another process"):
            async with open_sandbox(cfg):
                pass


async def test_a_state_dir_refuses_a_different_base(overlay: str, tmp_path: Path) -> None:
    cfg = SandboxConfig(backend=overlay, state_dir=str(tmp_path / "state"))
    async with open_sandbox(cfg) as sb:
        base_dir = sb.store.base.path
    other = tmp_path / "otherbase"
    shutil.copytree(base_dir, other, symlinks=True)
    (other / "etc" / "extra").write_text("different")
    with pytest.raises(SandboxError, match="created from a base with version"):
        async with open_sandbox(cfg.replace(base=str(other))):
            pass


async def test_a_directory_base_has_the_version_of_its_tree(overlay: str, tmp_path: Path) -> None:
    busybox = open_base("busybox")
    copy = tmp_path / "base"
    shutil.copytree(busybox.path, copy, symlinks=True)
    async with open_sandbox(SandboxConfig(backend=overlay, base=str(copy))) as sb:
        assert sb.version == busybox.version == base_version(tree_layer(copy).digest)
        assert (await sb.run("echo ok")).output == "ok\n"
    assert not (copy / "tmp" / "x").exists()


async def test_without_a_disk_limit_uppers_live_on_disk(overlay: str) -> None:
    cfg = SandboxConfig(backend=overlay, limits=Limits(disk_bytes=None))
    async with open_sandbox(cfg) as sb:
        await sb.run("echo root > /tmp/r")
        fork = await sb.fork()
        await fork.run("head -c 1000000 /dev/zero > /tmp/big")
        assert not any(p.endswith("/rw") for p in mounts_under(str(sb.store.path)))
        await sb.commit(fork)
        assert (await sb.run("wc -c < /tmp/big; cat /tmp/r")).output == "1000000\nroot\n"


async def test_bad_input_gives_one_clear_error(overlay: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown sandbox backend 'nope'; known: docker, overlay"):
        async with open_sandbox(backend="nope"):
            pass
    with pytest.raises(SandboxUnavailableError, match="does not exist"):
        async with open_sandbox(base=str(tmp_path / "missing")):
            pass
    (tmp_path / "empty").mkdir()
    with pytest.raises(SandboxUnavailableError, match="no /bin/sh"):
        async with open_sandbox(base=str(tmp_path / "empty")):
            pass
    with pytest.raises(SandboxUnavailableError, match="aospec sandbox build-base debootstrap:nosuchsuite"):
        async with open_sandbox(base="debootstrap:nosuchsuite"):
            pass
    with pytest.raises(ConfigError, match="unknown key 'timeout'; did you mean 'timeout_s'"):
        SandboxConfig.from_mapping({"timeout": 3})
    with pytest.raises(ConfigError, match=r"limits\.pids must be positive"):
        SandboxConfig.from_mapping({"limits": {"pids": 0}})
    async with open_sandbox(SandboxConfig(backend=overlay, workdir="/no/such/dir")) as sb:
        with pytest.raises(SandboxError, match="working directory '/no/such/dir' does not exist"):
            await sb.run("true")


def test_missing_privileges_are_explained() -> None:
    problems = HostSupport(
        root=False, overlayfs=False, bwrap=None, cgroup_version=None, cgroup_controllers=()
    ).problems()
    assert any("needs root" in p for p in problems)
    assert any("overlayfs" in p for p in problems)
    assert any("apt-get install bubblewrap" in p for p in problems)
    unprivileged = HostSupport(
        root=True, overlayfs=True, bwrap="/usr/bin/bwrap", cgroup_version=None, cgroup_controllers=(), can_mount=False
    )
    assert unprivileged.problems() == [
        "mounting is not permitted here (an unprivileged container?); run with CAP_SYS_ADMIN"
    ]


def test_chain_helpers_are_exported() -> None:
    assert chain_version("0" * 32, b"\0" * 16) != "0" * 32


async def test_durable_state_keeps_the_committed_layers_on_disk(overlay: str, tmp_path: Path) -> None:
    cfg = SandboxConfig(backend=overlay, state_dir=str(tmp_path / "state"), durable=True)
    async with open_sandbox(cfg) as sb:
        await sb.run("echo root > /tmp/r")
        fork = await sb.fork()
        await fork.run("echo fork > /tmp/f")
        await sb.commit(fork)
        assert sb.store.head_layers and not any(lid.startswith("m") for lid in sb.store.head_layers)
        version = sb.version
    async with open_sandbox(cfg) as sb:
        assert sb.version == version
        assert (await sb.run("cat /tmp/r /tmp/f")).output == "root\nfork\n"


async def test_memory_layers_spill_to_disk_past_their_budget(overlay: str) -> None:
    cfg = SandboxConfig(backend=overlay, memory_layers_bytes=2 << 20)
    async with open_sandbox(cfg) as sb:
        for i in range(4):
            await sb.run(f"head -c 1000000 /dev/zero > /tmp/blob{i}")
        assert any(not lid.startswith("m") for lid in sb.store.head_layers)
        assert sum(sb.store.mem_bytes.get(lid, 0) for lid in sb.store.head_layers) <= 2 << 20
        assert (await sb.run("cat /tmp/blob* | wc -c")).output == "4000000\n"


async def test_cancelling_at_any_moment_leaves_no_process(overlay: str) -> None:
    import random

    import anyio

    rng = random.Random(7)
    async with open_sandbox(SandboxConfig(backend=overlay)) as sb:
        for _ in range(60):
            fork = await sb.fork()
            with anyio.move_on_after(rng.uniform(0, 0.012)):
                await fork.run("echo x > /tmp/x; sleep 5")
            await fork.discard()
            assert not marked_processes(f"aospec-{sb.store.id}-")
        assert (await sb.run("echo alive")).output == "alive\n"


async def test_a_hard_link_survives_a_change_in_a_later_command(overlay: str) -> None:
    """The root freezes its upper after every command, so the two names are in a lower
    layer when chmod copies one up: overlayfs's index keeps them one inode, and the other
    name is copied up with it before the upper becomes a layer."""
    async with open_sandbox(SandboxConfig(backend=overlay, timeout_s=20)) as sb:
        await sb.run("mkdir -p /w && echo seed > /w/a && ln /w/a /w/h")
        r = await sb.run("chmod 600 /w/a && stat -c '%i %h %a' /w/a /w/h")
        first, second = r.output.split("\n")[:2]
        assert first == second and first.split()[1:] == ["2", "600"]  # one inode, two links, the new mode
        # and still one inode once that upper is a layer itself
        r = await sb.run("stat -c '%i %h %a' /w/a /w/h; cp -a /w/h /w/a 2>&1; echo rc=$?")
        lines = r.output.split("\n")
        assert lines[0] == lines[1] and lines[0].split()[1:] == ["2", "600"]
        assert "are the same file" in lines[2] and lines[3] == "rc=1"


@pytest.mark.parametrize("config", ["memory", "disk"])
async def test_hard_links_behave_as_on_a_plain_filesystem_across_layers_and_forks(overlay: str, config: str) -> None:
    extra = {"memory_layers_bytes": 0, "limits": Limits(disk_bytes=None)} if config == "disk" else {}
    async with open_sandbox(SandboxConfig(backend=overlay, timeout_s=20, **extra)) as sb:
        await sb.run(
            "mkdir -p /w/d /v && echo one > /w/a && ln /w/a /w/d/h && ln /w/a /v/k && echo b > /w/b && ln /w/b /w/c && echo u > /w/u && ln /w/u /w/u2"
        )
        # a write through one name reaches the others, in the same command and after it
        r = await sb.run("echo two >> /w/a && cat /w/d/h /v/k")
        assert r.output == "one\ntwo\none\ntwo\n"
        assert (await sb.run("cat /w/d/h; stat -c %h /w/a /w/d/h /v/k")).output == "one\ntwo\n3\n3\n3\n"
        # a removed name leaves the other with one link, now and in later layers
        await sb.run("rm /w/b")
        assert (await sb.run("stat -c %h /w/c; cat /w/c")).output == "1\nb\n"
        # a setuid bit set through one name is on the others, and stays
        await sb.run("chmod 4755 /w/d/h")
        assert (await sb.run("stat -c %a /w/a /v/k")).output == "4755\n4755\n"
        # in a fork, committed: the same
        fork = await sb.fork()
        await fork.run("echo three > /v/k")
        await sb.commit(fork)
        assert (await sb.run("cat /w/a /w/d/h; stat -c %h /w/a")).output == "three\nthree\n3\n"
        # a group nobody touched is not copied up: its names stay one lower inode
        r = await sb.run("stat -c '%i %h' /w/u /w/u2")
        a, b = r.output.split("\n")[:2]
        assert a == b and a.endswith(" 2")
