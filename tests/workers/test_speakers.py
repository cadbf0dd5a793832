"""The voice encoder and the speakers of a transcript: the MLX encoder against a NumPy LSTM on the real
weights, the two fixture voices told apart, the torch file reader's refusals, and the clustering's rules."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from tests.speech_clips import sentences
from workers import speakers
from workers.importers import torch_legacy
from workers.speakers import Speakers


@pytest.fixture(scope="module")
def encoder():
    return speakers.VoiceEncoder.load()


def numpy_ge2e(weights: dict, mels: np.ndarray) -> np.ndarray:
    """GE2E written out in NumPy from PyTorch's LSTM equations (two biases, gates i, f, g, o)."""
    sigmoid = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
    x = mels
    for layer in range(3):
        w_ih, w_hh = weights[f"lstm.weight_ih_l{layer}"], weights[f"lstm.weight_hh_l{layer}"]
        bias = weights[f"lstm.bias_ih_l{layer}"] + weights[f"lstm.bias_hh_l{layer}"]
        h = np.zeros((len(x), 256), np.float32)
        c = np.zeros_like(h)
        out = []
        for t in range(x.shape[1]):
            gates = x[:, t] @ w_ih.T + h @ w_hh.T + bias
            i, f, g, o = np.split(gates, 4, axis=1)
            c = sigmoid(f) * c + sigmoid(i) * np.tanh(g)
            h = sigmoid(o) * np.tanh(c)
            out.append(h)
        x = np.stack(out, axis=1)
    e = np.maximum(0, h @ weights["linear.weight"].T + weights["linear.bias"])
    return e / np.linalg.norm(e, axis=1, keepdims=True)


def test_the_mlx_encoder_is_the_lstm_it_was_trained_as(encoder):
    import mlx.core as mx

    weights = {k: np.array(v) for k, v in mx.load(str(speakers.weights_path())).items()}
    mels = np.random.default_rng(0).random((3, 40, 40), np.float32)  # 3 partials of 40 frames: quick
    np.testing.assert_allclose(np.array(encoder(mx.array(mels))), numpy_ge2e(weights, mels), atol=2e-5)


def test_the_two_fixture_voices_are_told_apart(encoder):
    a = [sentences("garden", i).samples / 32768 for i in range(3)]
    b = [sentences("voice_b/river", i).samples / 32768 for i in range(3)]
    e = encoder.embed([*a, *b], speakers.MAX_PARTIALS)
    similarity = e @ e.T
    same = [similarity[i, j] for i in range(6) for j in range(i + 1, 6) if (i < 3) == (j < 3)]
    other = [similarity[i, j] for i in range(3) for j in range(3, 6)]
    assert min(same) > speakers.SAME_SPEAKER > max(other), (same, other)
    spk = Speakers()
    labels = [spk.assign(e[i], 5.0) for i in (0, 3, 1, 4, 2, 5)]
    assert labels == ["A", "B", "A", "B", "A", "B"]


def test_the_torch_reader_reads_the_wheels_file_and_refuses_other_classes(tmp_path):
    from workers.store_admin import downloads_dir
    from workers.wheel_files import fetch_wheel_file

    saved = torch_legacy.load(fetch_wheel_file(speakers.MODEL_PACKAGE, speakers.MODEL_VERSION,
                                               speakers.MODEL_MEMBER, downloads_dir()))
    assert saved["model_state"]["lstm.weight_ih_l0"].shape == (1024, 40)

    class Payload:
        def __reduce__(self):
            import os
            return (os.system, ("echo owned",))

    evil = tmp_path / "evil.pt"
    evil.write_bytes(b"".join(pickle.dumps(x) for x in (torch_legacy.MAGIC, torch_legacy.PROTOCOL, {}))
                     + pickle.dumps(Payload()))
    with pytest.raises(torch_legacy.LegacyFormatError, match="refusing to unpickle"):
        torch_legacy.load(evil)
    (tmp_path / "zip.pt").write_bytes(b"PK\x03\x04 not a legacy file")
    with pytest.raises(torch_legacy.LegacyFormatError):
        torch_legacy.load(tmp_path / "zip.pt")


def _unit(*values) -> np.ndarray:
    v = np.array(values, np.float32)
    return v / np.linalg.norm(v)


def test_known_speakers_come_first_and_new_ones_take_free_letters():
    spk = Speakers()
    spk.add_known(["A", "Bob"], np.stack([_unit(1, 0, 0), _unit(0, 1, 0)]))
    assert spk.assign(_unit(0.1, 1, 0), 3.0) == "Bob"
    assert spk.assign(_unit(0, 0, 1), 3.0) == "B"  # "A" is a known speaker's name
    assert spk.assign(_unit(0, 0.1, 1), 3.0) == "B"


def test_max_and_min_speakers_and_short_segments():
    capped = Speakers(max_speakers=1)
    assert [capped.assign(v, 3.0) for v in (_unit(1, 0), _unit(0, 1))] == ["A", "A"]
    wanted = Speakers(min_speakers=2)
    assert [wanted.assign(v, 3.0) for v in (_unit(1, 0), _unit(1, 0.6))] == ["A", "B"]  # 0.86 alike: new all the same
    short = Speakers()
    assert [short.assign(v, d) for v, d in ((_unit(1, 0), 3.0), (_unit(0, 1), 0.5), (_unit(0, 1), 3.0))] == \
        ["A", "A", "B"]
    assert Speakers().assign(np.zeros(2, np.float32), 3.0) is None
    assert [speakers._letters(n) for n in (0, 25, 26, 27)] == ["A", "Z", "AA", "AB"]


def test_a_resumed_state_labels_what_follows_as_the_first_run_would():
    rng = np.random.default_rng(1)
    voices = [_unit(*rng.normal(size=8)) for _ in range(3)]
    stream = [_unit(*(voices[i % 3] + 0.08 * rng.normal(size=8))) for i in range(30)]
    whole = Speakers()
    first = [whole.assign(v, 3.0) for v in stream]
    part = Speakers()
    labels = [part.assign(v, 3.0) for v in stream[:13]]
    resumed = Speakers.from_dict(json.loads(json.dumps(part.to_dict())))  # as a checkpoint keeps it
    labels += [resumed.assign(v, 3.0) for v in stream[13:]]
    assert labels == first and len(set(first)) == 3
    assert resumed.to_dict() == whole.to_dict()
