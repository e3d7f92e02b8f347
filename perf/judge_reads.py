#!/usr/bin/env python3
"""How many tokens `--prm helper` decodes to read the rounds of KV-Rescue rows, with and without decoding the
base candidates' common beginnings once (rescue/judge.py, shared_tokens).

For each scored round of the rows (two or more distinct survivors): one token per text the helper sampled; each
other (base) text in the helper's tokens, counted whole, and as shared_tokens plans it (a prefix trie per round).
Also the winning base steps' tokens, which the commit then does not decode again. Counts from the recorded texts,
tokenized anew by the helper's vocabulary: no decoding, so it runs in seconds beside a sweep.

Usage: python3 perf/judge_reads.py RESULTS.jsonl [--preset coder] [--config kvrescue-b64-n4-rkv]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvrescue_local.bench.results_file import read_rows
from kvrescue_local.presets import load_preset
from kvrescue_local.rescue.judge import Read, shared_tokens
from kvrescue_local.rescue.rules import parse_rule
from kvrescue_local.runtime import Model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results")
    parser.add_argument("--preset", default="coder")
    parser.add_argument("--config", default="kvrescue-b64-n4-rkv", help="the rows' config_key")
    args = parser.parse_args()
    if not Path(args.results).is_file():
        raise SystemExit(f"Error: no results file {args.results}: give a JSONL file that `bench run --results` wrote")
    helper = Model(load_preset(args.preset).helper)
    rows = read_rows(Path(args.results))
    rows = [r for r in rows if r["config_key"] == args.config and parse_rule(r["config"]["rule"]).name == "judge"]
    problems = rounds = own = whole = shared = winners = 0
    for row in rows:
        problems += 1
        for step in row["trajectory"]["steps"]:
            survivors = [c for c in step["candidates"] if c["finished"] != "killed"]
            if len({c["text"] for c in survivors}) < 2:
                continue
            rounds += 1
            mine = {c["text"] for c in survivors if c["side"] == "helper"}
            texts = list(dict.fromkeys(c["text"] for c in survivors if c["side"] == "base" and c["text"] not in mine))
            pieces = {t: helper.tokenize(t, special=False).tolist() or [helper.eos] for t in texts}
            reads = [Read(0, t, seq, pieces[t], first=0, root=-1) for seq, t in enumerate(texts)]
            bodies, lasts, _ = shared_tokens(reads)
            own += len(mine)
            whole += sum(len(p) for p in pieces.values())
            shared += len(bodies) + len(lasts)
            if step["source"] == "base" and step["text"] in pieces:
                winners += len(pieces[step["text"]])
    if not rounds:
        raise SystemExit(f"Error: no scored rounds of {args.config} with the PRM's choice in {args.results}")
    print(f"{problems} problems, {rounds} scored rounds of {args.config}")
    print(f"  the helper's own survivors: {own} tokens (one each)")
    print(f"  the base's survivors: {whole} tokens decoded whole, {shared} with common beginnings once "
          f"({100 * (1 - shared / whole):.1f}% fewer)")
    print(f"  of them the winning base steps': {winners} tokens ({100 * winners / shared:.1f}% of the shared count), "
          "which the commit does not decode again")
    print(f"  per problem: {(own + shared) / problems:.0f} tokens read, {(own + whole) / problems:.0f} without sharing")


if __name__ == "__main__":
    main()
