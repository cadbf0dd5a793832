"""GGUF vision (language GGUF + mmproj GGUF) -> mlx-vlm importer, on a tiny random SmolVLM written the llama.cpp way.

No real SmolVLM GGUF is reachable offline, so each test builds one: a seeded random mlx-vlm idefics3
model, renamed to its Hugging Face tensor names and written as llama.cpp's convert_hf_to_gguf.py would
(tensor names from gguf-py's own TensorNameMap, q/k rows permuted for llama.cpp's rope, the patch
convolution in PyTorch layout, SmolVLMModel's clip.* metadata), then converted and loaded with mlx_vlm.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf  # llama.cpp's own gguf-py (a dev extra): its writer, quantizer and tensor-name tables
import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

from mlxq.models_cli import models
from workers.importers.errors import ConversionError, UnsupportedModel
from workers.importers.gguf_vlm import convert_gguf_vlm, merge_quantization

TEXT = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 256, "tie_word_embeddings": False}
VISION = {"model_type": "idefics3_vision", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 2, "patch_size": 8, "image_size": 32, "num_channels": 3, "layer_norm_eps": 1e-6}
SCALE = 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<fake_token_around_image>", "<image>",
            "<end_of_utterance>", "<global-img>", *(f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2))]
MERGES = ["h e", "l l", "ll o"]
# SmolVLM-Instruct's chat template (tokenizer.chat_template in its GGUF): images inline in user turns.
CHAT_TEMPLATE = ("<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
                 "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
                 "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
                 "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
                 "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet, in byte order (the base of a byte-level BPE vocabulary)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b], extra = chr(256 + extra), extra + 1
    return [table[b] for b in range(256)]


TOKENS = byte_tokens() + ["he", "ll", "llo"] + SPECIALS
IMAGE_ID = TOKENS.index("<image>")


def build_original(tied: bool):
    """A seeded random mlx-vlm idefics3 model; every weight is float16-exact so F16 storage is lossless."""
    from mlx.utils import tree_flatten
    from mlx_vlm.models import idefics3

    text = {**TEXT, "vocab_size": len(TOKENS)}
    config = idefics3.ModelConfig(text_config=idefics3.TextConfig.from_dict(text),
                                  vision_config=idefics3.VisionConfig.from_dict(VISION), model_type="idefics3",
                                  scale_factor=SCALE, image_token_id=IMAGE_ID, vocab_size=len(TOKENS))
    model = idefics3.Model(config)
    mx.random.seed(7)
    params = {}
    for name, value in tree_flatten(model.parameters()):
        noise = mx.random.normal(value.shape) * 0.2
        # Norm weights near 1 (not exactly: a wrongly mapped norm must show), everything else random.
        value = 1.0 + 0.5 * noise if re.search(r"norm\d?\.weight$", name) else noise
        params[name] = value.astype(mx.float16).astype(mx.float32)
    if tied:
        params["language_model.lm_head.weight"] = params["language_model.embed_tokens.weight"]
    model.load_weights(list(params.items()))
    mx.eval(model.parameters())
    return model, params


def hf_tensors(params: dict, tied: bool) -> dict[str, np.ndarray]:
    """The model's weights under Hugging Face SmolVLM names and layouts (what convert_hf_to_gguf.py reads)."""
    out = {}
    for name, value in params.items():
        array = np.array(value)
        if name.endswith("patch_embedding.weight"):
            array = array.transpose(0, 3, 1, 2)  # MLX (out, kh, kw, in) -> PyTorch (out, in, kh, kw)
        if name.startswith("language_model.lm_head."):
            if tied:
                continue
            hf = name.replace("language_model.", "")
        elif name.startswith("language_model."):
            hf = name.replace("language_model.", "model.text_model.")
        else:
            hf = "model." + name
        out[hf] = array
    return out


def llama_cpp_permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: HF's half-split rope rows -> llama.cpp's interleaved pairs."""
    return rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def storage(array: np.ndarray, ftype: str, force_f32: bool):
    """(data, raw_dtype) as llama.cpp stores a tensor under outtype f32 / f16 / q8_0."""
    if ftype == "f32" or array.ndim <= 1 or force_f32:
        return array.astype(np.float32), None
    if ftype == "q8_0" and array.shape[-1] % 32 == 0:
        q = gguf.quants.quantize(array.astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
        return q, gguf.GGMLQuantizationType.Q8_0
    return array.astype(np.float16), None


def stored_values(array: np.ndarray, ftype: str, force_f32: bool) -> np.ndarray:
    """The float values llama.cpp's file holds for a tensor (what an exact converter must reproduce)."""
    data, raw = storage(array, ftype, force_f32)
    if raw is None:
        return data.astype(np.float32)
    return gguf.quants.dequantize(data, raw).reshape(array.shape)


