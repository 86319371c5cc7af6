"""opencode through aospec (issue 26 #1): ``opencode run`` (npm ``opencode-ai``), configured
only by its own opencode.json -- serve-trace as an OpenAI-compatible provider
(``@ai-sdk/openai-compatible``, built into opencode), ``aospec mcp`` as its one MCP server,
its own bash/read/edit/write tools off -- with HOME and the XDG directories in a temporary
directory and the start-up fetches turned off (scripts/bench_harnesses.py,
``OPENCODE_OFFLINE``). The whole run is made in a network namespace that has only
loopback (``unshare -n``), so it proves opencode needs nothing off the host. Serial
(``aospec mcp --no-speculate``, a local server opencode starts) and speculating (``aospec
mcp --http``, a remote one) must give the same tool outputs, final files and requests
upstream, and the speculating one must serve calls from forks. Through ``aospec proxy``
as opencode's provider (in front of serve-trace; ``--mcp`` at the ``aospec mcp --http``
server opencode uses, ``--mcp-tool-prefix aospec_``) opencode must get the same again, the
proxy must have started every one of its calls in a fork as its reply streamed, and its
``/aospec/stats`` must count what it did. Needs root, overlayfs and opencode
(``.ci/run`` installs it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import bench_harnesses as bh  # noqa: E402  (the harness driver the bench measures)

if shutil.which("opencode") is None:
    pytest.skip(
        f"opencode is not installed: npm install -g opencode-ai@{bh.OPENCODE_VERSION} (.ci/run installs it)",
        allow_module_level=True,
    )


def _check_offline(mcp_state_root: Path, *flags: str) -> dict[str, Any]:
    """``scripts/bench_harnesses.py --check FLAGS`` in a network namespace with only
    loopback: what each mode's opencode run saw."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("the offline run needs root, unshare and ip (a network namespace with only loopback)")
    script = ROOT / "scripts" / "bench_harnesses.py"
    r = subprocess.run(
        [
            "unshare",
            "-n",
            "sh",
            "-c",
            'ip link set lo up && exec "$0" "$@"',
            sys.executable,
            str(script),
            "--check",
            "--tpot-ms",
            "2",
            *flags,
        ],
        env={**os.environ, "AOSPEC_STATE_ROOT": str(mcp_state_root)},
        capture_output=True,
        text=True,
        timeout=900,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


#: The task's MCP calls, as opencode names them (``SERVER_TOOL``).
CALLS = [f"aospec_{name}" for name, _ in bh.agents_calls() if name != "count_words"]


def _assert_serial_reference(serial: dict[str, Any]) -> None:
    assert [t[0] for t in serial["tool_outputs"]] == CALLS  # every call went to aospec mcp
    assert all(status == "completed" for _, status, _ in serial["tool_outputs"])
    assert serial["tool_outputs"][-1][2] == bh.FINAL_FILES  # the final files, as cat prints them
    assert serial["final_output"] == "Done: x is 10."
    # one request per reply, plus opencode's title request (served the first reply's text)
    assert len(serial["requests"]) == len(CALLS) + 2


def test_opencode_gets_the_same_result_through_aospec_offline(mcp_state_root: Path) -> None:
    seen = _check_offline(mcp_state_root)
    serial, spec = seen["serial"][0], seen["aospec"][0]
    _assert_serial_reference(serial)
    assert spec["tool_outputs"] == serial["tool_outputs"]
    assert spec["final_output"] == serial["final_output"]
    assert spec["requests"] == serial["requests"]  # byte for byte what the upstream saw
    assert seen["identical"] is True
    assert spec["metrics"]["aospec_requests_total"] == len(CALLS)
    assert spec["metrics"]['aospec_speculations_hit_total{kind="action"}'] >= 1  # calls served from forks


def test_opencode_gets_the_same_result_through_aospec_proxy_offline(mcp_state_root: Path) -> None:
    seen = _check_offline(mcp_state_root, "--proxy")
    serial, proxied = seen["serial"][0], seen["proxy"][0]
    _assert_serial_reference(serial)
    assert proxied["tool_outputs"] == serial["tool_outputs"]  # the final files included
    assert proxied["final_output"] == serial["final_output"]
    # what serve-trace received through the proxy, byte for byte what it received directly
    assert proxied["requests"] == serial["requests"]
    assert seen["identical"] is True
    stats = proxied["proxy_stats"]
    # every model request went through the proxy: the task's and the title's
    assert stats["chat_requests"] == len(CALLS) + 2
    assert stats["upstream_errors"] == stats["error_replies"] == stats["refused"] == 0
    # opencode sends no temperature or seed for this model, so no request is deterministic
    # enough to speculate: every one passes through, and nothing speculative went upstream
    assert stats["passthrough"] == stats["chat_requests"] and stats["speculable"] == 0
    assert stats["speculated"] == stats["hits"] == 0
    # --mcp with --mcp-tool-prefix aospec_ (opencode's names for its "aospec" server's
    # tools): every call, aospec_bash, aospec_read_file, aospec_edit_file and
    # aospec_write_file alike, was sent to the MCP server to start in a fork as its reply
    # streamed, and the server launched each
    assert stats["actions_prefetched"] == len(CALLS)
    assert stats["prefetch_refused"] == stats["prefetch_errors"] == 0
    assert proxied["metrics"]["aospec_requests_total"] == len(CALLS)
    assert proxied["metrics"]['aospec_speculations_hit_total{kind="action"}'] >= 1  # calls served from forks
