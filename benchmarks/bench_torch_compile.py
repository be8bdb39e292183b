"""torch.compile(mode="reduce-overhead") training with PyTorch's caching allocator, with it in
expandable-segments mode, and with emmpool, in the same run: CUDA graph trees replay each step
from the allocator's private pools (checkpointed and restored between graphs).

    python benchmarks/bench_torch_compile.py --out DIR [--rounds N] [--models transformer,...]

bench_torch_train.py with ``--compile reduce-overhead --expandable`` (its docstring says what is
measured; warm-up steps include the compilation); writes DIR/bench_torch_compile.{json,md}.
Default: the transformer language model, 2 rounds of 10 warm-up and 40 timed steps.
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
