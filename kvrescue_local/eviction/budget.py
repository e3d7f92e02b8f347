"""The KV budget: when a sequence's resident cells reach budget + buffer, evict back to budget.

Token-level eviction (one keep-set for all layers and heads: a llama.cpp cell is one position in every
layer) through `seq_rm` over runs of positions. The recent window (which holds the newest position:
the next token must sit at pos_max + 1), the policy's sinks and, optionally, the prompt are always
kept; the policy's scores choose the rest. A prompt longer than the budget is compressed to it as soon
as it has been read, as R-KV does at prefill. Works per sequence, so N candidates decoding in one
batch are budgeted independently.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import KVRescueError
from ..runtime import Context
from ..runtime.attention import (cell_scores, copy_scores, enable_scores, key_rows, n_head_kv, observe_scores,
                                 reset_scores)
from .base import EvictionInputs, Policy, make_policy


@dataclass(frozen=True)
class KVBudget:
    budget: int = 64
    buffer: int = 128
    n_sink: int | None = None  # first entries always kept; None: the policy's default (what its reference keeps)
    window: int = 8  # recent entries always kept; also the observation window of attention policies
    policy: str = "rkv"  # a policy spec: a name, optionally with options, e.g. "rkv:lam=0.1,kernel=7"
    protect_prompt: bool = False

    def __post_init__(self) -> None:
        make_policy(self.policy)
        if (self.n_sink is not None and self.n_sink < 0) or self.window < 1 or self.buffer < self.window:
            raise KVRescueError(f"KV budget needs n_sink >= 0, window >= 1 and buffer >= window (the observation "
                                f"window fits between evictions): got n_sink={self.n_sink}, window={self.window}, "
                                f"buffer={self.buffer}")
        if self.budget <= self.sinks + self.window:
            raise KVRescueError(f"KV budget {self.budget} leaves no room for the policy: it must exceed sinks "
                                f"({self.sinks}) + window ({self.window}); raise --budget or lower --window")

    @property
    def sinks(self) -> int:
        return make_policy(self.policy).n_sink if self.n_sink is None else self.n_sink

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

    def forced(self, positions: np.ndarray, n_prompt: int) -> np.ndarray:
        """Boolean mask of the entries kept whatever the scores: sinks, recent window, protected prompt."""
        forced = np.zeros(len(positions), bool)
        forced[: self.sinks] = True
        forced[-self.window:] = True
        if self.protect_prompt:
            forced |= positions < n_prompt
        return forced

    def keep(self, positions: np.ndarray, scores: np.ndarray, n_prompt: int) -> np.ndarray:
        """Boolean mask over positions: exactly `budget` entries (or all, if fewer) kept."""
        n = len(positions)
        if n <= self.budget:
            return np.ones(n, bool)
        forced = self.forced(positions, n_prompt)
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
class Track:
    """What the budget knows of one sequence between its decodes."""

    n_prompt: int = 0  # its prompt's tokens (compressed once read if over the budget; kept if protected)
    taken: int = 0  # tokens decoded into it since it was empty: its clock
    cells: int = 0  # resident cells when last seen
    observed_from: int | None = None  # the clock when its observation window opened; None while closed

    def copy(self) -> Track:
        return Track(self.n_prompt, self.taken, self.cells, self.observed_from)


@dataclass
class BudgetedSequences:
    """Applies a KVBudget to the sequences of one context; call `enforce` after every decode of a sequence.

    Attention policies read the patch's per-sequence, per-layer scores. A window policy (SnapKV, R-KV)
    ranks by the attention of the last `window` queries before an eviction: a sequence is observed
    only from `window` tokens before it reaches the limit (its scores reset then), so the other decodes
    pay nothing for the scores, and a decode ends at every window start (`next_chunk`) so the window
    holds exactly those queries. An eviction whose window holds fewer (a decode that crossed its
    start) is counted in `fallback_evictions`. H2O reads attention since each entry arrived: every
    query is observed.
    """

    ctx: Context
    config: KVBudget
    n_prompt: int = 0  # the prompt of a sequence not given its own by `start`
    policy: Policy = field(init=False)
    evictions: int = 0
    fallback_evictions: int = 0  # evictions of a window policy whose window held fewer than `window` queries
    # per sequence id, kept across drops until the caller clears them: [evictions, fallback evictions]
    counts: dict[int, list[int]] = field(default_factory=dict)
    peak_cells: dict[int, int] = field(default_factory=dict)  # most cells each sequence held when checked
    last_choice: tuple[EvictionInputs, np.ndarray] | None = None  # what the policy saw and kept, last time
    tracks: dict[int, Track] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.policy = make_policy(self.config.policy)
        if not self.ctx.model.supports_partial_removal:
            raise KVRescueError(f"{self.ctx.model.path.name} is a recurrent or hybrid model: its memory cannot "
                                "drop single positions, so KV eviction needs a pure-attention model")
        if self.policy.reads_attention:
            enable_scores(self.ctx, self.config.window)
        if self.windowed:
            observe_scores(self.ctx, -1, False)

    @property
    def windowed(self) -> bool:
        """Scores observed only in each sequence's observation window."""
        return self.policy.needs_attention and not self.policy.needs_cumulative_attention

    def start(self, seq_id: int, n_prompt: int) -> None:
        """seq_id (empty) is about to read a prompt of n_prompt tokens."""
        self.tracks[seq_id] = Track(n_prompt)
        if self.windowed:
            observe_scores(self.ctx, seq_id, False)

    def fork(self, src: int, dst: int) -> None:
        self.ctx.fork(src, dst)
        if self.policy.reads_attention:
            copy_scores(self.ctx, src, dst)
        self.tracks[dst] = self.track(src).copy()
        if self.windowed:
            observe_scores(self.ctx, dst, self.tracks[dst].observed_from is not None)

    def drop(self, seq_id: int) -> None:
        self.ctx.drop(seq_id)
        self.tracks.pop(seq_id, None)
        if self.windowed:
            observe_scores(self.ctx, seq_id, False)

    def track(self, seq_id: int) -> Track:
        """seq_id's track, its clock advanced by the tokens decoded since it was last seen."""
        track = self.tracks.setdefault(seq_id, Track(self.n_prompt))
        cells = self.ctx.n_cells(seq_id)
        track.taken += cells - track.cells
        track.cells = cells
        return track

    def compresses_prompt(self, track: Track) -> bool:
        return track.n_prompt > self.config.budget

    def next_chunk(self, seq_id: int, n_tokens: int, most: int) -> int:
        """How many of n_tokens to decode into seq_id next (at most `most`): a decode ends at every
        eviction point and at every start of an observation window."""
        track = self.track(seq_id)
        limit, window = self.config.limit, self.config.window
        ahead = [limit - track.cells]
        if self.compresses_prompt(track):
            ahead.append(track.n_prompt - track.taken)
        if self.windowed:
            ahead.append(limit - window - track.cells)
            if self.compresses_prompt(track):
                ahead.append(track.n_prompt - window - track.taken)
        return min([n_tokens, most] + [a for a in ahead if a > 0])

    def in_window(self, track: Track) -> bool:
        """Whether the next queries of the sequence are among the last `window` before an eviction."""
        window = self.config.window
        before_prompt_eviction = self.compresses_prompt(track) and track.n_prompt - window <= track.taken < track.n_prompt
        return track.cells >= self.config.limit - window or before_prompt_eviction

    def enforce(self, seq_id: int) -> bool:
        """Evict seq_id back to the budget if it reached budget + buffer (or just read a prompt longer than
        the budget); True if it evicted. Opens or closes its observation window."""
        track = self.track(seq_id)
        self.peak_cells[seq_id] = max(self.peak_cells.get(seq_id, 0), track.cells)
        prompt_read = self.compresses_prompt(track) and track.taken == track.n_prompt and track.cells > self.config.budget
        evicted = track.cells >= self.config.limit or prompt_read
        if evicted:
            self.evict(seq_id, track)
        if self.windowed:
            self.observe(seq_id, track)
        return evicted

    def observe(self, seq_id: int, track: Track) -> None:
        opened = self.in_window(track)
        if opened and track.observed_from is None:
            reset_scores(self.ctx, seq_id)
            observe_scores(self.ctx, seq_id, True)
            track.observed_from = track.taken
        elif not opened and track.observed_from is not None:
            observe_scores(self.ctx, seq_id, False)
            track.observed_from = None

    def evict(self, seq_id: int, track: Track) -> None:
        cells, positions = self.ctx.cells(seq_id)
        inputs = self.inputs(seq_id, track, cells, positions)
        kept = self.config.keep(positions, self.policy.score(inputs), track.n_prompt)
        for p0, p1 in evicted_runs(positions, kept):
            self.ctx.remove(seq_id, p0, p1)
        track.cells = self.ctx.n_cells(seq_id)
        self.last_choice = (inputs, kept)
        self.evictions += 1
        self.counts.setdefault(seq_id, [0, 0])[0] += 1

    def layer_scores(self, seq_id: int, cells: np.ndarray) -> np.ndarray:
        """[n_layer, len(cells)] accumulated attention of seq_id."""
        return np.stack([cell_scores(self.ctx, seq_id, layer)[cells] for layer in range(self.ctx.model.n_layer)])

    def window_attention(self, seq_id: int, track: Track, cells: np.ndarray) -> np.ndarray:
        """[n_layer, n] attention from the queries of the observation window (zeros if it never opened)."""
        observed = 0 if track.observed_from is None else track.taken - track.observed_from
        if observed < self.config.window:
            self.fallback_evictions += 1
            self.counts.setdefault(seq_id, [0, 0])[1] += 1
        if track.observed_from is None:
            return np.zeros((self.ctx.model.n_layer, len(cells)))
        return self.layer_scores(seq_id, cells).astype(np.float64)

    def inputs(self, seq_id: int, track: Track, cells: np.ndarray, positions: np.ndarray) -> EvictionInputs:
        forced = self.config.forced(positions, track.n_prompt)
        n_choose = max(0, self.config.budget - int(forced.sum()))
        window = cumulative = keys = None
        if self.policy.needs_attention:
            window = self.window_attention(seq_id, track, cells)
        if self.policy.needs_cumulative_attention:
            cumulative = cell_scores(self.ctx, seq_id)[cells].astype(np.float64)
        if self.policy.needs_keys:
            rows = np.stack([key_rows(self.ctx, layer, cells) for layer in range(self.ctx.model.n_layer)])
            n_layer, n, width = rows.shape
            heads = n_head_kv(self.ctx)
            keys = rows.reshape(n_layer, n, heads, width // heads).transpose(0, 2, 1, 3)
        return EvictionInputs(positions, forced, n_choose, window_attention=window, cumulative_attention=cumulative,
                              keys=keys)
