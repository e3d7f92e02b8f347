"""One model's side of the search, for several problems at once in one context.

Problem slot s owns sequences s·(N+1) (the prompt and the committed trajectory) and the N after it
(candidates), so the slots of K problems share one context and every llama_decode carries the live
candidates of all of them. A candidate ends at a blank line, at an end-of-generation token, at the
maximum step length, or when the detector kills it. The last sampled token of a candidate is not
decoded yet (`pending`): the commit queues it for the committed sequence, whose logits then start
the next round.

Queued tokens (prompts, commits) are decoded together by `flush`. A sequence's tokens are cut into
the same chunks whatever shares the batch (a chunk is never split to fill one), and every slot's last
token goes into one final decode, so the logits of all slots are there when the next round starts:
a problem's cache, attention scores and evictions do not depend on its batch mates.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from ..detect import Detector, Monitor, token_entropy
from ..errors import KVRescueError
from ..eviction import BudgetedSequences, KVBudget
from ..runtime import DEFAULT_FLASH_ATTN, Context, ContextParams, Model, Sampler, SamplingParams
from .record import Candidate

STEP_END = b"\n\n"


@dataclass
class Draft:
    """A candidate step while it is decoded; `record()` freezes it into a record.Candidate."""

    side: str
    index: int
    seq: int
    sampler: Sampler | None = None
    tokens: list[int] = field(default_factory=list)
    text: bytearray = field(default_factory=bytearray)
    pending: int | None = None
    finished: str | None = None  # "step", "eos", "max_step", "killed"
    monitor: Monitor | None = None
    score: float | None = None
    false_arithmetic: list[str] | None = None  # what rescue/arithmetic.py found, where the round checked it

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
                         self.monitor.stats() if self.monitor is not None else None, self.false_arithmetic)


def seed_for(*parts: int) -> int:
    return int(np.random.SeedSequence([p & 0xFFFFFFFF for p in parts]).generate_state(1)[0])


@dataclass(frozen=True)
class Request:
    """One slot's round: the seeds of its candidates, for the detector the committed text's tail, and the slot's
    problem's own sampling when it has one (temperature, top-p and the seed its candidates' seeds come from; None:
    the generator's)."""

    slot: int
    seed: tuple[int, ...]
    tail: bytes = b""
    sampling: SamplingParams | None = None