def add_tensors(writer, tensors: dict, ftype: str) -> None:
    for name, array in tensors.items():
        # SmolVLMModel.tensor_force_quant keeps the patch and position embeddings F32.
        data, raw = storage(array, ftype, force_f32=name.startswith(("v.patch_embd", "v.position_embd")))
        writer.add_tensor(name, data, raw_shape=data.shape if raw else None, raw_dtype=raw)


def finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_text_gguf(path: Path, hf: dict, ftype: str) -> None:
    """The language half, as convert_hf_to_gguf.py's LlamaModel writes a SmolVLM (vision tensors skipped)."""
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, TEXT["num_hidden_layers"])
    tensors = {}
    for name, array in hf.items():
        if "vision_model" in name or "model.connector" in name:
            continue
        name = name.replace("text_model.", "")
        if name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, TEXT["num_attention_heads"])
        if name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, TEXT["num_key_value_heads"])
        tensors[name_map.get_name(name, try_suffixes=(".weight", ".bias"))] = array
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("Tiny SmolVLM")
    writer.add_context_length(TEXT["max_position_embeddings"])
    writer.add_embedding_length(TEXT["hidden_size"])
    writer.add_block_count(TEXT["num_hidden_layers"])
    writer.add_feed_forward_length(TEXT["intermediate_size"])
    writer.add_head_count(TEXT["num_attention_heads"])
    writer.add_head_count_kv(TEXT["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(TEXT["rms_norm_eps"])
    writer.add_rope_freq_base(TEXT["rope_theta"])
    writer.add_rope_dimension_count(TEXT["hidden_size"] // TEXT["num_attention_heads"])
    writer.add_vocab_size(len(TOKENS))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TOKENS)
    # llama.cpp marks the added special tokens CONTROL (gguf.TokenType), the rest NORMAL.
    writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in TOKENS])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(TOKENS.index("<|im_start|>"))
    writer.add_eos_token_id(TOKENS.index("<end_of_utterance>"))
    writer.add_pad_token_id(TOKENS.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    add_tensors(writer, tensors, ftype)
    finish(writer)


def write_mmproj(path: Path, hf: dict, ftype: str, projector: str = "idefics3", text_width: int | None = None,
                 ) -> None:
    """The vision half, as convert_hf_to_gguf.py --mmproj's SmolVLMModel (an MmprojModel) writes it."""
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, VISION["num_hidden_layers"])
    tensors = {}
    for name, array in hf.items():
        if "vision_model" in name or "model.connector" in name:
            tensors[name_map.get_name(name, try_suffixes=(".weight", ".bias"))] = array
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(text_width or TEXT["hidden_size"])
    writer.add_vision_image_size(VISION["image_size"])
    writer.add_vision_patch_size(VISION["patch_size"])
    writer.add_vision_embedding_length(VISION["hidden_size"])
    writer.add_vision_feed_forward_length(VISION["intermediate_size"])
    writer.add_vision_block_count(VISION["num_hidden_layers"])
    writer.add_vision_head_count(VISION["num_attention_heads"])
    writer.add_vision_image_mean([0.5, 0.4, 0.3])
    writer.add_vision_image_std([0.25, 0.5, 0.75])
    writer.add_clip_projector_type(projector)
    writer.add_vision_attention_layernorm_eps(VISION["layer_norm_eps"])
    writer.add_vision_projector_scale_factor(SCALE)
    writer.add_vision_use_gelu(True)
    writer.add_vision_preproc_image_size(2 * VISION["image_size"])  # preprocessor size.longest_edge
    add_tensors(writer, tensors, ftype)
    finish(writer)


@pytest.fixture(scope="module")
def originals():
    """{tied: (model, params)} for an untied and a tied tiny SmolVLM."""
    return {tied: build_original(tied) for tied in (False, True)}


def write_pair(directory: Path, originals, ftype: str, tied: bool) -> tuple[Path, Path]:
    """Write (model.gguf, mmproj.gguf) for one of the originals under llama.cpp outtype `ftype`."""
    hf = hf_tensors(originals[tied][1], tied)
    text, mmproj = directory / f"tiny-smolvlm-{ftype}.gguf", directory / f"mmproj-tiny-smolvlm-{ftype}.gguf"
    write_text_gguf(text, hf, ftype)
    write_mmproj(mmproj, hf, ftype)
    return text, mmproj


def reference_model(originals, ftype: str, tied: bool):
    """The original model with every weight replaced by the value llama.cpp's file stores for it."""
    model, params = originals[tied]
    if ftype != "q8_0":
        return model  # F32 and F16 (weights are float16-exact) store the values unchanged
    import copy

    reference = copy.deepcopy(model)
    stored = {name: mx.array(stored_values(np.array(value), ftype, force_f32="embeddings" in name))
              for name, value in params.items()}
    reference.load_weights(list(stored.items()))
    return reference


