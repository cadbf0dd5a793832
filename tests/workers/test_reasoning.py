"""A reasoning model's thinking cut out of its answer, and its budget kept token by token (pure logic)."""

from __future__ import annotations

import numpy as np
import pytest

from jobs.model_files import think_markers_of
from workers.backends.reasoning import ANSWER, MAYBE, THINKING, ThinkingGate, Thoughts, opening_state


def split(pieces: list[str], state: str = MAYBE) -> tuple[str, str, int]:
    """Feed pieces one token each; the whole reasoning, the whole answer, and the reasoning's tokens."""
    thoughts = Thoughts("<think>", "</think>", state)
    reasoning, answer = "", ""
    for i, piece in enumerate(pieces):
        r, a = thoughts.split(piece, i == len(pieces) - 1)
        reasoning, answer = reasoning + r, answer + a
    return reasoning, answer, thoughts.tokens


def test_the_markers_and_the_blanks_around_them_go_to_neither_part():
    pieces = ["<", "think", ">\n", "2 +", " 2", " is", " 4", ".\n", "</", "think", ">\n\n", "It", " is 4", "."]
    assert split(pieces) == ("2 + 2 is 4.", "It is 4.", 11)


def test_a_marker_in_the_answer_is_never_content():
    # A block closed for the model (its budget) that it goes on with and closes again itself.
    pieces = ["<think>", "17 + 2", "</think>", "\n\n", "17 + 2 = 20.", "\n</th", "ink>\n\n", "20."]
    assert split(pieces) == ("17 + 2", "17 + 2 = 20.\n\n\n20.", 3)


def test_an_answer_without_a_block_is_all_answer():
    assert split(["Hello", " there", "."]) == ("", "Hello there.", 0)
    assert split(["<", "b>bold</b>"]) == ("", "<b>bold</b>", 0)  # a start marker's prefix that isn't one


def test_a_block_the_template_opened_starts_inside_it():
    assert split(["\nfirst", " line\n\n", "second", "</think>", "\n\nok"], THINKING) == (
        "first line\n\nsecond", "ok", 4)


def test_a_block_cut_off_by_the_budget_or_max_tokens_is_all_reasoning():
    assert split(["<think>", "still", " going "]) == ("still going", "", 3)


def test_reasoning_streams_without_its_trailing_blanks_until_more_follows():
    thoughts = Thoughts("<think>", "</think>", THINKING)
    assert thoughts.feed("a \n") == ("a", "")
    assert thoughts.feed("b") == (" \nb", "")
    assert thoughts.feed("</thi") == ("", "")  # may be the end marker: held
    assert thoughts.feed("nk>x") == ("", "x")


@pytest.mark.parametrize(("prompt", "state"), [
    ("<|im_start|>assistant\n", MAYBE),
    ("<|im_start|>assistant\n<think>\n", THINKING),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", ANSWER),
    ("<think>old</think>answer<|im_end|>\n<|im_start|>assistant\n", MAYBE),
])
def test_where_generation_starts_follows_the_prompt_s_end(prompt, state):
    assert opening_state(prompt, "<think>", "</think>") == state


def test_markers_come_from_the_chat_template():
    assert think_markers_of("{% if enable_thinking %}<think>{% endif %} ... </think>") == ("<think>", "</think>")
    assert think_markers_of("{{ messages }}<tool_call>") is None
    assert think_markers_of(None) is None


class CharTokenizer:
    """One token per character (ids are code points): enough to watch the gate count and force."""

    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def allowed(words: np.ndarray | None) -> list[int] | None:
    """The token ids a packed mask allows (None: any)."""
    if words is None:
        return None
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    return [int(i) for i in np.flatnonzero(bits)]


def run_gate(gate: ThinkingGate, model: str, steps: int) -> str:
    """Decode `steps` tokens: the model writes `model` (then spaces) wherever the gate lets it choose."""
    out, last = "", None
    for _ in range(steps):
        mask = allowed(gate.mask_words(last))
        wanted = ord(model[len(out)]) if len(out) < len(model) else ord(" ")
        token = wanted if mask is None or wanted in mask else mask[0]
        out += chr(token)
        last = token
    return out


def test_the_gate_writes_the_end_marker_when_the_budget_would_be_spent():
    gate = ThinkingGate(CharTokenizer(), 256, "<think>", "</think>", THINKING, budget=12)
    out = run_gate(gate, "abcdefghijklmnopqrstuvwxyz", 16)
    assert out[:12] == "abcd</think>"  # 4 tokens of thinking, then the 8 of the end marker: 12
    assert gate.state == ANSWER and gate.mask_words(ord(out[-1])) is None


def test_a_block_that_ends_within_its_budget_is_left_alone():
    gate = ThinkingGate(CharTokenizer(), 256, "<think>", "</think>", MAYBE, budget=40)
    assert run_gate(gate, "<think>hm</think>yes", 20) == "<think>hm</think>yes"
    assert gate.state == ANSWER


class Grammar:
    """A grammar that only allows 'x', recording what it was fed."""

    error = None

    def __init__(self):
        self.fed = []

    def mask_words(self, last):
        self.fed.append(last)
        words = np.zeros(8, np.uint32)
        words[ord("x") // 32] = np.uint32(1 << (ord("x") % 32))
        return words


def test_a_grammar_waits_for_the_end_of_the_block_which_the_gate_opens_for_it():
    grammar = Grammar()
    gate = ThinkingGate(CharTokenizer(), 256, "<think>", "</think>", MAYBE, budget=None, inner=grammar)
    out = run_gate(gate, "<think>ok</think>yyy", 20)
    assert out.startswith("<think>ok</think>xxx")  # opened for the model; the grammar from the answer's first token
    assert grammar.fed[0] is None  # its first mask: as at a prompt's end


def test_a_block_that_a_grammar_waits_for_cannot_end_the_answer():
    gate = ThinkingGate(CharTokenizer(), 256, "<think>", "</think>", THINKING, budget=None, inner=Grammar())
    mask = allowed(gate.mask_words(None))
    assert 0 not in mask and ord("a") in mask and len(mask) == 255
