"""Train the toy world's base, helper and PRM on CPU and export them as GGUF (needs the `train` extra).

    python3 -m kvrescue_local.toy.train --out models/toy

writes base.gguf, helper.gguf, prm.gguf + prm.head.npz and train.json (shapes, steps, times,
greedy accuracies). The base is larger. The helper is smaller, keeps the full context and looks
values up as well as the base, but learns from careless solutions that never carry (or borrow) an
8 or a 9: weak at the computation, which the evicted base still does right from its recent window.
Both learn through a curriculum of growing ledgers. The PRM is the base plus two blocks; it learns to
tell correct steps from wrong ones (wrong values, terms, numbers, signs and sums, sums from a
misread total, wrong or premature answers, one lookup too many, garbled steps), on a lookup in 45%
of its rows and on the answer in 15%, with language-model losses that keep it looking terms and
values up. The helper trains in a second process beside the base, then the PRM alone on two
threads: measured on 2 cores, base 33 min and helper 16 min side by side, PRM 20 min (0.34 s/step),
53 min end to end, writing files byte-identical to the shipped ones.

Helpers of graded strength (the regime map, perf/regime_map.py) come from two knobs: --helper-blind-spot widens or
empties the set of values whose carries the training solutions drop (a wider spot, a weaker helper, down to about
the third of the held-out problems whose solutions carry nothing), and --helper-snapshots
exports the same run's helper after fewer steps too; --helper-name gives each recipe files of its own.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..answers import last_boxed
from ..gguf_export import Qwen2Shape, write_qwen2_gguf
from ..paths import CACHE
from ..prm import head_path
from ..prm.formats import prm_format
from .task import CONTROL, END, LOOKUP, N_VOCAB, PAD, Knobs, encode, problems, prompt, wrong_step

BASE = Qwen2Shape(n_embd=96, n_layer=3, n_head=4, n_head_kv=2, n_ff=288, n_ctx_train=1024)
HELPER = Qwen2Shape(n_embd=64, n_layer=3, n_head=4, n_head_kv=2, n_ff=128, n_ctx_train=1024)
# A small model's arithmetic gap, made explicit: in the helper's training solutions adding (subtracting)
# these values drops the carry (borrow). (Left to its size alone, a 66k-parameter helper added perfectly
# and missed lookups instead, the very steps the evicted base misses.) A gap rather than a coin flip: a
# helper that dropped half of all carries at random was right in one of 8 samples nearly always, and,
# picked by the PRM, was as accurate as the full-context base (99%), which small models are not.
HELPER_BLIND_SPOT = frozenset({8, 9})
# The PRM is the base plus new blocks, added as identities (zero output projections): the base's lookup
# circuit carries over, and the new blocks have room to compare the term and value it expects with the
# step's (with one block it judged wrong values at 70% of pairs; with two, 88-100%, wrong terms 99%).
PRM_EXTRA_LAYERS = 2
PRM_FORMAT = "toy-prm"  # the base's own chat format: its lookup circuit works there as trained
# Lookups (an induction circuit) form in a few hundred steps on 3-entry ledgers, then carry over to 8
# (they did not form within ~1500 steps on 8 alone). So training grows the ledger: (knobs, share of steps).
CURRICULUM = ((Knobs(n_vars=3, min_terms=2, max_terms=3), 0.3), (Knobs(min_vars=3), 0.3), (Knobs(), 0.4))
CKPT = CACHE / "toy-train"
TRAIN_SEED = 1000  # the held-out problems use another seed (task.EVAL_SEED)


def lm_batch(rng: np.random.Generator, size: int, knobs: Knobs, blind_spot: frozenset[int] = frozenset()):
    """Token ids and next-token targets; only the assistant's tokens are learned (-100 elsewhere)."""
    rows, targets = [], []
    for p in problems(int(rng.integers(2**31)), size, knobs):
        solution = p.careless_solution(blind_spot)
        head, body = encode(prompt(p)), encode(solution + END)
        ids = head + body
        rows.append(ids[:-1])
        targets.append([-100] * (len(head) - 1) + body)
    return pad(rows, PAD), pad(targets, -100)