def sample_inputs(processor):
    """input_ids, pixel_values and pixel_attention_mask from the converted directory's own processor."""
    from PIL import Image

    pixels = np.random.default_rng(3).integers(0, 256, (48, 40, 3), dtype=np.uint8)
    prompt = "<|im_start|>User:<image>hello<end_of_utterance>\nAssistant:"
    return processor(text=[prompt], images=[[Image.fromarray(pixels)]])


def logits(model, inputs) -> np.ndarray:
    out = model(inputs["input_ids"], inputs["pixel_values"], pixel_attention_mask=inputs["pixel_attention_mask"])
    return np.array(out.logits.astype(mx.float32))


@pytest.mark.parametrize(("ftype", "tied"), [("f32", False), ("f16", False), ("q8_0", True)])
def test_converted_model_computes_what_the_original_does(tmp_path, originals, ftype, tied):
    import mlx_vlm

    text, mmproj = write_pair(tmp_path, originals, ftype, tied)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    facts = convert_gguf_vlm(text, mmproj, out_dir)
    assert facts["kind"] == "vision" and facts["architecture"] == "idefics3"
    assert facts["name_in_file"] == "Tiny SmolVLM" and facts["context_length"] == 256
    model, processor = mlx_vlm.load(str(out_dir))
    # Compare arithmetic in float32: F16 storage and Q8_0 scales would otherwise round the activations.
    model.set_dtype(mx.float32)
    inputs = sample_inputs(processor)
    ids = np.array(inputs["input_ids"])[0]
    # preproc size 64 over 32-pixel tiles: a 2x2 grid plus the global image, 16 patches / 2**2 = 4 tokens each.
    assert (ids == IMAGE_ID).sum() == 5 * 4
    assert inputs["pixel_values"].shape == (1, 5, 3, 32, 32)
    got, want = logits(model, inputs), logits(reference_model(originals, ftype, tied), inputs)
    assert got.shape == (1, len(ids), len(TOKENS))
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)


def test_generates_what_the_original_would(tmp_path, originals):
    """Through mlx-vlm's own serving path (chat template, image file, KV cache): the original's greedy tokens."""
    import mlx_vlm
    from mlx_vlm.prompt_utils import apply_chat_template
    from PIL import Image

    text, mmproj = write_pair(tmp_path, originals, "f32", tied=False)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    convert_gguf_vlm(text, mmproj, out_dir)
    model, processor = mlx_vlm.load(str(out_dir))
    prompt = apply_chat_template(processor, model.config, "hello", num_images=1)
    assert prompt == "<|im_start|>User:<image>hello<end_of_utterance>\nAssistant:"  # the GGUF's template
    image = tmp_path / "image.png"
    Image.fromarray(np.random.default_rng(5).integers(0, 256, (40, 56, 3), dtype=np.uint8)).save(image)
    result = mlx_vlm.generate(model, processor, prompt, image=[str(image)], max_tokens=5, temperature=0.0)
    inputs = processor(text=[prompt], images=[[Image.open(image)]])
    ids, original = np.array(inputs["input_ids"]), originals[False][0]
    for _ in range(5):  # greedy decoding on the original, recomputing the whole sequence each step
        inputs["input_ids"] = mx.array(ids)
        ids = np.concatenate([ids, logits(original, inputs)[:, -1:].argmax(-1)], axis=1)
    assert list(result.token_ids) == ids[0, -5:].tolist()


def test_directory_files(tmp_path, originals):
    text, mmproj = write_pair(tmp_path, originals, "q8_0", tied=True)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    facts = convert_gguf_vlm(text, mmproj, out_dir)
    assert facts["quantization"] == "Q8_0 (vision: Q8_0)"
    config = json.loads((out_dir / "config.json").read_text())
    assert (config["model_type"], config["scale_factor"], config["image_token_id"]) == ("idefics3", SCALE, IMAGE_ID)
    assert config["vision_config"] == VISION
    assert config["text_config"]["num_key_value_heads"] == 2 and config["text_config"]["rope_traditional"] is False
    assert config["quantization"] == {"group_size": 32, "bits": 8}
    pre = json.loads((out_dir / "preprocessor_config.json").read_text())
    assert pre["image_mean"] == [0.5, 0.4, 0.3] and pre["image_std"] == [0.25, 0.5, 0.75]
    assert pre["size"] == {"longest_edge": 64} and pre["max_image_size"] == {"longest_edge": 32}
    assert json.loads((out_dir / "processor_config.json").read_text())["image_seq_len"] == 4
    weights = mx.load(str(out_dir / "model.safetensors"))
    assert weights["vision_model.embeddings.patch_embedding.weight"].shape == (32, 8, 8, 3)
    for name in ("vision_model.encoder.layers.0.mlp.fc1", "connector.modality_projection.proj",
                 "language_model.layers.0.self_attn.q_proj"):
        assert weights[f"{name}.weight"].dtype == mx.uint32 and f"{name}.scales" in weights  # kept quantized
    assert weights["vision_model.embeddings.position_embedding.weight"].dtype == mx.float32
    assert mx.array_equal(weights["language_model.lm_head.weight"], weights["language_model.embed_tokens.weight"])


