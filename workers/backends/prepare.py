"""Preparing a text request for its batch: a short one at once, any other on threads beside the MLX thread.

A request's prompts are rendered with the chat template and tokenized, checked against the model's
context and counted against the worker's KV memory, and its grammar (json_schema, forced tools) is
compiled once, for its choices to copy. On the MLX thread, a request with 128 tools or a prompt of
megabytes held up everyone's next token for as long as that took; here it only waits for itself.
The batch (workers/backends/textbatch.py) takes a request in once it is prepared, or ends it with
the error its preparation raised.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from jobs.errors import ModelTooLarge
from workers.backends import reasoning, textgen

PREPARE_WAIT_S = 0.002
"""How long a batch's step waits for the preparations of the requests taken since the last one (a short
chat's takes about a millisecond on a quiet machine, and then starts at this step): one wait for all
of them; longer ones finish while the batch steps: on a GPU a step takes milliseconds, and waiting here
would hold everyone's next token."""

IDLE_WAIT_S = 0.02
"""With nothing to decode or process, how long a batch's step waits for a preparation to finish."""

LIGHT_CHARS = 2000
"""A request with at most this many characters of text, no tools and no grammar is prepared on the MLX thread
as it is taken (~0.1–0.4 ms: a template and a short tokenization). On the preparing threads, a burst of 64 such
chats fought the loop for Python's lock: each of the burst's starts took ~1 ms on the H100 host (2026-11-27),
and the look for the rest of the burst came ~75 ms late."""

THREADS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="mlxq-prepare")
"""The worker's preparing threads (tokenizers and llguidance let go of the GIL): a short chat is not
prepared after the long prompts that came just before it; embedding requests are tokenized there too."""


@dataclass
class Prepared:
    """A request ready to join: its prompts' ids with their token budgets, its KV need, its grammar."""

    prompts: list[tuple[list[int], int]]
    need: int  # bytes its KV caches may grow to
    grammar: object | None  # the compiled matcher its sequences copy (workers/backends/grammar.py)
    loaded: list = field(default_factory=list)  # per prompt, its prefix read from the prompt cache's disk tier
    media: list = field(default_factory=list)  # per prompt, its images (workers/backends/vision_batch.py's Media)


def submit(prepare: Callable, request, light_chars: int | None = None) -> Future:
    """Prepare `request` with `prepare`: a light one (`light`, at most `light_chars` characters: LIGHT_CHARS
    unless said) at once, on this thread; any other on a preparing thread."""
    if not light(request, LIGHT_CHARS if light_chars is None else light_chars):
        return THREADS.submit(prepare, request)
    future = Future()
    try:
        future.set_result(prepare(request))
    except Exception as exc:  # noqa: BLE001 (the request's own error: told to its client, as from a thread)
        future.set_exception(exc)
    return future


def light(request, chars: int) -> bool:
    """Whether a request is quick to prepare: at most `chars` characters of text, no tools, no grammar."""
    return (request.kind == "text" and not request.tools and not request.sampling.grammar
            and textgen.text_length(request.inputs) <= chars)


def prepare(request, tokenizer, vocab: int, kv_per_token: int, kv_memory: Callable[[], int]) -> Prepared:
    """Tokenize, check and count a request; compile its grammar. `kv_memory()`: bytes left for KV caches."""
    prompts = []  # every input checked before any is inserted: a refusal leaves the batch untouched
    for prompt in request.inputs:
        ids = textgen.prompt_ids(tokenizer, prompt, request.tools, request.model.context_length,
                                 reasoning.template_kwargs(request, tokenizer))
        prompts.append((ids, textgen.token_budget(len(ids), request.sampling.max_tokens,
                                                  request.model.context_length)))
    return checked(prompts, request, kv_per_token, kv_memory, tokenizer, vocab)


def checked(prompts: list[tuple[list[int], int]], request, kv_per_token: int, kv_memory: Callable[[], int],
            tokenizer, vocab: int) -> Prepared:
    """A request whose prompts are tokenized, counted against the KV memory left (`kv_memory()`), its grammar
    compiled."""
    need = kv_per_token * request.n * sum(len(ids) + budget for ids, budget in prompts)
    if need > kv_memory():
        raise ModelTooLarge(f"the request's KV cache may grow to {need / 2**20:.0f} MiB but the worker has "
                            f"{kv_memory() / 2**20:.0f} MiB beside its models; ask for fewer tokens")
    grammar = None
    if request.sampling.grammar:
        from workers.backends.grammar import compile_grammar  # llguidance only for requests that use it

        grammar = compile_grammar(request.sampling.grammar, tokenizer, vocab)
    return Prepared(prompts, need, grammar)
