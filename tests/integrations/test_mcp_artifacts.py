"""``aospec mcp --artifacts``: large results out of band through shared memory (issue 13),
read with the official SDK client plus specbox's consumers (``McpEnv``, ``ArtifactClient``)
against a real server over stdio and streamable HTTP. Needs root and overlayfs."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from aospec.specbox.mcp_env import McpEnv, artifact_ref_of
from aospec.specbox.transport import INLINE_THRESHOLD, ArtifactClient, ArtifactRef, UnknownTokenError

pytestmark = pytest.mark.anyio

TRANSPORTS = ["stdio", "http"]
SLOW_OK = ["--command-timeout", "600"]
AOSPEC = str(Path(sys.executable).with_name("aospec"))

#: A UTF-8 text file of 200000 bytes (over the inline threshold, under read_file's 1 MiB).
TEXT_SIZE = 200_000
TEXT = (b"abcdefghij\n" * (TEXT_SIZE // 11 + 1))[:TEXT_SIZE]
#: Makes /w/text (TEXT), /w/small, /w/bin (3 MB of random bytes: not UTF-8, over 1 MiB) and
#: /w/esc, a symlink aimed at a host path (it must resolve inside the sandbox, where that
#: path does not exist); prints /w/bin's md5.
SETUP = (
    "mkdir -p /w && yes abcdefghij | head -c 200000 > /w/text && printf 'hi\\n' > /w/small"
    " && head -c 3000000 /dev/urandom > /w/bin && ln -s /../../../../{host}/secret /w/esc && md5sum < /w/bin"
)


def _memfds(pid: int | str = "self") -> list[str]:
    """The aospec artifact memfds process ``pid`` has open."""
    out = []
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(fd_dir / fd)
        except OSError:
            continue
        if target.startswith("/memfd:aospec-"):
            out.append(target)
    return out


def _shm() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith("aospec-")}


def _artifact_stats(result: Any) -> dict[str, int]:
    return result.meta["aospec"]["artifacts"]


async def _call(session: Any, name: str, args: dict[str, Any]) -> Any:
    return await session.call_tool(name, args, read_timeout_seconds=300)


async def _setup(session: Any, tmp_path: Path) -> str:
    (tmp_path / "secret").write_text("host secret\n")
    r = await _call(session, "bash", {"command": SETUP.format(host=tmp_path)})
    assert not r.is_error and "[exit status" not in r.content[0].text, r.content
    return r.content[0].text.split()[0]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_large_results_are_taken_zero_copy_and_small_ones_stay_inline(
    mcp_state_root: Path, mcp_connect: Any, transport: str, tmp_path: Path
) -> None:
    env = {"AOSPEC_STATE_ROOT": str(mcp_state_root)}
    async with mcp_connect([*SLOW_OK, "--artifacts", "--no-speculate"], transport, env=env) as session:
        tools = {t.name: t for t in (await session.list_tools()).tools}
        assert list(tools) == ["bash", "read_file", "write_file", "edit_file", "export_file"]
        assert tools["export_file"].annotations.read_only_hint is True
        bin_md5 = await _setup(session, tmp_path)
        mcp = McpEnv(session, tuple(tools))  # C's consumer, attached to the running server
        try:
            with await mcp.call("read_file", {"path": "/w/text"}) as got:
                ref = artifact_ref_of(got.result)
                assert ref is not None and not ref.is_inline and ref.size == TEXT_SIZE
                assert got.view.readonly and got.view == TEXT
            with await mcp.call("bash", {"command": "cat /w/text"}) as got:
                assert got.artifact is not None and got.view == TEXT
            with await mcp.call("export_file", {"path": "/w/bin"}) as got:
                assert got.size == 3_000_000 and hashlib.md5(got.view).hexdigest() == bin_md5
            with await mcp.call("export_file", {"path": "small"}) as got:  # relative to /: missing
                assert got.is_error and "No such file" in got.text
            # small outputs: read_file and bash are the usual text; a small export is an inline ref
            with await mcp.call("read_file", {"path": "/w/small"}) as got:
                assert got.artifact is None and artifact_ref_of(got.result) is None and got.text == "hi\n"
            with await mcp.call("bash", {"command": "cat /w/small; exit 2"}) as got:
                assert got.artifact is None and got.text == "hi\n[exit status 2]"
            with await mcp.call("export_file", {"path": "/w/small"}) as got:
                ref = artifact_ref_of(got.result)
                assert ref is not None and ref.is_inline and got.tobytes() == b"hi\n"
            # read_file's own rules are unchanged: not UTF-8 (and over 1 MiB) is still an error
            with await mcp.call("read_file", {"path": "/w/bin"}) as got:
                assert got.is_error and "over the 1048576-byte limit" in got.text
            r = await _call(session, "bash", {"command": "true"})
            stats = _artifact_stats(r)
            assert stats["published"] == 3 and stats["opened"] == 3 and stats["live"] == 0
            assert _memfds() == []  # the consumer unmapped and closed every artifact
        finally:
            mcp._close()


async def test_a_path_escape_is_the_same_tool_error_as_read_files(
    mcp_state_root: Path, mcp_connect: Any, tmp_path: Path
) -> None:
    tool = "export_file"
    env = {"AOSPEC_STATE_ROOT": str(mcp_state_root)}
    async with mcp_connect([*SLOW_OK, "--artifacts", "--no-speculate"], env=env) as session:
        await _setup(session, tmp_path)
        errors = {}
        for name in ("read_file", tool):
            for path in ("/w/esc", f"../../../../{tmp_path}/secret"):
                r = await _call(session, name, {"path": path})
                assert r.is_error and artifact_ref_of(r) is None
                assert "host secret" not in r.content[0].text
                errors[name, path] = r.content[0].text.removeprefix(f"{name}: ")
        assert errors["read_file", "/w/esc"] == errors[tool, "/w/esc"]
        assert "No such file" in errors[tool, "/w/esc"]
        assert errors[tool, f"../../../../{tmp_path}/secret"] == errors["read_file", f"../../../../{tmp_path}/secret"]


async def test_an_export_over_the_cap_is_a_tool_error(mcp_state_root: Path, mcp_connect: Any) -> None:
    env = {"AOSPEC_STATE_ROOT": str(mcp_state_root)}
    async with mcp_connect([*SLOW_OK, "--artifacts", "--max-artifact-mb", "1"], env=env) as session:
        await _call(
            session, "bash", {"command": "head -c 1048577 /dev/zero > /tmp/z; head -c 1048576 /dev/zero > /tmp/y"}
        )
        r = await _call(session, "export_file", {"path": "/tmp/z"})
        assert r.is_error and r.content[0].text == (
            "export_file: /tmp/z is 1048577 bytes, over the 1048576-byte limit (--max-artifact-mb)"
        )
        r = await _call(session, "export_file", {"path": "/tmp/y"})
        ref = artifact_ref_of(r)
        assert ref is not None and ref.size == 1 << 20
        with ArtifactClient(ref.address) as client, client.take(ref) as artifact:
            assert artifact.view == bytes(1 << 20)


async def test_held_artifacts_are_bounded_by_max_held_mb(mcp_state_root: Path, mcp_connect: Any) -> None:
    """Three exports of a 500 MB file held 1.5 GB of shared memory for the TTL (issue 20 #7):
    the oldest untaken export makes room; when every held one is being read, the export
    is a tool error naming the limit."""
    env = {"AOSPEC_STATE_ROOT": str(mcp_state_root)}
    async with mcp_connect([*SLOW_OK, "--artifacts", "--no-speculate", "--max-held-mb", "1.5"], env=env) as session:
        await _call(session, "bash", {"command": "head -c 600000 /dev/zero > /tmp/z"})
        refs = [artifact_ref_of(await _call(session, "export_file", {"path": "/tmp/z"})) for _ in range(3)]
        stats = _artifact_stats(await _call(session, "bash", {"command": ":"}))
        assert stats["live"] == 2 and stats["evicted"] == 1 and stats["live_bytes"] == 1_200_000
        client = ArtifactClient(refs[2].address)  # type: ignore[union-attr]
        with pytest.raises(UnknownTokenError):
            client.open(refs[0])  # type: ignore[arg-type]  # the oldest went first
        held = [client.open(r) for r in refs[1:]]  # type: ignore[arg-type]
        r = await _call(session, "export_file", {"path": "/tmp/z"})
        text = r.content[0].text
        assert r.is_error and "1572864-byte limit on held artifacts" in text and "(--max-held-mb raises it)" in text
        for artifact in held:
            artifact.close()
        client.close()


async def test_speculated_results_are_served_and_leak_no_artifact(
    mcp_state_root: Path, mcp_connect: Any, tmp_path: Path
) -> None:
    """The default predictor re-runs recent read-only calls (export_file included) in forks;
    writes between them leave stale forks that are discarded. Only returned results are
    published, and every one comes back once the client closes it."""
    env = {"AOSPEC_STATE_ROOT": str(mcp_state_root)}
    async with mcp_connect([*SLOW_OK, "--artifacts", "--speculate", "3"], env=env) as session:
        bin_md5 = await _setup(session, tmp_path)
        mcp = McpEnv(session, ())
        served, out_of_band = [], 0
        try:
            for i in range(4):
                for name, args in [("export_file", {"path": "/w/bin"}), ("read_file", {"path": "/w/text"})]:
                    with await mcp.call(name, args) as got:
                        assert got.artifact is not None and not got.is_error
                        out_of_band += 1
                        if name == "read_file":
                            assert got.view == (TEXT[:-2] + f"{i:02d}".encode() if i else TEXT)
                        else:
                            assert hashlib.md5(got.view).hexdigest() == bin_md5
                        served.append(got.result.meta["aospec"]["speculated"])
                # a write moves the version: every fork still live is stale, and discarded
                await _call(session, "bash", {"command": f"printf '{i + 1:02d}' | dd of=/w/text bs=1 seek=199998"})
            r = await _call(session, "bash", {"command": "true"})
        finally:
            mcp._close()
    stats, meta = _artifact_stats(r), r.meta["aospec"]["stats"]
    assert any(served), "no call was served from a fork"
    assert meta["stale_discarded"] + meta["wasted"] > 0
    assert stats["published"] == out_of_band and stats["live"] == 0


async def test_a_consumer_that_goes_away_frees_what_it_held(mcp_state_root: Path, mcp_connect: Any) -> None:
    env = {"AOSPEC_STATE_ROOT": str(mcp_state_root)}
    before = _shm()
    async with mcp_connect([*SLOW_OK, "--artifacts", "--no-speculate"], env=env) as session:
        await _call(session, "bash", {"command": "head -c 500000 /dev/zero > /tmp/z"})
        refs = [artifact_ref_of(await _call(session, "export_file", {"path": "/tmp/z"})) for _ in range(3)]
        assert all(isinstance(ref, ArtifactRef) for ref in refs)
        client = ArtifactClient(refs[0].address)
        server_pid = client.ping(refs[2])
        held = [client.take(refs[0]), client.open(refs[1])]  # taken; opened (token kept)
        assert (
            len(_memfds(server_pid)) == 3
            and _artifact_stats(await _call(session, "bash", {"command": ":"}))["live"] == 3
        )
        client.release(refs[1])
        client.close()  # leases go with the connection; the mappings stay valid
        assert held[0].view[:4] == b"\0\0\0\0" and held[1].size == 500_000
        for artifact in held:
            artifact.close()
        with anyio.fail_after(60):  # the producer notices the closed connection in its own thread
            while _artifact_stats(await _call(session, "bash", {"command": ":"}))["live"] != 1:
                await anyio.sleep(0.05)
        assert len(_memfds(server_pid)) == 1  # refs[2]: published, never taken
    # the server is gone: nothing named in /dev/shm, no artifact descriptor left here
    assert not any(n.startswith(f"aospec-{server_pid}-") for n in _shm() - before) and _memfds() == []
    assert not Path(f"/proc/{server_pid}").exists() or _memfds(server_pid) == []


async def test_without_artifacts_nothing_changes(mcp_state_root: Path, mcp_connect: Any) -> None:
    env = {"AOSPEC_STATE_ROOT": str(mcp_state_root)}
    big = f"yes abcdefghij | head -c {4 * INLINE_THRESHOLD} > /tmp/big; cat /tmp/big"
    async with mcp_connect([*SLOW_OK, "--no-speculate"], env=env) as session:
        tools = [t.name for t in (await session.list_tools()).tools]
        r_bash = await _call(session, "bash", {"command": big})
        r_read = await _call(session, "read_file", {"path": "/tmp/big"})
        r_export = await _call(session, "export_file", {"path": "/tmp/big"})
    assert tools == ["bash", "read_file", "write_file", "edit_file"]
    expected = ("abcdefghij\n" * INLINE_THRESHOLD)[: 4 * INLINE_THRESHOLD]
    for r in (r_bash, r_read):
        assert r.content[0].text == expected and r.structured_content is None
        assert "artifacts" not in r.meta["aospec"]
    assert r_export.is_error and r_export.content[0].text == (
        "unknown tool 'export_file'; the tools are bash, edit_file, read_file, write_file"
    )


def test_artifact_options_need_artifacts_and_the_help_says_why() -> None:
    help_text = subprocess.run([AOSPEC, "mcp", "--help"], capture_output=True, text=True, check=True).stdout
    assert "--artifacts" in help_text and "Off by default" in help_text
    for argv, message in [
        (["--max-artifact-mb", "8"], "--max-artifact-mb: only with --artifacts"),
        (["--artifacts", "--upstream", "true"], "--artifacts applies to the sandbox tools"),
        (["--artifacts", "--artifact-threshold", "0"], "--artifact-threshold must be >= 1"),
    ]:
        p = subprocess.run([AOSPEC, "mcp", *argv], capture_output=True, text=True, stdin=subprocess.DEVNULL)
        assert p.returncode == 2 and message in p.stderr, p.stderr


def test_export_file_is_a_tool_only_with_artifacts() -> None:
    from aospec.integrations.mcp_server import ToolArgumentError, check_args, read_only

    from aospec.types import Action

    check_args("export_file", {"path": "x"}, export=True)
    with pytest.raises(ToolArgumentError, match="unknown tool 'export_file'; the tools are bash, edit_file, read"):
        check_args("export_file", {"path": "x"})
    with pytest.raises(ToolArgumentError, match="unknown argument"):
        check_args("export_file", {"path": "x", "mode": "b"}, export=True)
    assert read_only(Action("export_file", {"path": "x"}))
