"""The transformers backend: every decode path agrees, log-probabilities are exact,
sampling is reproducible, cancellation stops the model."""

from __future__ import annotations

import math
import os
import shutil
import time

import anyio
import pytest

torch = pytest.importorskip("torch")

from aospec.drafters.backends import Completion, LMBackend, make_backend, merge_completions  # noqa: E402
from aospec.drafters.backends.transformers import TransformersBackend  # noqa: E402
from aospec.replay import bundled_traces_path, load_traces  # noqa: E402

from aospec.errors import ConfigError, DrafterError  # noqa: E402


@pytest.fixture(scope="module")
def backend() -> TransformersBackend:
    traces = load_traces([bundled_traces_path()])
    texts = [x for t in traces[:4] for s in t.steps for x in (s.action.command or "", s.observation)]
    return TransformersBackend("tiny", texts=texts, vocab_size=1024, device="cpu", decode="dynamic")


@pytest.fixture(scope="module")
def prompt(backend: TransformersBackend) -> str:
    return backend.render([{"role": "system", "content": "task: list files"}, {"role": "user", "content": "ls -la"}])


@pytest.fixture(scope="module")
def long_prompt(backend: TransformersBackend) -> str:
    """A prompt of 217..239 tokens: 16 new tokens keep its cache in the first 256-token
    bucket, 40 cross into the next."""
    traces = load_traces([bundled_traces_path()])
    body = backend.encode("\n".join(s.observation for t in traces[:4] for s in t.steps))
    for cut in range(200, 260):
        prompt = backend.render(
            [
                {"role": "system", "content": "task: fix the build"},
                {"role": "user", "content": backend.tokenizer.decode(body[:cut])},
            ]
        )
        if 216 < len(backend.encode(prompt)) < 240:
            return prompt
    raise AssertionError("no prompt of the wanted length")


def with_path(backend: TransformersBackend, path: str):
    backend.decode = path
    return backend


def test_it_is_an_lm_backend(backend: TransformersBackend) -> None:
    assert isinstance(backend, LMBackend)
    assert backend.count_tokens("ls -la") == len(backend.encode("ls -la")) > 0


@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_static_cache_path_matches_dynamic_path(backend: TransformersBackend, prompt: str, mode: str) -> None:
    try:
        a = with_path(backend, "dynamic").complete_sync(prompt, n=3, max_new_tokens=24, mode=mode, seed=5)
        b = with_path(backend, "static").complete_sync(prompt, n=3, max_new_tokens=24, mode=mode, seed=5)
    finally:
        backend.decode = "dynamic"
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for x, y in zip(a, b, strict=True):
        assert math.isclose(x.logprob, y.logprob, rel_tol=1e-4, abs_tol=1e-4)


def test_generate_path_matches_greedy_loop(backend: TransformersBackend, prompt: str) -> None:
    try:
        a = with_path(backend, "generate").complete_sync(prompt, n=1, max_new_tokens=16, mode="greedy")
    finally:
        backend.decode = "dynamic"
    b = backend.complete_sync(prompt, n=1, max_new_tokens=16, mode="greedy")
    assert a[0].token_ids == b[0].token_ids
    assert math.isclose(a[0].logprob, b[0].logprob, rel_tol=1e-4, abs_tol=1e-4)


@pytest.mark.parametrize("path", ["dynamic", "static", "generate"])
def test_sequence_logprob_is_the_teacher_forced_sum(backend: TransformersBackend, prompt: str, path: str) -> None:
    try:
        comps = with_path(backend, path).complete_sync(prompt, n=4, max_new_tokens=20, seed=1)
    finally:
        backend.decode = "dynamic"
    assert len(comps) == 4
    scored = backend.score_ids(backend.encode(prompt), [c.token_ids for c in comps])
    for c, s in zip(comps, scored, strict=True):
        assert c.tokens == len(c.token_ids) == len(c.token_logprobs)
        assert math.isclose(c.logprob, s, rel_tol=1e-4, abs_tol=1e-3)
        assert math.isclose(c.logprob, math.fsum(c.token_logprobs), abs_tol=1e-6)
        assert c.logprob < 0


