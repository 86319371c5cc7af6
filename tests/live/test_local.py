"""TransformersActor with the tiny model on CPU: greedy decodes through the model's chat
template, the memo, determinism, and cancellation that stops the worker."""

from __future__ import annotations

import threading

import anyio
import pytest

torch = pytest.importorskip("torch")

from aospec.errors import ConfigError  # noqa: E402
from aospec.protocols import Actor  # noqa: E402
from aospec.types import Action, History  # noqa: E402
from live.chat import ActorError, ChatFormat  # noqa: E402
from live.local import TransformersActor  # noqa: E402

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
