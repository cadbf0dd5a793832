"""A sentence-transformers BERT embedding model in plain numpy (float32): the reference the embeddings tests
check the service's vectors against. Each text is encoded alone (no padding, so no attention mask)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file
from scipy.special import erf  # scipy comes with mlx-audio; numpy has no erf
from tokenizers import Tokenizer


def reference_token_ids(model_dir: Path | str, texts: list[str]) -> list[list[int]]:
    """Each text's token ids, [CLS] ... [SEP], truncated to the model's max_seq_length."""
    model_dir = Path(model_dir)
    max_len = json.loads((model_dir / "sentence_bert_config.json").read_text())["max_seq_length"]
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.no_padding()  # all-MiniLM-L6-v2's tokenizer.json pads and truncates to 128 by itself
    tokenizer.enable_truncation(max_len)
    return [e.ids for e in tokenizer.encode_batch(texts)]


def reference_embeddings(model_dir: Path | str, texts: list[str]) -> np.ndarray:
    """The texts' sentence embeddings, float32 [len(texts), hidden]: BERT, pooling, then L2 norm if the model has it."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    pooling = json.loads((model_dir / "1_Pooling" / "config.json").read_text())
    modules = json.loads((model_dir / "modules.json").read_text())
    weights = load_file(str(model_dir / "model.safetensors"))
    vectors = []
    for ids in reference_token_ids(model_dir, texts):
        hidden = bert(weights, config, np.array(ids))
        vectors.append(hidden[0] if pooling.get("pooling_mode_cls_token") else hidden.mean(axis=0))
    out = np.stack(vectors).astype(np.float32)
    if any(m["type"].endswith(".Normalize") for m in modules):
        out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
    return out


def bert(w: dict, config: dict, ids: np.ndarray) -> np.ndarray:
    """The last hidden states [len(ids), hidden] of one unpadded sequence (token type 0 throughout)."""
    eps = config["layer_norm_eps"]
    x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][: len(ids)]
         + w["embeddings.token_type_embeddings.weight"][0])
    x = layer_norm(x, w, "embeddings.LayerNorm", eps)
    heads = config["num_attention_heads"]
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        q, k, v = (dense(x, w, p + f"attention.self.{n}") for n in ("query", "key", "value"))
        q, k, v = (t.reshape(len(ids), heads, -1).transpose(1, 0, 2) for t in (q, k, v))
        scores = q @ k.transpose(0, 2, 1) / np.float32(np.sqrt(q.shape[-1]))
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        context = (scores / scores.sum(axis=-1, keepdims=True)) @ v
        context = context.transpose(1, 0, 2).reshape(len(ids), -1)
        x = layer_norm(x + dense(context, w, p + "attention.output.dense"), w, p + "attention.output.LayerNorm", eps)
        h = dense(x, w, p + "intermediate.dense")
        h = (0.5 * h * (1 + erf(h / np.sqrt(2)))).astype(np.float32)  # exact GELU, as BERT's "gelu"
        x = layer_norm(x + dense(h, w, p + "output.dense"), w, p + "output.LayerNorm", eps)
    return x


def dense(x: np.ndarray, w: dict, name: str) -> np.ndarray:
    """A torch Linear layer: x @ weight.T + bias."""
    return x @ w[name + ".weight"].T + w[name + ".bias"]


def layer_norm(x: np.ndarray, w: dict, name: str, eps: float) -> np.ndarray:
    """LayerNorm over the last axis, with the layer's weight and bias."""
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + np.float32(eps)) * w[name + ".weight"] + w[name + ".bias"]