def test_sampling_is_reproducible_per_prompt_and_seed(backend: TransformersBackend, prompt: str) -> None:
    a = backend.complete_sync(prompt, n=4, max_new_tokens=12, seed=0)
    backend.complete_sync(prompt + "x", n=2, max_new_tokens=5)  # other calls in between change nothing
    b = backend.complete_sync(prompt, n=4, max_new_tokens=12, seed=0)
    c = backend.complete_sync(prompt, n=4, max_new_tokens=12, seed=1)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]
    assert len({x.token_ids for x in a}) > 1  # rows of one batch are independent samples


def test_beam_candidates_are_ranked_with_exact_logprobs(backend: TransformersBackend, prompt: str) -> None:
    comps = backend.complete_sync(prompt, n=3, max_new_tokens=8, mode="beam")
    assert len(comps) == 3
    scored = backend.score_ids(backend.encode(prompt), [c.token_ids for c in comps])
    for c, s in zip(comps, scored, strict=True):
        assert math.isclose(c.logprob, s, rel_tol=1e-5, abs_tol=1e-4)
    greedy = backend.complete_sync(prompt, n=1, max_new_tokens=8, mode="greedy")[0]
    assert max(c.logprob for c in comps) >= greedy.logprob - 1e-4


def test_merge_collapses_duplicates_and_ranks_finished_first() -> None:
    comps = [
        Completion("a", -3.0, 2, True),
        Completion("b", -1.0, 2, False),
        Completion("a", -3.0, 2, True),
        Completion("c", -2.0, 2, True),
    ]
    assert [c.text for c in merge_completions(comps)] == ["c", "a", "b"]


def test_bad_requests_are_one_clear_error(backend: TransformersBackend, prompt: str) -> None:
    with pytest.raises(ConfigError, match="unknown mode"):
        backend.complete_sync(prompt, n=1, max_new_tokens=4, mode="nucleus")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=">= 1"):
        backend.complete_sync(prompt, n=0, max_new_tokens=4)
    with pytest.raises(DrafterError, match="max_context"):
        backend.complete_sync(prompt * 400, n=1, max_new_tokens=4)
    with pytest.raises(ConfigError, match="unknown decode path"):
        TransformersBackend("tiny", decode="warp")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        TransformersBackend("tiny", device="cpu", decode="cuda_graph", vocab_size=300)


def test_backends_are_built_by_name_with_checked_options() -> None:
    b = make_backend("transformers", {"model": "tiny", "device": "cpu", "vocab_size": 300})
    assert isinstance(b, TransformersBackend)
    with pytest.raises(ConfigError, match="LM backend 'transformers'"):
        make_backend("transformers", {"modle": "tiny"})
    with pytest.raises(ConfigError, match="unknown LM backend"):
        make_backend("nonsense")


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
def test_async_complete_runs_off_the_loop_and_matches_sync(
    backend: TransformersBackend, prompt: str, anyio_backend: str
) -> None:
    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await anyio.sleep(0.001)
                ticks += 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            comps = await backend.complete(prompt, n=2, max_new_tokens=64, seed=2)
            tg.cancel_scope.cancel()
        return comps, ticks

    comps, ticks = anyio.run(main, backend=anyio_backend)
    assert [c.token_ids for c in comps] == [
        c.token_ids for c in backend.complete_sync(prompt, n=2, max_new_tokens=64, seed=2)
    ]
    assert ticks > 0  # the event loop kept running while the model decoded


def test_cancelling_a_completion_stops_the_model_promptly(backend: TransformersBackend, prompt: str) -> None:
    big = TransformersBackend(loaded=backend.loaded, max_context=8192, decode="dynamic")

    async def main() -> float:
        with anyio.move_on_after(0.2):
            await big.complete(prompt, n=8, max_new_tokens=4000)
        return time.perf_counter()

    start = time.perf_counter()
    end = anyio.run(main)
    assert end - start < 3.0  # 4000 steps would take far longer
    assert big._lock.acquire(blocking=False)  # the worker has released the model
    big._lock.release()


def test_virtual_time_runs_inline_without_advancing_the_clock(backend: TransformersBackend, prompt: str) -> None:
    import trio
    import trio.testing

    async def main() -> float:
        t0 = trio.current_time()
        await backend.complete(prompt, n=2, max_new_tokens=16)
        return trio.current_time() - t0

    assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) == 0.0


