"""`--prm helper`: a reward head on the helper model's own context, with no PRM model or context of its own.

The helper already holds every problem's prompt and committed steps with full context, so the head reads
them where they are, at the last token of each candidate step as the helper holds it (formats.PRMFormat,
as_held):
- a helper candidate is read in the sequence that sampled it: only its last token was never decoded, and
  it is decoded now (an end-of-generation candidate's last token again), so a candidate costs one token;
- a base candidate is decoded in one of its slot's scoring sequences, forked from the committed one, in the
  tokens the helper would commit; if it wins, that sequence becomes the committed one (Generator.commit_held),
  so the winning step is not decoded again;
- every read of a round, all slots, goes into shared llama_decode calls, and the tokens the base candidates of a
  slot begin with in common are decoded once, in cells their scoring sequences share (`shared_tokens`).
Nothing committed is decoded twice: a committed step's last token is, for the logits of the next round.

A candidate's hidden state then depends, by float rounding, on what shared its decodes (its round mates and
other problems'): at F16 weights that moves the state by about 6e-4 of its norm, and perf/prm_layout.py
measures how often it flips a pick against reading each candidate alone (`candidate_hidden`, the layout the
head is trained in). At Q4_K_M weights llama.cpp's 8-bit activations amplify it into picks flipped one
round in five, which is why the coder helper runs at F16 (presets.coder_helper, docs/prm.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import KVRescueError
from ..prm import PRMFormat, RewardHead, prm_format
from ..runtime import Model
from .generator import Draft, Generator


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


@dataclass(frozen=True)
class Read:
    """A candidate to read: its tokens decoded into `seq` from position `first`, after the cells of `root`."""

    slot: int
    text: str
    seq: int
    tokens: list[int]
    first: int
    root: int  # reads that continue one sequence from one position share the cells of the tokens they begin with


@dataclass(frozen=True)
class Held:
    """A base candidate read in a scoring sequence, kept until its slot commits."""

    seq: int
    last_token: int
    body_tokens: int  # decoded before its last token, without outputs


@dataclass(frozen=True)
class Token:
    """One token to decode, in one cell every sequence of `seqs` holds."""

    seqs: tuple[int, ...]
    position: int
    token: int


def shared_tokens(reads: list[Read]) -> tuple[list[Token], list[Token], list[int]]:
    """(bodies, lasts, last_of): the tokens that decode every read, a token that reads of one root begin with in
    common once for all of them (a prefix trie). `lasts` end the reads (read i's is lasts[last_of[i]]), `bodies`
    are the rest, by position, so that sequences sharing a cell hold the same cells before it, as llama.cpp
    requires. A read that another one begins with is decoded on its own: its last token needs an output where
    the other's body has none."""
    def begins(longer: Read, shorter: Read) -> bool:
        return (longer.root, longer.first) == (shorter.root, shorter.first) and len(longer.tokens) > len(
            shorter.tokens) and longer.tokens[:len(shorter.tokens)] == shorter.tokens

    child: dict[tuple[object, int], int] = {}  # (parent node or a trie's root key, token) -> node
    nodes: list[tuple[list[int], int, int, int]] = []  # sequences, position, token, depth
    parents: set[int] = set()
    ends = []
    for read in reads:
        alone = any(begins(other, read) for other in reads)
        at: object = ("alone", read.seq) if alone else ("root", read.root, read.first)
        for depth, token in enumerate(read.tokens):
            node = child.get((at, token))
            if node is None:
                node = child[(at, token)] = len(nodes)
                nodes.append(([], read.first + depth, token, depth))
                if isinstance(at, int):
                    parents.add(at)
            nodes[node][0].append(read.seq)
            at = node
        ends.append(at)

    def token(node: int) -> Token:
        seqs, position, value, _ = nodes[node]
        return Token(tuple(seqs), position, value)

    bodies = sorted((n for n in range(len(nodes)) if n in parents), key=lambda n: nodes[n][3])
    last_of = {node: i for i, node in enumerate(dict.fromkeys(ends))}
    return [token(n) for n in bodies], [token(n) for n in last_of], [last_of[e] for e in ends]


class HelperJudge:
    """Scores candidate steps of the helper generator's problems in its own context (a Generator made with
    scores=True): a round's survivors where they are (`score_round`), or any steps each alone (`score_many`)."""

    def __init__(self, gen: Generator, fmt: PRMFormat, head: RewardHead | None = None, prompt: str | None = None) -> None:
        """head None: hidden states only (training one). prompt: the template `trajectory_hidden` starts a problem
        with (default: the head's, else the format's; the loop prompts the helper itself)."""
        if not gen.scoring(0):
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
        self.decoded_tokens = 0  # every token this judge decoded (candidates only)
        self.llama_seconds = 0.0  # its part of the helper context's llama.cpp time
        # the part of llama_seconds that decoded base winners' tokens before their last: work the helper's commit
        # would do with any choice (it decodes a base winner whole at commit), not the judge's
        self.committed_seconds = 0.0
        self.held: dict[int, dict[str, Held]] = {}  # slot -> base step text -> where it was read
        self.body_seconds_per_token = 0.0  # in this round's decodes without outputs

    def score_round(self, survivors: dict[int, list[Draft]],
                    as_committed: Callable[[Draft], list[int]]) -> dict[int, dict[str, float]]:
        """Rewards of each slot's surviving candidates of this round, by text (a text read once), all slots in shared
        decodes. `as_committed(draft)`: the tokens the helper would commit a base draft in. Keeps each base draft's
        scoring sequence for `commit_held` until the slot commits."""
        gen, ctx = self.gen, self.gen.ctx
        before = ctx.llama_seconds
        reads: list[Read] = []
        for slot, drafts in survivors.items():
            self.held[slot] = {}
            spare = iter(gen.scoring(slot))
            texts: set[str] = set()
            for d in sorted(drafts, key=lambda d: d.side != gen.side):  # a text the helper sampled is read where it is
                if d.content in texts:
                    continue
                texts.add(d.content)
                if d.side == gen.side:
                    reads.append(Read(slot, d.content, d.seq, *self.last_token(d), root=d.seq))
                else:
                    tokens = as_committed(d) or [gen.model.eos]  # an empty step is read at the end of generation
                    seq = next(spare)
                    gen.fork(gen.committed(slot), seq)
                    self.held[slot][d.content] = Held(seq, tokens[-1], len(tokens) - 1)
                    reads.append(Read(slot, d.content, seq, tokens, ctx.pos_max(seq) + 1, root=gen.committed(slot)))
        rows = self.decode_reads(reads)
        gen.peak_used_cells = max(gen.peak_used_cells, ctx.used_cells(range(ctx.n_seq_max)))
        self.llama_seconds += ctx.llama_seconds - before
        rewards = self.rewards(rows)
        out: dict[int, dict[str, float]] = {slot: {} for slot in survivors}
        for read, reward in zip(reads, rewards):
            out[read.slot][read.text] = float(reward)
        return out

    def last_token(self, d: Draft) -> tuple[list[int], int]:
        """(tokens, position) that give a helper draft's state at its last token as held: its pending token after
        what it decoded; an end-of-generation draft's last text token again (its cell rewritten), or the
        end-of-generation token itself for an empty step."""
        ctx = self.gen.ctx
        if d.pending is not None:
            self.gen.read_ahead.add(d.seq)
            return [d.pending], ctx.pos_max(d.seq) + 1
        if len(d.tokens) > 1:  # [..., last, eos]: last was decoded when eos was sampled
            self.gen.drop_last(d.seq)
            return [d.tokens[-2]], ctx.pos_max(d.seq) + 1
        return [self.gen.model.eos], ctx.pos_max(d.seq) + 1

    def decode_reads(self, reads: list[Read]) -> np.ndarray:
        """Decode every read in shared llama_decode calls of at most n_batch tokens (`shared_tokens`): all but each
        read's last token without outputs, then the last tokens with hidden states on (with them on llama.cpp
        outputs every token of a batch, logits included); the hidden state at each read's last token
        [len(reads), n_embd]."""
        ctx = self.gen.ctx
        bodies, lasts, last_of = shared_tokens(reads)
        before = ctx.llama_seconds
        self.decode_rows(bodies, outputs=False)
        self.body_seconds_per_token = (ctx.llama_seconds - before) / max(len(bodies), 1)
        with ctx.hidden_states():
            rows = self.decode_rows(lasts, outputs=True)
        self.decoded_tokens += len(bodies) + len(lasts)
        return np.array([rows[i] for i in last_of], np.float32).reshape(len(reads), ctx.n_embd)

    def decode_rows(self, items: list[Token], outputs: bool) -> list[np.ndarray]:
        """Items in decodes of at most n_batch, in their order; with outputs, each one's hidden state."""
        ctx, rows = self.gen.ctx, []
        for at in range(0, len(items), ctx.batch.capacity):
            chunk = items[at:at + ctx.batch.capacity]
            ctx.decode(np.array([t.token for t in chunk], np.int32), np.array([t.position for t in chunk], np.int32),
                       [t.seqs for t in chunk], np.full(len(chunk), int(outputs), np.int8))
            if outputs:
                rows += [ctx.embedding(r) for r in range(len(chunk))]
        return rows

    def commit_held(self, slot: int, text: str) -> bool:
        """Commit the slot's base winner from the scoring sequence it was read in; False if it was not read (a
        round with one survivor, or a text the helper sampled too)."""
        held = self.held.pop(slot, {}).get(text)
        if held is None:
            return False
        self.gen.commit_held(slot, held.seq, held.last_token)
        # its last token is decoded again at commit, as a commit of its text decodes it; the tokens before it were
        # decoded in this round's bodies, at their mean cost
        self.committed_seconds += held.body_tokens * self.body_seconds_per_token
        return True

    def candidate_hidden(self, slot: int, steps: list[str]) -> np.ndarray:
        """The helper's final hidden state at the last token of each candidate step, each decoded alone on the
        slot's committed trajectory [len(steps), n_embd]: what a head is trained on, the reference the layout of
        `score_round` is measured against (perf/prm_layout.py)."""
        ctx = self.gen.ctx
        before = ctx.llama_seconds
        committed, seq = self.gen.committed(slot), self.gen.scoring(slot)[0]
        pieces = [self.format.step_tokens(self.gen.model, s) for s in steps]
        if pieces:
            held = ctx.used_cells(range(ctx.n_seq_max))
            self.gen.peak_used_cells = max(self.gen.peak_used_cells, held + max(len(p) for p in pieces))
        rows = []
        with ctx.hidden_states():
            for tokens in pieces:
                ctx.fork(committed, seq)
                rows.append(ctx.embedding(ctx.prefill(seq, tokens)))
                ctx.drop(seq)
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

