"""Who spoke when: a voice encoder (Resemblyzer's GE2E, run in MLX) and the speakers of a transcript, found
as it goes.

The encoder is Resemblyzer's pretrained model (Apache-2.0; three LSTM layers of 256 over 40 mel bands, a
linear layer: a 256-d voice embedding), read from its PyPI wheel without torch (workers/importers/
torch_legacy.py) and kept as safetensors beside the other downloads. A clip is cut into 1.6 s partials
(1.3 a second, as Resemblyzer cuts them), each is embedded, and the clip's embedding is their normalized mean.

`Speakers` labels each transcribed segment as the transcript goes, so segment events carry their speaker
live and memory stays flat however long the file: it keeps one running mean per speaker (and nothing per
segment). A segment joins the nearest speaker when it is near enough, else starts a new one (up to
`max_speakers`); its state is a few kilobytes of JSON in the transcription's checkpoint, so a resumed job
labels what follows as the first run would have. Known speakers (names with reference clips) are speakers
from the start, under their names.
"""

from __future__ import annotations

import functools
import string
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from jobs.errors import JobError
from workers.audio import SAMPLE_RATE, AudioReader

MODEL_PACKAGE, MODEL_VERSION, MODEL_MEMBER = "resemblyzer", "0.1.4", "resemblyzer/pretrained.pt"
WEIGHTS_NAME = "resemblyzer-0.1.4-ge2e.safetensors"

N_FFT, HOP, MELS = 400, 160, 40  # 25 ms windows every 10 ms (Resemblyzer's mel settings)
PARTIAL_FRAMES = 160  # 1.6 s
PARTIALS_PER_S = 1.3
MIN_COVERAGE = 0.75  # a last partial must be this full of audio to count
TARGET_DBFS = -30.0  # quieter clips are raised to this loudness first (Resemblyzer's preprocessing)
HIDDEN = 256

SAME_SPEAKER = 0.75
"""Cosine similarity to a speaker's mean at or above which a segment is that speaker's. On the test fixtures'
two synthetic voices (tests/workers/test_speakers.py) sentences of one voice come at 0.83-0.95 to each other
and of the other at 0.55-0.65; real voices of one sex are nearer each other."""

NEW_SPEAKER_BELOW_MIN = 0.9
"""While fewer speakers than `min_speakers` are known, a segment below this similarity starts a new one."""

MIN_SEGMENT_S = 0.8
"""A shorter segment is too short to start a speaker: it joins the nearest one (when there is one)."""


def weights_path() -> Path:
    """The encoder's weights as safetensors, made once from the wheel's `pretrained.pt` (fetched from PyPI)."""
    from workers.importers import torch_legacy
    from workers.store_admin import downloads_dir
    from workers.wheel_files import fetch_wheel_file

    target = downloads_dir() / WEIGHTS_NAME
    if not target.exists():
        state = torch_legacy.load(fetch_wheel_file(MODEL_PACKAGE, MODEL_VERSION, MODEL_MEMBER, downloads_dir()))
        weights = {name: mx.array(value) for name, value in state["model_state"].items()
                   if name.startswith(("lstm.", "linear."))}
        staging = target.with_name(f".{target.stem}-{np.random.randint(1 << 30)}.safetensors")
        mx.save_safetensors(str(staging), weights)
        staging.replace(target)  # whole or absent: another worker may be making it too
    return target


