"""Where the worker's embedding step loses to mlx-embeddings called directly (a probe, not a benchmark to publish).

Encodes the same 2,048 texts (bench_embeddings' sentences) four ways in this process, each three times after a
warm-up, and prints the best wall time of each:
- direct: mlx-embeddings' forward (`text_embeds`), all texts sorted by length, passes of 256 texts;
- ours, direct's passes: the worker's Encoder.encode (bert_hidden, pooling, numpy) on those passes;
- ours, the worker's passes: EmbeddingBatch's own picking and packing (FIFO windows, pass_tokens tokens a pass);
- module, the worker's passes: the same, with mlx-embeddings' module forward instead of bert_hidden.

    python bench/device/embed_probe.py --model DIR [--pass-tokens 16384]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--pass-tokens", type=int, default=16384)
    args = parser.parse_args()

    import mlx.core as mx
    import numpy as np

    from bench.bench_embeddings import make_texts
    from workers.backends.embeddings import EmbeddingBatch, Member, load_encoder

    encoder, _ = load_encoder(args.model, False)
    texts = make_texts("probe", 2048)
    ids = encoder.token_ids(texts)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    direct_passes = [[ids[i] for i in order[s:s + 256]] for s in range(0, len(order), 256)]

    batch = EmbeddingBatch.__new__(EmbeddingBatch)
    batch.pass_tokens, batch.members = args.pass_tokens, {}
    for r in range(64):
        rows = ids[r * 32:(r + 1) * 32]
        batch.members[r] = Member(r, None, rows, vectors=[None] * 32, left=32)
    worker_passes = []
    while any(m.taken < len(m.ids) for m in batch.members.values()):
        worker_passes += [[m.ids[i] for m, i in rows] for rows in batch._passes(batch._pick())]

    def direct():
        for rows in direct_passes:
            longest = max(map(len, rows))
            padded = mx.array([row + [0] * (longest - len(row)) for row in rows])
            mask = mx.array([[1.0] * len(row) + [0.0] * (longest - len(row)) for row in rows])
            np.array(encoder.model(padded, attention_mask=mask).text_embeds)

    def ours(passes, bert=True):
        encoder.bert = bert
        for rows in passes:
            encoder.encode(rows)
        encoder.bert = True

    trials = {"direct": direct, "ours, direct's passes": lambda: ours(direct_passes),
              f"ours, the worker's passes ({len(worker_passes)})": lambda: ours(worker_passes),
              "module, the worker's passes": lambda: ours(worker_passes, bert=False)}
    for name, run in trials.items():
        run()  # warm-up: kernels built for these shapes
        best = min(_timed(run) for _ in range(3))
        print(f"{name:<40} {best * 1000:8.1f} ms  {2048 / best:8.0f} texts/s")


def _timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
