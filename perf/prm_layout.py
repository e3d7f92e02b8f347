#!/usr/bin/env python3
"""How much the batch's layout moves the PRM's scores, and how often it changes the round's pick.

Replays the rounds of KV-Rescue rows in a results file (each round's distinct survivors, on the committed steps
before it) and prints, for each pair of layouts, the mean and largest score differences and the share of rounds
whose favourite differs; and, for a pick made by margin m (the first survivor, in the round's order, whose score
is within m of the best), the share of rounds whose pick differs.

--prm preset (the preset's separate PRM): the survivors scored together (one group forked from the committed
prefix, as that PRM scores a round) and each alone (a decode of its own); and the scores recorded in the row (the
loop's, on the machine that ran it) beside those scored together.

--prm helper (`--prm helper`, rescue/judge.py): the judge on the helper's context scores each round as the loop
does (`score_round`: the helper's survivors read in the sequences that sampled them, written one token a decode,
the base's decoded in scoring sequences, another problem's prompt, steps and round in the same context and
decodes, the committed steps written one token a decode) against each survivor read alone on a clean context
(the layout the head is trained in). Beside them, on the same file, format and head in a PRM context of its own:
each survivor alone (decoded by other code), and the baseline, the survivors grouped in one decode against each
alone. The head is --head, else the preset's helper head, else its PRM head (its weights on states read as
held: a layout test, not a quality one). --served-only: the first comparison alone (the judge as served against
each survivor alone), without the PRM context, in about half the time.

Usage: python3 perf/prm_layout.py RESULTS.jsonl [--preset coder] [--prm preset|helper] [--head FILE] [--helper FILE]
                                   [--config kvrescue-b64-n4-rkv:heads=shared] [--rounds 60] [--served-only]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from kvrescue_local.bench.results_file import read_rows
from kvrescue_local.compose import preset_config
from kvrescue_local.presets import load_preset
from kvrescue_local.prm import PRM, PRMParams, RewardHead, prm_format
from kvrescue_local.rescue import Generator
from kvrescue_local.rescue.generator import Draft
from kvrescue_local.rescue.judge import HelperJudge
from kvrescue_local.rescue.rules import parse_rule
from kvrescue_local.runtime import Model, SamplingParams

OTHER_PROBLEM = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."


def rounds(path: str, config_key: str):
    """(problem, committed steps before the round, the round's distinct survivors, their recorded scores, and each
    survivor's (side, finished) as first sampled)."""
    for row in read_rows(Path(path)):
        if row["config_key"] != config_key or parse_rule(row["config"]["rule"]).name != "judge" or "trajectory" not in row:
            continue
        steps = row["trajectory"]["steps"]
        for i, step in enumerate(steps):
            survivors = [c for c in step["candidates"] if c["finished"] != "killed"]
            recorded = {c["text"]: c["score"] for c in survivors}
            origin = {}
            for c in sorted(survivors, key=lambda c: c["side"] != "helper"):  # as the judge reads a shared text
                origin.setdefault(c["text"], (c["side"], c["finished"]))
            if len(recorded) > 1:
                yield (row["trajectory"]["problem"], [s["text"] for s in steps[:i]], list(recorded),
                       list(recorded.values()), [origin[t] for t in recorded])


MARGINS = (0.0, 0.005, 0.01, 0.02)  # a pick by margin m: the first survivor within m of the best (0: the best)


def pick(scores, margin: float) -> int:
    scores = np.asarray(scores)
    return int(np.flatnonzero(scores >= scores.max() - margin)[0])


class Tally:
    def __init__(self) -> None:
        self.diffs: dict[str, list[float]] = {}
        self.flips: dict[str, dict[float, int]] = {}

    def add(self, name: str, a, b) -> None:
        a, b = np.asarray(a), np.asarray(b)
        self.diffs.setdefault(name, []).extend(np.abs(a - b).tolist())
        flips = self.flips.setdefault(name, dict.fromkeys(MARGINS, 0))
        for margin in MARGINS:
            flips[margin] += int(pick(a, margin) != pick(b, margin))

    def show(self, seen: int) -> None:
        for name, values in self.diffs.items():
            flips = self.flips[name]
            print(f"  {name:42s}: |score difference| mean {np.mean(values):.5f}, max {np.max(values):.5f}; "
                  f"favourite differs in {flips[0.0]} of {seen} rounds ({100 * flips[0.0] / seen:.1f}%)")
            print(f"  {'':42s}  the first survivor within m of the best differs: " +
                  ", ".join(f"m={m:g} {flips[m]} ({100 * flips[m] / seen:.1f}%)" for m in MARGINS[1:]))


def separate_prm(args, preset) -> None:
    prm = PRM(preset.prm, PRMParams(n_ctx=4096, max_candidates=16), head=args.head or preset.prm_head)
    tally, seen = Tally(), 0
    for problem, committed, survivors, recorded, _ in rounds(args.results, args.config):
        if seen == args.rounds:
            break
        seen += 1
        prm.start(problem)
        for text in committed:
            prm.commit(text)
        together = prm.score(survivors)
        tally.add("together vs alone", together, [prm.score([text])[0] for text in survivors])
        tally.add("recorded vs together", recorded, together)
    print(f"{seen} rounds of {args.config} with 2 or more survivors, the preset's PRM")
    tally.show(seen)


def sampled_round(gen: Generator, slots: list[int], survivors: list[str], origins) -> dict[int, list[Draft]]:
    """Each slot's round as the loop holds it when it scores: the helper's survivors in the slot's candidate
    sequences, decoded from its committed sequence one token a decode, every sequence in the same decodes, their
    last token not decoded (an end-of-generation step's last text token is); the base's as drafts of their own."""
    ctx, drafts, writing = gen.ctx, {}, []
    for slot in slots:
        drafts[slot] = []
        own = iter(gen.sequences(slot)[1:])
        for i, (text, (side, finished)) in enumerate(zip(survivors, origins)):
            tokens = gen.model.tokenize(text, special=False).tolist() + [gen.model.eos] * (finished == "eos")
            draft = Draft(side, i, next(own) if side == "helper" else -1, tokens=tokens, text=bytearray(text.encode()),
                          finished=finished, pending=None if finished == "eos" else tokens[-1])
            drafts[slot].append(draft)
            if side == "helper":
                gen.fork(gen.committed(slot), draft.seq)
                writing.append((draft.seq, tokens[:-1]))
    for at in range(max((len(t) for _, t in writing), default=0)):
        live = [(seq, t[at]) for seq, t in writing if at < len(t)]
        ctx.step([seq for seq, _ in live], [token for _, token in live])
    return drafts


def helper_judge(args, preset) -> None:
    config = preset_config(preset)
    shipped = preset.helper_head if preset.helper_head and preset.helper_head.exists() else preset.prm_head
    head_file = Path(args.head) if args.head else shipped
    head = RewardHead.load(head_file)
    fmt = prm_format("helper-value")
    helper = Model(args.helper or preset.helper)
    n = max(len(s) for _, _, s, _, _ in rounds(args.results, args.config))

    def judge(slots: int) -> HelperJudge:
        gen = Generator("helper", helper, n, 4096 * slots, None, SamplingParams(), config.max_step_tokens,
                        n_batch=config.n_batch, flash_attn=config.flash_attn, type_k=config.helper_cache_type_k,
                        type_v=config.helper_cache_type_v, slots=slots, scores=True)
        return HelperJudge(gen, fmt, head, prompt=config.prompt)

    clean, crowded = judge(1), judge(2)
    # the same states in a PRM context of its own: the head's format and prompt where it is a head for the helper
    as_held = prm_format(head.format).as_held
    prm = None if args.served_only else PRM(
        args.helper or preset.helper, PRMParams(n_ctx=4096, max_candidates=16, n_batch=config.n_batch,
                                                flash_attn=config.flash_attn, kv_type=config.helper_cache_type_k),
        head=head_file if as_held else None, features_only=None if as_held else fmt.name)
    tally, seen, problem_now, held = Tally(), 0, None, 0
    for problem, committed, survivors, _, origins in rounds(args.results, args.config):
        if seen == args.rounds:
            break
        seen += 1
        if problem != problem_now or len(committed) < held:  # the rounds of one row extend one trajectory
            problem_now, held = problem, 0
            clean.gen.start(0, helper.tokenize(config.prompt.format(problem=problem)))
            crowded.gen.start(0, helper.tokenize(config.prompt.format(problem=OTHER_PROBLEM)))
            crowded.gen.start(1, helper.tokenize(config.prompt.format(problem=problem)))
            crowded.gen.flush()
            if prm:
                prm.start(problem)
        for slot in (0, 1):
            crowded.gen.drop_candidates(slot)
        for text in committed[held:]:
            tokens = helper.tokenize(text, special=False)
            clean.gen.feed(0, tokens)
            for token in tokens:  # one token a decode, as a sampled step is written
                crowded.gen.ctx.step([crowded.gen.committed(1)], [token])
            if prm:
                prm.commit(text)
        held = len(committed)
        clean.gen.flush()
        alone = clean.score_many({0: survivors})[0]
        drafts = sampled_round(crowded.gen, [0, 1], survivors, origins)
        served = crowded.score_round(drafts, lambda d: [t for t in d.tokens if not helper.is_eog(t)])[1]
        tally.add("judge: as served vs alone", [served[t] for t in survivors], alone)
        if prm:
            prm_alone = head.rewards(np.concatenate([prm.candidate_hidden([text]) for text in survivors]))
            tally.add("judge (alone) vs a PRM context, alone", alone, prm_alone)
            tally.add("baseline, a PRM context: grouped vs alone", head.rewards(prm.candidate_hidden(survivors)),
                      prm_alone)
        if seen % 10 == 0:  # a long replay says where it is
            print(f"{seen} rounds: picks differ (by margin) {tally.flips}", file=sys.stderr, flush=True)
    print(f"{seen} rounds of {args.config} with 2 or more survivors, --prm helper with {head_file.name} "
          f"(format {head.format})")
    tally.show(seen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results")
    parser.add_argument("--preset", default="coder")
    parser.add_argument("--prm", choices=["preset", "helper"], default="preset")
    parser.add_argument("--head", help="a head file [default: the preset's]")
    parser.add_argument("--helper", help="the helper's GGUF, with --prm helper [default: the preset's]")
    parser.add_argument("--config", default="kvrescue-b64-n4-rkv:heads=shared", help="the rows' config_key")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--served-only", action="store_true", help="with --prm helper: the judge as served against "
                        "each survivor alone only, without a PRM context")
    args = parser.parse_args()
    if args.served_only and args.prm != "helper":
        raise SystemExit("Error: --served-only compares the judge's layouts: use it with --prm helper")
    preset = load_preset(args.preset)
    (helper_judge if args.prm == "helper" else separate_prm)(args, preset)


if __name__ == "__main__":
    main()
