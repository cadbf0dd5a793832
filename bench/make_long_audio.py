"""Build a long speech file by concatenating the speech fixtures (tests/long_audio.py) and print its path.

Usage: python bench/make_long_audio.py --minutes 30 [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.long_audio import build  # noqa: E402


def main(argv=None) -> None:
    """Command line: build the file and print its path."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, required=True)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    print(build(args.minutes, args.out_dir))


if __name__ == "__main__":
    main()
