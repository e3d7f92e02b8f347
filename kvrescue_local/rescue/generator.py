"""One model's side of the search: a committed sequence and N candidate steps forked from it.

Sequence 0 holds the prompt and the committed trajectory; candidates are sequences 1..N,
decoded together one token each per llama_decode. A candidate ends at a blank line, at an
end-of-generation token, at the maximum step length, or when the detector kills it. The last
sampled token of a candidate is not decoded yet (`pending`): the commit decodes it into
sequence 0, whose logits then start the next round.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..detect import Detector, Monitor
from ..errors import KVRescueError
from ..eviction import BudgetedSequences, KVBudget
from ..runtime import DEFAULT_FLASH_ATTN, Context, ContextParams, Model, Sampler, SamplingParams
from .record import Candidate

COMMITTED = 0
STEP_END = b"\n\n"


@dataclass
class Draft:
    """A candidate step while it is decoded; `record()` freezes it into a record.Candidate."""

    side: str
    index: int
    seq: int
    tokens: list[int] = field(default_factory=list)
    text: bytearray = field(default_factory=bytearray)
    pending: int | None = None
    finished: str | None = None  # "step", "eos", "max_step", "killed"
    monitor: Monitor | None = None
    score: float | None = None

    @property
    def alive(self) -> bool:
        return self.finished is None

    @property
    def killed(self) -> bool:
        return self.finished == "killed"

    @property
    def content(self) -> str:
        return self.text.decode("utf-8", "replace")

    def record(self) -> Candidate:
        return Candidate(self.side, self.index, self.content, len(self.tokens), self.finished, self.score,
                         self.monitor.stats() if self.monitor is not None else None)


def seed_for(*parts: int) -> int:
    return int(np.random.SeedSequence([p & 0xFFFFFFFF for p in parts]).generate_state(1)[0])


class Generator:
    """A model, its context and its candidates; budgeted when `kv` is given."""

    def __init__(self, side: str, model: Model, n: int, n_ctx: int, kv: KVBudget | None, sampling: SamplingParams,
                 max_step_tokens: int, n_batch: int = 512, flash_attn: str = DEFAULT_FLASH_ATTN,
                 kv_type: str = "f16", n_threads: int = 0) -> None:
        self.side = side
        self.model = model
        self.n = n
        self.sampling = sampling
        self.max_step_tokens = max_step_tokens
        self.ctx = Context(model, ContextParams(n_ctx=n_ctx, n_seq_max=n + 1, n_batch=n_batch,
                                                flash_attn=flash_attn, kv_type=kv_type, n_threads=n_threads))
        self.budget = BudgetedSequences(self.ctx, kv) if kv else None
        if kv:
            kv.check_context(self.ctx, n + 1)
        self.chunk = min(n_batch, kv.buffer) if kv else n_batch
        self.tokens_generated = 0
        self.row = -1

    # --- the committed sequence ------------------------------------------
    def fork(self, src: int, dst: int) -> None:
        (self.budget or self.ctx).fork(src, dst)

    def drop(self, seq: int) -> None:
        (self.budget or self.ctx).drop(seq)

    def start(self, prompt: np.ndarray) -> None:
        for seq in range(self.n + 1):
            self.drop(seq)
        self.tokens_generated = 0
        if self.budget:
            self.budget.n_prompt = len(prompt)
        self.ingest(prompt)

    def ingest(self, tokens) -> None:
        """Append tokens to the committed sequence, keeping it within budget after each chunk."""
        tokens = np.asarray(tokens, dtype=np.int32)
        if len(tokens) == 0:
            return
        offset = 0
        while offset < len(tokens):
            size = self.budget.next_chunk(COMMITTED, len(tokens) - offset, self.chunk) if self.budget else self.chunk
            chunk = tokens[offset:offset + size]
            offset += size
            if not self.budget and self.ctx.pos_max(COMMITTED) + 1 + len(chunk) + self.n > self.ctx.n_ctx:
                raise KVRescueError(f"the {self.side} context (n_ctx={self.ctx.n_ctx}) is full: raise its context "
                                    "size or lower --max-tokens")
            self.row = self.ctx.prefill(COMMITTED, chunk)
            if self.budget:
                self.budget.enforce(COMMITTED)

    @property
    def llama_seconds(self) -> float:
        """Time spent inside llama.cpp (decoding and sampling) so far."""
        return self.ctx.decode_seconds + self.ctx.sample_seconds

    def resident_cells(self, seq: int = COMMITTED) -> int:
        return self.ctx.n_cells(seq)

    # --- candidates --------------------------------------------------------
    def propose(self, round_seed: int, detector: Detector | None = None, tail: bytes = b"") -> list[Draft]:
        """Decode N candidate steps from the committed sequence, all in the same llama_decode calls."""
        samplers = [Sampler(SamplingParams(temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                                           top_k=self.sampling.top_k, min_p=self.sampling.min_p,
                                           seed=seed_for(self.sampling.seed, round_seed, i)))
                    for i in range(self.n)]
        candidates = [Draft(self.side, i, i + 1, monitor=detector.monitor(tail) if detector else None)
                      for i in range(self.n)]
        first_logits = self.ctx.logits(self.row) if detector else None
        for cand, sampler in zip(candidates, samplers):
            self.fork(COMMITTED, cand.seq)
            self.accept(cand, sampler.sample(self.ctx, self.row), first_logits)
        if self.budget:
            self.budget.peak_cells = 0
        while True:
            active = [c for c in candidates if c.alive]
            if not active:
                return candidates
            self.ctx.step([c.seq for c in active], [c.pending for c in active])
            for row, cand in enumerate(active):
                logits = self.ctx.logits(row) if cand.monitor else None
                self.accept(cand, samplers[cand.index].sample(self.ctx, row), logits)
                if self.budget:
                    self.budget.enforce(cand.seq)

    def accept(self, cand: Draft, token: int, logits: np.ndarray | None) -> None:
        cand.tokens.append(token)
        self.tokens_generated += 1
        if self.model.is_eog(token):
            cand.pending = None
            cand.finished = "eos"
            return
        piece = self.model.token_bytes(token)
        cand.text += piece
        cand.pending = token
        if cand.monitor is not None and cand.monitor.update(logits, piece):
            cand.finished = "killed"
        elif cand.text.endswith(STEP_END):
            cand.finished = "step"
        elif len(cand.tokens) >= self.max_step_tokens:
            cand.finished = "max_step"

    def drop_candidates(self) -> None:
        for seq in range(1, self.n + 1):
            self.drop(seq)

    def commit_own(self, cand: Draft) -> None:
        """The winner is ours: its sequence becomes the committed one (no re-encoding)."""
        self.fork(cand.seq, COMMITTED)
        self.drop_candidates()
        if cand.pending is not None:
            self.ingest([cand.pending])

    def commit_foreign(self, tokens) -> None:
        """The winner came from the other model: encode its step."""
        self.drop_candidates()
        self.ingest(tokens)
