"""The KV budget: when a sequence's resident cells reach budget + buffer, evict back to budget.

Token-level eviction (one keep-set for all layers and heads) through `seq_rm` over runs of
positions. The sinks, the recent window (which holds the newest position: the next token must
sit at pos_max + 1) and, optionally, the prompt are always kept; the policy's scores choose the
rest. Works per sequence, so N candidates decoding in one batch are budgeted independently.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import KVRescueError
from ..runtime import Context
from ..runtime.attention import cell_scores, copy_scores, enable_scores, key_rows
from .base import EvictionInputs, Policy, make_policy


@dataclass(frozen=True)
class KVBudget:
    budget: int = 64
    buffer: int = 128
    n_sink: int = 4
    window: int = 8  # recent entries always kept; also the observation window of attention policies
    policy: str = "streaming"
    protect_prompt: bool = False

    def __post_init__(self) -> None:
        make_policy(self.policy)
        if self.n_sink < 0 or self.window < 1 or self.buffer < 1:
            raise KVRescueError("KV budget needs n_sink >= 0, window >= 1 and buffer >= 1")
        if self.budget <= self.n_sink + self.window:
            raise KVRescueError(f"KV budget {self.budget} leaves no room for the policy: it must exceed sinks "
                                f"({self.n_sink}) + window ({self.window}); raise --budget or lower --window")

    @property
    def limit(self) -> int:
        """Resident cells that trigger eviction (the most a sequence ever holds)."""
        return self.budget + self.buffer

    def context_cells(self, n_sequences: int, batch: int) -> int:
        """Cells a context needs so that n_sequences each hold up to `limit` entries, plus one decode batch."""
        return n_sequences * self.limit + batch

    def check_context(self, ctx: Context, n_sequences: int) -> None:
        needed = self.context_cells(n_sequences, ctx.batch.capacity)
        if ctx.n_ctx < needed:
            raise KVRescueError(f"base context n_ctx={ctx.n_ctx} is too small for {n_sequences} sequences of "
                                f"budget {self.budget} + buffer {self.buffer}: it needs {needed}; raise the base context")

    def keep(self, positions: np.ndarray, scores: np.ndarray, n_prompt: int) -> np.ndarray:
        """Boolean mask over positions: exactly `budget` entries (or all, if fewer) kept."""
        n = len(positions)
        if n <= self.budget:
            return np.ones(n, bool)
        forced = np.zeros(n, bool)
        forced[: self.n_sink] = True
        forced[-self.window:] = True
        if self.protect_prompt:
            forced |= positions < n_prompt
        room = self.budget - int(forced.sum())
        if room < 0:
            raise KVRescueError(f"the protected prompt ({n_prompt} tokens) does not fit in KV budget {self.budget}: "
                                "raise --budget or drop --protect-prompt")
        candidates = np.flatnonzero(~forced)
        # stable order: among equal scores the newer entry wins
        order = candidates[np.lexsort((positions[candidates], scores[candidates]))[::-1]]
        kept = forced.copy()
        kept[order[:room]] = True
        return kept


def evicted_runs(positions: np.ndarray, kept: np.ndarray) -> list[tuple[int, int]]:
    """[p0, p1) ranges covering exactly the positions not kept (absent positions in between are harmless)."""
    runs = []
    start = None
    for pos, keep in zip(positions.tolist(), kept.tolist()):
        if not keep and start is None:
            start = pos
        elif keep and start is not None:
            runs.append((start, last + 1))
            start = None
        last = pos
    if start is not None:
        runs.append((start, last + 1))
    return runs


@dataclass
class BudgetedSequences:
    """Applies a KVBudget to the sequences of one context.

    Attention policies read the patch's per-sequence scores: a cell's score is the attention it
    received since its token was written (H2O's cumulative attention); the observation-window
    attention is that minus a snapshot taken `window` tokens before the budget fires. R-KV also
    reads the last layer's keys of the resident cells.
    """

    ctx: Context
    config: KVBudget
    n_prompt: int = 0
    policy: Policy = field(init=False)
    evictions: int = 0
    peak_cells: int = 0  # most cells a sequence held when checked (the caller may reset it)
    last_choice: tuple[EvictionInputs, np.ndarray] | None = None  # what the policy saw and kept, last time
    snapshots: dict[int, dict[int, float]] = field(default_factory=dict)  # seq -> {position: score}

    def __post_init__(self) -> None:
        self.policy = make_policy(self.config.policy)
        if not self.ctx.model.supports_partial_removal:
            raise KVRescueError(f"{self.ctx.model.path.name} is a recurrent or hybrid model: its memory cannot "
                                "drop single positions, so KV eviction needs a pure-attention model")
        if self.policy.needs_attention:
            enable_scores(self.ctx, self.config.window)

    def fork(self, src: int, dst: int) -> None:
        self.ctx.fork(src, dst)
        if self.policy.needs_attention:
            copy_scores(self.ctx, src, dst)
            self.snapshots.pop(dst, None)
            if src in self.snapshots:
                self.snapshots[dst] = dict(self.snapshots[src])

    def drop(self, seq_id: int) -> None:
        self.ctx.drop(seq_id)
        self.snapshots.pop(seq_id, None)

    def enforce(self, seq_id: int) -> bool:
        """Evict seq_id back to the budget if it reached budget + buffer; True if it evicted."""
        n = self.ctx.n_cells(seq_id)
        self.peak_cells = max(self.peak_cells, n)
        if self.policy.needs_attention and n == self.config.limit - self.config.window:
            cells, positions = self.ctx.cells(seq_id)
            self.snapshots[seq_id] = dict(zip(positions.tolist(), cell_scores(self.ctx, seq_id)[cells].tolist()))
        if n < self.config.limit:
            return False
        cells, positions = self.ctx.cells(seq_id)
        inputs = self.inputs(seq_id, cells, positions)
        kept = self.config.keep(positions, self.policy.score(inputs), self.n_prompt)
        for p0, p1 in evicted_runs(positions, kept):
            self.ctx.remove(seq_id, p0, p1)
        self.snapshots.pop(seq_id, None)
        self.last_choice = (inputs, kept)
        self.evictions += 1
        return True

    def inputs(self, seq_id: int, cells: np.ndarray, positions: np.ndarray) -> EvictionInputs:
        if not self.policy.needs_attention:
            return EvictionInputs(positions=positions)
        cumulative = cell_scores(self.ctx, seq_id)[cells].astype(np.float64)
        before = self.snapshots.get(seq_id, {})
        window = cumulative - np.array([before.get(p, 0.0) for p in positions.tolist()])
        keys = key_rows(self.ctx, self.ctx.model.n_layer - 1, cells) if self.policy.needs_keys else None
        return EvictionInputs(positions, window_attention=window, cumulative_attention=cumulative, keys=keys)
