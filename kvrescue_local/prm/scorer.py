"""Score candidate steps with a GGUF PRM backbone and its reward head, for several problems at once.

Problem slot s holds its problem and committed steps in sequence s, only ever extended; a round's
candidates (of every slot that asks) are forks of their slot's sequence into the sequences after the
slots, decoded together, with hidden states read at the last token of each candidate. Steps to commit
are queued and decoded together before the next scoring. Each segment (header, each step) is tokenized
on its own, so a trajectory scored incrementally and one scored from scratch see the same tokens.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import KVRescueError
from ..runtime import DEFAULT_FLASH_ATTN, Context, ContextParams, Model
from .formats import prm_format
from .head import RewardHead, head_path

PREFIX = 0  # the slot of a single problem
AGGREGATIONS = ("last", "min", "prod")


@dataclass(frozen=True)
class PRMParams:
    n_ctx: int = 4096
    max_candidates: int = 16
    n_gpu_layers: int = 0
    n_batch: int = 512
    kv_type: str = "f16"
    flash_attn: str = DEFAULT_FLASH_ATTN
    n_threads: int = 0


class PRM:
    def __init__(self, path: str | Path, params: PRMParams = PRMParams(), head: str | Path | None = None,
                 features_only: str | None = None) -> None:
        """head: the reward head's file (default: beside the backbone, head_path(path)); a head trained on a
        model used as it is ships apart from its backbone. features_only: a format name; the backbone's hidden
        states are read in it and no head is loaded (training one: only the *_hidden methods work)."""
        self.params = params
        self.model = Model(path, n_gpu_layers=params.n_gpu_layers)
        self.head_file = None if features_only else Path(head) if head is not None else head_path(path)
        self.head = self.head_file and RewardHead.load(self.head_file, hidden_size=self.model.n_embd)
        self.format = prm_format(features_only or self.head.format)
        self.slots = 1
        self.ctx = self.new_context(params.n_ctx)
        self.bos = self.model.detokenize([self.model.bos])
        # per slot, its sequence's tokens by segment (re-encoded when the context grows), and those not decoded yet
        self.prefix: dict[int, list[np.ndarray]] = {}
        self.queued: dict[int, list[np.ndarray]] = {}
        self.peak_cells = 0  # most cells held while scoring: every slot's prefix and one group of candidates

    def sibling(self) -> PRM:
        """A PRM on the same backbone and head with a context of its own (for another group of problems)."""
        other = copy.copy(self)
        other.slots = 1
        other.ctx = other.new_context(self.params.n_ctx)
        other.prefix, other.queued, other.peak_cells = {}, {}, 0
        return other

    def new_context(self, n_ctx: int) -> Context:
        p = self.params
        return Context(self.model, ContextParams(n_ctx=n_ctx, n_seq_max=self.slots + p.max_candidates,
                                                 n_batch=p.n_batch, type_k=p.kv_type, type_v=p.kv_type, flash_attn=p.flash_attn,
                                                 embeddings=True, n_threads=p.n_threads))

    def reserve(self, slots: int) -> None:
        """Hold `slots` problems at once, each with n_ctx cells to start with, one batch shared (forgets every
        problem)."""
        if slots != self.slots:
            self.slots = slots
            self.ctx.free()
            self.ctx = self.new_context(slots * max(0, self.params.n_ctx - self.params.n_batch) + self.params.n_batch)
            self.prefix, self.queued = {}, {}

    # --- incremental scoring ----------------------------------------------
    def start(self, problem: str, slot: int = PREFIX) -> None:
        """Forget the slot's problem and queue the new one's header."""
        self.finish(slot)
        self.prefix[slot], self.queued[slot] = [], []
        self.append(slot, self.model.tokenize(self.format.header(problem, self.bos, self.head and self.head.prompt)))

    def finish(self, slot: int) -> None:
        """Forget the slot's problem and free its cells."""
        self.ctx.drop(slot)
        self.prefix.pop(slot, None)
        self.queued.pop(slot, None)

    def append(self, slot: int, tokens: np.ndarray) -> None:
        self.check_length(slot, len(tokens))
        self.prefix[slot].append(tokens)
        self.queued[slot].append(tokens)

    def commit(self, step: str, slot: int = PREFIX) -> None:
        """Append a step to the slot's cached trajectory (encoded once, never again)."""
        self.append(slot, self.format.step_tokens(self.model, step))

    def flush(self) -> None:
        """Decode every slot's queued tokens together."""
        queued = {slot: np.concatenate(parts) for slot, parts in self.queued.items() if parts}
        self.queued = {slot: [] for slot in self.queued}
        if queued and not self.make_room(sum(len(t) for t in queued.values())):
            self.decode_prefixes(queued)

    def score(self, steps: list[str], slot: int = PREFIX) -> np.ndarray:
        """Reward of each candidate step given the slot's committed trajectory."""
        return self.score_many({slot: steps})[slot]

    def score_many(self, steps: dict[int, list[str]]) -> dict[int, np.ndarray]:
        """Rewards of each slot's candidate steps given its committed trajectory, all slots in the same decodes."""
        return {slot: self.rewards(hidden) for slot, hidden in self.candidate_hidden_many(steps).items()}

    def candidate_hidden(self, steps: list[str], slot: int = PREFIX) -> np.ndarray:
        """The backbone's final hidden state at the end of each candidate step given the slot's committed
        trajectory [len(steps), n_embd]: what `score` feeds the head (and what a head is trained on)."""
        return self.candidate_hidden_many({slot: steps})[slot]

    def candidate_hidden_many(self, steps: dict[int, list[str]]) -> dict[int, np.ndarray]:
        """candidate_hidden of every slot's candidates, all slots in the same decodes.

        Candidates are decoded together in groups of at most n_batch tokens, and each group's
        sequences are dropped once read: in a unified KV cache every query attends over all
        resident cells, so keeping earlier groups would make a round quadratic in its tokens.
        """
        self.flush()
        for texts in steps.values():
            if len(texts) > self.params.max_candidates:
                raise KVRescueError(f"{len(texts)} candidates exceed the PRM's max_candidates="
                                    f"{self.params.max_candidates}: raise it")
        pieces = [(slot, self.format.step_tokens(self.model, s)) for slot, texts in steps.items() for s in texts]
        for slot, piece in pieces:
            self.check_length(slot, len(piece))
        groups = self.groups([len(p) for _, p in pieces])
        if pieces:
            largest = max(sum(len(pieces[i][1]) for i in g) for g in groups)
            self.make_room(largest)
            self.peak_cells = max(self.peak_cells, sum(len(t) for p in self.prefix.values() for t in p) + largest)
        hidden = []
        for group in groups if pieces else []:
            seqs = range(self.slots, self.slots + len(group))
            for seq, i in zip(seqs, group):
                self.ctx.fork(pieces[i][0], seq)
            tokens = np.concatenate([pieces[i][1] for i in group])
            seq_ids = np.concatenate([np.full(len(pieces[i][1]), seq, np.int32) for seq, i in zip(seqs, group)])
            positions = np.concatenate([self.ctx.pos_max(pieces[i][0]) + 1 + np.arange(len(pieces[i][1]), dtype=np.int32)
                                        for i in group])
            outputs = np.zeros(len(tokens), np.int8)
            outputs[np.cumsum([len(pieces[i][1]) for i in group]) - 1] = 1
            hidden.append(self.decode_hidden(tokens, positions, seq_ids, outputs))
            self.drop_candidates()
        rows = np.concatenate(hidden) if hidden else np.zeros((0, self.model.n_embd), np.float32)
        slots = np.array([slot for slot, _ in pieces])
        return {slot: rows[slots == slot] for slot in steps}

    def groups(self, lengths: list[int]) -> list[list[int]]:
        """Consecutive candidates packed into groups of at most n_batch tokens (a longer one stands alone) and at
        most max_candidates sequences."""
        groups, current, size = [], [], 0
        for i, n in enumerate(lengths):
            if current and (size + n > self.params.n_batch or len(current) == self.params.max_candidates):
                groups.append(current)
                current, size = [], 0
            current.append(i)
            size += n
        return groups + [current]

    def drop_candidates(self) -> None:
        for seq in range(self.slots, self.ctx.n_seq_max):
            self.ctx.drop(seq)

    # --- whole trajectories -------------------------------------------------
    def score_trajectory(self, problem: str, steps: list[str]) -> np.ndarray:
        """Per-step rewards of a whole trajectory encoded from scratch (resets the incremental state)."""
        return self.rewards(self.trajectory_hidden(problem, steps))

    def trajectory_hidden(self, problem: str, steps: list[str]) -> np.ndarray:
        """The backbone's final hidden state at the end of each step of a whole trajectory encoded from scratch
        [len(steps), n_embd] (resets the incremental state): what `score_trajectory` feeds the head."""
        self.start(problem)
        self.flush()
        if not steps:
            return np.zeros((0, self.model.n_embd), np.float32)
        pieces = [self.format.step_tokens(self.model, s) for s in steps]
        tokens = np.concatenate(pieces)
        self.check_length(PREFIX, len(tokens))
        self.make_room(len(tokens))
        start = self.ctx.pos_max(PREFIX) + 1
        outputs = np.zeros(len(tokens), np.int8)
        outputs[np.cumsum([len(p) for p in pieces]) - 1] = 1
        return self.decode_hidden(tokens, start + np.arange(len(tokens), dtype=np.int32),
                                  np.zeros(len(tokens), np.int32), outputs)

    # --- plumbing -----------------------------------------------------------
    def rewards(self, hidden: np.ndarray) -> np.ndarray:
        if self.head is None:
            raise KVRescueError(f"this PRM on {self.model.path.name} reads hidden states only (opened without a reward "
                                "head): open it with its head to score steps")
        return self.head.rewards(hidden) if len(hidden) else np.zeros(0, np.float32)

    def check_length(self, slot: int, extra: int) -> None:
        """A problem's trajectory plus `extra` tokens must fit in the PRM's training context."""
        held = sum(len(t) for t in self.prefix.get(slot, []))
        limit = max(self.model.n_ctx_train, self.params.n_ctx)
        if held + extra > limit:
            raise KVRescueError(f"the PRM needs {held + extra} tokens (trajectory {held} + candidates) but "
                                f"{self.model.path.name} was trained on a context of {limit}: lower --max-tokens")

    def make_room(self, extra: int) -> bool:
        """Grow the context to hold `extra` more tokens than it holds (at least doubling it) and re-encode every
        slot's prefix, queued tokens included, into it: a trajectory's length in the PRM's tokens is known only as
        it grows. True if it grew."""
        needed = sum(len(t) for parts in self.prefix.values() for t in parts) + extra
        if needed <= self.ctx.n_ctx:
            return False
        self.ctx.free()
        self.ctx = self.new_context(max(needed, 2 * self.ctx.n_ctx))
        self.queued = {slot: [] for slot in self.queued}
        self.decode_prefixes({slot: np.concatenate(parts) for slot, parts in self.prefix.items() if parts})
        return True

    def decode_prefixes(self, parts: dict[int, np.ndarray]) -> None:
        """Append tokens to each slot's sequence, all slots in shared decodes."""
        tokens = np.concatenate(list(parts.values()))
        positions = np.concatenate([self.ctx.pos_max(slot) + 1 + np.arange(len(t), dtype=np.int32)
                                    for slot, t in parts.items()])
        seq_ids = np.concatenate([np.full(len(t), slot, np.int32) for slot, t in parts.items()])
        self.decode_hidden(tokens, positions, seq_ids, np.zeros(len(tokens), np.int8))

    def decode_hidden(self, tokens, positions, seq_ids, outputs) -> np.ndarray:
        """Decode in n_batch chunks; hidden states of the rows flagged in outputs, in order."""
        rows = []
        step = self.params.n_batch
        for offset in range(0, len(tokens), step):
            chunk = slice(offset, offset + step)
            self.ctx.decode(tokens[chunk], positions[chunk], seq_ids[chunk], outputs[chunk])
            rows += [self.ctx.embedding(int(r)) for r in np.flatnonzero(outputs[chunk])]
        return np.array(rows, dtype=np.float32)


def aggregate(rewards, how: str = "last") -> float:
    """One number for a whole trajectory from its step rewards."""
    rewards = np.asarray(rewards, dtype=np.float64)
    if how not in AGGREGATIONS:
        raise KVRescueError(f"unknown aggregation {how!r}: use one of {', '.join(AGGREGATIONS)}")
    if len(rewards) == 0:
        raise KVRescueError("cannot aggregate the rewards of a trajectory with no steps")
    return float({"last": rewards[-1], "min": rewards.min(), "prod": rewards.prod()}[how])
