"""In-process transformers backend: batched sampling with sequence log-probabilities.

Decoding paths (``decode=``):

- ``generate``: Hugging Face ``model.generate`` (eager, dynamic KV cache); the baseline.
- ``dynamic``: our own decode loop over a dynamic KV cache.
- ``static``: our loop over a preallocated static KV cache (one per batch size and
  256-token length bucket) with an explicit attention mask, so one decode step has fixed
  shapes and addresses.
- ``compile``: ``static`` with the step compiled by ``torch.compile`` (CUDA graphs through
  ``mode="reduce-overhead"`` on a GPU; those are recorded per thread, so a threaded
  ``offload`` may record again in a new worker thread).
- ``cuda_graph``: ``static`` with the decode step captured once per (batch, cache length)
  as a CUDA graph and replayed; sampling (Gumbel-max) stays outside the graph.
- ``auto``: ``cuda_graph`` on a GPU (falling back to ``static`` if capture fails; the
  reason is kept in ``fallback_reason``), ``dynamic`` on a CPU or for a model with
  sliding-window layers (the static paths need full attention in every layer).

All paths draw the same way: N copies of the prompt decode as one batch (our loops run
the prompt once and copy its cache to every row); each row's log-probability is the sum of
its tokens' log-probabilities under the model at temperature 1 (sampling itself may use
another temperature). Seeds derive from the prompt, so a prompt's candidates are
reproducible regardless of call order. Per decode step the host does not wait for the
device except once every ``_CHECK_EVERY`` steps.

Streaming: ``complete_sync(..., on_text=f)`` (one sequence: greedy, or ``n=1``) calls
``f(piece)`` with each newly decoded piece of the reply's text as the tokens come (in the
calling thread; every path, ``generate`` through a Hugging Face streamer). Pieces are
decoded incrementally and only text that further tokens cannot change is given (a token
ending inside a multi-byte character waits for the rest), so their concatenation is the
completion's text exactly. The host then reads each token as it is drawn; tokens, log
probabilities and texts are those of the same call without ``on_text``, and without it
nothing changes.
"""

from __future__ import annotations

import inspect
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Literal

from aospec.drafters.backends import BlockingCompletions, Completion, DecodeMode, Offload
from aospec.drafters.backends._text import TokenizerText, end_token_ids, prompt_seed

from aospec._lazy import require
from aospec.errors import ConfigError

__all__ = ["DECODE_PATHS", "TransformersBackend"]

DecodePath = Literal["auto", "generate", "dynamic", "static", "compile", "cuda_graph"]
DECODE_PATHS = ("auto", "generate", "dynamic", "static", "compile", "cuda_graph")

_CHECK_EVERY = 8  # decode steps between host syncs that test "all rows finished"
_CACHE_BUCKET = 256
_REPLACEMENT = "\ufffd"  # what decoding gives for bytes of an unfinished UTF-8 character


class _TextStream:
    """Incremental detokenization of one generated sequence for ``on_text``.

    Each pushed token is decoded within a window that starts at the last token whose
    text was given (``prefix``): the window's text beyond that of its already given tokens
    (``prefix:read``) is new. Decoding both with the same first token keeps what a
    tokenizer does at the start of a text (e.g. a dropped leading space) out of the
    difference. New text ending in U+FFFD (a token ending inside a multi-byte character)
    waits for the next token. The end token stops the stream; :meth:`finish` gives
    whatever the final text holds beyond what was given (a held-back tail), so the pieces
    concatenate to the completion's text.
    """

    __slots__ = ("backend", "done", "ends", "ids", "on_text", "prefix", "read", "sent")

    def __init__(self, backend: TransformersBackend, on_text: Callable[[str], None]) -> None:
        self.backend = backend
        self.on_text = on_text
        self.ends = frozenset(backend._end_ids)
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0
        self.sent: list[str] = []
        self.done = False

    def push(self, token: int) -> bool:
        """Take the next generated token; True once the sequence has ended."""
        if self.done:
            return True
        if token in self.ends:
            self.done = True
            return True
        ids = self.ids
        ids.append(token)
        decode = self.backend.decode_text
        before = decode(ids[self.prefix : self.read]) if self.read > self.prefix else ""
        now = decode(ids[self.prefix :])
        if len(now) > len(before) and not now.endswith(_REPLACEMENT) and now.startswith(before):
            self.prefix, self.read = self.read, len(ids)
            self._give(now[len(before) :])
        return False

    def finish(self, text: str) -> None:
        """The completion's final ``text``: give what of it was not given yet."""
        self.done = True
        sent = "".join(self.sent)
        if len(text) > len(sent) and text.startswith(sent):
            self._give(text[len(sent) :])

    def _give(self, piece: str) -> None:
        self.sent.append(piece)
        self.on_text(piece)


