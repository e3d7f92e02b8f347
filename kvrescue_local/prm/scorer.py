"""Score candidate steps with a GGUF PRM backbone and its reward head.

Sequence 0 holds the problem and the committed steps and is only ever extended; each round's
candidates are forks of it (sequences 1..N) decoded together, with hidden states read at the
last token of each candidate. Each segment (header, each step) is tokenized on its own, so a trajectory
scored incrementally and one scored from scratch see the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import KVRescueError
from ..runtime import DEFAULT_FLASH_ATTN, Context, ContextParams, Model
from .formats import prm_format
from .head import RewardHead, head_path

PREFIX = 0
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
        self.ctx = self.new_context(params.n_ctx)
        self.bos = self.model.detokenize([self.model.bos])
        self.prefix: list[np.ndarray] = []  # the tokens of sequence 0 by segment, to re-encode when the context grows

    def new_context(self, n_ctx: int) -> Context:
        p = self.params
        return Context(self.model, ContextParams(n_ctx=n_ctx, n_seq_max=p.max_candidates + 1, n_batch=p.n_batch,
                                                 kv_type=p.kv_type, flash_attn=p.flash_attn, embeddings=True,
                                                 n_threads=p.n_threads))

    # --- incremental scoring ----------------------------------------------
    def start(self, problem: str) -> None:
        """Forget everything and encode the problem's header."""
        for seq in range(self.ctx.n_seq_max):
            self.ctx.drop(seq)
        self.prefix = []
        self.append(self.model.tokenize(self.format.header(problem, self.bos)))

    def append(self, tokens: np.ndarray) -> None:
        self.make_room(self.ctx.pos_max(PREFIX) + 1 + len(tokens))
        self.ctx.prefill(PREFIX, tokens)
        self.prefix.append(tokens)

    def score(self, steps: list[str]) -> np.ndarray:
        """Reward of each candidate step given the committed trajectory."""
        return self.rewards(self.candidate_hidden(steps))

    def candidate_hidden(self, steps: list[str]) -> np.ndarray:
        """The backbone's final hidden state at the end of each candidate step given the committed trajectory
        [len(steps), n_embd]: what `score` feeds the head (and what a head is trained on).

        Candidates are decoded together in groups of at most n_batch tokens, and each group's
        sequences are dropped once read: in a unified KV cache every query attends over all
        resident cells, so keeping earlier groups would make a round quadratic in its tokens.
        """
        if not steps:
            return np.zeros((0, self.model.n_embd), np.float32)
        if len(steps) > self.params.max_candidates:
            raise KVRescueError(f"{len(steps)} candidates exceed the PRM's max_candidates="
                                f"{self.params.max_candidates}: raise it")
        pieces = [self.model.tokenize(self.format.step_text(s)) for s in steps]
        self.make_room(self.ctx.pos_max(PREFIX) + 1 + max(len(p) for p in pieces))
        start = self.ctx.pos_max(PREFIX) + 1
        hidden = []
        for group in self.groups([len(p) for p in pieces]):
            for seq, i in enumerate(group, start=1):
                self.ctx.fork(PREFIX, seq)
            tokens = np.concatenate([pieces[i] for i in group])
            seq_ids = np.concatenate([np.full(len(pieces[i]), seq, np.int32) for seq, i in enumerate(group, start=1)])
            positions = np.concatenate([start + np.arange(len(pieces[i]), dtype=np.int32) for i in group])
            outputs = np.zeros(len(tokens), np.int8)
            outputs[np.cumsum([len(pieces[i]) for i in group]) - 1] = 1
            hidden.append(self.decode_hidden(tokens, positions, seq_ids, outputs))
            self.drop_candidates()
        return np.concatenate(hidden)

    def groups(self, lengths: list[int]) -> list[list[int]]:
        """Consecutive candidates packed into groups of at most n_batch tokens (a longer one stands alone)."""
        groups, current, size = [], [], 0
        for i, n in enumerate(lengths):
            if current and size + n > self.params.n_batch:
                groups.append(current)
                current, size = [], 0
            current.append(i)
            size += n
        return groups + [current]

    def commit(self, step: str) -> None:
        """Append a step to the cached trajectory (encoded once, never again)."""
        self.append(self.model.tokenize(self.format.step_text(step)))

    def drop_candidates(self) -> None:
        for seq in range(1, self.ctx.n_seq_max):
            self.ctx.drop(seq)

    # --- whole trajectories -------------------------------------------------
    def score_trajectory(self, problem: str, steps: list[str]) -> np.ndarray:
        """Per-step rewards of a whole trajectory encoded from scratch (resets the incremental state)."""
        return self.rewards(self.trajectory_hidden(problem, steps))

    def trajectory_hidden(self, problem: str, steps: list[str]) -> np.ndarray:
        """The backbone's final hidden state at the end of each step of a whole trajectory encoded from scratch
        [len(steps), n_embd] (resets the incremental state): what `score_trajectory` feeds the head."""
        self.start(problem)
        if not steps:
            return np.zeros((0, self.model.n_embd), np.float32)
        pieces = [self.model.tokenize(self.format.step_text(s)) for s in steps]
        tokens = np.concatenate(pieces)
        self.make_room(self.ctx.pos_max(PREFIX) + 1 + len(tokens))
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
        return self.head.rewards(hidden)

    def make_room(self, needed: int) -> None:
        """Grow the context to hold `needed` tokens (at least doubling it, up to the PRM's training context) and
        re-encode the committed prefix into it: the trajectory's length in the PRM's tokens is known only as it grows."""
        if needed <= self.ctx.n_ctx:
            return
        limit = max(self.model.n_ctx_train, self.params.n_ctx)
        if needed > limit:
            raise KVRescueError(f"the PRM needs {needed} tokens (trajectory {self.ctx.pos_max(PREFIX) + 1} + candidates) "
                                f"but {self.model.path.name} was trained on a context of {limit}: lower --max-tokens")
        self.ctx.free()
        self.ctx = self.new_context(min(limit, max(needed, 2 * self.ctx.n_ctx)))
        if self.prefix:
            self.ctx.prefill(PREFIX, np.concatenate(self.prefix))

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
