"""Token log-probabilities of a transcription (include[]=logprobs): the model's own, on both Whisper paths,
and nothing else about the transcript changes when they are asked for (on a sentence of a fixture: what is
checked is per token)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.speech_clips import sentences, write
from tests.workers.test_speech import model, ref, worker_parts  # noqa: F401  (fixtures)
from workers import vad
from workers.backends import whisper, whisper_batch, whisper_encoder
from workers.backends.segments import attach_logprobs


@pytest.fixture(scope="module")
def birds():
    """garden's last sentence: 'The birds sing loudly at sunrise, and the cat sleeps in the shade all afternoon.'"""
    return sentences("garden", 2)


@pytest.fixture(scope="module")
def audio(birds, tmp_path_factory):
    """The sentence's file."""
    return write(birds, tmp_path_factory.mktemp("logprobs") / "birds.wav")


@pytest.fixture(scope="module")
def with_logprobs(model, audio) -> list[dict]:  # noqa: F811
    """The sequential path's segments with their log-probabilities (both tests look at them)."""
    return sequential(model, audio, logprobs=True)


def sequential(model, audio, logprobs: bool) -> list[dict]:  # noqa: F811
    """The file's segments, window by window."""
    # vad=False: the window is the whole file, as the independent computation below takes it.
    return [seg for chunk in whisper.transcribe_chunks(model, audio, whisper.Options(logprobs=logprobs, vad=False))
            for seg in chunk.segments]


def batched(model, audio, logprobs: bool) -> list[dict]:  # noqa: F811
    """The file's segments, its speech pieces decoded together."""
    chunks = whisper_batch.transcribe_batches(model, audio, whisper.Options(logprobs=logprobs), None,
                                              vad.speech_pieces(audio), 8)
    return [seg for chunk in chunks for seg in chunk.segments]


def without_logprobs(segments: list[dict]) -> list[dict]:
    return [{k: v for k, v in seg.items() if k != "logprobs"} for seg in segments]


def test_each_text_token_has_the_model_s_log_probability(model, birds, with_logprobs):  # noqa: F811
    segments = with_logprobs
    tokenizer = model.get_tokenizer(language="en")
    for seg in segments:  # one entry per text token, whose pieces make up the segment's text
        text_tokens = [t for t in seg["tokens"] if t < tokenizer.eot]
        assert len(seg["logprobs"]) == len(text_tokens) > 0
        assert "".join(e["token"] for e in seg["logprobs"]) == seg["text"]
        assert all(e["bytes"] == list(e["token"].encode()) and e["logprob"] <= 0 for e in seg["logprobs"])
    # Worked out apart, with mlx-audio's own decoder: the first window (the sentence is one), no prompt.
    samples = birds.samples.astype(np.float32) / 32768
    features = whisper_encoder.encode(model, whisper.window_mel(model, samples)[None])
    initial, tokens = list(tokenizer.sot_sequence), segments[0]["tokens"]
    logits = model.decoder(mx.array([initial + tokens]), features)[0][0, len(initial) - 1:-1].astype(mx.float32)
    expected = mx.take_along_axis(logits, mx.array(tokens)[:, None], axis=-1)[:, 0] - mx.logsumexp(logits, axis=-1)
    wanted = [value for token, value in zip(tokens, expected.tolist(), strict=True) if token < tokenizer.eot]
    assert [e["logprob"] for e in segments[0]["logprobs"]] == pytest.approx(wanted, abs=2e-3)


def test_asking_for_logprobs_changes_nothing_else_and_both_paths_agree(model, audio, with_logprobs):  # noqa: F811
    assert without_logprobs(with_logprobs) == sequential(model, audio, logprobs=False)
    in_batches = batched(model, audio, logprobs=True)
    assert without_logprobs(in_batches) == batched(model, audio, logprobs=False)
    assert [seg["text"] for seg in in_batches] == [seg["text"] for seg in with_logprobs]
    for one, other in zip(in_batches, with_logprobs, strict=True):  # the pieces start elsewhere: close, not equal
        assert [e["token"] for e in one["logprobs"]] == [e["token"] for e in other["logprobs"]]
        assert [e["logprob"] for e in one["logprobs"]] == pytest.approx([e["logprob"] for e in other["logprobs"]],
                                                                         abs=0.05)


class _Tokenizer:
    """Ids below 10 are text ("a".."j"), 10 is the end of text, 11 and up are timestamps."""

    eot = 10

    def decode(self, tokens):
        return "".join(chr(ord("a") + t) for t in tokens)


def test_segments_take_their_own_tokens_scores_without_timestamps():
    segments = [{"tokens": [11, 0, 1, 12]}, {"tokens": [12, 2, 13]}]
    attach_logprobs(segments, [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6, -0.7], _Tokenizer())
    assert [[(e["token"], e["logprob"]) for e in seg["logprobs"]] for seg in segments] == \
        [[("a", -0.2), ("b", -0.3)], [("c", -0.6)]]
    assert segments[0]["logprobs"][0]["bytes"] == [ord("a")]