class _HFStreamer:
    """A Hugging Face ``generate`` streamer (``put``/``end``) feeding a :class:`_TextStream`;
    the first ``put`` is the prompt."""

    def __init__(self, stream: _TextStream) -> None:
        self.stream = stream
        self.prompt = True

    def put(self, value: Any) -> None:
        if self.prompt:
            self.prompt = False
            return
        for token in value.reshape(-1).tolist():
            self.stream.push(int(token))

    def end(self) -> None:
        pass


class _StaticRunner:
    """A static KV cache for (batch, max_len) with a decode step, optionally compiled or
    captured as a CUDA graph.

    The cache tensors, the input token/position buffers and (for ``cuda_graph``) the
    captured logits keep their addresses for the runner's life; :meth:`reset` zeroes them
    in place, so a captured graph stays valid across prompts.
    """

    def __init__(self, backend: TransformersBackend, batch: int, max_len: int, path: str) -> None:
        torch = backend._torch
        self.backend = backend
        self.batch = batch
        self.max_len = max_len
        self.path = path
        device = backend.device
        try:
            self.cache = backend._transformers.StaticCache(config=backend._config, max_cache_len=max_len)
        except TypeError:  # transformers < 5 sizes the cache up front
            self.cache = backend._transformers.StaticCache(
                config=backend._config,
                max_cache_len=max_len,
                max_batch_size=batch,
                device=device,
                dtype=backend.dtype,
            )
        self.token = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.pos = torch.zeros((1,), dtype=torch.long, device=device)
        self.columns = torch.arange(max_len, device=device)
        self.min_value = torch.finfo(backend.dtype).min
        self.graph: Any = None
        self.logits: Any = None
        self.step_fn = self._step
        if path == "static":
            return
        with torch.inference_mode():
            # One eager step on the current stream allocates the cache's lazily created
            # tensors here, outside any compiled region or capture, so their addresses are
            # fixed before compilation (transformers marks them static only when eager).
            self._step()
        self.reset()
        if path == "cuda_graph":
            self._capture()
        elif path == "compile":
            dynamo = torch._dynamo
            for t in (self.token, self.pos, self.columns):
                dynamo.mark_static_address(t)
            mode = "reduce-overhead" if device.startswith("cuda") else None
            self.step_fn = torch.compile(self._step, mode=mode, dynamic=False, fullgraph=False)
            # Compile now (several calls: CUDA-graph trees record on a later one), so that a
            # model or library the compiler cannot handle fails here and falls back. Every
            # (batch, max_len) is one more compiled entry of the same code: lift the
            # recompile limit so that later shapes are compiled too, not run eagerly.
            name = "recompile_limit" if hasattr(dynamo.config, "recompile_limit") else "cache_size_limit"
            limit = max(int(getattr(dynamo.config, name)), 64)
            with dynamo.config.patch(**{name: limit}), torch.inference_mode():
                for _ in range(3):
                    self.step_fn()
            self.reset()

    def _masks(self, allowed: Any) -> Any:
        """The additive attention mask of ``allowed``: one per layer type for a model whose
        config names its layer types (Qwen3: its forward takes that mapping), else the
        4D mask itself (Llama: its forward takes only a tensor)."""
        torch = self.backend._torch
        zero = torch.zeros((), dtype=self.backend.dtype, device=self.backend.device)
        mask = torch.where(allowed, zero, torch.full_like(zero, self.min_value))
        if getattr(self.backend._config, "layer_types", None) is None:
            return mask
        return {kind: mask for kind in self.backend._layer_types}

    def _step(self) -> Any:
        allowed = (self.columns <= self.pos).view(1, 1, 1, self.max_len).expand(self.batch, 1, 1, self.max_len)
        kwargs = {
            "input_ids": self.token,
            "position_ids": self.pos.view(1, 1).expand(self.batch, 1),
            "attention_mask": self._masks(allowed),
            self.backend._cache_kw: self.cache,
            "use_cache": True,
        }
        if self.backend._takes_cache_position:
            kwargs["cache_position"] = self.pos
        return self.backend.model(**kwargs).logits[:, -1, :]

    def _capture(self) -> None:
        torch = self.backend._torch
        # Warm up on a side stream (autotuning, library handles and workspaces), then
        # capture; warm-up writes are undone by reset().
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(stream)
        self.reset()
        graph = torch.cuda.CUDAGraph()
        # thread_local: an unsafe call (e.g. cudaMalloc) by another thread of the process
        # meanwhile (another drafter, an encoder) is not an error that voids the capture.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"), torch.inference_mode():
            self.logits = self._step()
        self.graph = graph
        self.reset()

    def reset(self) -> None:
        self.cache.reset()

    def prefill(self, ids: Any) -> Any:
        """Run the prompt ``ids`` (shape (1, length)) into every row of the cache; the
        last position's logits, shape (1, vocab) or (batch, vocab)."""
        backend = self.backend
        torch = backend._torch
        length = ids.shape[1]
        positions = torch.arange(length, device=backend.device)
        if backend._shared_prefill:
            # The prompt is the same for every row: run it once, then copy its keys and
            # values into each row (through the cache's own update, which writes
            # positions 0..length-1 of an empty cache).
            cache = backend._dynamic_cache()
            logits = backend.model(
                input_ids=ids,
                position_ids=positions.view(1, -1),
                use_cache=True,
                logits_to_keep=1,
                **{backend._cache_kw: cache},
            ).logits[:, -1, :]
            for i, layer in enumerate(cache.layers):
                keys, values = (t.expand(self.batch, *t.shape[1:]).contiguous() for t in (layer.keys, layer.values))
                self.cache.update(keys, values, i, {"cache_position": positions})
            return logits
        allowed = (self.columns.view(1, -1) <= positions.view(-1, 1)).view(1, 1, length, self.max_len)
        kwargs = {
            "input_ids": ids.expand(self.batch, length),
            "position_ids": positions.view(1, -1).expand(self.batch, length),
            "attention_mask": self._masks(allowed.expand(self.batch, 1, length, self.max_len)),
            backend._cache_kw: self.cache,
            "use_cache": True,
            "logits_to_keep": 1,
        }
        if backend._takes_cache_position:
            kwargs["cache_position"] = positions
        return backend.model(**kwargs).logits[:, -1, :]

    def decode(self, token: Any, position: int) -> Any:
        self.token.copy_(token.view(self.batch, 1))
        self.pos.fill_(position)
        if self.graph is not None:
            self.graph.replay()
            return self.logits
        return self.step_fn()


