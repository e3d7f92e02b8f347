"""Greedy decoding of one budgeted sequence, shared by the eviction tests that inspect every choice."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


def greedy_evictions(ctx, seqs, first_row: int, steps: int) -> Iterator[tuple]:
    """Decode sequence 0 greedily for `steps` tokens and yield (inputs, kept) of each eviction the budget made."""
    row = first_row
    for _ in range(steps):
        ctx.step([0], [int(np.argmax(ctx.logits(row)))])
        row = 0
        if seqs.enforce(0):
            yield seqs.last_choice
