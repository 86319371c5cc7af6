"""TransformersActor with the tiny model on CPU: greedy decodes through the model's chat
template, the memo, determinism, cancellation that stops the worker, and streaming decodes
that feed each token's text from the decoding task while the model decodes."""

from __future__ import annotations

import threading

import anyio
import pytest

torch = pytest.importorskip("torch")

from aospec.live.chat import ActorError, ChatFormat  # noqa: E402
from aospec.live.local import TransformersActor  # noqa: E402

from aospec.errors import ConfigError  # noqa: E402
from aospec.protocols import Actor, StreamingActor  # noqa: E402
from aospec.types import Action, History  # noqa: E402

pytestmark = pytest.mark.anyio

TEXTS = [
    "```bash\nls -la\n```",
    "THOUGHT: list the files",
    "<returncode>0</returncode>\n<output>\nfile\n</output>",
] * 20


@pytest.fixture(scope="module")
def actor() -> TransformersActor:
    return TransformersActor("tiny", texts=TEXTS, vocab_size=400, max_new_tokens=12)


async def test_greedy_decodes_are_memoised_and_deterministic(actor: TransformersActor) -> None:
    assert isinstance(actor, Actor)
    h = History("list the files").extend(Action.bash("ls"), "<returncode>0</returncode>\n<output>\nx\n</output>")
    before = actor.stats.requests
    action = await actor.decode(h)
    reply = actor.reply_for(h)
    assert reply is not None and reply.action == action == actor.chat_format.parse(reply.text)
    assert 1 <= reply.output_tokens <= 12 and not reply.tokens_estimated
    assert reply.finish_reason in ("stop", "length")
    assert await actor.decode(h) == action and actor.stats.requests == before + 1
    report = await actor.check_determinism(h)
    assert report.identical and report.first.text == reply.text
    # The same weights and prompt in another actor give the same reply.
    other = TransformersActor(actor.backend.loaded, max_new_tokens=12)
    assert await other.decode(h) == action and other.reply_for(h).text == reply.text


async def test_cancelling_a_decode_stops_the_worker(actor: TransformersActor) -> None:
    long = TransformersActor(actor.backend.loaded, max_new_tokens=4000, max_context=8192)
    lock: threading.Lock = long.backend._lock
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(long.decode, History("write a very long answer"))
            for _ in range(20000):
                if lock.locked():
                    break
                await anyio.sleep(0.001)
            assert lock.locked()  # generating in the worker
            scope.cancel()
    # Cancellation returned only once the worker stopped: the model is free again.
    assert lock.acquire(blocking=False)
    lock.release()
    assert long.stats.cancelled_requests == 1 and long.reply_for(History("write a very long answer")) is None


def test_configuration_errors(actor: TransformersActor) -> None:
    with pytest.raises(ConfigError, match="tokenizer"):
        TransformersActor(actor.backend.model)
    with pytest.raises(ConfigError, match="tool calls"):
        TransformersActor(actor.backend.loaded, chat_format=ChatFormat(action_format="tools"))
    with pytest.raises(ConfigError, match="unknown sampling"):
        TransformersActor(actor.backend.loaded, sampling={"top_k": 3})


async def test_a_prompt_over_the_context_is_an_actor_error(actor: TransformersActor) -> None:
    small = TransformersActor(actor.backend.loaded, max_new_tokens=8, max_context=64)
    with pytest.raises(ActorError, match=r"local model tiny: .*exceeds max_context=64"):
        await small.decode(History("x " * 200))


