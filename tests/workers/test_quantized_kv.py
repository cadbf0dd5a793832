"""Quantized KV caches in the text batch, on a tiny random Llama: sequences merged, extended, filtered and
extracted decode as they do alone; prompts processed together as alone; prompt-cache hits that never write
the kept entry; and the memory budget counting what the quantized arrays really hold."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import trim_prompt_cache

from jobs.errors import JobError
from jobs.kv_quant import KVQuant
from jobs.settings import load_settings
from workers.backends import quantized_kv
from workers.backends.decoding import DecodeBatch, Joining
from workers.backends.prefill import Prompt, feed_together
from workers.backends.prompt_cache import PromptCache
from workers.backends.quantized_kv import BatchQuantizedKVCache, QuantizedCache, make_cache
from workers.backends.sampling import Row
from workers.backends.textbatch import kv_bytes_per_token

VOCAB = 512
KVS = [KVQuant(8, 64), KVQuant(4, 32)]


@pytest.fixture(scope="module")
def model(models_dir):
    """A 2-layer Llama of the demo model's config (grouped-query attention, 64-element heads), random weights
    at their default scale: logits far enough apart that greedy tokens never hang on a rounding."""
    from mlx_lm.utils import _get_classes

    config = json.loads((models_dir / "smollm2-135m" / "config.json").read_text())
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    config.update(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, intermediate_size=256, vocab_size=VOCAB)
    model_class, args_class = _get_classes(config)
    mx.random.seed(7)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def prompt_ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def alone(model, ids: list[int], kv: KVQuant, n: int) -> list[int]:
    """The greedy tokens of a sequence decoded by itself, on mlx-lm's one-sequence quantized cache."""
    cache = make_cache(model, kv)
    logits = model(mx.array(ids)[None], cache=cache)[0, -1]
    tokens = []
    for _ in range(n):
        tokens.append(mx.argmax(logits).item())
        logits = model(mx.array([[tokens[-1]]]), cache=cache)[0, -1]
    return tokens


def joining(model, key, ids: list[int], kv: KVQuant) -> Joining:
    """A sequence ready to join a DecodeBatch: its prompt processed, its first (greedy) token drawn."""
    prompt = Prompt(None, [], make_cache(model, kv), [], list(ids), 0)
    logits = prompt.feed(model, len(ids))
    return Joining(key, prompt.cache, prompt.fed, mx.argmax(logits).item(), 1000, Row())


@pytest.mark.parametrize("kv", KVS, ids=str)
def test_sequences_decode_in_the_batch_as_they_decode_alone(model, kv):
    lengths = {"a": 3, "b": 11, "c": 6, "d": 9}  # each row its own left padding
    ids = {key: prompt_ids(i, n) for i, (key, n) in enumerate(lengths.items())}
    got = {key: [] for key in ids}
    keys = {key: object() for key in ids}  # the decoder tells its sequences apart by identity
    names = {id(k): key for key, k in keys.items()}
    decoder = DecodeBatch(model, VOCAB, set())

    def join(*which):
        for key in which:
            got[key].append(None)  # its first token: drawn before it joined (filled in below)
        new = [joining(model, keys[key], ids[key], kv) for key in which]
        for key, j in zip(which, new, strict=True):
            got[key][-1] = j.first
        decoder.insert_many(new)

    def steps(n):
        for _ in range(n):
            for out in decoder.step():
                got[names[id(out.key)]].append(out.token)

    join("a", "b")  # two merge into a batch cache
    assert type(decoder.cache[0]) is BatchQuantizedKVCache
    steps(3)
    join("c")  # one joins the batch: extend
    steps(2)
    kept = decoder.remove([keys["b"]], keep_caches=True)  # one leaves with its cache: extract, then filter
    (cache, fed), = kept
    assert all(type(c) is QuantizedCache and c.offset == len(fed) for c in cache)
    steps(2)
    join("d")
    steps(4)
    decoder.remove([keys["a"], keys["c"]])  # one left: back to a one-sequence cache
    assert type(decoder.cache[0]) is QuantizedCache
    steps(3)
    for key in ids:
        assert len(got[key]) > 3, key
        assert got[key] == alone(model, ids[key], kv, len(got[key])), key
    # The cache "b" left with continues as its own would have: the next token is the one alone gives.
    reference = alone(model, ids["b"], kv, len(fed) - len(ids["b"]) + 1)
    logits = model(mx.array([[fed[-1]]]), cache=cache)[0, -1]
    assert mx.argmax(logits).item() == reference[-1]


@pytest.mark.parametrize("kv", KVS, ids=str)
def test_prompts_processed_together_give_what_they_give_alone(model, kv):
    ids = [prompt_ids(10 + i, n) for i, n in enumerate((5, 17, 8, 12))]
    cached = [0, 4, 0, 9]  # two resume from a cached prefix of their own

    def prompts():
        out = [Prompt(None, [], make_cache(model, kv), [], list(i), n) for n, i in enumerate(ids)]
        for prompt, n in zip(out, cached, strict=True):
            if n:
                prompt.feed(model, n)
        return out

    by_one, together = prompts(), prompts()
    assert all(p.plain for p in together)
    logits_alone = [p.feed(model, p.left) for p in by_one]
    logits_together = feed_together(model, together)
    for a, b, la, lb in zip(by_one, together, logits_alone, logits_together, strict=True):
        assert a.fed == b.fed and not b.rest
        assert all(type(c) is QuantizedCache and c.offset == len(b.fed) for c in b.cache)
        assert mx.allclose(la, lb, atol=1e-3).item() and mx.argmax(la).item() == mx.argmax(lb).item()
        token = mx.array([[mx.argmax(la).item()]])
        next_a, next_b = model(token, cache=a.cache)[0, -1], model(token, cache=b.cache)[0, -1]
        assert mx.allclose(next_a, next_b, atol=1e-3).item()


