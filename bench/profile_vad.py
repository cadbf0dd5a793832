"""The voice activity detector's time on a long file: reading the audio vs judging it, per number of lanes
(stretches judged side by side) and blocks judged at once (threads).

    python bench/profile_vad.py [--minutes 30] [--lanes 16,32,64] [--parallel 1,2,4]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.long_audio import build  # noqa: E402


def main() -> None:
    """Print one JSON line per setting."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--lanes", default="16,32,64")
    parser.add_argument("--parallel", default="1,2,4")
    args = parser.parse_args()
    from workers import vad
    from workers.audio import iter_samples

    path = build(args.minutes)
    t0 = time.perf_counter()
    samples = list(iter_samples(path))
    print(json.dumps({"read_s": round(time.perf_counter() - t0, 2)}))
    for threads in [int(t) for t in args.parallel.split(",")]:
        detector = vad.SileroVAD(parallel=threads)
        for lanes in [int(n) for n in args.lanes.split(",")]:
            vad.LANES = lanes
            t0 = time.perf_counter()
            count = sum(1 for _ in detector.probabilities(iter(samples)))
            print(json.dumps({"parallel": threads, "lanes": lanes, "judge_s": round(time.perf_counter() - t0, 2),
                              "windows": count}))


if __name__ == "__main__":
    main()