class VoiceEncoder(nn.Module):
    """GE2E: three LSTM layers and a linear layer with ReLU; a 256-d, L2-normalized embedding per partial."""

    def __init__(self):
        super().__init__()
        self.layers = [nn.LSTM(MELS, HIDDEN), nn.LSTM(HIDDEN, HIDDEN), nn.LSTM(HIDDEN, HIDDEN)]
        self.linear = nn.Linear(HIDDEN, HIDDEN)

    @classmethod
    def load(cls, path: Path | None = None) -> "VoiceEncoder":
        """The pretrained encoder (its weights fetched and converted on first use)."""
        weights = mx.load(str(path or weights_path()))
        model = cls()
        for i, layer in enumerate(model.layers):
            # PyTorch keeps two biases; MLX's LSTM one (their sum); the gate order (i, f, g, o) is the same.
            layer.Wx = weights[f"lstm.weight_ih_l{i}"]
            layer.Wh = weights[f"lstm.weight_hh_l{i}"]
            layer.bias = weights[f"lstm.bias_ih_l{i}"] + weights[f"lstm.bias_hh_l{i}"]
        model.linear.weight, model.linear.bias = weights["linear.weight"], weights["linear.bias"]
        mx.eval(model.parameters())
        return model

    def __call__(self, mels: mx.array) -> mx.array:
        x = mels
        for layer in self.layers:
            x, _ = layer(x)
        embedding = nn.relu(self.linear(x[:, -1]))
        return embedding / mx.maximum(mx.linalg.norm(embedding, axis=-1, keepdims=True), 1e-12)

    def embed(self, clips: list[np.ndarray], max_partials: int | None = None) -> np.ndarray:
        """One L2-normalized embedding per clip of 16 kHz float32 samples (all clips' partials in one pass; at
        most `max_partials` a clip, spread along it)."""
        windows, owners = [], []
        for n, clip in enumerate(clips):
            for partial in _partials(clip, max_partials):
                windows.append(partial)
                owners.append(n)
        if not windows:
            return np.zeros((len(clips), HIDDEN), np.float32)
        per_partial = np.array(self(mel_power(mx.array(np.stack(windows)))))
        sums = np.zeros((len(clips), HIDDEN), np.float32)
        np.add.at(sums, np.array(owners), per_partial)
        return _normalized(sums)