# ----------------------------------------------------------------------------- streaming decodes


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_decode_streaming_feeds_each_token_mid_decode_from_the_decoding_task(
    actor: TransformersActor, anyio_backend: str
) -> None:
    streaming = TransformersActor(actor.backend.loaded, max_new_tokens=24)
    assert isinstance(streaming, StreamingActor)
    backend = streaming.backend
    complete_sync = backend.complete_sync
    heard = threading.Event()  # set by on_delta, in the event loop
    waited: list[bool] = []

    def gated(*args, on_text, **kwargs):
        # After its first piece the worker waits until on_delta has had it: so on_delta is
        # called while the decode goes on, not once it is over.
        def hand_on(piece: str) -> None:
            on_text(piece)
            if not waited:
                waited.append(heard.wait(timeout=120))

        return complete_sync(*args, on_text=hand_on, **kwargs)

    backend.complete_sync = gated  # type: ignore[method-assign]
    loop_thread = threading.get_ident()
    me = anyio.get_current_task().id
    deltas: list[object] = []

    def on_delta(delta: object) -> None:
        assert threading.get_ident() == loop_thread and anyio.get_current_task().id == me
        assert backend._lock.locked() or deltas  # the first piece comes while the model decodes
        deltas.append(delta)
        heard.set()

    h = History("list the files")
    action = await streaming.decode_streaming(h, on_delta)
    reply = streaming.reply_for(h)
    assert waited == [True]
    assert len(deltas) > 1 and all(isinstance(d, str) and d for d in deltas)
    assert "".join(deltas) == reply.text and reply.action == action  # type: ignore[union-attr]
    assert reply.first_token_ns is not None and 0 < reply.first_token_ns <= reply.latency_ns  # type: ignore[union-attr]
    # Greedy: the same reply as a decode without the stream (another actor, same weights).
    plain = TransformersActor(actor.backend.loaded, max_new_tokens=24)
    assert await plain.decode(h) == action and plain.reply_for(h).text == reply.text  # type: ignore[union-attr]
    assert plain.reply_for(h).output_tokens == reply.output_tokens  # type: ignore[union-attr]
    # From the memo: the whole reply at once.
    again: list[object] = []
    assert await streaming.decode_streaming(h, again.append) == action and again == [reply.text]  # type: ignore[union-attr]
    assert streaming.stats.requests == 1 and streaming.stats.memo_hits == 1


async def test_cancelling_a_streaming_decode_stops_the_worker(actor: TransformersActor) -> None:
    long = TransformersActor(actor.backend.loaded, max_new_tokens=4000, max_context=8192)
    backend = long.backend
    complete_sync = backend.complete_sync
    results = []

    def recorded(*args, **kwargs):
        results.extend(complete_sync(*args, **kwargs))
        return results[-1:]

    backend.complete_sync = recorded  # type: ignore[method-assign]
    h = History("write a very long answer")
    deltas: list[object] = []
    with anyio.CancelScope() as scope:

        def on_delta(delta: object) -> None:
            deltas.append(delta)
            scope.cancel()  # on the first piece: the decode stops at a next token

        await long.decode_streaming(h, on_delta)
    assert scope.cancelled_caught and deltas
    # Cancellation returned only once the worker stopped: the model is free again.
    assert backend._lock.acquire(blocking=False)
    backend._lock.release()
    assert len(results) == 1 and results[0].tokens < 4000 and not results[0].finished
    assert long.stats.cancelled_requests == 1 and long.reply_for(h) is None


async def test_a_streaming_decode_raises_the_actor_error_itself(actor: TransformersActor) -> None:
    small = TransformersActor(actor.backend.loaded, max_new_tokens=8, max_context=64)
    deltas: list[object] = []
    with pytest.raises(ActorError, match=r"exceeds max_context=64"):
        await small.decode_streaming(History("x " * 200), deltas.append)
    assert deltas == [] and small.stats.failed_requests == 1


async def test_an_inline_streaming_decode_feeds_from_the_decoding_task(actor: TransformersActor) -> None:
    inline = TransformersActor(actor.backend.loaded, max_new_tokens=12, offload="inline")
    me = anyio.get_current_task().id
    deltas: list[object] = []

    def on_delta(delta: object) -> None:
        assert anyio.get_current_task().id == me
        deltas.append(delta)

    h = History("list the files")
    action = await inline.decode_streaming(h, on_delta)
    assert len(deltas) > 1 and "".join(deltas) == inline.reply_for(h).text  # type: ignore[arg-type, union-attr]
    assert action == await actor.decode(h)
