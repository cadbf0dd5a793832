"""Text generation on the real SmolLM2 demo model: streaming, stop strings, usage, seeds, limits, safety."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import mlx_lm
import pytest

from jobs.contract import Sampling
from jobs.errors import ContextLengthExceeded, ModelTooLarge
from jobs.settings import load_settings
from jobs.store import resolve
from workers.backends import textgen
from workers.backends.textgen import StopBuffer
from workers.main import build_scheduler
from workers.models import weight_stats

MODEL = "smollm2-135m"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
STORY = "Once upon a time, a dragon"  # a plain completion prompt: a few tokens, so quick to prefill
GREEDY = Sampling(temperature=0.0, max_tokens=40)


@pytest.fixture(scope="module")
def models(models_dir, text_worker_parts):
    """The worker's model manager, with the real backends' loaders (no Redis needed here; shared with
    test_batching: tests/workers/conftest.py)."""
    if not (models_dir / MODEL / "config.json").exists():
        pytest.fail(f"demo model missing in {models_dir}: run `mlxq models pull-demo` first")
    return text_worker_parts[0]


@pytest.fixture(scope="module")
def info(models_dir):
    """The demo model's catalog entry."""
    return resolve(MODEL, load_settings({"models_dir": models_dir}))


@pytest.fixture(scope="module")
def tokenizer(models, info):
    """The resident model's tokenizer."""
    return models.get(info).processor


def run(models, info, prompt, sampling):
    """Generate for a chat or a plain prompt; return (the pieces with text or a finish, the final piece)."""
    resident = models.get(info)
    tokenizer = resident.processor
    ids = textgen.chat_prompt(tokenizer, prompt) if isinstance(prompt, list) else textgen.text_prompt(tokenizer, prompt)
    pieces = [p for p in textgen.generate(resident.model, tokenizer, ids, sampling, info.context_length)
              if p.text or p.finish_reason]
    return pieces, pieces[-1]


@pytest.fixture(scope="module")
def reference(models, info, tokenizer) -> str:
    """mlx-lm's own non-streaming greedy answer to FRANCE."""
    ids = tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=True)
    return mlx_lm.generate(models.get(info).model, tokenizer, ids, max_tokens=GREEDY.max_tokens)


@pytest.fixture(scope="module")
def greedy(models, info):
    """Our streamed greedy answer to FRANCE: (pieces, final piece)."""
    return run(models, info, FRANCE, GREEDY)


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


def test_stop_string_truncates_and_is_never_streamed(models, info, tokenizer, reference):
    stop = "France is"  # spans two tokens (" France", " is"): the first must be held back
    assert stop in reference
    pieces, final = run(models, info, FRANCE, replace(GREEDY, stop=("no such stop", stop)))
    text = "".join(p.text for p in pieces)
    assert text == reference[: reference.index(stop)]
    assert final.finish_reason == "stop"
    assert not any("France" in p.text for p in pieces)
    # Counted up to and including the token that completed the stop string.
    through_stop = reference[: reference.index(stop) + len(stop)]
    assert final.tokens == len(tokenizer.encode(through_stop, add_special_tokens=False))


def test_max_tokens_finishes_with_length(models, info, tokenizer):
    pieces, final = run(models, info, STORY, replace(GREEDY, max_tokens=5))
    text = "".join(p.text for p in pieces)
    assert final.finish_reason == "length"
    assert final.tokens == 5
    assert final.prompt_tokens == len(tokenizer.encode(STORY))
    assert len(tokenizer.encode(text, add_special_tokens=False)) == 5


def test_prompt_longer_than_the_context_is_refused(models, info):
    tiny = replace(info, context_length=8)
    with pytest.raises(ContextLengthExceeded, match="context length is 8"):
        run(models, tiny, FRANCE, GREEDY)


def test_model_larger_than_the_budget_is_refused_before_loading(info, models_dir):
    small = build_scheduler(load_settings({"models_dir": models_dir, "memory_budget_mb": 10}), "test-small").models
    with pytest.raises(ModelTooLarge, match="budget is 10 MiB"):
        small.load(info)
    assert small.list() == []


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


def test_seed_makes_sampling_reproducible_and_top_k_of_the_whole_vocabulary_is_no_top_k(models, info):
    # mlx-lm refuses top_k >= its vocabulary inside a compiled sampler; the backend treats it as no top_k:
    # the same seed then draws the same text with either, which also shows the seed reproduces its draws.
    whole = Sampling(temperature=0.8, top_k=info.vocab_size, seed=1234, max_tokens=8)

    def sample(sampling) -> tuple[str, int]:
        pieces, final = run(models, info, STORY, sampling)
        return "".join(p.text for p in pieces), final.tokens

    first = sample(whole)
    assert first[1] == 8 and sample(replace(whole, top_k=0)) == first
    assert any(sample(replace(whole, seed=seed))[0] != first[0] for seed in (1, 2, 3)), \
        "different seeds should sample differently"


def test_sampling_leaves_mlx_global_random_state_alone(models, info):
    # Each sequence draws from its own counter-based stream: a failed or finished request can leave
    # nothing behind in MLX's global generator (mlx-lm's compiled samplers once left a placeholder there,
    # and every later sampled request failed).
    mx.random.seed(11)
    expected = mx.random.uniform(shape=(4,)).tolist()
    mx.random.seed(11)
    _, final = run(models, info, STORY, Sampling(temperature=0.7, top_p=0.9, max_tokens=4))
    assert final.tokens == 4
    assert mx.random.uniform(shape=(4,)).tolist() == expected