class Generator:
    """A model, its context and the candidates of `slots` problems; budgeted when `kv` is given.

    `slot_cells` bounds what one problem may hold in a context that never evicts."""

    def __init__(self, side: str, model: Model, n: int, n_ctx: int, kv: KVBudget | None, sampling: SamplingParams,
                 max_step_tokens: int, n_batch: int = 512, flash_attn: str = DEFAULT_FLASH_ATTN,
                 type_k: str = "f16", type_v: str = "f16", n_threads: int = 0, slots: int = 1,
                 slot_cells: int | None = None, scores: bool = False) -> None:
        """scores: the context also scores candidate steps (`--prm helper`, judge.py): after the slots' sequences,
        each slot has N more to read the other side's candidates in (`scoring`)."""
        self.side = side
        self.model = model
        self.n = n
        self.slots = slots
        self.stride = n + 1
        self.sampling = sampling
        self.max_step_tokens = max_step_tokens
        self.ctx = Context(model, ContextParams(n_ctx=n_ctx, n_seq_max=slots * (self.stride + scores * n), n_batch=n_batch,
                                                flash_attn=flash_attn, type_k=type_k, type_v=type_v, n_threads=n_threads))
        self.slot_cells = slot_cells or self.ctx.n_ctx
        self.budget = BudgetedSequences(self.ctx, kv) if kv else None
        if kv:
            kv.check_context(self.ctx, slots * self.stride)
        self.chunk = min(n_batch, kv.buffer) if kv else n_batch
        self.tokens_generated = [0] * slots
        self.feeds: dict[int, list[np.ndarray]] = {}  # slot -> tokens queued for its committed sequence
        self.rows: dict[int, int] = {}  # slot -> row of its logits in the last decode
        self.peak_used_cells = 0  # most cells the context held at the end of a round (every slot together)
        self.read_ahead: set[int] = set()  # candidate sequences whose pending token a judge decoded (judge.py)

    def committed(self, slot: int) -> int:
        return slot * self.stride

    def sequences(self, slot: int) -> range:
        return range(self.committed(slot), self.committed(slot) + self.stride)

    def scoring(self, slot: int) -> range:
        """The slot's sequences to read candidates in (empty unless made with scores=True)."""
        first = self.slots * self.stride + slot * self.n
        return range(first, min(first + self.n, self.ctx.n_seq_max))

    # --- the committed sequence ------------------------------------------
    def fork(self, src: int, dst: int) -> None:
        (self.budget or self.ctx).fork(src, dst)

    def drop(self, seq: int) -> None:
        (self.budget or self.ctx).drop(seq)

    def start(self, slot: int, prompt: np.ndarray) -> None:
        """Empty the slot and queue a problem's prompt."""
        self.finish(slot)
        if self.budget:
            self.budget.start(self.committed(slot), len(prompt))
            for seq in self.sequences(slot):
                self.budget.counts.pop(seq, None)
        self.feed(slot, prompt)

    def finish(self, slot: int) -> None:
        """Free the slot's cells and forget its counts (its problem is done)."""
        for seq in (*self.sequences(slot), *self.scoring(slot)):
            self.drop(seq)
        self.feeds.pop(slot, None)
        self.rows.pop(slot, None)
        self.tokens_generated[slot] = 0

    def feed(self, slot: int, tokens) -> None:
        tokens = np.asarray(tokens, dtype=np.int32)
        if len(tokens):
            self.feeds.setdefault(slot, []).append(tokens)

    def overflow(self, slot: int) -> str | None:
        """Why the slot's queued tokens cannot fit (a context that never evicts), else None."""
        queued = sum(len(t) for t in self.feeds.get(slot, []))
        if self.budget or self.ctx.pos_max(self.committed(slot)) + 1 + queued + self.n <= self.slot_cells:
            return None
        return (f"the {self.side} context ({self.slot_cells} cells per problem) is full: raise its context size or "
                "lower --max-tokens")

    def flush(self) -> None:
        """Decode every slot's queued tokens into its committed sequence, keeping each within budget."""
        queues = {self.committed(slot): np.concatenate(parts) for slot, parts in self.feeds.items()}
        self.feeds = {}
        self.rows = {}
        self.decode_chunks({seq: q[:-1] for seq, q in queues.items() if len(q) > 1}, outputs=False)
        rows = self.decode_chunks({seq: q[-1:] for seq, q in queues.items()}, outputs=True)
        self.rows = {seq // self.stride: row for seq, row in rows.items()}

    def decode_chunks(self, queues: dict[int, np.ndarray], outputs: bool) -> dict[int, int]:
        """Decode the queues in shared batches of whole chunks; with outputs, the row of each sequence's last
        token (all in the last decode when each queue is one token)."""
        if outputs and len(queues) > self.ctx.batch.capacity:
            raise KVRescueError(f"{len(queues)} problems at once exceed the batch of {self.ctx.batch.capacity} tokens: "
                                "lower the concurrency or raise n_batch")
        offsets = dict.fromkeys(queues, 0)
        rows: dict[int, int] = {}
        while offsets:
            tokens, positions, seq_ids = [], [], []
            for seq, offset in list(offsets.items()):
                left = len(queues[seq]) - offset
                size = self.budget.next_chunk(seq, left, self.chunk) if self.budget else min(left, self.chunk)
                if len(tokens) + size > self.ctx.batch.capacity:
                    continue  # the next batch takes it whole
                start = self.ctx.pos_max(seq) + 1
                tokens += queues[seq][offset:offset + size].tolist()
                positions += range(start, start + size)
                seq_ids += [seq] * size
                rows[seq] = len(tokens) - 1
                offsets[seq] = offset + size
                if offsets[seq] == len(queues[seq]):
                    del offsets[seq]
            marks = np.zeros(len(tokens), np.int8)
            if outputs:
                marks[:] = 1
            self.ctx.check_vocab(np.asarray(tokens, np.int32))
            self.ctx.decode(np.asarray(tokens, np.int32), np.asarray(positions, np.int32),
                            np.asarray(seq_ids, np.int32), marks)
            if self.budget:
                for seq in dict.fromkeys(seq_ids):
                    self.budget.enforce(seq)
        return rows

    @property
    def llama_seconds(self) -> float:
        """Time spent inside llama.cpp (decoding, sampling, memory and patch calls) so far."""
        return self.ctx.llama_seconds

    def resident_cells(self, slot: int) -> int:
        return self.ctx.n_cells(self.committed(slot))

    def peak_candidate_cells(self, slot: int) -> int:
        """Most cells any of the slot's candidates held in its last round (0 without a budget)."""
        if not self.budget:
            return 0
        return max(self.budget.peak_cells.get(seq, 0) for seq in self.sequences(slot)[1:])

    def evictions(self, slot: int) -> tuple[int, int]:
        """(evictions, fallback evictions) of the slot's sequences since its problem started."""
        if not self.budget:
            return 0, 0
        counts = [self.budget.counts.get(seq, [0, 0]) for seq in self.sequences(slot)]
        return sum(c[0] for c in counts), sum(c[1] for c in counts)

    # --- candidates --------------------------------------------------------
    def propose(self, requests: list[Request], detector: Detector | None = None) -> dict[int, list[Draft]]:
        """N candidate steps for each requested slot, the live ones of every slot decoded in the same llama_decode
        calls; each candidate samples with its own seed, at its problem's temperature and top-p."""
        drafts: dict[int, list[Draft]] = {}
        for request in requests:
            if request.slot not in self.rows:
                raise KVRescueError(f"{self.side} slot {request.slot} has no logits to start a round from: queue its "
                                    "prompt or its last step and flush first")
            row = self.rows.pop(request.slot)
            first_entropy = token_entropy(self.ctx.logits(row)) if detector else None
            drafts[request.slot] = []
            sampling = request.sampling or self.sampling
            for i, seq in enumerate(self.sequences(request.slot)[1:]):
                params = replace(sampling, seed=seed_for(sampling.seed, *request.seed, i))
                cand = Draft(self.side, i, seq, Sampler(params), monitor=detector.monitor(request.tail) if detector else None)
                self.fork(self.committed(request.slot), seq)
                self.accept(request.slot, cand, cand.sampler.sample(self.ctx, row), first_entropy)
                if self.budget:
                    self.budget.peak_cells.pop(seq, None)
                drafts[request.slot].append(cand)
        every = [(slot, c) for slot, cands in drafts.items() for c in cands]
        while True:
            active = [(slot, c) for slot, c in every if c.alive]
            if not active:
                break
            for at in range(0, len(active), self.ctx.batch.capacity):
                part = active[at:at + self.ctx.batch.capacity]
                self.ctx.step([c.seq for _, c in part], [c.pending for _, c in part])
                entropies = token_entropy(self.ctx.output_logits()) if detector else None
                for row, (slot, cand) in enumerate(part):
                    entropy = entropies[row] if cand.monitor else None
                    self.accept(slot, cand, cand.sampler.sample(self.ctx, row), entropy)
                    if self.budget:
                        self.budget.enforce(cand.seq)
        held = [seq for r in requests for seq in self.sequences(r.slot)]
        self.peak_used_cells = max(self.peak_used_cells, self.ctx.used_cells(held))
        for _, cand in every:
            cand.sampler.free()
        return drafts

    def accept(self, slot: int, cand: Draft, token: int, entropy: float | None) -> None:
        """Append a sampled token to cand (entropy: of the logits it was drawn from, for cand's monitor)."""
        cand.tokens.append(token)
        self.tokens_generated[slot] += 1
        if self.model.is_eog(token):
            cand.pending = None
            cand.finished = "eos"
            return
        piece = self.model.token_bytes(token)
        cand.text += piece
        cand.pending = token
        if cand.monitor is not None and cand.monitor.update(entropy, piece):
            cand.finished = "killed"
            return
        ending = ("step" if cand.text.endswith(STEP_END) else
                  "max_step" if len(cand.tokens) >= self.max_step_tokens else None)
        if ending:
            cand.finished = "killed" if cand.monitor is not None and cand.monitor.finish() else ending

    def drop_candidates(self, slot: int) -> None:
        for seq in (*self.sequences(slot)[1:], *self.scoring(slot)):
            self.drop(seq)
            self.read_ahead.discard(seq)

    def commit_own(self, slot: int, cand: Draft) -> None:
        """The winner is ours: its sequence becomes the committed one (no re-encoding)."""
        if cand.seq in self.read_ahead:  # the pending token is queued again below, for the logits of the next round
            self.drop_last(cand.seq)
        self.fork(cand.seq, self.committed(slot))
        self.drop_candidates(slot)
        if cand.pending is not None:
            self.feed(slot, [cand.pending])

    def commit_held(self, slot: int, seq: int, last_token: int) -> None:
        """The winner was decoded whole into the slot's scoring sequence `seq` (judge.py): it becomes the committed
        one, its last token queued again for the logits that start the next round."""
        self.drop_last(seq)
        self.fork(seq, self.committed(slot))
        self.drop_candidates(slot)
        self.feed(slot, [last_token])

    def drop_last(self, seq: int) -> None:
        """Forget a sequence's last token (a context that never evicts: its positions are contiguous)."""
        last = self.ctx.pos_max(seq)
        self.ctx.remove(seq, last, last + 1)

    def commit_foreign(self, slot: int, tokens) -> None:
        """The winner came from the other model: queue its step."""
        self.drop_candidates(slot)
        self.feed(slot, tokens)