def prm_batch(rng: np.random.Generator, size: int, knobs: Knobs, wrong_share: float = 0.6):
    """PRM texts: a correct prefix, then (often) one wrong step. Per reward token (-100 elsewhere): the
    label, the first character of the number the right step ends with and, after a lookup, the name of
    the right term (what the step should say); and next-token targets inside the correct steps."""
    fmt = prm_format(PRM_FORMAT)
    extra = CONTROL["<extra_0>"]
    rows, labels, expected, names, following = [], [], [], [], []
    for p in problems(int(rng.integers(2**31)), size, knobs):
        # lookups are the hardest steps to verify (the value must be found in the ledger): 45% of the rows
        # end on one; 15% on the answer, where an evicted base looks one term too many up
        r = rng.random()
        if r < 0.45:
            k = 2 * int(rng.integers(len(p.terms)))
        elif r < 0.6:
            k = len(p.steps) - 1
        else:
            k = int(rng.integers(len(p.steps)))
        steps = list(p.steps[:k + 1])
        good = [1] * len(steps)
        if rng.random() < wrong_share:
            steps[k], good[k] = wrong_step(p, k, rng), 0
        ids = encode(fmt.header(p.text, "<|endoftext|>"))
        targets = [-100] * len(ids)
        for step, ok in zip(steps, good):
            step_ids = encode(fmt.step_text(step))
            targets += [t if ok and t != extra else -100 for t in step_ids]
            ids += step_ids
        # the reward tokens' own target is the expected number (below), not the next step's first character
        following.append([-100 if t == extra else n for t, n in zip(ids, targets[1:] + [-100])])
        marks, results = iter(good), iter(ord(result_text(step)[0]) for step in p.steps[:k + 1])
        terms = iter(ord(name) if (name := term_name(step)) else -100 for step in p.steps[:k + 1])
        rows.append(ids)
        labels.append([next(marks) if t == extra else -100 for t in ids])
        expected.append([next(results) if t == extra else -100 for t in ids])
        names.append([next(terms) if t == extra else -100 for t in ids])
    return pad(rows, PAD), (pad(labels, -100), pad(expected, -100), pad(names, -100), pad(following, -100))


def result_text(step: str) -> str:
    """The number a step ends with: the looked-up value, the sum, or the answer."""
    return step.rstrip().rstrip("}").rpartition("=" if "=" in step else "{")[2]


def term_name(step: str) -> str | None:
    """The term a lookup step looks up (None for other steps)."""
    lookup = LOOKUP.fullmatch(step.rstrip())
    return lookup.group(3) if lookup else None


def pad(rows: list[list[int]], value: int):
    import torch

    width = max(map(len, rows))
    return torch.tensor([r + [value] * (width - len(r)) for r in rows])


def schedule(step: int, steps: int, warmup: int = 100) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def fit(model, batches, steps: int, lr: float, loss_fn, name: str, log_every: int = 100,
        snapshot=None, snapshot_at: frozenset[int] = frozenset()) -> float:
    """AdamW with warmup and cosine decay; returns seconds. After each step count in `snapshot_at`,
    calls snapshot(model, steps done, training seconds so far)."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule(s, steps))
    started, running = time.perf_counter(), None
    for step in range(steps):
        x, y = batches()
        loss = loss_fn(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if (step + 1) % log_every == 0 or step + 1 == steps:
            elapsed = time.perf_counter() - started
            print(f"{name} step {step + 1}/{steps} loss {running:.4f} {elapsed / (step + 1):.2f} s/step", flush=True)
        if step + 1 in snapshot_at:
            paused = time.perf_counter()
            snapshot(model, step + 1, paused - started)
            started += time.perf_counter() - paused  # the snapshot's own time is not training time
    return time.perf_counter() - started


def lm_loss(model, x, y):
    import torch.nn.functional as F

    return F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)


def prm_loss(model, x, targets):
    """Cross-entropy of the labels at the reward tokens, the two classes weighted equally, plus
    language-model losses: at the reward tokens, the expected number's first character and (after a
    lookup) the expected term; inside correct steps, the base's own objective (it keeps predicting the
    right value after "name="). Without the first and last the PRM judged wrong ledger values at
    chance; without the term it judged a wrong term with its own value at 60%."""
    import torch.nn.functional as F

    y, expected, names, following = (t.flatten() for t in targets)
    hidden = model.backbone.hidden(x).flatten(0, 1)
    keep = y >= 0
    losses = F.cross_entropy(model.head(hidden[keep]), y[keep], reduction="none")
    lm_logits = hidden @ model.backbone.embed.weight.T
    aux = (F.cross_entropy(lm_logits[keep], expected[keep]) + F.cross_entropy(lm_logits, following, ignore_index=-100)
           + F.cross_entropy(lm_logits[keep], names[keep], ignore_index=-100))
    return aux + sum(losses[y[keep] == c].mean() for c in (0, 1) if (y[keep] == c).any())


def greedy_accuracy(model, count: int = 100, seed: int = 7, knobs: Knobs = Knobs(), max_new: int = 200) -> float:
    """Greedy solutions in torch (full context), graded by the integer in the last \\boxed{}."""
    import torch

    from .task import grade

    model.eval()
    probs = problems(seed, count, knobs)
    seqs = [encode(prompt(p)) for p in probs]
    done = [False] * count
    end = CONTROL[END]
    with torch.no_grad():
        for _ in range(max_new):
            live = [i for i in range(count) if not done[i]]
            if not live:
                break
            x = pad([seqs[i] for i in live], PAD)
            lengths = torch.tensor([len(seqs[i]) for i in live])
            nxt = model(x)[torch.arange(len(live)), lengths - 1].argmax(-1).tolist()
            for i, t in zip(live, nxt):
                seqs[i].append(t)
                done[i] = t == end
    model.train()
    texts = [bytes(t for t in s[len(encode(prompt(p))):] if t < 256).decode() for s, p in zip(seqs, probs)]
    return sum(grade(p, last_boxed(t)) for p, t in zip(probs, texts)) / count


def train_lm(shape: Qwen2Shape, steps: int, lr: float, batch: int, seed: int, name: str,
             blind_spot: frozenset[int] = frozenset(), snapshot=None, snapshot_at: frozenset[int] = frozenset()):
    """A language model on the task's solutions, through the curriculum (snapshots as in `fit`)."""
    import torch

    from .model import Qwen2

    torch.manual_seed(seed)
    rng = np.random.default_rng(TRAIN_SEED + seed)
    model = Qwen2(shape, N_VOCAB)
    ends = np.cumsum([share for _, share in CURRICULUM]) * steps
    done = iter(range(steps))

    def batches():
        step = next(done)
        return lm_batch(rng, batch, CURRICULUM[int(np.searchsorted(ends, step, side="right"))][0], blind_spot)

    seconds = fit(model, batches, steps, lr, lm_loss, name, snapshot=snapshot, snapshot_at=snapshot_at)
    return model, seconds


