"""The grammar processor on the demo model's real tokenizer: a matcher that fails mid-answer."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from llguidance import LLMatcher

from jobs.errors import error_data
from workers.backends import sampling
from workers.backends.grammar import GrammarFailed, GrammarProcessor, compile_grammar

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer(demo_text_model):
    """The demo model's tokenizer (the one the worker holds: tests/workers/conftest.py)."""
    return demo_text_model[1]


def allowed_after(processor, last: int | None, vocab: int) -> np.ndarray:
    """Zero logits masked as the processor's grammar allows after `last` (None: at the start)."""
    return np.array(sampling.masked(mx.zeros((1, vocab)), [0], processor.mask_words(last)[None])[0])


def disallowed_after_start(tokenizer, processor, vocab: int) -> int:
    """A token the grammar does not allow first (a letter where `{` must come)."""
    logits = allowed_after(processor, None, vocab)
    token = tokenizer.encode("zebra")[0]
    assert logits[token] == -np.inf
    return token


@pytest.mark.parametrize("strict", [True, False])
def test_a_matcher_that_fails_mid_answer_ends_it_with_a_400_or_with_end_of_sequence(tokenizer, strict):
    vocab = 49152
    grammar = LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matcher = compile_grammar(grammar, tokenizer, vocab)
    processor = GrammarProcessor(matcher, tokenizer, vocab, strict=strict)
    token = disallowed_after_start(tokenizer, processor, vocab)
    if strict:  # a sequence decoding alone: its job ends with a client error, not a 500
        with pytest.raises(GrammarFailed) as failed:
            processor.mask_words(token)
        assert error_data(failed.value)["status"] == 400 and "grammar" in str(failed.value)
        return
    # In a batch: only end-of-sequence from now on, the error kept for the request.
    logits = allowed_after(processor, token, vocab)
    assert processor.error and "grammar" in processor.error
    assert set(np.flatnonzero(np.isfinite(logits)).tolist()) == set(processor.eos) != set()
    # The compiled matcher it was copied from is untouched: the next sequence starts clean.
    fresh = GrammarProcessor(matcher, tokenizer, vocab, strict=False)
    assert disallowed_after_start(tokenizer, fresh, vocab) == token and fresh.error is None
