"""The text engine on the real SmolLM2 demo model: streaming, stop strings, usage, cancel, seeds, limits."""

from __future__ import annotations

import time
from dataclasses import replace

import mlx_lm
import pytest

from jobs.settings import load_settings
from jobs.store import resolve
from workers.engine import Canceled, Runtime
from workers.registry import ModelTooLarge, weight_stats
from workers.text import ContextLengthExceeded, Sampling, StopBuffer

MODEL = "smollm2-135m"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
STORY = "Once upon a time, a dragon"  # a plain completion prompt: a few tokens, so quick to prefill
GREEDY = Sampling(temperature=0.0, max_tokens=40)


@pytest.fixture(scope="module")
def runtime(models_dir):
    """One engine for the module (no Redis needed: a reader cancels by closing its stream)."""
    if not (models_dir / MODEL / "config.json").exists():
        pytest.fail(f"demo model missing in {models_dir}: run `mlxq models pull-demo` first")
    rt = Runtime.create(load_settings({"models_dir": models_dir}))
    yield rt
    rt.engine.stop()


@pytest.fixture(scope="module")
def info(runtime):
    """The demo model's catalog entry."""
    return resolve(MODEL, runtime.settings)


@pytest.fixture(scope="module")
def tokenizer(runtime, info):
    """The resident model's tokenizer (pure Python: fine to use off the engine thread)."""
    return runtime.warm(info).processor


def run(runtime, info, prompt, sampling):
    """Generate for a chat or a plain prompt; return (the pieces as streamed, the final piece)."""
    pieces = [p for batch in runtime.generate_text(info, prompt, sampling).batches() for p in batch]
    return pieces, pieces[-1]


@pytest.fixture(scope="module")
def reference(runtime, info, tokenizer) -> str:
    """mlx-lm's own non-streaming greedy answer to FRANCE, generated on the engine thread."""
    ids = tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=True)
    model = runtime.warm(info).model
    return runtime.engine.call(lambda: mlx_lm.generate(model, tokenizer, ids, max_tokens=GREEDY.max_tokens))


@pytest.fixture(scope="module")
def greedy(runtime, info):
    """Our streamed greedy answer to FRANCE: (pieces, final piece)."""
    return run(runtime, info, FRANCE, GREEDY)


def test_greedy_chat_streams_exactly_the_full_answer(greedy, reference):
    pieces, final = greedy
    text = "".join(p.text for p in pieces)
    assert "Paris" in text
    assert text == reference
    assert final.finish_reason == "stop"  # the model ended its turn (EOS) well before 40 tokens
    assert all(p.text for p in pieces[:-1]), "empty pieces are not streamed"


def test_usage_counts_real_tokens(greedy, reference, tokenizer):
    _, final = greedy
    assert final.prompt_tokens == len(tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True,
                                                                     tokenize=True))
    # The answer's tokens plus the end-of-turn token, which was generated too.
    assert final.tokens == len(tokenizer.encode(reference, add_special_tokens=False)) + 1


def test_stop_string_truncates_and_is_never_streamed(runtime, info, tokenizer, reference):
    stop = "France is"  # spans two tokens (" France", " is"): the first must be held back
    assert stop in reference
    pieces, final = run(runtime, info, FRANCE, replace(GREEDY, stop=("no such stop", stop)))
    text = "".join(p.text for p in pieces)
    assert text == reference[: reference.index(stop)]
    assert final.finish_reason == "stop"
    assert not any("France" in p.text for p in pieces)
    # Counted up to and including the token that completed the stop string.
    through_stop = reference[: reference.index(stop) + len(stop)]
    assert final.tokens == len(tokenizer.encode(through_stop, add_special_tokens=False))


def test_max_tokens_finishes_with_length(runtime, info, tokenizer):
    pieces, final = run(runtime, info, STORY, replace(GREEDY, max_tokens=5))
    text = "".join(p.text for p in pieces)
    assert final.finish_reason == "length"
    assert final.tokens == 5
    assert final.prompt_tokens == len(tokenizer.encode(STORY))
    assert len(tokenizer.encode(text, add_special_tokens=False)) == 5


def test_closing_the_stream_stops_generation_at_the_next_token(runtime, info):
    seen = []
    stream = runtime.generate_text(info, STORY, replace(GREEDY, max_tokens=300))
    with pytest.raises(Canceled, match="canceled after"):
        for batch in stream.batches(timeout=120):
            seen.extend(batch)
            if seen[-1].tokens >= 3 and not stream.closed:
                stream.close()
                at_cancel = seen[-1].tokens
    # The engine may have produced a token or two before it saw the close, never the 300.
    assert seen[-1].tokens <= at_cancel + 2, "generation went on after the stream was closed"
    assert runtime.engine.call(lambda: "idle", timeout=60) == "idle", "the engine is free for the next request"


def test_batches_gather_tokens_within_the_interval_and_never_hold_the_last(runtime, info):
    pieces = run(runtime, info, STORY, replace(GREEDY, max_tokens=12))[0]
    stream = runtime.generate_text(info, STORY, replace(GREEDY, max_tokens=12))
    started = time.monotonic()
    batches = list(stream.batches(timeout=120, interval=60.0))  # far longer than the whole generation
    # What is ready at the first piece comes at once; everything after it waits for the interval,
    # except the final piece, which ends the wait: no minute-long hold.
    assert time.monotonic() - started < 30
    assert len(batches) <= 2
    assert [p.text for b in batches for p in b] == [p.text for p in pieces]
    assert batches[-1][-1].final and batches[-1][-1].finish_reason == "length"


def test_seed_makes_sampling_reproducible(runtime, info):
    def sample(seed):
        pieces, _ = run(runtime, info, STORY, Sampling(temperature=1.0, top_p=0.95, max_tokens=8, seed=seed))
        return "".join(p.text for p in pieces)

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3)), "different seeds should sample differently"


def test_prompt_longer_than_the_context_is_refused(runtime, info):
    tiny = replace(info, context_length=8)
    with pytest.raises(ContextLengthExceeded, match="context length is 8"):
        run(runtime, tiny, FRANCE, GREEDY)


def test_model_larger_than_the_budget_is_refused_before_loading(info, models_dir):
    small = Runtime.create(load_settings({"models_dir": models_dir, "memory_budget_mb": 10}))
    try:
        with pytest.raises(ModelTooLarge, match="budget is 10 MiB"):
            small.warm(info)
        assert small.registry.resident() == []
    finally:
        small.engine.stop()


def test_weight_stats_read_from_safetensors_headers(info):
    stats = weight_stats(info.path)
    assert 90 * 2**20 < stats.stored_bytes <= info.size_bytes
    assert stats.float32_bytes == 134_515_008 * 4  # SmolLM2-135M's parameter count, in float32


def test_stop_buffer_holds_back_possible_stop_prefixes():
    buffer = StopBuffer(["\nUser:", "END"])
    assert buffer.feed("Hello\nUs") == ("Hello", False)
    assert buffer.feed("ually") == ("\nUsually", False)
    assert buffer.feed(" E") == (" ", False)
    assert buffer.feed("NDING") == ("", True)
    assert StopBuffer([]).feed("x") == ("x", False)
