"""The KV budget: when a sequence's resident cells reach budget + buffer, evict back to budget.

A shared-set policy keeps one set of positions for all layers and heads (a llama.cpp cell is one
position in every layer), through `seq_rm` over runs of positions. A per-head policy (rkv, snapkv by
default) chooses per (layer, KV head); the budget then keeps as many cells, those whose entries the
most heads chose (so that nothing moves when every head agrees), moves each head's other chosen
entries into the cells it did not choose (llama_kvr_compact, patch 0004) and drops the rest. A kept
cell's position is then a label: the per-head map, keyed by position, says which entry (original
position) each (layer, head) of that cell holds; it follows forks and drops. The recent window (which holds the newest position:
the next token must sit at pos_max + 1), the policy's sinks and, optionally, the prompt are always
kept; the policy's scores choose the rest. A prompt longer than the budget is compressed to it as soon
as it has been read, as R-KV does at prefill. Works per sequence, so N candidates decoding in one
batch are budgeted independently.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import KVRescueError, SettingError
from ..runtime import Context
from ..runtime.attention import (cell_scores, copy_scores, enable_scores, key_rows, n_head_kv, observe_scores,
                                 reset_scores, span_scores)
from ..runtime.compaction import check_compaction, compact
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
        if self.n_sink is not None and self.n_sink < 0:
            raise SettingError(f"{{kv.n_sink}} {self.n_sink} is negative: keep 0 or more first entries", "kv.n_sink")
        if self.window < 1:
            raise SettingError(f"{{kv.window}} {self.window} keeps no recent entry: give at least 1", "kv.window")
        if self.buffer < self.window:
            raise SettingError(f"{{kv.window}} {self.window} exceeds {{kv.buffer}} {self.buffer}: the observation "
                               f"window must fit between evictions; lower {{kv.window}} to at most {self.buffer} or "
                               "raise {kv.buffer}", "kv.window", "kv.buffer")
        if self.budget <= self.sinks + self.window:
            raise SettingError(f"{{kv.budget}} {self.budget} leaves no room for the policy: it must exceed sinks "
                               f"({self.sinks}) + window ({self.window}); raise {{kv.budget}} to at least "
                               f"{self.sinks + self.window + 1} or lower {{kv.window}}", "kv.budget", "kv.window")

    @property
    def sinks(self) -> int:
        return make_policy(self.policy).n_sink if self.n_sink is None else self.n_sink

    @property
    def limit(self) -> int:
        """Resident cells that trigger eviction (the most a sequence ever holds)."""
        return self.budget + self.buffer

    def context_cells(self, n_sequences: int, batch: int) -> int:
        """Cells a context needs so that n_sequences each hold up to `limit` entries, plus one decode batch
        (per head, plus the free cells a compaction of a sequence shared with a fork moves into)."""
        spare = self.budget if make_policy(self.policy).per_head else 0
        return n_sequences * self.limit + batch + spare

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

    def room(self, forced: np.ndarray, n_prompt: int) -> int:
        """How many entries besides the forced ones the budget keeps."""
        room = self.budget - int(forced.sum())
        if room < 0:
            raise KVRescueError(f"the protected prompt ({n_prompt} tokens) does not fit in KV budget {self.budget}: "
                                "raise --budget or drop --protect-prompt")
        return room

    def keep(self, positions: np.ndarray, scores: np.ndarray, n_prompt: int) -> np.ndarray:
        """Boolean mask over positions: exactly `budget` entries (or all, if fewer) kept."""
        n = len(positions)
        if n <= self.budget:
            return np.ones(n, bool)
        forced = self.forced(positions, n_prompt)
        room = self.room(forced, n_prompt)
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


def choose_per_head(scores: np.ndarray, forced: np.ndarray, room: int) -> np.ndarray:
    """[n_layer, n_head_kv, n] bool: the forced entries and each head's `room` best others by its scores
    [n_layer, n_head_kv, n_free] (decreasing, ties to the older entry, as the reference ranks)."""
    kept = np.broadcast_to(forced, (*scores.shape[:2], len(forced))).copy()
    best = np.argsort(-scores, axis=-1, kind="stable")[..., :room]
    np.put_along_axis(kept, np.flatnonzero(~forced)[best], True, axis=-1)
    return kept


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
    # per head: seq -> {position label: [n_layer, n_head_kv] entry each (layer, head) of that cell holds};
    # a cell not listed holds its own position in every head
    head_maps: dict[int, dict[int, np.ndarray]] = field(default_factory=dict)
    moved_heads: int = 0  # (layer, head, cell) moves of all compactions
    compaction_seconds: float = 0.0  # wall time in llama_kvr_compact

    def __post_init__(self) -> None:
        self.policy = make_policy(self.config.policy)
        if not self.ctx.model.supports_partial_removal:
            raise KVRescueError(f"{self.ctx.model.path.name} is a recurrent or hybrid model: its memory cannot "
                                "drop single positions, so KV eviction needs a pure-attention model")
        if self.policy.per_head:
            check_compaction(self.ctx)
        if self.policy.reads_attention:
            enable_scores(self.ctx, self.config.window, per_head=self.policy.per_head)
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
        # a window policy's scores outside an open window are stale and reset when the next one opens: copying them
        # would cost a device read and write per layer for nothing
        if self.policy.reads_attention and (not self.windowed or self.track(src).observed_from is not None):
            copy_scores(self.ctx, src, dst)
        self.tracks[dst] = self.track(src).copy()
        if src in self.head_maps:
            self.head_maps[dst] = {p: e.copy() for p, e in self.head_maps[src].items()}
        else:
            self.head_maps.pop(dst, None)
        if self.windowed:
            observe_scores(self.ctx, dst, self.tracks[dst].observed_from is not None)

    def drop(self, seq_id: int) -> None:
        self.ctx.drop(seq_id)
        self.tracks.pop(seq_id, None)
        self.head_maps.pop(seq_id, None)
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
        if self.policy.per_head:
            entries = self.entries(seq_id, positions)
            order = np.argsort(entries, axis=-1, kind="stable")  # each head's cells in its entries' order
            inputs = dataclasses.replace(self.inputs(seq_id, track, cells, positions, order),
                                         head_positions=np.take_along_axis(entries, order, axis=-1))
            kept = self.head_keep(inputs, track.n_prompt)
            held = np.zeros_like(kept)
            np.put_along_axis(held, order, kept, axis=-1)
            self.apply_heads(seq_id, cells, positions, entries, held, inputs.forced)
        else:
            inputs = self.inputs(seq_id, track, cells, positions)
            kept = self.config.keep(positions, self.policy.score(inputs), track.n_prompt)
            for p0, p1 in evicted_runs(positions, kept):
                self.ctx.remove(seq_id, p0, p1)
        track.cells = self.ctx.n_cells(seq_id)
        self.last_choice = (inputs, kept)
        self.evictions += 1
        self.counts.setdefault(seq_id, [0, 0])[0] += 1

    def entries(self, seq_id: int, positions: np.ndarray) -> np.ndarray:
        """[n_layer, n_head_kv, n]: the entry (original position) each head of each cell of seq_id holds."""
        model = self.ctx.model
        out = np.broadcast_to(positions, (model.n_layer, model.n_head_kv, len(positions))).copy()
        held = self.head_maps.get(seq_id, {})
        for i, p in enumerate(positions.tolist()):
            if p in held:
                out[:, :, i] = held[p]
        return out

    def head_keep(self, inputs: EvictionInputs, n_prompt: int) -> np.ndarray:
        """[n_layer, n_head_kv, n] bool in each head's entry order: the forced entries and each head's best
        n_choose others (its scores in decreasing order, ties to the older entry, as the reference ranks)."""
        forced = inputs.forced
        if len(forced) <= self.config.budget:
            return np.ones((self.ctx.model.n_layer, self.ctx.model.n_head_kv, len(forced)), bool)
        return choose_per_head(self.policy.head_scores(inputs), forced, self.config.room(forced, n_prompt))

    def apply_heads(self, seq_id: int, cells: np.ndarray, positions: np.ndarray, entries: np.ndarray,
                    held: np.ndarray, forced: np.ndarray) -> None:
        """Keep per head the cells marked in held [n_layer, n_head_kv, n] (cell order): budget cells stay,
        those whose entries the most heads keep (ties: the newer), each head's other kept entries move
        into the kept cells it did not choose, and the other cells are dropped."""
        votes = held.sum(axis=(0, 1))
        candidates = np.flatnonzero(~forced)
        n_stay = int(held[0, 0].sum() - forced.sum())
        order = candidates[np.lexsort((positions[candidates], votes[candidates]))[::-1]]
        stays = forced.copy()
        stays[order[:n_stay]] = True
        # each head keeps budget entries, so it has as many incoming entries as free slots: in (layer, head, cell)
        # order the k-th incoming entry of a head pairs with its k-th slot
        layer, head, src = np.nonzero(held & ~stays)
        dst = np.nonzero(stays & ~held)[2]
        moved = entries.copy()
        moved[layer, head, dst] = entries[layer, head, src]
        started = time.perf_counter()
        compact(self.ctx, seq_id, layer, head, cells[src], cells[dst])
        self.compaction_seconds += time.perf_counter() - started
        self.moved_heads += len(src)
        for p0, p1 in evicted_runs(positions, stays):
            self.ctx.remove(seq_id, p0, p1)
        self.head_maps[seq_id] = {int(positions[i]): moved[:, :, i] for i in np.flatnonzero(stays)
                                  if (moved[:, :, i] != positions[i]).any()}

    def layer_scores(self, seq_id: int, cells: np.ndarray) -> np.ndarray:
        """[n_layer, len(cells)] accumulated attention of seq_id (per head: [n_layer, n_head_kv, len(cells)]), read
        from the device once per eviction, one transfer per layer."""
        scores = span_scores(self.ctx, seq_id, cells)
        return scores if self.policy.per_head else scores[:, 0]

    def window_attention(self, seq_id: int, track: Track, cells: np.ndarray) -> np.ndarray:
        """[n_layer, n] attention from the queries of the observation window (zeros if it never opened)."""
        observed = 0 if track.observed_from is None else track.taken - track.observed_from
        if observed < self.config.window:
            self.fallback_evictions += 1
            self.counts.setdefault(seq_id, [0, 0])[1] += 1
        if track.observed_from is None:
            heads = (self.ctx.model.n_head_kv,) if self.policy.per_head else ()
            return np.zeros((self.ctx.model.n_layer, *heads, len(cells)))
        return self.layer_scores(seq_id, cells).astype(np.float64)

    def inputs(self, seq_id: int, track: Track, cells: np.ndarray, positions: np.ndarray,
               order: np.ndarray | None = None) -> EvictionInputs:
        """What the policy sees; per head (order [n_layer, n_head_kv, n]: each head's cells in its entries'
        order) the attention and keys of each head are taken in that order."""
        forced = self.config.forced(positions, track.n_prompt)
        n_choose = max(0, self.config.budget - int(forced.sum()))
        window = cumulative = keys = None
        if self.policy.needs_attention:
            window = self.window_attention(seq_id, track, cells)
            if order is not None:
                window = np.take_along_axis(window, order, axis=-1)
        if self.policy.needs_cumulative_attention:
            cumulative = cell_scores(self.ctx, seq_id)[cells].astype(np.float64)
        if self.policy.needs_keys:
            rows = np.stack([key_rows(self.ctx, layer, cells) for layer in range(self.ctx.model.n_layer)])
            n_layer, n, width = rows.shape
            heads = n_head_kv(self.ctx)
            keys = rows.reshape(n_layer, n, heads, width // heads).transpose(0, 2, 1, 3)
            if order is not None:
                keys = np.take_along_axis(keys, order[..., None], axis=2)
        return EvictionInputs(positions, forced, n_choose, window_attention=window, cumulative_attention=cumulative,
                              keys=keys)
