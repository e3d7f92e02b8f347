"""`--prm helper`: a reward head on the helper model's own context, with no PRM model or context of its own.

The helper already holds every problem's prompt and committed steps with full context, so the head reads
them where they are. A candidate step, the helper's or the base's, is scored in a spare sequence of the
helper's context forked from the problem's committed sequence: its tokens (formats.PRMFormat.step_tokens,
as the helper would hold the step once committed) are decoded alone, in llama_decode calls of their own,
the hidden state at its last token goes to the head, and the sequence is dropped. Nothing committed is
decoded again.

Alone, a candidate's hidden state does not depend on which candidates share a decode: grouped (as the
separate PRM decodes a round's candidates) that layout noise is as large as the head's margins between
similar steps and flipped about one N = 4 pick in six (perf/prm_layout.py). The committed prefix still
carries the layout it was written in; at Q4_K_M weights llama.cpp's 8-bit activations amplify that into
picks flipped as often, which is why the coder helper runs at F16 (presets.coder_helper, docs/prm.md). It
is also the state training reads: prmtrain/features.py scores every labelled step through
`candidate_hidden` on the committed prefix of its round, so training and serving read the same states by
the same code.

The states of a helper candidate are not taken from the decode that sampled it: that decode is shared by
the round's N candidates (its layout noise again), and its last token was never decoded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import KVRescueError
from ..prm import PRMFormat, RewardHead, prm_format
from ..runtime import Model
from .generator import Generator


@dataclass(frozen=True)
class HelperHead:
    """A reward head for `--prm helper`, checked against the helper's file (compose.open_models); the engine
    binds it to its helper's context."""

    head: RewardHead
    head_file: Path
    model: Model  # the helper

    @property
    def format(self) -> PRMFormat:
        return prm_format(self.head.format)

    @property
    def prompt(self) -> str:
        """The prompt template the head was trained on: the helper must be prompted so."""
        return self.head.prompt or self.format.prompt


class HelperJudge:
    """Scores candidate steps of the helper generator's problems in its spare sequence (Generator(scores=True))."""

    def __init__(self, gen: Generator, fmt: PRMFormat, head: RewardHead | None = None, prompt: str | None = None) -> None:
        """head None: hidden states only (training one). prompt: the template `trajectory_hidden` starts a problem
        with (default: the head's, else the format's; the loop prompts the helper itself)."""
        if gen.ctx.n_seq_max <= gen.slots * gen.stride:
            raise KVRescueError("the helper's context was made without room to score: create its Generator with "
                                "scores=True")
        if not fmt.as_held:
            raise KVRescueError(f"a head of format {fmt.name} reads steps rewritten for a PRM of its own, not as the "
                                "helper holds them: train one with `kvrescue-local prm train --format helper-value`")
        self.gen = gen
        self.format = fmt
        self.head = head
        self.model = gen.model
        self.prompt = prompt or (head and head.prompt) or fmt.prompt
        self.seq = gen.slots * gen.stride  # the spare sequence
        self.decoded_tokens = 0  # every token this judge decoded (candidates only)
        self.llama_seconds = 0.0  # its part of the helper context's llama.cpp time

    def candidate_hidden(self, slot: int, steps: list[str]) -> np.ndarray:
        """The helper's final hidden state at the last token of each candidate step, each decoded alone on the
        slot's committed trajectory [len(steps), n_embd]: what `score_many` feeds the head."""
        ctx = self.gen.ctx
        before = ctx.llama_seconds
        committed = self.gen.committed(slot)
        pieces = [self.format.step_tokens(self.gen.model, s) for s in steps]
        if pieces:
            held = ctx.used_cells(range(self.seq))
            self.gen.peak_used_cells = max(self.gen.peak_used_cells, held + max(len(p) for p in pieces))
        rows = []
        with ctx.hidden_states():
            for tokens in pieces:
                ctx.fork(committed, self.seq)
                rows.append(ctx.embedding(ctx.prefill(self.seq, tokens)))
                ctx.drop(self.seq)
                self.decoded_tokens += len(tokens)
        self.llama_seconds += ctx.llama_seconds - before
        return np.array(rows, np.float32).reshape(len(rows), ctx.n_embd)

    def trajectory_hidden(self, problem: str, steps: list[str], candidates: list[list[str]] | None = None,
                          slot: int = 0) -> np.ndarray:
        """A recorded trajectory read as the loop reads it: the helper holds the prompt and each committed step as
        the loop commits a step from text, and each round's step, then that round's `candidates`, are read by
        `candidate_hidden` on the prefix before it [steps + candidates, n_embd]. What training reads; forgets the
        slot's problem."""
        candidates = candidates or [[] for _ in steps]
        gen = self.gen
        gen.start(slot, gen.model.tokenize(self.prompt.format(problem=problem)))
        gen.flush()
        rows = []
        for i, step in enumerate(steps):
            rows.append(self.candidate_hidden(slot, [step, *candidates[i]]))
            if i + 1 < len(steps):
                gen.commit_foreign(slot, gen.model.tokenize(step, special=False))
                gen.flush()
        gen.finish(slot)
        return np.concatenate(rows) if rows else np.zeros((0, gen.ctx.n_embd), np.float32)

    def score_many(self, steps: dict[int, list[str]]) -> dict[int, np.ndarray]:
        """Rewards of each slot's candidate steps given its committed trajectory."""
        return {slot: self.rewards(self.candidate_hidden(slot, texts)) for slot, texts in steps.items()}

    def rewards(self, hidden: np.ndarray) -> np.ndarray:
        if self.head is None:
            raise KVRescueError("this judge reads hidden states only (made without a reward head): give it its head "
                                "to score steps")
        return self.head.rewards(hidden) if len(hidden) else np.zeros(0, np.float32)

