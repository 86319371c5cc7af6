"""Codex CLI (npm ``@openai/codex``, ``codex exec``) through ``aospec proxy``: a scripted task
served by ``serve-trace`` in the Responses API format (Codex's ``exec_command`` tool calls),
run once straight against serve-trace and once through the ``aospec proxy`` verb, Codex
configured only by its own settings (a custom model provider, ``wire_api = "responses"``,
no login, ``CODEX_HOME`` a fresh temporary directory). Both runs leave the same files in
the work directory and send the same requests upstream (less the ids and clocks Codex
draws per run). See docs/harness-codex.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aospec.live.serve_trace import serve_trace_app, serving

from aospec.types import Action, Step, Trace, canonical_json
from tests.integrations.conftest import AOSPEC
from tests.integrations.test_proxy_responses import Recorder

pytestmark = pytest.mark.skipif(
    shutil.which("codex") is None, reason="codex not installed (npm install -g @openai/codex; .ci/run does)"
)

TASK = "Write the greeting files and count their lines."
COMMANDS = [
    "mkdir -p out && echo hello > out/a.txt",
    "echo world > out/b.txt && cat out/a.txt out/b.txt",
    "cat out/*.txt | wc -l > out/count.txt",
]
TOKEN = "test-proxy-token"
#: What Codex draws afresh per run: ids (UUIDs), the turn's start time, a tool output's
#: chunk id and the command's wall time.
VOLATILE = [
    (re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"), b"<uuid>"),
    (re.compile(rb'(turn_started_at_unix_ms\\?"\s*:\s*)\d+'), rb"\1<t>"),
    (re.compile(rb"(Chunk ID: )[0-9a-f]+"), rb"\1<id>"),
    (re.compile(rb"(Wall time: )[0-9.]+( seconds?)"), rb"\1<s>\2"),
]


def codex_trace() -> Trace:
    # login false: bash -c, not a login shell, so the host's profile (a pyenv init that can
    # race with another shell's rehash and print into one run's output) is not part of the test
    steps = tuple(Step(Action("exec_command", {"cmd": c, "login": False}), "", 20) for c in COMMANDS)
    steps += (Step(Action.none(), "", 5, reply="Done: out/count.txt holds 2."),)
    return Trace("codex-greeting", TASK, "test", "m", "test", steps, instruction=TASK)


def normalised(body: bytes) -> str:
    for pattern, repl in VOLATILE:
        body = pattern.sub(repl, body)
    return canonical_json(json.loads(body))


def first_difference(a: list[str], b: list[str]) -> str:
    """Where two request lists first differ, as a short diff of the requests' JSON."""
    import difflib

    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    if i == min(len(a), len(b)):
        return f"{len(a)} requests vs {len(b)}"
    lines = [json.dumps(json.loads(x), indent=1, sort_keys=True).splitlines() for x in (a[i], b[i])]
    return f"request {i}:\n" + "\n".join(list(difflib.unified_diff(*lines, lineterm="", n=1))[:60])


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def run_codex(base_url: str, root: Path, api_key: str) -> dict[str, bytes]:
    """``codex exec`` on TASK in ``root/work`` (a fresh work directory and CODEX_HOME at the
    same paths each run), its provider at ``base_url``; the files it left."""
    work, home = root / "work", root / "codex-home"
    for d in (work, home):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    provider = f'{{name="aospec", base_url="{base_url}", wire_api="responses", env_key="AOSPEC_TEST_KEY"}}'
    cmd = ["codex", "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
           "-c", "model_provider=aospec", "-c", f"model_providers.aospec={provider}", "-m", "m", TASK]  # fmt: skip
    env = {**os.environ, "CODEX_HOME": str(home), "AOSPEC_TEST_KEY": api_key, "NO_COLOR": "1"}
    r = subprocess.run(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-3000:]
    return files_of(work)


@pytest.fixture
def proxy_cli(tmp_path: Path) -> Iterator[Any]:
    """Start ``aospec proxy --upstream URL --port 0`` (its token from a file); yields a
    function returning its API root. The process is stopped with SIGTERM and must exit 0."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(upstream: str) -> str:
        (tmp_path / "token").write_text(TOKEN)
        log = tmp_path / "proxy.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [AOSPEC, "proxy", "--upstream", upstream, "--port", "0", "--token-file", str(tmp_path / "token")],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        procs.append(proc)
        for _ in range(600):  # bounded wait for the "aospec proxy at URL" line
            text = log.read_text()
            if "aospec proxy at " in text:
                return text.split("aospec proxy at ", 1)[1].split()[0]
            assert proc.poll() is None, text
            subprocess.run(["sleep", "0.1"], check=True)
        raise AssertionError(f"aospec proxy did not start: {log.read_text()}")

    try:
        yield start
    finally:
        for proc in procs:
            proc.terminate()
            assert proc.wait(timeout=60) == 0


def test_codex_same_files_and_requests(tmp_path: Path, proxy_cli: Any) -> None:
    trace = codex_trace()
    direct_up = Recorder(serve_trace_app([trace], 1.0))
    with serving(direct_up) as up:
        direct = run_codex(up.base_url, tmp_path, "sk-direct")
    proxied_up = Recorder(serve_trace_app([trace], 1.0))
    with serving(proxied_up) as up:
        base = proxy_cli(up.base_url)
        via = run_codex(base, tmp_path, TOKEN)
        stats = httpx.get(base.removesuffix("/v1") + "/aospec/stats", headers={"Authorization": f"Bearer {TOKEN}"})
    assert direct == via
    assert direct["out/count.txt"] == b"2\n" and direct["out/a.txt"] == b"hello\n"
    # the proxy's own start-up probe (GET /v1/models) aside, upstream sees Codex's requests
    sent = [normalised(b) for p, b in direct_up.requests if p == "/v1/responses"]
    assert len(sent) == len(direct_up.requests) == len(trace.steps)
    got = [normalised(b) for p, b in proxied_up.requests if p == "/v1/responses"]
    assert got == sent, first_difference(sent, got)
    # Codex sends no temperature (the API's default samples) and draws a new id for every
    # tool output: nothing is speculable, every request passes through
    s = stats.json()
    assert s["chat_requests"] == len(trace.steps) and s["speculable"] == 0 and s["speculated"] == 0
