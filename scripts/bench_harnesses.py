"""Third-party harnesses through aospec (issue 26 #4): a scripted task, served by
``aospec serve-trace`` in the harness's own format (chat-completions tool calls), run by
the harness with ``aospec mcp`` as its tool server, speculating vs not; the same final
files and the same requests seen upstream are checked, and the wall time is measured at
each TPOT.

Harnesses:

- ``openai-agents``: the OpenAI Agents SDK (``pip install openai-agents``) in
  chat-completions mode (``set_default_openai_api("chat_completions")``, tracing off), an
  ``OpenAIChatCompletionsModel`` on an ``AsyncOpenAI`` client pointed at serve-trace, the
  sandbox tools of ``aospec mcp`` through the SDK's ``MCPServerStdio``, and one function
  tool of its own (``count_words``, run in process).
- ``opencode``: ``opencode run`` (npm ``opencode-ai``), configured only by its
  opencode.json: serve-trace as an OpenAI-compatible provider, ``aospec mcp`` as its MCP
  server (serial: ``--no-speculate``, a local server; speculating: ``--http``, a remote
  one), HOME/XDG in a temporary directory, start-up fetches off (``OPENCODE_OFFLINE``).
- ``opencode-proxy``: the same with opencode's provider at ``aospec proxy`` (its own
  process, loopback, port 0; the proxy's token as opencode's API key) in front of
  serve-trace, ``aospec mcp --http`` as its tools, and the proxy's ``--mcp`` at that server
  (``--mcp-tool-prefix aospec_``, the prefix opencode gives the tools of its ``aospec``
  server: the proxy starts each ``aospec_bash``, ``aospec_read_file``, ... call in a fork as
  soon as its reply holds it; ``--no-prefetch`` leaves that off). It shares its serial runs
  with ``opencode``.

Usage (root and overlayfs, for the sandbox)::

  .venv/bin/python scripts/bench_harnesses.py [--harness H,...] [--tpot-ms 20,10,1] [--repeats 3] [--json]

Each row: the median wall time of the task without speculation (``aospec mcp
--no-speculate``: serial execution, the reference) and with it (``aospec mcp
--train-traces`` of the task's own recorded trajectory: the history action drafter, so
every call the model makes next is a prediction -- an upper bound on the hit rate; for
``opencode-proxy``, the same behind the proxy), and the saving; each row also carries
(``--json``) the speculating MCP server's calls, speculations and hits (its ``/metrics``;
the Agents SDK's stdio server: its ``--stats``) and ``opencode-proxy`` the proxy's counters.
A harness whose install is missing is skipped with one line (:func:`harness_missing`).
:func:`measure` makes the rows; ``scripts/bench_live.py --integrations`` uses it too.
Timing figures on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import anyio

AOSPEC = str(Path(sys.executable).with_name("aospec"))
HARNESSES = ("openai-agents", "opencode", "opencode-proxy")
#: The opencode release .ci/run installs (npm ``opencode-ai``) and the tests were run with.
OPENCODE_VERSION = "1.18.33"
#: What keeps opencode off the network at start-up (each checked to exist in its binary):
#: the models.dev list, default plugins from npm, the update check, LSP servers, sharing.
OPENCODE_OFFLINE = {
    "OPENCODE_DISABLE_MODELS_FETCH": "1",
    "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
    "OPENCODE_DISABLE_AUTOUPDATE": "1",
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    "OPENCODE_DISABLE_SHARE": "1",
}
#: The opencode.json ``mcp`` key of aospec's server, and so the prefix of its tools there.
OPENCODE_MCP_KEY = "aospec"
TASK = "Set up /tmp/a/conf, bump x to 10, leave a note, and show the final files."
#: Seconds each of the task's shell commands takes (a build or a test run, scaled down).
TOOL_S = 0.3
_S = f"sleep {TOOL_S}; "


def agents_calls(tool_s: float = TOOL_S) -> list[tuple[str, dict[str, Any]]]:
    """The task's tool calls, in order: MCP sandbox tools and the ``count_words`` function
    tool. The last call's result is the final files (``cat``)."""
    slow = f"sleep {tool_s}; " if tool_s > 0 else ""
    return [
        ("bash", {"command": f"{slow}mkdir -p /tmp/a && printf 'x=1\\ny=2\\n' > /tmp/a/conf"}),
        ("read_file", {"path": "/tmp/a/conf"}),
        ("count_words", {"text": "x=1 y=2"}),
        ("bash", {"command": f"{slow}grep -c = /tmp/a/conf"}),
        ("edit_file", {"path": "/tmp/a/conf", "old_str": "x=1", "new_str": "x=10"}),
        ("bash", {"command": f"{slow}grep -c = /tmp/a/conf"}),
        ("write_file", {"path": "/tmp/a/notes", "content": "x bumped\n"}),
        ("bash", {"command": f"{slow}cat /tmp/a/conf /tmp/a/notes"}),
    ]


