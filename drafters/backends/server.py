"""OpenAI-compatible servers of local models.

:class:`CompletionServer` is a small completions server over the transformers backend.
It answers ``POST /v1/completions`` (prompt, n, max_tokens, temperature, logprobs, stop,
seed) and ``GET /v1/models`` like vLLM's server does, which makes a trained drafter
reachable from another process and gives the ``openai`` backend a real endpoint in tests.
Run it with ``python -m aospec.drafters.backends.server --model OUT_DIR --port 8000``.

:func:`transformers_serve` runs Hugging Face's own ``transformers serve`` (chat
completions, streamed or not, the ``transformers[serving]`` extra of the ``models``
extra) on a model spec resolved by :func:`aospec.drafters.model.resolve_model` (``smollm2``
is converted once; the server cannot load the GGUF file itself), offline, on loopback:
the real endpoint of the actor in tests and ``aospec models serve``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from aospec.errors import ConfigError, MissingDependencyError

__all__ = ["OFFLINE_ENV", "CompletionServer", "ServedModel", "main", "transformers_serve"]

#: What keeps ``transformers serve`` offline: no hub look-ups, no update check.
OFFLINE_ENV: Mapping[str, str] = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1", "TRANSFORMERS_OFFLINE": "1"}


class CompletionServer:
    """Serve ``backend`` (a TransformersBackend) as model ``name`` on ``host:port``
    (port 0 picks a free one). Use :meth:`running` to start and always stop it."""

    def __init__(self, backend: Any, *, name: str = "drafter", host: str = "127.0.0.1", port: int = 0) -> None:
        self.backend = backend
        self.name = name
        self.host = host
        self.port = port

    def _complete(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if body.get("model") not in (self.name, None):
            return 404, {"error": {"message": f"model {body.get('model')!r} not found; serving {self.name!r}",
                                   "type": "NotFoundError", "code": 404}}
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            return 400, {"error": {"message": "prompt must be a non-empty string", "type": "BadRequestError"}}
        n = int(body.get("n") or 1)
        max_tokens = int(body.get("max_tokens") or 16)
        temperature = float(body.get("temperature", 1.0))
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        mode = "greedy" if temperature == 0 else "sample"
        try:
            rows = []
            for _ in range(n if mode == "greedy" else 1):
                rows += self.backend.complete_sync(
                    prompt, n=1 if mode == "greedy" else n, max_new_tokens=max_tokens, mode=mode,
                    temperature=temperature or 1.0, seed=int(body.get("seed") or 0),
                )
        except Exception as exc:  # the client gets the error; the server keeps serving
            return 400, {"error": {"message": f"{type(exc).__name__}: {exc}", "type": "BadRequestError"}}
        choices = []
        completion_tokens = 0
        for i, c in enumerate(rows):
            ids = list(c.token_ids[:-1] if c.finished else c.token_ids)
            lps = list(c.token_logprobs[: len(ids)])
            text = c.text
            reason = "stop" if c.finished else "length"
            for s in stop:
                cut = text.find(s) if s else -1
                if cut >= 0:
                    text, reason = text[:cut], "stop"
            pieces = [self.backend.decode_text([t]) for t in ids]
            offsets = [sum(len(p) for p in pieces[:k]) for k in range(len(pieces))]
            completion_tokens += len(ids)
            choices.append({
                "index": i,
                "text": text,
                "finish_reason": reason,
                "logprobs": {"tokens": pieces, "token_logprobs": lps, "top_logprobs": None, "text_offset": offsets},
            })
        prompt_tokens = self.backend.count_tokens(prompt)
        return 200, {
            "id": f"cmpl-{time.monotonic_ns():x}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.name,
            "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        }

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path.rstrip("/") == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": server.name, "object": "model"}]})
                else:
                    self._send(404, {"error": {"message": f"no route {self.path}", "type": "NotFoundError"}})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                except ValueError:
                    self._send(400, {"error": {"message": "body is not JSON", "type": "BadRequestError"}})
                    return
                if self.path.rstrip("/") != "/v1/completions":
                    self._send(404, {"error": {"message": f"no route {self.path}", "type": "NotFoundError"}})
                    return
                self._send(*server._complete(body))

        return Handler

    @contextmanager
    def running(self) -> Iterator[str]:
        """Serve in a background thread while the block runs; yields the base URL."""
        httpd = ThreadingHTTPServer((self.host, self.port), self._handler())
        # One request per connection and joined handler threads: server_close() returns
        # only when no request is still being served.
        httpd.daemon_threads = False
        httpd.block_on_close = True
        thread = threading.Thread(target=httpd.serve_forever, name="aospec-completion-server", daemon=True)
        thread.start()
        try:
            yield f"http://{self.host}:{httpd.server_address[1]}/v1"
        finally:
            httpd.shutdown()
            httpd.server_close()
            thread.join()


@dataclass(frozen=True, slots=True)
class ServedModel:
    """A running ``transformers serve``: ``base_url`` (``http://127.0.0.1:P/v1``), the
    ``model`` name its requests carry (the served directory), its process id."""

    base_url: str
    model: str
    pid: int


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


@contextmanager
def transformers_serve(
    model: str,
    *,
    port: int = 0,
    host: str = "127.0.0.1",
    threads: int | None = 1,
    device: str = "cpu",
    start_timeout_s: float = 300.0,
) -> Iterator[ServedModel]:
    """Run ``transformers serve`` on ``model`` (a spec of :mod:`aospec.drafters.model`,
    resolved and converted first) while the block runs; yields a :class:`ServedModel`.

    The server runs offline (:data:`OFFLINE_ENV`) with ``threads`` CPU threads (None: its
    default) and ``OMP_WAIT_POLICY=PASSIVE`` (idle OpenMP threads spinning on a busy host
    made decoding many times slower), in its own process group, which is terminated (then
    killed) when the block ends, also on an exception or a cancellation. ``port`` 0 picks a
    free one. A server that exits or is not healthy within ``start_timeout_s`` raises
    ConfigError with the end of its log. It has no API key: keep ``host`` on loopback."""
    from aospec.drafters.model import is_shape, resolve_model

    if is_shape(model):
        raise ConfigError(f"transformers serve needs a model directory, not the shape {model!r}")
    directory = resolve_model(model)
    if not (Path(directory) / "config.json").is_file():
        raise ConfigError(f"transformers serve: {directory} holds no config.json (a Hugging Face model directory)")
    exe = shutil.which("transformers", path=str(Path(sys.executable).parent)) or shutil.which("transformers")
    try:
        import fastapi  # noqa: F401  (transformers serve needs it, and says so only once started)
    except ImportError:
        exe = None
    if exe is None:
        raise MissingDependencyError(
            "transformers serve (transformers[serving]) is not installed; install it with: pip install 'aospec[models]'"
        )
    port = port or _free_port(host)
    env = {**os.environ, **OFFLINE_ENV, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [exe, "serve", directory, "--host", host, "--port", str(port), "--device", device, "--log-level", "warning"]
    with tempfile.TemporaryFile(mode="w+", prefix="aospec-serve-") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, preexec_fn=_die_with_parent)
        try:
            deadline = time.monotonic() + start_timeout_s
            while not _healthy(f"http://{host}:{port}/health"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    tail = " | ".join(log.read().strip().splitlines()[-5:])
                    state = f"exited with status {proc.returncode}" if proc.poll() is not None else "is not healthy"
                    raise ConfigError(f"transformers serve {directory} {state} ({start_timeout_s:.0f} s): {tail}")
                time.sleep(0.5)
            yield ServedModel(f"http://{host}:{port}/v1", directory, proc.pid)
        finally:
            _stop(proc)


def _die_with_parent() -> None:
    """In the server's process before it starts: SIGTERM it when this process dies, so a
    parent killed without running its cleanup (SIGKILL, an unhandled SIGTERM) leaves no
    server behind (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing)."""
    with suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _stop(proc: subprocess.Popen[Any]) -> None:
    """Terminate the server's process group, then kill it if it does not exit."""
    for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def main(argv: list[str] | None = None) -> int:
    from aospec.drafters.backends.transformers import TransformersBackend

    p = argparse.ArgumentParser(prog="python -m aospec.drafters.backends.server", description=__doc__)
    p.add_argument("--model", default="tiny", help="shape name, aospec train output dir or local model dir")
    p.add_argument("--adapter", default=None)
    p.add_argument("--name", default="drafter", help="served model name")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="auto")
    args = p.parse_args(argv)
    backend = TransformersBackend(args.model, adapter=args.adapter, device=args.device, offload="inline")
    server = CompletionServer(backend, name=args.name, host=args.host, port=args.port)
    with server.running() as url:
        print(f"serving {args.model} as {args.name!r} at {url}", flush=True)
        with suppress(KeyboardInterrupt):
            threading.Event().wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