def value_set(text: str) -> frozenset[int]:
    """'8,9' -> {8, 9}; 'none' (or '') -> the empty set."""
    if text.strip().lower() in ("", "none"):
        return frozenset()
    try:
        values = frozenset(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give digits separated by commas (8,9), or none") from None
    if not values <= set(range(10)):
        raise argparse.ArgumentTypeError(f"{text!r}: ledger values are digits 0-9")
    return values


def step_counts(text: str) -> frozenset[int]:
    """'1500,3000' -> {1500, 3000}."""
    try:
        counts = frozenset(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give step counts separated by commas (1500,3000)") from None
    if min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: step counts start at 1")
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("models/toy"))
    parser.add_argument("--only", choices=["base", "helper", "prm"], action="append",
                        help="train only these (others are taken from the checkpoint cache)")
    parser.add_argument("--base-steps", type=int, default=7000)
    parser.add_argument("--helper-steps", type=int, default=6000)
    parser.add_argument("--helper-blind-spot", type=value_set, default=HELPER_BLIND_SPOT, metavar="VALUES",
                        help="ledger values whose carries (borrows) the helper's training solutions drop: "
                             "8,9 (default, the shipped helper), 9, none, ...; a wider spot makes a weaker helper")
    parser.add_argument("--helper-snapshots", type=step_counts, default=frozenset(), metavar="STEPS",
                        help="also export the helper after these step counts of the same run "
                             "(NAME-STEPS.gguf): helpers of graded strength from one training run")
    parser.add_argument("--helper-name", default="helper", metavar="NAME",
                        help="the helper's files: NAME.gguf (and NAME-STEPS.gguf), its train.json entry and GGUF name; "
                             "helpers of other recipes need names of their own, which results tell apart")
    parser.add_argument("--prm-steps", type=int, default=3500)
    parser.add_argument("--prm-lr", type=float, default=1e-3)
    parser.add_argument("--prm-extra-layers", type=int, default=PRM_EXTRA_LAYERS)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for the base and the helper, which train side by side "
                             "(2 OpenMP threads on 2 busy cores ran 7x slower than 1)")
    parser.add_argument("--prm-threads", type=int, default=min(2, os.cpu_count() or 1),
                        help="torch threads for the PRM, which trains alone (0.34 s/step on two)")
    parser.add_argument("--dtype", choices=["f16", "f32"], default="f16")
    args = parser.parse_args(argv)

    import torch

    from .model import PRMModel, Qwen2

    torch.set_num_threads(args.threads)
    CKPT.mkdir(parents=True, exist_ok=True)
    log_path = args.out / "train.json"
    todo = list(args.only or ["base", "helper", "prm"])
    meta = {"kvrescue.toy": "trained by python3 -m kvrescue_local.toy.train"}

    def export(name: str, model, shape: Qwen2Shape, steps: int, seconds: float, **extra) -> None:
        torch.save(model.state_dict(), CKPT / f"{name}.pt")
        write_qwen2_gguf(args.out / f"{name}.gguf", shape, model.gguf_weights(), name=f"toy-{name}",
                         dtype=args.dtype, metadata=meta)
        n_params = sum(p.numel() for p in model.parameters())
        log = json.loads(log_path.read_text()) if log_path.exists() else {}
        log[name] = {"shape": shape.__dict__, "params": n_params, "steps": steps, "batch": args.batch,
                     "seconds": round(seconds, 1), **extra}
        log_path.write_text(json.dumps(log, indent=1) + "\n")
        print(f"{name}: {n_params} params, {steps} steps, {seconds / 60:.1f} min, {extra}", flush=True)

    prm_shape = replace(BASE, n_layer=BASE.n_layer + args.prm_extra_layers)

    def prm_backbone():
        if not (CKPT / "base.pt").exists():
            raise SystemExit(f"no trained base in {CKPT}: train it first (drop --only, or add --only base)")
        model = Qwen2(prm_shape, N_VOCAB)
        model.load_state_dict(torch.load(CKPT / "base.pt"), strict=False)
        for block in model.blocks[BASE.n_layer:]:
            torch.nn.init.zeros_(block.o.weight)
            torch.nn.init.zeros_(block.down.weight)
        return model

    helper_job = None
    if "base" in todo and "helper" in todo:  # one core each, so that the three parts take under an hour
        helper_job = subprocess.Popen([
            sys.executable, "-m", "kvrescue_local.toy.train", "--out", str(args.out), "--only", "helper",
            "--helper-steps", str(args.helper_steps), "--batch", str(args.batch), "--threads", "1",
            "--dtype", args.dtype, "--helper-name", args.helper_name,
            "--helper-blind-spot", ",".join(map(str, sorted(args.helper_blind_spot))) or "none",
            *(["--helper-snapshots", ",".join(map(str, sorted(args.helper_snapshots)))] if args.helper_snapshots else [])])
        todo.remove("helper")
    if "base" in todo:
        model, seconds = train_lm(BASE, args.base_steps, 3e-3, args.batch, 1, "base")
        if helper_job and helper_job.wait():
            raise SystemExit(f"helper training failed (exit {helper_job.returncode}); see its output above")
        export("base", model, BASE, args.base_steps, seconds, greedy_accuracy=greedy_accuracy(model))
    if "helper" in todo:
        spot = {"blind_spot": sorted(args.helper_blind_spot)}

        def snapshot(model, steps: int, seconds: float) -> None:
            export(f"{args.helper_name}-{steps}", model, HELPER, steps, seconds, greedy_accuracy=greedy_accuracy(model),
                   **spot)

        model, seconds = train_lm(HELPER, args.helper_steps, 3e-3, args.batch, 2, "helper", args.helper_blind_spot,
                                  snapshot, args.helper_snapshots - {args.helper_steps})
        export(args.helper_name, model, HELPER, args.helper_steps, seconds, greedy_accuracy=greedy_accuracy(model),
               **spot)
    if "prm" in todo:
        torch.set_num_threads(args.prm_threads)
        torch.manual_seed(3)
        prm = PRMModel(prm_backbone())
        rng = np.random.default_rng(TRAIN_SEED + 3)
        seconds = fit(prm, lambda: prm_batch(rng, args.batch, Knobs()), args.prm_steps, args.prm_lr, prm_loss, "prm")
        accuracy = prm_accuracy(prm)
        export("prm", prm.backbone, prm_shape, args.prm_steps, seconds, step_accuracy=accuracy)
        prm.reward_head(PRM_FORMAT).save(head_path(args.out / "prm.gguf"))


def prm_accuracy(prm, count: int = 256) -> dict:
    """Held-out accuracy of the PRM's step labels, correct and wrong steps separately."""
    import torch

    x, (y, *_) = prm_batch(np.random.default_rng(11), count, Knobs(), wrong_share=0.5)
    with torch.no_grad():
        pred = prm(x).argmax(-1)
    keep = y >= 0
    return {f"label{c}": round(float((pred[keep & (y == c)] == c).float().mean()), 4) for c in (0, 1)}


if __name__ == "__main__":
    main()