#: What the last call prints when the task went right.
FINAL_FILES = "x=10\ny=2\nx bumped\n"


def agents_trace(tool_s: float = TOOL_S, output_tokens: int = 40) -> Any:
    """The scripted task as a trace serve-trace serves: one tool call per reply (with a
    short thought as its text), then a final answer without one."""
    from aospec.types import Action, Step, Trace

    steps = [
        Step(action=Action(name, args), observation="", output_tokens=output_tokens, reply=f"Next: {name}.")
        for name, args in agents_calls(tool_s)
    ]
    steps.append(Step(action=Action.none(), observation="", output_tokens=output_tokens, reply="Done: x is 10."))
    return Trace("agents-sdk-task", "agents", "openai-agents", "serve-trace", "scripts", tuple(steps), instruction=TASK)


class RecordRequests:
    """An ASGI middleware keeping the body of every POST that reaches the app, as sent: what
    the upstream model server saw."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.bodies: list[bytes] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        body = b"".join(chunks)
        self.bodies.append(body)
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def run_agents_sdk(
    base_url: str,
    mcp_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    *,
    mcp_url: str | None = None,
    token: str | None = None,
    stderr_log: Path | None = None,
) -> dict[str, Any]:
    """One run of the task by the OpenAI Agents SDK: its model at ``base_url`` (serve-trace),
    its MCP server ``aospec mcp MCP_ARGS`` over stdio (environment ``env``; its stderr
    appended to ``stderr_log`` when given), or, with ``mcp_url``, a running ``aospec mcp
    --http`` over streamable HTTP (sending ``token``). Returns the final output, every tool
    output (the last: the final files) and the wall time of the task."""
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_default_openai_api,
        set_tracing_disabled,
    )
    from agents.mcp import MCPServerStdio, MCPServerStreamableHttp
    from openai import AsyncOpenAI

    set_default_openai_api("chat_completions")
    set_tracing_disabled(True)  # nothing leaves the host

    @function_tool
    def count_words(text: str) -> str:
        """Count the words of a text."""
        return str(len(text.split()))

    client = AsyncOpenAI(base_url=base_url, api_key="not-needed", max_retries=0)
    server: Any
    if mcp_url is not None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        server = MCPServerStreamableHttp(
            params={"url": mcp_url, "headers": headers, "timeout": 300, "sse_read_timeout": 300},
            name="aospec",
            client_session_timeout_seconds=300,
        )
    else:
        command, cmd_args = AOSPEC, ["mcp", *mcp_args]
        if stderr_log is not None:  # the same process (exec), its stderr (--stats) kept
            keep = 'log=$1; shift; exec "$@" 2>>"$log"'
            command, cmd_args = "/bin/sh", ["-c", keep, "sh", str(stderr_log), AOSPEC, *cmd_args]
        params = {"command": command, "args": cmd_args, "env": env if env is not None else dict(os.environ)}
        server = MCPServerStdio(params=params, name="aospec", client_session_timeout_seconds=300)  # type: ignore[arg-type]
    async with server:
        t0 = time.monotonic()  # the task, not the server's start (a sandbox made once per session)
        agent = Agent(
            name="worker",
            instructions="You are a careful engineer. Use the tools.",
            model=OpenAIChatCompletionsModel(model="serve-trace", openai_client=client),
            tools=[count_words],
            mcp_servers=[server],
        )
        result = await Runner.run(agent, TASK, max_turns=len(agents_calls()) + 2)
        wall = time.monotonic() - t0
    await client.close()
    outputs = [item.output for item in result.new_items if type(item).__name__ == "ToolCallOutputItem"]
    return {"final_output": result.final_output, "tool_outputs": outputs, "wall_s": wall}


# -- opencode ------------------------------------------------------------------------------


def opencode_trace(tool_s: float = TOOL_S, output_tokens: int = 40) -> Any:
    """The task for opencode: the MCP calls of :func:`agents_calls` under the names opencode
    gives an MCP server's tools (``SERVER_TOOL``: ``aospec_bash``, ...)."""
    from aospec.integrations._proxy_actions import opencode_tool_prefix

    from aospec.types import Action, Step, Trace

    prefix = opencode_tool_prefix(OPENCODE_MCP_KEY)
    steps = [
        Step(action=Action(prefix + name, args), observation="", output_tokens=output_tokens, reply=f"Next: {name}.")
        for name, args in agents_calls(tool_s)
        if name != "count_words"
    ]
    steps.append(Step(action=Action.none(), observation="", output_tokens=output_tokens, reply="Done: x is 10."))
    return Trace("opencode-task", "agents", "opencode", "serve-trace", "scripts", tuple(steps), instruction=TASK)


