"""torch.compile(mode="reduce-overhead") training with PyTorch's caching allocator, with it in
expandable-segments mode, and with emmpool, in the same run.

    python benchmarks/bench_torch_compile.py --out DIR [--rounds N] [--models transformer,...]

bench_torch_train.py with DEFAULTS below (benchmarks/README.md); writes
DIR/bench_torch_compile.{json,md}.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_torch_train import main  # noqa: E402

DEFAULTS = ["--compile", "reduce-overhead", "--expandable", "--models", "transformer",
            "--rounds", "2", "--warmup", "10", "--steps", "40"]

if __name__ == "__main__":
    main(DEFAULTS + sys.argv[1:])  # later arguments win