def run_cli(models_dir: Path, *args: str):
    return CliRunner().invoke(models, list(args), env={"MLXQ_MODELS_DIR": str(models_dir)})


def test_cli_imports_a_vision_model(tmp_path, originals, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-hub"))  # keep the machine's HF cache out of listings
    text, mmproj = write_pair(tmp_path, originals, "f16", tied=False)
    models_dir = tmp_path / "models"
    result = run_cli(models_dir, "import-gguf-vlm", "--model", str(text), "--mmproj", str(mmproj))
    assert result.exit_code == 0, result.output
    assert "imported tiny-smolvlm-f16 (vision" in result.stdout
    manifest = json.loads((models_dir / "tiny-smolvlm-f16" / "mlxq.json").read_text())
    assert manifest["kind"] == "vision" and manifest["source"] == f"gguf-vlm:{text.resolve()}"
    assert manifest["mmproj"] == str(mmproj.resolve()) and len(manifest["mmproj_sha256"]) == 64
    listed = json.loads(run_cli(models_dir, "list", "--json").stdout)
    assert [(m["id"], m["kind"]) for m in listed] == [("tiny-smolvlm-f16", "vision")]
    table = run_cli(models_dir, "list").stdout.splitlines()
    assert table[1].split()[:2] == ["tiny-smolvlm-f16", "vision"]
    again = run_cli(models_dir, "import-gguf-vlm", "--model", str(text), "--mmproj", str(mmproj))
    assert again.exit_code == 1 and "already exists" in again.stderr
    swapped = run_cli(models_dir, "import-gguf-vlm", "--model", str(mmproj), "--mmproj", str(text),
                      "--name", "swapped")
    assert swapped.exit_code == 1 and "is an mmproj" in swapped.stderr
    assert not (models_dir / "swapped").exists()


def test_other_projector_type_is_refused(tmp_path, originals):
    text, _ = write_pair(tmp_path, originals, "f32", tied=False)
    other = tmp_path / "mmproj-gemma3.gguf"
    write_mmproj(other, hf_tensors(originals[False][1], False), "f32", projector="gemma3")
    with pytest.raises(UnsupportedModel, match="projector type 'gemma3' is not supported"):
        convert_gguf_vlm(text, other, tmp_path)


def test_mismatched_pair_is_refused(tmp_path, originals):
    text, _ = write_pair(tmp_path, originals, "f32", tied=False)
    hf = hf_tensors(originals[False][1], False)
    # The mmproj of a model whose language part is 48 wide: a self-consistent file, just not this model's.
    hf["model.connector.modality_projection.proj.weight"] = np.zeros((48, VISION["hidden_size"] * SCALE**2),
                                                                     np.float32)
    other = tmp_path / "mmproj-other.gguf"
    write_mmproj(other, hf, "f32", text_width=48)
    with pytest.raises(ConversionError, match="projects image features to 48 dims .* hidden size 64: these files "
                                              "are not a pair"):
        convert_gguf_vlm(text, other, tmp_path)


def test_truncated_mmproj_is_refused(tmp_path, originals):
    text, mmproj = write_pair(tmp_path, originals, "f16", tied=False)
    cut = tmp_path / "mmproj-cut.gguf"
    cut.write_bytes(mmproj.read_bytes()[:-1000])
    with pytest.raises(ConversionError, match="mmproj-cut.gguf is truncated"):
        convert_gguf_vlm(text, cut, tmp_path)


def test_quantization_of_both_halves_in_one_config():
    vision = {"vision_model.encoder.layers.0.mlp.fc1": 8, "connector.modality_projection.proj": 8}
    text = {"group_size": 32, "bits": 4, "language_model.embed_tokens": {"group_size": 32, "bits": 8}}
    assert merge_quantization(text, vision) == {**text, **{m: {"group_size": 32, "bits": 8} for m in vision}}
    assert merge_quantization(None, vision) == {"group_size": 32, "bits": 8}  # F16 text, Q8_0 mmproj
    assert merge_quantization({"group_size": 32, "bits": 8}, {}) == {"group_size": 32, "bits": 8}
    assert merge_quantization(None, {}) is None