def opencode_config(base_url: str, mcp: dict[str, Any], api_key: str = "not-needed") -> dict[str, Any]:
    """opencode.json: serve-trace (or ``aospec proxy`` in front of it) at ``base_url`` as an
    OpenAI-compatible provider (the provider package ``@ai-sdk/openai-compatible`` is built
    into opencode; it sends ``api_key`` as ``Authorization: Bearer``), ``mcp`` as its one MCP
    server, and its own file and shell tools off, so every tool call goes through aospec."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "servetrace": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "serve-trace",
                "options": {"baseURL": base_url, "apiKey": api_key},
                "models": {"serve-trace": {"name": "serve-trace"}},
            }
        },
        "model": "servetrace/serve-trace",
        "small_model": "servetrace/serve-trace",
        "mcp": {OPENCODE_MCP_KEY: mcp},
        "tools": {
            name: False for name in ("bash", "edit", "write", "read", "patch", "glob", "grep", "list", "webfetch")
        },
        "autoupdate": False,
        "share": "disabled",
    }


def run_opencode(
    base_url: str, mcp: dict[str, Any], work: Path, env: dict[str, str] | None = None, *, api_key: str = "not-needed"
) -> dict[str, Any]:
    """One headless ``opencode run`` of the task in ``work`` (its project directory and its
    HOME/XDG directories, emptied first: a directory this function made), with the MCP
    server ``mcp`` (opencode's ``mcp`` entry: ``local`` or ``remote``) and its provider's
    API key ``api_key`` (the token of an ``aospec proxy`` at ``base_url``). Returns the tool
    outputs, the final text, the task's wall time (``wall_s``, from opencode's first event to
    its last) and the process's (``process_s``, start-up included)."""
    import shutil
    import subprocess

    if work.exists():
        shutil.rmtree(work)
    project, home = work / "project", work / "home"
    project.mkdir(parents=True)
    home.mkdir()
    (project / "opencode.json").write_text(json.dumps(opencode_config(base_url, mcp, api_key), indent=2))
    run_env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local/share"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_STATE_HOME": str(home / ".local/state"),
        **OPENCODE_OFFLINE,
        **(env or {}),
    }
    t0 = time.monotonic()
    r = subprocess.run(
        ["opencode", "run", "--format", "json", TASK],
        cwd=project,
        env=run_env,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    wall = time.monotonic() - t0
    if r.returncode != 0:
        raise RuntimeError(f"opencode run exited {r.returncode}: {r.stderr.strip()[-2000:]}")
    events = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    tools = [e["part"] for e in events if e.get("type") == "tool_use"]
    texts = [e["part"]["text"] for e in events if e.get("type") == "text"]
    stamps = [e["timestamp"] for e in events if isinstance(e.get("timestamp"), int | float)]
    return {
        "tool_outputs": [(t["tool"], t["state"]["status"], t["state"].get("output")) for t in tools],
        "final_output": texts[-1] if texts else None,
        # the task: from opencode's first event (the first reply's start) to its last (ms
        # stamps), without its own start-up, which varies by seconds from run to run
        "wall_s": (stamps[-1] - stamps[0]) / 1000 if len(stamps) > 1 else wall,
        "process_s": wall,
    }


@contextmanager
def aospec_server(argv: Sequence[str], log: Path, marker: str, env: dict[str, str]) -> Iterator[str]:
    """Run ``aospec ARGV`` (a server on loopback, port 0) with stdout and stderr to ``log``
    until the block ends; yields the address it prints after ``marker`` (``aospec mcp
    --http``: ``listening on URL`` on stderr; ``aospec proxy``: ``aospec proxy at URL`` on
    stdout)."""
    import subprocess

    with log.open("wb") as out:
        proc = subprocess.Popen(
            [AOSPEC, *argv], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env
        )
    try:
        url = None
        for _ in range(3000):
            if marker in (text := log.read_text()):
                url = text.split(marker, 1)[1].split()[0]
                break
            if proc.poll() is not None:
                raise RuntimeError(f"aospec {argv[0]} did not start: {text}")
            time.sleep(0.1)
        if url is None:
            raise RuntimeError(f"aospec {argv[0]} printed no {marker!r} in 300 s: {log.read_text()}")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def mcp_metrics(url: str, token: str) -> dict[str, float]:
    """The request and speculation counters of the ``aospec mcp --http`` server at ``url``."""
    import httpx

    scraped = httpx.get(url.removesuffix("/mcp") + "/metrics", headers={"Authorization": f"Bearer {token}"})
    scraped.raise_for_status()
    return {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in scraped.text.splitlines()
        if line.startswith(
            ("aospec_requests_total", "aospec_speculations_launched_total", "aospec_speculations_hit_total")
        )
    }


#: The modes :func:`compare_opencode` runs: serial (the reference), ``aospec mcp --http``
#: speculating, and the same behind ``aospec proxy`` as opencode's provider.
OPENCODE_MODES = ("serial", "aospec", "proxy")


def compare_opencode(
    tpot_ms: float,
    tmp: Path,
    *,
    repeats: int = 1,
    modes: Sequence[str] = ("serial", "aospec"),
    prefetch: bool = True,
) -> dict[str, Any]:
    """opencode on the task, each of ``modes`` ``repeats`` times: ``serial`` (``aospec mcp
    --no-speculate`` as a local MCP server it starts; the reference), ``aospec`` (``aospec
    mcp --http`` as a remote one, with the task's recorded trajectory as training traces)
    and ``proxy`` (that server, and opencode's provider at an ``aospec proxy`` in front of
    serve-trace, with the proxy's token as its API key; with ``prefetch``, ``--mcp`` at the
    same server and ``--mcp-tool-prefix aospec_``: the proxy starts each call of that
    server's tools in a fork as its reply streams). Returns what each run saw (tool outputs, the
    requests serve-trace got, sorted: opencode's title request runs beside the first one),
    the speculating server's metrics, the proxy's ``/aospec/stats``, and the median wall
    time of each mode (``MODE_s``)."""
    import httpx
    from aospec.integrations._proxy_actions import opencode_tool_prefix
    from aospec.live.serve_trace import serve_trace_app, serving

    if "serial" not in modes or not set(modes) <= set(OPENCODE_MODES):
        raise ValueError(f"modes: serial and any of {OPENCODE_MODES[1:]}, got {modes}")
    args = mcp_modes(tmp)
    out: dict[str, Any] = {mode: [] for mode in modes}
    for _ in range(repeats):
        for mode in modes:
            recorder = RecordRequests(serve_trace_app([opencode_trace()], tpot_ms))
            if mode == "serial":
                with serving(recorder) as server:
                    local = {"type": "local", "command": [AOSPEC, "mcp", *args["serial"]], "enabled": True}
                    if "AOSPEC_STATE_ROOT" in os.environ:
                        local["environment"] = {"AOSPEC_STATE_ROOT": os.environ["AOSPEC_STATE_ROOT"]}
                    run = run_opencode(server.base_url, local, tmp / "opencode")
                out[mode].append({**run, "requests": sorted(b.decode() for b in recorder.bodies)})
                continue
            token = "bench-" + os.urandom(8).hex()
            mcp_env = {**os.environ, "AOSPEC_TOKEN": token}
            with (
                aospec_server(
                    ["mcp", "--http", "0", *args["aospec"]], tmp / "mcp-http.log", "listening on ", mcp_env
                ) as url,
                serving(recorder) as server,
            ):
                remote = {
                    "type": "remote",
                    "url": url,
                    "headers": {"Authorization": f"Bearer {token}"},
                    "enabled": True,
                }
                extra: dict[str, Any] = {}
                if mode == "aospec":
                    run = run_opencode(server.base_url, remote, tmp / "opencode")  # the same path: it is in the prompt
                else:
                    proxy_token = "bench-proxy-" + os.urandom(8).hex()
                    proxy_args = ["proxy", "--upstream", server.base_url, "--port", "0"]
                    if prefetch:
                        prefix = opencode_tool_prefix(OPENCODE_MCP_KEY)
                        proxy_args += ["--mcp", url, "--mcp-tool-prefix", prefix]
                    proxy_env = {**os.environ, "AOSPEC_TOKEN": proxy_token, "AOSPEC_MCP_TOKEN": token}
                    with aospec_server(proxy_args, tmp / "proxy.log", "aospec proxy at ", proxy_env) as proxy_url:
                        run = run_opencode(proxy_url, remote, tmp / "opencode", api_key=proxy_token)
                        got = httpx.get(
                            proxy_url.removesuffix("/v1") + "/aospec/stats",
                            headers={"Authorization": f"Bearer {proxy_token}"},
                        )
                        got.raise_for_status()
                        extra["proxy_stats"] = got.json()
                metrics = mcp_metrics(url, token)
            out[mode].append(
                {**run, "requests": sorted(b.decode() for b in recorder.bodies), "metrics": metrics, **extra}
            )
    first = out["serial"][0]
    reference = (first["tool_outputs"], first["final_output"], first["requests"])
    out["identical_by_mode"] = {
        mode: all((r["tool_outputs"], r["final_output"], r["requests"]) == reference for r in out[mode])
        for mode in modes
    }
    out["identical"] = all(out["identical_by_mode"].values())
    for mode in modes:
        out[f"{mode}_s"] = statistics.median(r["wall_s"] for r in out[mode])
    return out


def _train_file(tmp: Path, tool_s: float) -> Path:
    from aospec.replay import write_jsonl

    path = tmp / "agents-train.jsonl"
    write_jsonl([agents_trace(tool_s)], path)
    return path


def mcp_modes(tmp: Path, tool_s: float = TOOL_S) -> dict[str, list[str]]:
    """The two ``aospec mcp`` argument lists compared: serial and speculating."""
    slow_ok = ["--timeout", "600"]
    return {
        "serial": [*slow_ok, "--no-speculate", "--stats"],
        "aospec": [*slow_ok, "--train-traces", str(_train_file(tmp, tool_s)), "--stats"],
    }


def _mcp_stats(stderr_log: Path) -> dict[str, Any]:
    """The counters ``aospec mcp --stats`` printed last in ``stderr_log`` (``{}``: none)."""
    import ast

    text = stderr_log.read_text() if stderr_log.exists() else ""
    lines = [ln for ln in text.splitlines() if ln.startswith("aospec mcp: {")]
    return ast.literal_eval(lines[-1].removeprefix("aospec mcp: ")) if lines else {}


def measure_agents_sdk(tpot: float, repeats: int, tmp: Path) -> dict[str, Any]:
    """The OpenAI Agents SDK row at ``tpot``: median wall times, whether every run agreed,
    and the speculating server's calls, speculations and calls served from forks (its last
    run's ``--stats``)."""
    from aospec.live.serve_trace import serve_trace_app, serving

    modes = mcp_modes(tmp)
    walls: dict[str, list[float]] = {m: [] for m in modes}
    reference = None
    agree = True
    stats: dict[str, Any] = {}
    for _ in range(repeats):
        for mode, args in modes.items():
            recorder = RecordRequests(serve_trace_app([agents_trace()], tpot))
            log = tmp / f"agents-mcp-{mode}.log"
            log.unlink(missing_ok=True)
            with serving(recorder) as server:
                out = anyio.run(partial(run_agents_sdk, server.base_url, args, dict(os.environ), stderr_log=log))
            walls[mode].append(out["wall_s"])
            key = (out["final_output"], json.dumps(out["tool_outputs"]), tuple(recorder.bodies))
            reference = reference or key
            agree &= key == reference
            if mode == "aospec":
                stats = _mcp_stats(log)
    serial, spec = statistics.median(walls["serial"]), statistics.median(walls["aospec"])
    row = _row("openai-agents", tpot, repeats, serial, spec, agree)
    if stats:
        row |= {"mcp_calls": stats["calls"], "mcp_launched": stats["launched"], "mcp_hits": stats["served_speculated"]}
    return row


def _row(harness: str, tpot: float, repeats: int, serial: float, spec: float, agree: bool) -> dict[str, Any]:
    return {
        "harness": harness,
        "tpot_ms": tpot,
        "repeats": repeats,
        "serial_s": round(serial, 3),
        "aospec_s": round(spec, 3),
        "saving": round(1 - spec / serial, 4),
        "identical": agree,
    }


def _speculation(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What aospec did in an opencode mode's runs (the last run's counters): the MCP server's
    calls, speculations and hits, and the proxy's requests, speculative requests, hits and
    prefetched actions."""
    last = runs[-1]
    m, p = last.get("metrics", {}), last.get("proxy_stats")
    out: dict[str, Any] = {}
    if m:
        out["mcp_calls"] = int(m.get("aospec_requests_total", 0))
        out["mcp_launched"] = int(sum(v for k, v in m.items() if k.startswith("aospec_speculations_launched_total")))
        out["mcp_hits"] = int(sum(v for k, v in m.items() if k.startswith("aospec_speculations_hit_total")))
    if p:
        out |= {
            f"proxy_{k}": p[k]
            for k in ("chat_requests", "speculable", "speculated", "hits", "actions_prefetched", "prefetch_refused")
        }
    return out


def harness_missing(harness: str) -> str | None:
    """Why ``harness`` cannot run here (its install is missing: one line naming it), or None."""
    import importlib.util
    import shutil

    if harness == "openai-agents" and importlib.util.find_spec("agents") is None:
        return "the OpenAI Agents SDK is not installed (pip install openai-agents)"
    if harness in ("opencode", "opencode-proxy") and shutil.which("opencode") is None:
        return f"opencode is not installed (npm install -g opencode-ai@{OPENCODE_VERSION}; .ci/run installs it)"
    return None


def measure(
    which: Sequence[str], tpot: float, repeats: int, tmp: Path, *, prefetch: bool = True, log: Any = None
) -> list[dict[str, Any]]:
    """The rows of ``which`` (of :data:`HARNESSES`) at ``tpot``, ``repeats`` runs per mode
    each (the median kept); ``opencode`` and ``opencode-proxy`` share their serial runs.
    ``log(row)`` is called as each row is done."""
    rows = []
    if "openai-agents" in which:
        rows.append(measure_agents_sdk(tpot, repeats, tmp))
        if log is not None:
            log(rows[-1])
    opencode = {"opencode": "aospec", "opencode-proxy": "proxy"}
    if wanted := [h for h in which if h in opencode]:
        modes = ("serial", *(opencode[h] for h in wanted))
        o = compare_opencode(tpot, tmp, repeats=repeats, modes=modes, prefetch=prefetch)
        for h in wanted:
            mode = opencode[h]
            row = _row(h, tpot, repeats, o["serial_s"], o[f"{mode}_s"], o["identical_by_mode"][mode])
            rows.append(row | _speculation(o[mode]))
            if log is not None:
                log(rows[-1])
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--harness", default="all", help=f"comma-separated: {', '.join(HARNESSES)}, or all (default)")
    ap.add_argument("--tpot-ms", default="20,10,1", help="comma-separated TPOTs (default 20,10,1)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per mode and TPOT (default 3; the median is kept)")
    ap.add_argument(
        "--check",
        action="store_true",
        help="opencode only: one run per mode at the first TPOT, everything each saw printed as JSON (the test's driver)",
    )
    ap.add_argument(
        "--proxy",
        action="store_true",
        help="with --check: serial and through aospec proxy (the proxy mode) instead of serial and aospec mcp --http",
    )
    ap.add_argument(
        "--no-prefetch",
        action="store_true",
        help="opencode through the proxy: without --mcp (no action prefetch; observation speculation only)",
    )
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    try:
        tpots = [float(t) for t in args.tpot_ms.split(",")]
    except ValueError:
        ap.error(f"--tpot-ms: not a list of numbers: {args.tpot_ms!r}")
    which = HARNESSES if args.harness == "all" else tuple(args.harness.split(","))
    if unknown := [h for h in which if h not in HARNESSES]:
        ap.error(f"--harness: unknown {', '.join(unknown)}; have {', '.join(HARNESSES)}")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    with tempfile.TemporaryDirectory(prefix="aospec-bench-harness-") as tmp:
        prefetch = not args.no_prefetch
        if args.check:
            modes = ("serial", "proxy") if args.proxy else ("serial", "aospec")
            print(json.dumps(compare_opencode(tpots[0], Path(tmp), modes=modes, prefetch=prefetch), indent=2))
            return 0
        rows = []
        for h in [h for h in which if harness_missing(h)]:
            print(f"skip {h}: {harness_missing(h)}", file=sys.stderr)
        present = [h for h in which if not harness_missing(h)]
        for tpot in tpots:
            rows += measure(
                present,
                tpot,
                args.repeats,
                Path(tmp),
                prefetch=prefetch,
                log=lambda r: print(json.dumps(r), file=sys.stderr),
            )
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'harness':<14} {'TPOT ms':>7} {'serial s':>9} {'aospec s':>9} {'saving':>7} identical")
        for r in rows:
            print(
                f"{r['harness']:<14} {r['tpot_ms']:>7g} {r['serial_s']:>9.3f} {r['aospec_s']:>9.3f} "
                f"{r['saving']:>7.1%} {r['identical']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
