#!/usr/bin/env python3
"""PRM cost per round on a tiny model: 16 candidates scored in one batch vs the tokens scored.

Prints, for candidate steps of increasing length, the wall time of one `PRM.score` round,
the tokens it encoded, and the time per token; plus the same 16 candidates scored one call
each, side by side.

Usage: python3 perf/prm_perf.py [--rounds 20]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from kvrescue_local.presets import tiny_preset
from kvrescue_local.prm import PRM, PRMParams

N_CANDIDATES = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        prm = PRM(tiny_preset(Path(tmp)).prm, PRMParams(n_ctx=8192, max_candidates=N_CANDIDATES))
        prm.start("Let a=17, b=42 and c=5. Compute a+b-c. " * 4)
        prm.commit("a is 17.")
        print(f"PRM round of {N_CANDIDATES} candidates on {prm.model.describe()}")
        for step_len in (16, 64, 256):
            steps = [f"step {i}: " + "x" * step_len for i in range(N_CANDIDATES)]
            n_tokens = sum(len(prm.model.tokenize(prm.format.step_text(s))) for s in steps)
            started = time.perf_counter()
            for _ in range(args.rounds):
                prm.score(steps)
            batched = (time.perf_counter() - started) / args.rounds
            started = time.perf_counter()
            for _ in range(args.rounds):
                for s in steps:
                    prm.score([s])
            alone = (time.perf_counter() - started) / args.rounds
            print(f"  {n_tokens:5d} tokens/round: batched {1e3 * batched:7.2f} ms ({1e6 * batched / n_tokens:6.1f} us/token), "
                  f"one call each {1e3 * alone:7.2f} ms, speed-up {alone / batched:.2f}x")


if __name__ == "__main__":
    main()
