"""A PyTorch-like training loop as an allocation trace: what benchmarks/growable_steps.py drives
a pool with, step by step, and benchmarks/replay.py replays on every backend.

24 layers of random widths; parameters and Adam's two moments allocated once; each step a
shape (sequence length x batch) drawn at random, so that activations change size from step to
step: forward, a temporary and an activation per layer (the temporary freed at once);
backward, an activation gradient and a parameter gradient per layer, the activation and the
previous gradient freed; then an optimizer temporary per parameter and the gradients freed.
("sync", 0, 0) follows each layer and each step (where the GPU catches up: the host driver's
events complete there when it replays a GPU behind). Operations are emmpool.replay's: ("alloc",
id, size) and ("free", id, 0); ids are never reused.
"""

from __future__ import annotations

import random

MiB = 1 << 20
LAYERS = 24


class _Ids:
    def __init__(self):
        self.ops, self.next = [], 0

    def alloc(self, size: int) -> int:
        key, self.next = self.next, self.next + 1
        self.ops.append(("alloc", key, size))
        return key

    def free(self, key: int) -> None:
        self.ops.append(("free", key, 0))

    def sync(self) -> None:
        self.ops.append(("sync", 0, 0))


def make(steps: int, seed: int = 1, steady: bool = False) -> tuple[list, list[int], list[int]]:
    """(the operations, the index in them where each step starts, the ids allocated before
    the first step: parameters and optimizer state, freed by no step). ``steady``: every step
    the same shape and sizes (a loop whose sizes never change)."""
    rng = random.Random(seed)
    t = _Ids()
    width = [rng.choice([1, 2, 3, 4, 6, 8]) for _ in range(LAYERS)]  # MiB per unit of shape
    kept = [t.alloc(w * 2 * MiB) for w in width]  # parameters
    kept += [t.alloc(w * 4 * MiB) for w in width]  # Adam's two moments
    starts = []
    for _ in range(steps):
        starts.append(len(t.ops))
        shape = 12 if steady else rng.randint(4, 16) * rng.choice([1, 2])
        acts = []
        for w in width:  # forward
            tmp = t.alloc(w * shape * MiB // 8 + (0 if steady else rng.randrange(64) * 256))
            acts.append(t.alloc(w * shape * MiB // 4 + (0 if steady else rng.randrange(64) * 256)))
            t.free(tmp)
            t.sync()
        grad = None
        grads = []
        for w, a in zip(reversed(width), reversed(acts)):  # backward
            g = t.alloc(w * shape * MiB // 4)
            grads.append(t.alloc(w * 2 * MiB))  # parameter gradient
            t.free(a)
            if grad is not None:
                t.free(grad)
            grad = g
            t.sync()
        t.free(grad)
        for g in grads:  # optimizer step: a temporary per parameter, then the gradients go
            tmp = t.alloc(2 * MiB * 2)
            t.free(tmp)
            t.free(g)
        t.sync()
    return t.ops, starts, kept