def assert_same(got: list[Completion], want: list[Completion], *, what: str) -> None:
    assert [c.token_ids for c in got] == [c.token_ids for c in want], what
    for x, y in zip(got, want, strict=True):
        assert math.isclose(x.logprob, y.logprob, rel_tol=1e-4, abs_tol=1e-3), what
        assert x.finished == y.finished and x.text == y.text, what


# Requests in an order that reuses one runner (batch, 256-token bucket) for a shorter
# prompt after a longer one (its cache still holds the longer prompt's keys beyond the
# shorter one's end), then moves to the next bucket and back.
SEQUENCE = [("long", 16), ("short", 24), ("long", 40), ("short", 24)]


def run_sequence(
    backend: TransformersBackend, prompts: dict[str, str], batch: int, mode: str
) -> list[list[Completion]]:
    return [
        backend.complete_sync(prompts[name], n=batch, max_new_tokens=new, mode=mode, seed=7) for name, new in SEQUENCE
    ]


def check_static_path(
    backend: TransformersBackend, prompt: str, long_prompt: str, path: str, cases: list[tuple[int, str]]
) -> None:
    prompts = {"short": prompt, "long": long_prompt}
    reference = TransformersBackend(loaded=backend.loaded, decode="dynamic")
    under_test = TransformersBackend(loaded=backend.loaded, decode=path)
    for batch, mode in cases:
        want = run_sequence(reference, prompts, batch, mode)
        rows = 1 if mode == "greedy" else batch
        first = None
        got = []
        for name, new in SEQUENCE:
            got.append(under_test.complete_sync(prompts[name], n=batch, max_new_tokens=new, mode=mode, seed=7))
            first = first or under_test._runners[(rows, 256, path)]
            assert under_test._runners[(rows, 256, path)] is first  # the runner was reused, not rebuilt
        assert under_test.fallback_reason is None and under_test.decode == path
        assert {k[1] for k in under_test._runners if k[0] == rows} == {256, 512}
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, what=f"{path} batch {batch} {mode}, request {i} {SEQUENCE[i]}")


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_static_path_matches_dynamic_across_batches_buckets_and_reuse(
    backend: TransformersBackend, prompt: str, long_prompt: str, batch: int
) -> None:
    check_static_path(
        backend, prompt, long_prompt, "static", [(batch, "sample")] + ([(1, "greedy")] if batch == 1 else [])
    )


@pytest.mark.slow
@pytest.mark.skipif(
    not shutil.which(os.environ.get("CXX", "g++")), reason="torch.compile on a CPU needs a C++ compiler (g++ or $CXX)"
)
@pytest.mark.slow
def test_compiled_path_matches_dynamic_across_buckets_and_reuse(
    backend: TransformersBackend, prompt: str, long_prompt: str
) -> None:
    check_static_path(backend, prompt, long_prompt, "compile", [(3, "sample")])


def test_greedy_paths_agree_with_generate_on_a_long_prompt(backend: TransformersBackend, long_prompt: str) -> None:
    results = {
        path: TransformersBackend(loaded=backend.loaded, decode=path).complete_sync(
            long_prompt, n=1, max_new_tokens=40, mode="greedy"
        )
        for path in ("generate", "dynamic", "static")
    }
    for path in ("dynamic", "static"):
        assert_same(results[path], results["generate"], what=path)


def test_sliding_window_models_decode_dynamically(backend: TransformersBackend, long_prompt: str) -> None:
    transformers = pytest.importorskip("transformers")
    from aospec.drafters.model import LoadedModel, qwen3_config

    config = qwen3_config("tiny", backend.tokenizer, use_sliding_window=True, sliding_window=32, max_window_layers=1)
    assert "sliding_attention" in config.layer_types
    torch.manual_seed(0)
    loaded = LoadedModel(
        model=transformers.Qwen3ForCausalLM(config).eval(), tokenizer=backend.tokenizer, spec="sliding", meta={}
    )
    sliding = TransformersBackend(loaded=loaded)
    assert sliding.decode == "dynamic"
    comps = sliding.complete_sync(long_prompt, n=3, max_new_tokens=20, seed=1)
    scored = sliding.score_ids(sliding.encode(long_prompt), [c.token_ids for c in comps])
    for c, s in zip(comps, scored, strict=True):
        assert math.isclose(c.logprob, s, rel_tol=1e-4, abs_tol=1e-3)
    with pytest.raises(ConfigError, match="full attention in every layer"):
        TransformersBackend(loaded=loaded, decode="static")
    sliding.decode = "static"
    with pytest.raises(ConfigError, match="use decode='dynamic'"):
        sliding.complete_sync(long_prompt, n=2, max_new_tokens=4)