def processed(model, ids: list[int], kv: KVQuant) -> list:
    cache = make_cache(model, kv)
    model(mx.array(ids)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def test_a_hit_on_a_quantized_entry_resumes_as_a_fresh_prefill_and_never_writes_the_entry(model):
    kv = KVS[0]
    kept = prompt_ids(20, 64)  # its buffers (256 tokens) have room: a hit that wrote into them would show
    cache = PromptCache(max_size=4)
    cache.insert_cache("m", kept, processed(model, kept, kv))
    entry = cache._trie.get("m", kept).prompt_cache
    before = [[np.array(part[..., :64, :]) for part in (*c.keys, *c.values)] for c in entry]
    new = prompt_ids(21, 8)
    for case, ids, expected in [("longer", kept[:20] + new, 20), ("shorter", kept + new, 64), ("exact", kept, 64)]:
        got, rest = cache.fetch_nearest_cache("m", ids)
        assert len(ids) - len(rest) == expected, case
        assert all(type(c) is QuantizedCache for c in got), case
        if not rest:  # the whole prompt was cached: its last token is fed again (as the batch does)
            trim_prompt_cache(got, 1)
            rest = ids[-1:]
        fresh = processed(model, ids[:len(ids) - len(rest)], kv)
        np.testing.assert_allclose(np.array(model(mx.array(rest)[None], cache=got)[0, -1]),
                                   np.array(model(mx.array(rest)[None], cache=fresh)[0, -1]), atol=1e-4, err_msg=case)
        for parts, c in zip(before, entry, strict=True):
            for part, now in zip(parts, (*c.keys, *c.values), strict=True):
                np.testing.assert_array_equal(part, np.array(now[..., :64, :]), err_msg=case)


@pytest.mark.parametrize("kv", [None, *KVS], ids=str)
def test_the_budget_counts_the_bytes_the_quantized_arrays_hold(model, kv):
    tokens = 512  # a multiple of the caches' 256-token steps: no room allocated beyond what is held
    cache = processed(model, prompt_ids(30, tokens), kv)
    real = sum(c.nbytes for c in cache)
    assert kv_bytes_per_token(model, True, kv) * tokens == real
    kept = PromptCache(max_size=2)
    kept.insert_cache("m", prompt_ids(30, tokens), cache)
    assert kept.nbytes == real  # kept caches count at their quantized size too
    batch = BatchQuantizedKVCache.merge([c for c in cache[:1]]) if kv else None
    if batch is not None:
        assert batch.nbytes == cache[0].nbytes
    # Per head vector of 64 float32 elements (256 bytes): 8 bits 64 + 2 x 4 (a scale and a bias per group of 64),
    # 4 bits 32 + 4 x 4 (per group of 32).
    unquantized = kv_bytes_per_token(model, True)
    assert {None: 1.0, KVS[0]: 256 / 72, KVS[1]: 256 / 48}[kv] == pytest.approx(unquantized / (real / tokens))


def test_a_group_size_the_heads_cannot_be_cut_into_is_refused_by_name(model, tmp_path):
    (tmp_path / "mlxq.json").write_text(json.dumps({"kv_bits": 8, "kv_group_size": 128}))
    with pytest.raises(JobError, match="64 elements.*groups of 128") as caught:
        quantized_kv.for_model(model, tmp_path, load_settings(environ={}))
    assert caught.value.code == "invalid_model_settings"
    (tmp_path / "mlxq.json").write_text(json.dumps({"kv_bits": 6}))
    with pytest.raises(JobError, match="mlxq.json: KV bits must be one of 4, 8"):
        quantized_kv.for_model(model, tmp_path, load_settings(environ={}))
    assert quantized_kv.for_model(model, tmp_path / "none", load_settings(environ={"MLXQ_KV_BITS": "4"})) == KVQuant(4)


def test_the_lone_decoder_decodes_on_a_quantized_cache_with_the_same_greedy_answer(demo_text_model, monkeypatch):
    # The path of a model that cannot batch (mlx-lm's stream_generate), on the demo model as the worker holds it.
    import mlx_lm

    from jobs.contract import Sampling
    from workers.backends import textgen

    model, tokenizer = demo_text_model
    system = {"role": "system", "content": "You are a patient teacher who answers in plain words, briefly."}
    ids = textgen.chat_prompt(tokenizer, [system, {"role": "user", "content": "Why is the sky blue?"}])
    greedy = Sampling(temperature=0.0, max_tokens=16)
    caches, stream_generate = [], mlx_lm.stream_generate
    monkeypatch.setattr(mlx_lm, "stream_generate",
                        lambda *a, **k: caches.append(k.get("prompt_cache")) or stream_generate(*a, **k))
    plain = [p for p in textgen.generate(model, tokenizer, ids, greedy)]
    quantized = [p for p in textgen.generate(model, tokenizer, ids, greedy, kv=KVS[0])]
    assert caches[0] is None and all(type(c) is QuantizedCache for c in caches[1])
    assert caches[1][0].offset >= len(ids) + 15  # the prompt and the answer went through the quantized cache
    assert quantized[-1].tokens == plain[-1].tokens == 16
    assert "".join(p.text for p in quantized) == "".join(p.text for p in plain)
