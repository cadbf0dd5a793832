"""The sampling fields clients send, through the official openai client and the real worker: a logit
bias keeps a token out, a presence penalty lowers repetition, on chat (batch and lone) and completions."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from transformers import AutoTokenizer

from tests.integration.test_vision import DEMO_VLM, HELD_OUT_SEED, QUESTION, data_url, image_part, png_bytes
from workers.demo import shapes

MODEL = "smollm2-135m"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
REPEAT = [{"role": "user", "content": "Write the word hello twenty times."}]


def first_token(client, **kwargs) -> str:
    """The first token of a greedy answer, as logprobs name it."""
    choice = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, temperature=0, logprobs=True,
                                            **kwargs).choices[0]
    return choice.logprobs.content[0].token


def test_a_logit_bias_of_minus_100_keeps_greedys_next_token_out(openai_client, models_dir):
    tokenizer = AutoTokenizer.from_pretrained(models_dir / MODEL)
    greedy = first_token(openai_client)
    [banned] = tokenizer.encode(greedy, add_special_tokens=False)
    assert first_token(openai_client, logit_bias={str(banned): -100}) != greedy
    # In a batch too: two at once, one with the bias and one without.
    with ThreadPoolExecutor(2) as pool:
        biased = pool.submit(first_token, openai_client, logit_bias={str(banned): -100})
        plain = pool.submit(first_token, openai_client)
        assert biased.result(timeout=120) != greedy and plain.result(timeout=120) == greedy
    # Completions take it the same way (logprobs name the token with its leading space; the text
    # at the start of an answer loses it).
    def completion_token(**kwargs) -> str:
        return openai_client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1,
                                                temperature=0, logprobs=0, **kwargs).choices[0].logprobs.tokens[0]

    token = completion_token()
    [their] = tokenizer.encode(token, add_special_tokens=False)
    assert completion_token(logit_bias={str(their): -100}) != token


def repeats(client, **kwargs) -> int:
    """Tokens of a seeded sampled answer that its earlier tokens already hold."""
    # 32 tokens: the answer's first ~22 ("Here's the word "hello" ... times:") repeat little; the list of
    # hellos after them is where the unpenalized answer repeats itself (about ten tokens) and a penalized one
    # does not.
    choice = client.chat.completions.create(model=MODEL, messages=REPEAT, max_tokens=32, temperature=0.7, seed=3,
                                            logprobs=True, **kwargs).choices[0]
    tokens = [entry.token for entry in choice.logprobs.content]
    return len(tokens) - len(set(tokens))


def test_a_presence_penalty_lowers_repetition_on_the_same_seed(openai_client):
    # The four answers are asked at once and decode as one batch: a seeded row draws the same tokens alone or
    # in any batch, so each is the answer it would be alone.
    with ThreadPoolExecutor(4) as pool:
        plain, penalized, frequency, again = [future.result(timeout=300) for future in [
            pool.submit(repeats, openai_client), pool.submit(repeats, openai_client, presence_penalty=2.0),
            pool.submit(repeats, openai_client, frequency_penalty=2.0), pool.submit(repeats, openai_client)]]
    assert penalized < plain, (penalized, plain)
    assert frequency < plain, (frequency, plain)
    assert again == plain  # the same seed, the same answer: the difference is the penalty's


def test_the_vision_path_honours_them_too(openai_client, models_dir):
    # A chat with an image decodes on mlx-vlm's own loop, with mlxq's sampler and processors.
    picture = shapes.samples(HELD_OUT_SEED, 1)[0]
    content = [image_part(data_url(png_bytes(picture.image))), {"type": "text", "text": QUESTION}]

    def first(**kwargs) -> str:
        choice = openai_client.chat.completions.create(
            model=DEMO_VLM, messages=[{"role": "user", "content": content}], max_tokens=1, temperature=0,
            logprobs=True, **kwargs).choices[0]
        return choice.logprobs.content[0].token

    greedy = first()
    tokenizer = AutoTokenizer.from_pretrained(models_dir / DEMO_VLM)
    [banned] = tokenizer.encode(greedy, add_special_tokens=False)
    assert first(logit_bias={str(banned): -100}) != greedy
    assert first(presence_penalty=2.0) == greedy  # nothing repeated yet at the first token: no change