# ----------------------------------------------------------------- GPU only (skipped here)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@gpu
def test_auto_decodes_with_cuda_graphs_on_a_gpu(backend: TransformersBackend, prompt: str) -> None:
    b = TransformersBackend("tiny", texts=["ls -la\n", "total 0\n"], vocab_size=300, device="cuda")
    assert b.decode == "cuda_graph"
    b.complete_sync(prompt, n=2, max_new_tokens=8)
    assert b.fallback_reason is None and b.decode == "cuda_graph"


@gpu
@pytest.mark.parametrize(
    ("path", "dtype", "cases"),
    [
        ("cuda_graph", "float32", [(1, "greedy"), (8, "sample")]),
        ("cuda_graph", "bfloat16", [(1, "greedy"), (8, "sample")]),  # the same kernels: same numbers
        pytest.param("compile", "float32", [(8, "sample")], marks=pytest.mark.slow),
    ],
)
def test_gpu_paths_match_static_on_the_gpu(
    backend: TransformersBackend, prompt: str, long_prompt: str, path: str, dtype: str, cases: list[tuple[int, str]]
) -> None:
    import copy

    from aospec.drafters.model import LoadedModel

    model = copy.deepcopy(backend.loaded.model).to(device="cuda", dtype=getattr(torch, dtype))
    loaded = LoadedModel(model=model, tokenizer=backend.tokenizer, spec="tiny", meta={})
    prompts = {"short": prompt, "long": long_prompt}
    static = TransformersBackend(loaded=loaded, decode="static")
    fast = TransformersBackend(loaded=loaded, decode=path)
    for batch, mode in cases:
        want = run_sequence(static, prompts, batch, mode)
        got = run_sequence(fast, prompts, batch, mode)
        assert fast.fallback_reason is None and fast.decode == path
        rows = 1 if mode == "greedy" else batch
        assert {k[1] for k in fast._runners if k[0] == rows} == {256, 512}
        if path == "cuda_graph":
            assert all(r.graph is not None for r in fast._runners.values())
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, what=f"{path} {dtype} batch {batch} {mode}, request {i}")


# ----------------------------------------------------------------- streaming text (on_text)

cxx = pytest.mark.skipif(
    not shutil.which(os.environ.get("CXX", "g++")), reason="torch.compile on a CPU needs a C++ compiler (g++ or $CXX)"
)
STREAM_PATHS = ["dynamic", "static", "generate", pytest.param("compile", marks=[pytest.mark.slow, cxx])]


@pytest.mark.slow
@pytest.mark.parametrize("path", STREAM_PATHS)
def test_on_text_streams_the_text_without_changing_the_completion(
    backend: TransformersBackend, prompt: str, path: str
) -> None:
    b = TransformersBackend(loaded=backend.loaded, decode=path)
    # Sampled replies of the random model are full of lone bytes of multi-byte characters:
    # the pieces hold their text back until it is final, and still add up to the text.
    for mode, seed in [("greedy", 0), ("sample", 1), ("sample", 2), ("sample", 3)]:
        want = b.complete_sync(prompt, n=1, max_new_tokens=48, mode=mode, seed=seed)
        pieces: list[str] = []
        got = b.complete_sync(prompt, n=1, max_new_tokens=48, mode=mode, seed=seed, on_text=pieces.append)
        assert_same(got, want, what=f"{path} {mode} {seed}")
        assert got[0].token_logprobs == want[0].token_logprobs
        assert "".join(pieces) == got[0].text and len(pieces) > 1 and all(pieces)
    assert b.decode == path and b.fallback_reason is None