def _partials(samples: np.ndarray, limit: int | None = None) -> list[np.ndarray]:
    """The analysis windows (PARTIAL_FRAMES x N_FFT samples) of a clip's 1.6 s partials (Resemblyzer's slicing:
    1.3 a second, the last one kept when it is at least 75 % audio; a short clip is padded to one partial); at
    most `limit` of them, spread along the clip. Only these frames are ever transformed."""
    samples = _louder(samples.astype(np.float32))
    frames = int(np.ceil((len(samples) + 1) / HOP))
    step = max(1, round(SAMPLE_RATE / PARTIALS_PER_S / HOP))
    starts = list(range(0, max(1, frames - PARTIAL_FRAMES + step + 1), step))
    if len(starts) > 1 and (len(samples) - starts[-1] * HOP) / (PARTIAL_FRAMES * HOP) < MIN_COVERAGE:
        starts.pop()
    if limit is not None and len(starts) > limit:
        starts = [starts[i] for i in np.linspace(0, len(starts) - 1, limit).round().astype(int)]
    need = (starts[-1] + PARTIAL_FRAMES) * HOP
    if need > len(samples):
        samples = np.pad(samples, (0, need - len(samples)))
    padded = np.pad(samples, N_FFT // 2)  # centred frames, as librosa's melspectrogram makes them
    count = 1 + (len(padded) - N_FFT) // HOP
    framed = np.lib.stride_tricks.as_strided(padded, (count, N_FFT), (padded.strides[0] * HOP, padded.strides[0]))
    return [framed[s:s + PARTIAL_FRAMES] for s in starts]


def _louder(samples: np.ndarray) -> np.ndarray:
    """Raise a quiet clip to TARGET_DBFS (never lower a loud one)."""
    rms = float(np.sqrt(np.mean(samples ** 2))) if len(samples) else 0.0
    if rms <= 0:
        return samples
    change_db = TARGET_DBFS - 20 * np.log10(rms)
    return samples * (10 ** (change_db / 20)) if change_db > 0 else samples


def _mel_filters() -> np.ndarray:
    """Slaney-style mel filters (librosa's default), MELS x (N_FFT // 2 + 1)."""

    def to_mel(hz):
        hz = np.asarray(hz, np.float64)
        return np.where(hz >= 1000, 15.0 + np.log(np.maximum(hz, 1e-10) / 1000) / (np.log(6.4) / 27), hz * 3 / 200)

    def to_hz(mel):
        mel = np.asarray(mel, np.float64)
        return np.where(mel >= 15, 1000 * np.exp((np.log(6.4) / 27) * (mel - 15)), mel * 200 / 3)

    bins = np.linspace(0, SAMPLE_RATE / 2, 1 + N_FFT // 2)
    edges = to_hz(np.linspace(to_mel(0), to_mel(SAMPLE_RATE / 2), MELS + 2))
    widths = np.diff(edges)
    ramps = edges[:, None] - bins[None, :]
    filters = np.maximum(0, np.minimum(-ramps[:-2] / widths[:-1, None], ramps[2:] / widths[1:, None]))
    return (filters * (2.0 / (edges[2:] - edges[:-2]))[:, None]).astype(np.float32)


def _dft() -> np.ndarray:
    """The real DFT of a Hann-windowed frame as one matrix, N_FFT x 2 (N_FFT // 2 + 1): [cos | -sin] (a matmul
    runs on the GPU and through BLAS on a CPU, where an FFT of 400 points has no such path)."""
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)  # periodic Hann
    angles = 2 * np.pi * np.outer(np.arange(N_FFT), np.arange(N_FFT // 2 + 1)) / N_FFT
    return np.concatenate([np.cos(angles), -np.sin(angles)], axis=1) * window[:, None]


_DFT = mx.array(_dft().astype(np.float32))
_FILTERS_T = mx.array(_mel_filters().T)


def mel_power(windows: mx.array) -> mx.array:
    """(..., frames, 40) mel power spectrogram of (..., frames, N_FFT) analysis windows (librosa's
    melspectrogram: Hann window, power 2, Slaney mel filters)."""
    spectrum = windows @ _DFT
    real, imaginary = mx.split(spectrum, 2, axis=-1)
    return (real * real + imaginary * imaginary) @ _FILTERS_T


def _normalized(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return (vectors / np.maximum(norms, 1e-12)).astype(np.float32)


@dataclass
class Speakers:
    """The speakers of one transcript so far: a label and a running sum of embeddings each (JSON state)."""

    min_speakers: int = 1
    max_speakers: int | None = None
    labels: list[str] = field(default_factory=list)
    sums: list[list[float]] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    named: int = 0  # the first `named` speakers are the known ones

    def add_known(self, names: list[str], embeddings: np.ndarray) -> None:
        """Start with these named speakers (their reference clips' embeddings)."""
        for name, vector in zip(names, embeddings, strict=True):
            self.labels.append(name)
            self.sums.append([round(float(v), 6) for v in vector])
            self.counts.append(1)
        self.named = len(self.labels)

    def assign(self, embedding: np.ndarray, duration_s: float) -> str | None:
        """The label of the speaker of a segment with this embedding (a new speaker's if none is near)."""
        if not np.any(embedding):
            return None  # nothing to go on (no audio)
        if not self.labels:
            return self._new(embedding)
        means = _normalized(np.array(self.sums, np.float32))
        similarity = means @ embedding
        best = int(np.argmax(similarity))
        full = self.max_speakers is not None and len(self.labels) >= self.max_speakers
        wanted = len(self.labels) < self.min_speakers and similarity[best] < NEW_SPEAKER_BELOW_MIN
        if not full and duration_s >= MIN_SEGMENT_S and (similarity[best] < SAME_SPEAKER or wanted):
            return self._new(embedding)
        # Rounded as the checkpoint's JSON keeps them: a resumed run goes on from the very same numbers.
        self.sums[best] = [round(a + float(b), 6) for a, b in zip(self.sums[best], embedding, strict=True)]
        self.counts[best] += 1
        return self.labels[best]

    def _new(self, embedding: np.ndarray) -> str:
        n = len(self.labels) - self.named
        while _letters(n) in self.labels:  # a known speaker named "A": the next free letter
            n += 1
        label = _letters(n)
        self.labels.append(label)
        self.sums.append([round(float(v), 6) for v in embedding])
        self.counts.append(1)
        return label

    def to_dict(self) -> dict:
        """The state to checkpoint."""
        return {"min_speakers": self.min_speakers, "max_speakers": self.max_speakers, "labels": self.labels,
                "sums": self.sums, "counts": self.counts, "named": self.named}

    @classmethod
    def from_dict(cls, data: dict) -> "Speakers":
        """Rebuild from `to_dict`'s output."""
        return cls(**data)


def _letters(n: int) -> str:
    """A, B, ..., Z, AA, AB, ... for the n-th unnamed speaker (OpenAI's labels)."""
    label = ""
    n += 1
    while n:
        n, rest = divmod(n - 1, 26)
        label = string.ascii_uppercase[rest] + label
    return label


MAX_PARTIALS = 3
"""Most partials embedded per segment, spread over it: a segment's voice is one voice (mostly), and the encoder's
cost grows with the partials (three LSTM layers over 160 frames each), so a long segment costs what a 5 s one does."""

MAX_REFERENCE_S = 30.0
"""Most seconds of a known speaker's reference clip that are read."""


@functools.lru_cache(maxsize=1)
def default_encoder() -> VoiceEncoder:
    """The worker's one voice encoder (5.7 MB of weights, loaded at the first diarized transcription)."""
    from workers.wheel_files import FetchError

    try:
        return VoiceEncoder.load()
    except FetchError as exc:
        raise JobError(f"Diarization is unavailable: the voice encoder could not be fetched ({exc}); "
                       "`mlxq models pull-demo` fetches it.", status=503, code="diarization_unavailable") from None


class Diarizer:
    """Labels the segments of one transcription, and their words, with their speakers as they come."""

    def __init__(self, path, speakers: Speakers, start_s: float, encoder: VoiceEncoder | None = None):
        self.encoder = encoder or default_encoder()
        self.speakers = speakers
        self._reader = AudioReader(path, start_s)
        self._at = round(start_s * SAMPLE_RATE)

    @classmethod
    def starting(cls, path, min_speakers: int | None, max_speakers: int | None, names: list[str],
                 references: list[str]) -> "Diarizer":
        """A diarizer for a transcription from its start: the known speakers' references embedded first."""
        encoder = default_encoder()
        speakers = Speakers(min_speakers or 1, max_speakers)
        if names:
            clips = [_head(reference, MAX_REFERENCE_S) for reference in references]
            speakers.add_known(names, encoder.embed(clips))
        return cls(path, speakers, 0.0, encoder)

    def label(self, segments: list[dict]) -> None:
        """Give each segment (in time order) and each of its words a `speaker`."""
        clips = []
        for seg in segments:
            start = max(self._at, round(seg["start"] * SAMPLE_RATE))  # forward only (segments may touch)
            end = max(start, round(seg["end"] * SAMPLE_RATE))
            clips.append(self._reader.read(start, end - start))
            self._at = start
        for seg, embedding in zip(segments, self.encoder.embed(clips, MAX_PARTIALS) if clips else [], strict=True):
            seg["speaker"] = self.speakers.assign(embedding, seg["end"] - seg["start"])
            for word in seg.get("words", ()):
                word["speaker"] = seg["speaker"]

    def close(self) -> None:
        """Close the audio file."""
        self._reader.close()


def _head(path, seconds: float) -> np.ndarray:
    """The first `seconds` of an audio file, 16 kHz mono float32."""
    reader = AudioReader(path)
    try:
        return reader.read(0, round(seconds * SAMPLE_RATE))
    finally:
        reader.close()
