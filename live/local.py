"""The actor on an in-process transformers model (the project's model code, no server).

:class:`TransformersActor` renders a history's messages with the model's chat template and
decodes greedily (or samples, with ``sampling={"temperature": T, "seed": S}``) through
:class:`aospec.drafters.backends.transformers.TransformersBackend`. Decodes run in a worker thread
and are cancel-safe: a cancelled decode sets a flag the decode loop checks every token, and
the caller's cancellation returns once the worker has stopped, so no computation outlives
the call. The memo, ``reply_for`` and the determinism check are those of every actor
(:class:`aospec.live.chat.MemoActor`).

``decode_streaming`` (:class:`aospec.protocols.StreamingActor`) streams the reply as it is
decoded: the backend gives each token's new text (``complete_sync(on_text=...)``) in the
worker thread, which hands it to the event loop without waiting (a thread-safe call-soon
into a memory object stream); the decoding task reads the stream and calls ``on_delta``
itself, while the decode goes on. A router on the stream thus fires mid-decode.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from aospec.live.chat import ActorError, ChatFormat, MemoActor, Reply, StreamFeed

from aospec.errors import ConfigError, DrafterError

__all__ = ["TransformersActor"]

_SAMPLING = frozenset({"temperature", "seed", "max_tokens"})


class TransformersActor(MemoActor):
    """An actor decoding with a local causal LM.

    ``model``: a model spec of :mod:`aospec.drafters.model` (a shape name such as ``tiny`` with
    ``texts`` to train its tokenizer on, an ``aospec train`` output directory, a local
    Hugging Face directory), a ``LoadedModel``, or a torch module (then ``tokenizer`` is
    required). ``sampling``: ``temperature`` (default 0: greedy), ``seed``, ``max_tokens``
    (overrides ``max_new_tokens``). ``max_context`` bounds prompt + reply in tokens.
    ``offload``: ``thread`` (default) or ``inline`` (in the event loop; for virtual time).
    """

    def __init__(
        self,
        model: Any,
        *,
        tokenizer: Any = None,
        chat_format: ChatFormat | None = None,
        sampling: Mapping[str, Any] | None = None,
        max_new_tokens: int = 512,
        device: str = "cpu",
        dtype: str | None = "auto",
        max_context: int = 8192,
        texts: Sequence[str] | None = None,
        vocab_size: int = 4096,
        seed: int = 0,
        offload: str = "thread",
    ) -> None:
        from aospec.drafters.backends.transformers import TransformersBackend
        from aospec.drafters.model import LoadedModel

        super().__init__(chat_format)
        if self.chat_format.action_format != "bash":
            raise ConfigError("TransformersActor: only action_format='bash' (a local model makes no tool calls)")
        sampling = dict(sampling or {})
        unknown = set(sampling) - _SAMPLING
        if unknown:
            raise ConfigError(
                f"TransformersActor: unknown sampling keys {sorted(unknown)} (known: {sorted(_SAMPLING)})"
            )
        self.temperature = float(sampling.get("temperature", 0.0))
        self.sample_seed = int(sampling.get("seed", 0) or 0)
        self.max_new_tokens = int(sampling.get("max_tokens") or max_new_tokens)
        if self.max_new_tokens < 1 or self.temperature < 0:
            raise ConfigError("TransformersActor: max_new_tokens must be >= 1 and temperature >= 0")
        if isinstance(model, str):
            loaded, spec = None, model
        elif isinstance(model, LoadedModel):
            loaded, spec = model, model.spec
        else:
            if tokenizer is None:
                raise ConfigError("TransformersActor: a model module needs its tokenizer (tokenizer=...)")
            loaded, spec = LoadedModel(model=model, tokenizer=tokenizer, spec=type(model).__name__, meta={}), None
        if loaded is not None and tokenizer is not None and loaded.tokenizer is not tokenizer:
            loaded = LoadedModel(model=loaded.model, tokenizer=tokenizer, spec=loaded.spec, meta=loaded.meta)
        self.backend = TransformersBackend(
            spec or loaded.spec,  # type: ignore[union-attr]
            device=device,
            dtype=dtype,
            decode="dynamic",
            offload=offload,  # type: ignore[arg-type]
            max_context=max_context,
            seed=seed,
            texts=texts,
            vocab_size=vocab_size,
            loaded=loaded,
        )
        self.model = spec or loaded.spec  # type: ignore[union-attr]

    def _inline(self) -> bool:
        """Whether decodes run in the event loop's thread (see ``run_blocking``)."""
        from aospec.drafters.backends import is_inline

        return is_inline(self.backend.offload)

    async def _generate_streaming(self, messages: list[dict[str, Any]], feed: StreamFeed) -> Reply:
        """:meth:`_generate` feeding each decoded piece of text to ``feed`` from this task.

        Threaded, the worker posts each piece into a memory object stream through the
        loop's thread-safe call-soon (never blocking the decode on the loop); a child task
        runs the decode while this task reads the stream and feeds it. The stream is closed
        by a call posted after the worker's last piece, so every piece is read first.
        Cancelled, the child's decode stops at the next token as :meth:`_generate` does,
        and this returns once it has. Inline (virtual time), pieces are fed directly."""
        import anyio

        feed.attempt()
        if self._inline():
            return await self._generate(messages, on_text=feed.content)
        send, receive = anyio.create_memory_object_stream[str](math.inf)
        soon = _call_soon()

        def put(piece: str) -> None:  # in the loop: must not raise
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
                send.send_nowait(piece)  # (raises only once the reader has gone: cancelled)

        def on_text(piece: str) -> None:  # in the worker
            soon(lambda: put(piece))

        reply: Reply | None = None
        error: Exception | None = None

        async def decode() -> None:
            nonlocal reply, error
            try:
                reply = await self._generate(messages, on_text=on_text)
            except Exception as exc:
                error = exc  # raised below as itself, not in a task group's exception group
            finally:
                soon(send.close)

        async with anyio.create_task_group() as tg:
            tg.start_soon(decode)
            with receive:
                async for piece in receive:
                    feed.content(piece)
        if error is not None:
            raise error
        assert reply is not None
        return reply

    async def _generate(self, messages: list[dict[str, Any]], on_text: Callable[[str], None] | None = None) -> Reply:
        import anyio

        backend = self.backend
        prompt = backend.render(messages)
        greedy = self.temperature == 0
        start = time.monotonic_ns()
        first: list[int] = []  # when the first piece of text was decoded (streaming)
        self.stats.requests += 1
        report = on_text
        if on_text is not None:
            give = on_text

            def report(piece: str) -> None:
                if not first:
                    first.append(time.monotonic_ns())
                give(piece)

        try:
            (done,) = await backend.complete(
                prompt,
                n=1,
                max_new_tokens=self.max_new_tokens,
                mode="greedy" if greedy else "sample",
                temperature=1.0 if greedy else self.temperature,
                seed=self.sample_seed,
                on_text=report,
            )
        except anyio.get_cancelled_exc_class():
            self.stats.cancelled_requests += 1
            raise
        except (DrafterError, ConfigError) as exc:
            self.stats.failed_requests += 1
            raise ActorError(f"local model {self.model}: {exc}") from None
        return Reply(
            text=done.text,
            action=self.chat_format.parse(done.text),
            output_tokens=done.tokens,
            tokens_estimated=False,
            latency_ns=time.monotonic_ns() - start,
            first_token_ns=first[0] - start if first else None,
            finish_reason="stop" if done.finished else "length",
        )


def _call_soon() -> Callable[[Callable[[], object]], None]:
    """A thread-safe way to run a callback soon in the current event loop, without waiting
    for it (asyncio's ``call_soon_threadsafe``, trio's ``run_sync_soon``; both in order)."""
    import asyncio

    import anyio.lowlevel

    native = anyio.lowlevel.current_token().native_token
    if isinstance(native, asyncio.AbstractEventLoop):
        return native.call_soon_threadsafe
    return native.run_sync_soon  # type: ignore[attr-defined]