@pytest.mark.parametrize("path", ["dynamic", "static", "generate"])
def test_the_stream_ends_at_the_end_token(backend: TransformersBackend, prompt: str, path: str) -> None:
    b = TransformersBackend(loaded=backend.loaded, decode=path)
    free = b.complete_sync(prompt, n=1, max_new_tokens=32, mode="sample", seed=3)[0]
    end = free.token_ids[12]  # make a token the reply reaches mid-way its end token
    cut = free.token_ids.index(end)
    b._end_ids = (end,)
    b._end_tensor = torch.tensor([end])
    want = b.complete_sync(prompt, n=1, max_new_tokens=32, mode="sample", seed=3)
    pieces: list[str] = []
    got = b.complete_sync(prompt, n=1, max_new_tokens=32, mode="sample", seed=3, on_text=pieces.append)
    assert_same(got, want, what=path)
    assert got[0].finished and got[0].token_ids == free.token_ids[: cut + 1]
    assert "".join(pieces) == got[0].text == b.decode_text(free.token_ids[:cut])


def test_text_stream_holds_back_unfinished_characters(backend: TransformersBackend) -> None:
    from aospec.drafters.backends.transformers import _TextStream

    text = "ls → 日本語 ✓ é\n```bash\necho 'naïve' > x\n```"
    ids = backend.encode(text)
    assert any("\ufffd" in backend.decode_text([i]) for i in ids)  # characters split across tokens
    pieces: list[str] = []
    stream = _TextStream(backend, pieces.append)
    assert not any(stream.push(i) for i in ids)
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces) and len(pieces) > 5
    assert stream.push(backend._end_ids[0]) and stream.push(ids[0])  # ended: later tokens are ignored
    stream.finish(text)
    assert "".join(pieces) == text
    # A reply cut inside a character: the held-back bytes come at the end, as decoded.
    cut = next(k for k in range(1, len(ids)) if backend.decode_text(ids[:k]).endswith("\ufffd"))
    pieces.clear()
    stream = _TextStream(backend, pieces.append)
    for i in ids[:cut]:
        stream.push(i)
    assert "\ufffd" not in "".join(pieces)
    stream.finish(backend.decode_text(ids[:cut]))
    assert "".join(pieces) == backend.decode_text(ids[:cut])


def test_a_stop_set_by_on_text_ends_the_decode_at_that_token(backend: TransformersBackend, prompt: str) -> None:
    import threading

    b = TransformersBackend(loaded=backend.loaded, max_context=8192)
    stop = threading.Event()
    pieces: list[str] = []

    def on_text(piece: str) -> None:
        pieces.append(piece)
        stop.set()

    (c,) = b.complete_sync(prompt, n=1, max_new_tokens=4000, mode="greedy", stop=stop, on_text=on_text)
    # The token whose text was the first piece is the last one decoded.
    assert c.tokens <= 8 and "".join(pieces) == c.text and not c.finished
    assert c.token_ids == b.complete_sync(prompt, n=1, max_new_tokens=c.tokens, mode="greedy")[0].token_ids
    assert len(pieces) == 1 or c.text.endswith("\ufffd")


def test_on_text_streams_only_one_sequence(backend: TransformersBackend, prompt: str) -> None:
    with pytest.raises(ConfigError, match="on_text streams one sequence"):
        backend.complete_sync(prompt, n=2, max_new_tokens=4, on_text=print)
    with pytest.raises(ConfigError, match="on_text streams one sequence"):
        backend.complete_sync(prompt, n=2, max_new_tokens=4, mode="beam", on_text=print)
    assert backend.complete_sync(prompt, n=3, max_new_tokens=4, mode="greedy", on_text=lambda p: None)  # 1 row


@gpu
def test_on_text_on_cuda_graphs_keeps_the_tokens(backend: TransformersBackend, prompt: str) -> None:
    import copy

    from aospec.drafters.model import LoadedModel

    model = copy.deepcopy(backend.loaded.model).to(device="cuda")
    b = TransformersBackend(
        loaded=LoadedModel(model=model, tokenizer=backend.tokenizer, spec="tiny", meta={}), decode="cuda_graph"
    )
    for mode, seed in [("greedy", 0), ("sample", 1)]:
        want = b.complete_sync(prompt, n=1, max_new_tokens=48, mode=mode, seed=seed)
        pieces: list[str] = []
        got = b.complete_sync(prompt, n=1, max_new_tokens=48, mode=mode, seed=seed, on_text=pieces.append)
        assert_same(got, want, what=mode)
        assert "".join(pieces) == got[0].text and len(pieces) > 1
    assert b.decode == "cuda_graph" and b.fallback_reason is None