class TransformersBackend(TokenizerText, BlockingCompletions):
    """A causal LM run in-process with PyTorch.

    ``model``: a shape name (``tiny``, ``small``, ``qwen3-0.6b``: random init with a
    tokenizer trained on ``texts``), an ``aospec train`` output directory, or a local HF
    model directory. ``adapter``: a PEFT LoRA directory (merged for decoding).
    ``offload``: ``thread`` runs decoding in a worker thread, ``inline`` in the event loop,
    ``auto`` inline under a virtual clock (trio MockClock) and threaded otherwise.
    """

    def __init__(
        self,
        model: str = "tiny",
        *,
        adapter: str | None = None,
        device: str = "auto",
        dtype: str | None = "auto",
        decode: DecodePath = "auto",
        offload: Offload = "auto",
        max_context: int = 4096,
        seed: int = 0,
        texts: Sequence[str] | None = None,
        vocab_size: int = 4096,
        loaded: Any = None,
    ) -> None:
        if decode not in DECODE_PATHS:
            raise ConfigError(f"transformers backend: unknown decode path {decode!r}; known: {', '.join(DECODE_PATHS)}")
        if offload not in ("auto", "thread", "inline"):
            raise ConfigError(f"transformers backend: offload must be auto, thread or inline, not {offload!r}")
        self._torch = torch = require("torch", "train", purpose="the transformers drafter backend")
        self._transformers = require("transformers", "train", purpose="the transformers drafter backend")
        from aospec.drafters.model import load_model, resolve_device, resolve_dtype

        if loaded is None:
            self.device = resolve_device(device)
            self.dtype = resolve_dtype(dtype, self.device)
            loaded = load_model(
                model,
                adapter=adapter,
                device=self.device,
                dtype=self.dtype,
                texts=texts,
                vocab_size=vocab_size,
                seed=seed,
            )
        else:
            param = next(loaded.model.parameters())
            self.device, self.dtype = str(param.device), param.dtype
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.spec = model
        self.seed = seed
        self.offload = offload
        self.max_context = max_context
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        self._config = base.config
        params = inspect.signature(type(base).forward).parameters
        self._cache_kw = "past_key_values" if "past_key_values" in params else "cache"
        self._takes_cache_position = "cache_position" in params
        self._layer_types = tuple(sorted(set(getattr(self._config, "layer_types", None) or ["full_attention"])))
        if decode == "auto":
            static_ok = self._layer_types == ("full_attention",)
            decode = "cuda_graph" if self.device.startswith("cuda") and static_ok else "dynamic"
        if decode == "cuda_graph" and not self.device.startswith("cuda"):
            raise ConfigError("transformers backend: decode='cuda_graph' needs a CUDA device")
        self.decode = decode
        self._check_static(decode)
        self.fallback_reason: str | None = None
        self._valid_vocab = len(self.tokenizer)
        self._end_ids = end_token_ids(
            self.tokenizer,
            getattr(getattr(self.model, "generation_config", None), "eos_token_id", None),
            model=self.spec,
        )
        self._pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self._end_ids[0]
        self._runners: OrderedDict[tuple[int, int, str], _StaticRunner] = OrderedDict()
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._end_tensor = torch.tensor(self._end_ids, device=self.device)
        # Static paths prefill once for all rows through a dynamic cache whose per-layer
        # keys/values can be read (transformers 5).
        self._shared_prefill = hasattr(self._dynamic_cache(), "layers")

    def _dynamic_cache(self) -> Any:
        cls = self._transformers.DynamicCache
        if "config" in inspect.signature(cls.__init__).parameters:
            return cls(config=self._config)
        return cls()

    def _check_static(self, decode: str) -> None:
        if decode in ("static", "compile", "cuda_graph") and self._layer_types != ("full_attention",):
            raise ConfigError(
                f"transformers backend: decode={decode!r} needs full attention in every layer; model "
                f"{self.spec!r} has {', '.join(self._layer_types)} layers: use decode='dynamic' or 'generate'"
            )

    def reset_compiled(self) -> None:
        """Drop static caches and captured graphs (after the weights changed, e.g. by fit)."""
        with self._lock:
            self._runners.clear()
            self._counts.clear()

    # ----------------------------------------------------------------- text helpers

    @property
    def end_token(self) -> str:
        """The token that ends a reply (training appends it to every target)."""
        tok = self.tokenizer.convert_ids_to_tokens(self.tokenizer.eos_token_id)
        return tok if isinstance(tok, str) else "<|im_end|>"

    def _seed(self, prompt: str, seed: int) -> int:
        return prompt_seed(prompt, self.seed, seed)

    # ----------------------------------------------------------------- decoding

    def complete_sync(
        self,
        prompt: str,
        *,
        n: int,
        max_new_tokens: int,
        mode: DecodeMode = "sample",
        temperature: float = 1.0,
        seed: int = 0,
        stop: threading.Event | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> list[Completion]:
        """Blocking version of :meth:`complete`: ``n`` rows (1 for greedy), in row order.

        ``on_text``: called (in this thread) with each newly decoded piece of the text of
        the one sequence generated (greedy, or ``n=1``; not beam search) as it is decoded;
        the pieces concatenate to the completion's ``text``. An exception it raises ends
        the call."""
        ids = self.request_ids(
            prompt,
            n=n,
            max_new_tokens=max_new_tokens,
            mode=mode,
            temperature=temperature,
            limit=self.max_context,
            limit_name="max_context",
        )
        batch = 1 if mode == "greedy" else n
        if on_text is not None and (mode == "beam" or batch != 1):
            raise ConfigError("complete: on_text streams one sequence (greedy, or n=1 without beam search)")
        stream = None if on_text is None else _TextStream(self, on_text)
        with self._lock, self._torch.inference_mode():
            if mode == "beam":
                return self._beam(ids, n, max_new_tokens)
            if self.decode == "generate":
                rows = self._generate(ids, batch, max_new_tokens, mode, temperature, seed, prompt, stream)
            else:
                rows = self._loop(ids, batch, max_new_tokens, mode, temperature, seed, prompt, stop, stream)
            completions = [self._completion(*row) for row in rows]
        if stream is not None:
            stream.finish(completions[0].text)
        return completions

    def _completion(self, tokens: Sequence[int], logprob: float, token_logprobs: Sequence[float] = ()) -> Completion:
        finished = bool(tokens) and tokens[-1] in self._end_ids
        body = tokens[:-1] if finished else tokens
        return Completion(
            self.decode_text(body), float(logprob), len(tokens), finished, tuple(tokens), tuple(token_logprobs)
        )

    def _logprobs(self, logits: Any) -> Any:
        """Float32 log-probabilities over the tokenizer's vocabulary (the model's may be
        padded; those ids never come out)."""
        if logits.shape[-1] > self._valid_vocab:
            logits = logits[..., : self._valid_vocab]
        return self._torch.log_softmax(logits, dim=-1, dtype=self._torch.float32)

    def _runner(self, batch: int, max_len: int) -> _StaticRunner:
        key = (batch, max_len, self.decode)
        runner = self._runners.get(key)
        if runner is None:
            self._check_static(self.decode)
            if len(self._runners) >= 8:
                self._runners.popitem(last=False)
            try:
                runner = _StaticRunner(self, batch, max_len, self.decode)
            except Exception as exc:
                if self.decode not in ("cuda_graph", "compile"):
                    raise
                # Capture or compilation is not possible with this model/library version:
                # keep working on the eager static path and say why.
                self.fallback_reason = f"{type(exc).__name__}: {exc}"
                self.decode = "static"
                key = (batch, max_len, "static")
                runner = _StaticRunner(self, batch, max_len, "static")
            self._runners[key] = runner
        else:
            self._runners.move_to_end(key)
        return runner

    def _loop(
        self,
        ids: list[int],
        batch: int,
        max_new: int,
        mode: str,
        temperature: float,
        seed: int,
        prompt: str,
        stop: threading.Event | None,
        stream: _TextStream | None = None,
    ) -> list[tuple[list[int], float, list[float]]]:
        torch = self._torch
        device = self.device
        gen = torch.Generator(device=device)
        gen.manual_seed(self._seed(prompt, seed))
        prompt_ids = torch.tensor([ids], device=device)
        length = len(ids)
        if self.decode == "dynamic":
            cache = self._dynamic_cache()

            def forward(tokens: Any, start: int) -> Any:
                positions = torch.arange(start, start + tokens.shape[1], device=device).view(1, -1)
                kwargs = {
                    "input_ids": tokens,
                    "position_ids": positions.expand(tokens.shape[0], -1),
                    self._cache_kw: cache,
                    "use_cache": True,
                    "logits_to_keep": 1,
                }
                return self.model(**kwargs).logits[:, -1, :]

            if batch > 1 and hasattr(cache, "batch_repeat_interleave"):
                logits = forward(prompt_ids, 0)  # the prompt once, its cache then copied per row
                cache.batch_repeat_interleave(batch)
            else:
                logits = forward(prompt_ids.expand(batch, length), 0)
            step = lambda tok, pos: forward(tok.view(batch, 1), pos)  # noqa: E731
        else:
            max_len = min(self.max_context, -(-(length + max_new) // _CACHE_BUCKET) * _CACHE_BUCKET)
            runner = self._runner(batch, max_len)
            runner.reset()
            logits = runner.prefill(prompt_ids)
            step = runner.decode
        # Every per-step operation below stays on the device: the host waits for it only
        # once every _CHECK_EVERY steps (the "all rows finished" test) and at the end.
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        pad = torch.full((batch,), self._pad_id, dtype=torch.long, device=device)
        ends = self._end_tensor.view(1, -1)
        noise_shape = (batch, logits.shape[-1])
        out = []
        picked = []
        for t in range(max_new):
            logp = self._logprobs(logits).expand(batch, -1)  # the prefill's may be one shared row
            if mode == "greedy":
                tok = logp.argmax(dim=-1)
            else:
                # Gumbel-max over the model's whole (padded) vocabulary, so that a seed draws
                # the same noise whatever the tokenizer size.
                u = torch.rand(noise_shape, generator=gen, device=device)[:, : logp.shape[-1]].clamp_(1e-20, 1.0)
                scaled = logp if temperature == 1.0 else logp / temperature
                tok = (scaled - torch.log(-torch.log(u))).argmax(dim=-1)
            tok = torch.where(finished, pad, tok)
            out.append(tok)
            picked.append(logp.gather(1, tok.view(-1, 1)).view(-1))
            finished |= (tok.view(-1, 1) == ends).any(dim=1)
            if stream is not None and stream.push(int(tok[0])):
                break  # the one row has ended (read anyway for its text: no extra wait)
            if t + 1 == max_new:
                break
            if (t % _CHECK_EVERY == _CHECK_EVERY - 1 and bool(finished.all())) or (stop is not None and stop.is_set()):
                break
            logits = step(tok, length + t)
        return self._rows(torch.stack(out, dim=1).tolist(), torch.stack(picked, dim=1).tolist())

    def _rows(self, tokens: list[list[int]], logps: list[list[float]]) -> list[tuple[list[int], float, list[float]]]:
        """Cut each row after its first end token; sum its token log-probabilities."""
        rows = []
        for row, lp in zip(tokens, logps, strict=True):
            cut = next((i + 1 for i, x in enumerate(row) if x in self._end_ids), len(row))
            rows.append((row[:cut], math.fsum(lp[:cut]), lp[:cut]))
        return rows

    def _generate(
        self,
        ids: list[int],
        batch: int,
        max_new: int,
        mode: str,
        temperature: float,
        seed: int,
        prompt: str,
        stream: _TextStream | None = None,
    ) -> list[tuple[list[int], float, list[float]]]:
        torch = self._torch
        input_ids = torch.tensor([ids], device=self.device)
        with torch.random.fork_rng(devices=[self.device] if self.device.startswith("cuda") else []):
            torch.manual_seed(self._seed(prompt, seed))
            out = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=mode == "sample",
                temperature=temperature if mode == "sample" else None,
                top_k=0 if mode == "sample" else None,
                top_p=1.0 if mode == "sample" else None,
                num_return_sequences=batch,
                max_new_tokens=max_new,
                min_new_tokens=0,
                eos_token_id=list(self._end_ids),
                pad_token_id=self._pad_id,
                output_logits=True,
                return_dict_in_generate=True,
                **({} if stream is None else {"streamer": _HFStreamer(stream)}),
            )
        new = out.sequences[:, len(ids) :]
        picked = [
            self._logprobs(logits).gather(1, new[:, t].view(-1, 1)).view(-1) for t, logits in enumerate(out.logits)
        ]
        return self._rows(new.tolist(), torch.stack(picked, dim=1).tolist())

    def _beam(self, ids: list[int], n: int, max_new: int) -> list[Completion]:
        torch = self._torch
        input_ids = torch.tensor([ids], device=self.device)
        out = self.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            num_beams=max(n, 2),
            num_return_sequences=n,
            max_new_tokens=max_new,
            eos_token_id=list(self._end_ids),
            pad_token_id=self._pad_id,
            early_stopping=True,
            length_penalty=0.0,
        )
        conts = []
        for row in out[:, len(ids) :].tolist():
            cut = next((i + 1 for i, x in enumerate(row) if x in self._end_ids), None)
            if cut is None:
                while row and row[-1] == self._pad_id and self._pad_id not in self._end_ids:
                    row.pop()
                conts.append(row)
            else:
                conts.append(row[:cut])
        scores = self._score_ids(ids, conts)
        return [self._completion(c, s) for c, s in zip(conts, scores, strict=True)]

    def score(self, prompt: str, continuations: Sequence[str], *, finished: bool = True) -> list[float]:
        """Exact log-probability of each continuation text after ``prompt`` (plus the end
        token when ``finished``): teacher forcing, no sampling."""
        ids = self.encode(prompt)
        end = self._end_ids[0]
        conts = [self.encode(c) + ([end] if finished else []) for c in continuations]
        return self.score_ids(ids, conts)

    def score_ids(self, ids: Sequence[int], conts: Sequence[Sequence[int]]) -> list[float]:
        """Exact log-probabilities of token continuations ``conts`` after prompt ``ids``."""
        with self._lock, self._torch.inference_mode():
            return self._score_ids(list(ids), conts)

    def _score_ids(self, ids: list[int], conts: Sequence[Sequence[int]]) -> list[float]:
        torch = self._torch
        if not conts:
            return []
        width = max(len(c) for c in conts)
        if width == 0:
            return [0.0] * len(conts)
        rows = [ids + list(c) + [self._pad_id] * (width - len(c)) for c in conts]
        batch = torch.tensor(rows, device=self.device)
        mask = torch.tensor([[1] * (len(ids) + len(c)) + [0] * (width - len(c)) for c in conts], device=self.device)
        logits = self.model(input_ids=batch, attention_mask=mask, use_cache=False).logits
        logp = self._logprobs(logits[:, len(ids) - 1 : -1, :])
        target = batch[:, len(ids) :]
        picked = logp.gather(2, target.unsqueeze(-1)).squeeze(-1)
        valid = mask[:, len(ids) :].bool()
        return (picked * valid).sum(dim=1).tolist()

    # ----------------------------------------------------------------- embeddings

    def embed(self, texts: Sequence[str], *, max_tokens: int = 256) -> Any:
        """Mean-pooled, L2-normalised last hidden states of ``texts`` (numpy, one row each)."""
        torch = self._torch
        if not texts:
            import numpy as np

            return np.zeros((0, self._config.hidden_size), dtype=np.float32)
        encoded = [self.encode(t)[:max_tokens] or [self._pad_id] for t in texts]
        width = max(len(e) for e in encoded)
        batch = torch.tensor([e + [self._pad_id] * (width - len(e)) for e in encoded], device=self.device)
        mask = torch.tensor([[1] * len(e) + [0] * (width - len(e)) for e in encoded], device=self.device)
        with self._lock, torch.inference_mode():
            out = self.model(input_ids=batch, attention_mask=mask, output_hidden_states=True, use_cache=False)
            hidden = out.hidden_states[-1].float()
            m = mask.unsqueeze(-1).float()
            pooled = (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)
            pooled = torch.nn.functional.normalize(pooled, dim=-1)
        return pooled.cpu().numpy()
