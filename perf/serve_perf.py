#!/usr/bin/env python3
"""The server against `bench run`, side by side in one run, on the toy preset (one llama.cpp thread each):

  overhead  problems/min of `kvrescue-local serve` (16 requests at once, streamed) and of `bench run` on the
            same problems at the same concurrency and settings, and their ratio;
  latency   p50 and p95 seconds from sending a streamed request to its first committed step, 32 at once;
  soak      the server's RSS after a warm-up and after --soak-seconds of repeated requests (growth in %);
  rpc       a greedy solve with its layers on a loopback `rpc-server` against the local one (equal
            trajectories, speed ratio); needs a build with `python3 patches/build.py --rpc`;
  refusals  seconds to each refused request (a budget of 10**12, n over -n, a 10 MB body, a prompt of 1 MB
            that is tokenized and found too long) while 8 streams run, and the slowest /health answer meanwhile;
  mixed     --streams requests at once with the same settings (temperature 0.7, budget 64), then with alternating
            temperatures (0.7/0.75) and alternating budgets (64/96): each batch's wall and median first chunk
            side by side, and the server's RSS after each (two same/temperature pairs, six budget alternations).

Usage: python3 perf/serve_perf.py [--parts overhead,latency,soak,rpc,refusals,mixed] [--problems 16]
                                  [--concurrency 8] [-n 2] [--streams 32] [--soak-seconds 600]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from kvrescue_local.toy.dataset import toy_dataset

CLI = [sys.executable, "-m", "kvrescue_local"]
ENV = dict(os.environ, KVRESCUE_THREADS="1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # the toy's prompts are about 40 tokens: 128 reserved cells, not the default 1024, as `bench run` sizes
        # its contexts from the longest prompt (every decode attends over the whole context)
        self.proc = subprocess.Popen(CLI + ["serve", "--port", str(self.port), "-t", "1", "--prompt-tokens", "128",
                                            *args], env=ENV, stderr=subprocess.DEVNULL)
        while True:
            try:
                httpx.get(f"{self.url}/health")
                return
            except httpx.TransportError:
                if self.proc.poll() is not None:
                    raise SystemExit("the server did not start")
                time.sleep(0.1)

    def rss_kib(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def stream(url: str, problem: str, seed: int, out: dict, settings: dict | None = None) -> None:
    sent = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=600,
                      json={"messages": [{"role": "user", "content": problem}], "seed": seed, "stream": True,
                            **(settings or {})}) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and first is None:
                first = time.perf_counter()
    out[seed] = (first - sent, time.perf_counter() - sent)


def at_once(url: str, problems: list[str], seeds: list[int], settings: list[dict] | None = None) -> dict:
    """(seconds to the first chunk, seconds to the end) of each request by seed; settings: each request's body fields."""
    out: dict = {}
    threads = [threading.Thread(target=stream, args=(url, p, s, out, body))
               for p, s, body in zip(problems, seeds, settings or [None] * len(problems))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def overhead(problems: list[str], concurrency: int, n: int) -> None:
    server = Server(["-n", str(n), "--concurrency", str(concurrency)])
    try:
        at_once(server.url, problems[:concurrency], [0] * concurrency)  # warm-up
        started = time.perf_counter()
        at_once(server.url, problems, [0] * len(problems))
        served = len(problems) / (time.perf_counter() - started) * 60
    finally:
        server.close()
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "bench.jsonl"
        subprocess.run(CLI + ["bench", "run", "--dataset", "toy", "--limit", str(len(problems)), "--modes", "kvrescue",
                              "--ns", str(n), "--concurrency", str(concurrency), "-t", "1", "--results", str(results)],
                       env=ENV, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rows = [json.loads(line) for line in results.read_text().splitlines()]
    benched = len(rows) / max(r["engine"]["elapsed"] for r in rows) * 60
    print(f"overhead: {len(problems)} toy problems, concurrency {concurrency}, N={n}: serve {served:.1f} problems/min, "
          f"bench run {benched:.1f} problems/min, ratio {served / benched:.3f}")


def latency_and_soak(problems: list[str], streams: int, n: int, soak_seconds: float, parts: set[str]) -> None:
    server = Server(["-n", str(n), "--concurrency", str(streams)])
    try:
        batch = (problems * streams)[:streams]
        at_once(server.url, batch, list(range(streams)))  # warm-up: every slot used once
        if "latency" in parts:
            firsts = sorted(v[0] for v in at_once(server.url, batch, list(range(streams))).values())
            p50, p95 = statistics.median(firsts), firsts[min(len(firsts) - 1, int(0.95 * len(firsts)))]
            print(f"latency: {streams} streams at once, time to the first committed step: p50 {p50:.3f} s, p95 {p95:.3f} s")
        if "soak" in parts:
            samples = [server.rss_kib()]
            started, seed = time.perf_counter(), 1000
            while time.perf_counter() - started < soak_seconds:
                at_once(server.url, batch, list(range(seed, seed + streams)))
                seed += streams
                samples.append(server.rss_kib())
            before, after = samples[0], samples[-1]
            print(f"soak: {(len(samples) - 1) * streams} requests in {time.perf_counter() - started:.0f} s ({streams} at "
                  f"once): RSS {before / 1024:.1f} MiB -> {after / 1024:.1f} MiB ({100 * (after - before) / before:+.2f}%); "
                  f"after each {streams}: {' '.join(f'{s / 1024:.0f}' for s in samples)} MiB")
    finally:
        server.close()


def rpc(problem: str) -> None:
    port = free_port()
    server = subprocess.Popen(CLI + ["rpc-server", "--port", str(port), "-t", "1"], env=ENV,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(2)
        seconds, steps = {}, {}
        with tempfile.TemporaryDirectory() as tmp:
            for name, extra in (("local", []), ("rpc", ["--rpc", f"127.0.0.1:{port}"])):
                out = Path(tmp) / f"{name}.json"
                subprocess.run(CLI + ["solve", problem, "--mode", "kvrescue", "--budget", "48", "-n", "2", "--temp", "0", "-t", "1",
                                "--json", str(out), *extra],
                               env=ENV, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                record = json.loads(out.read_text())
                seconds[name] = record["timings"]["total"]
                steps[name] = [s["text"] for s in record["steps"]]
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"rpc: greedy toy solve (kvrescue, budget 48, N = 2), loopback: local {seconds['local']:.3f} s, over RPC {seconds['rpc']:.3f} s, "
          f"speed ratio {seconds['local'] / seconds['rpc']:.3f}; trajectories equal: {steps['local'] == steps['rpc']}")


def health_latencies(url: str, done: threading.Event, out: list[float]) -> None:
    """Seconds of each /health answer, one after another, until `done` is set."""
    with httpx.Client() as prober:  # one client: a new one per request would time its own setup
        while not done.is_set():
            sent = time.perf_counter()
            prober.get(f"{url}/health", timeout=60)
            out.append(time.perf_counter() - sent)
            time.sleep(0.01)


def latencies(seconds: list[float]) -> str:
    return f"{len(seconds)} answers, median {statistics.median(seconds) * 1000:.1f} ms, slowest {max(seconds) * 1000:.1f} ms"


def refusals(problems: list[str], n: int) -> None:
    server = Server(["-n", str(n), "--concurrency", "8"])
    try:
        idle: list[float] = []
        done = threading.Event()
        prober = threading.Thread(target=health_latencies, args=(server.url, done, idle))
        prober.start()
        time.sleep(3)
        done.set()
        prober.join()
        load = threading.Thread(target=at_once, args=(server.url, problems[:8], list(range(8))))
        load.start()
        busy: list[float] = []
        done = threading.Event()
        prober = threading.Thread(target=health_latencies, args=(server.url, done, busy))
        prober.start()
        bad = {"budget 10**12": {"budget": 10 ** 12}, f"n {n + 1} on -n {n}": {"n": n + 1},
               "a 10 MB body": {"prompt": "a" * 10_000_000}, "a 1 MB prompt": {"prompt": "a=1 " * 250_000}}
        with httpx.Client(timeout=60) as asker:
            for name, body in bad.items():
                sent = time.perf_counter()
                response = asker.post(f"{server.url}/v1/completions", json={"prompt": problems[0], **body})
                print(f"refusals: {name}: {response.status_code} in {time.perf_counter() - sent:.3f} s")
        done.set()
        prober.join()
        load.join()
        print(f"refusals: /health idle before: {latencies(idle)}; meanwhile: {latencies(busy)}")
    finally:
        server.close()


def mixed(problems: list[str], streams: int, n: int) -> None:
    server = Server(["-n", str(n), "--concurrency", str(streams)])
    try:
        batch, seeds = (problems * streams)[:streams], list(range(streams))
        same = [{"temperature": 0.7, "budget": 64}] * streams

        def alternating(field: str, values: tuple) -> list[dict]:
            return [{**same[i], field: values[i % 2]} for i in range(streams)]

        kinds = {"same settings": same, "temperature 0.7/0.75": alternating("temperature", (0.7, 0.75)),
                 "budget 64/96": alternating("budget", (64, 96))}
        at_once(server.url, batch, seeds, same)  # warm-up: every slot used once
        rows = []
        for kind in ["same settings", "temperature 0.7/0.75"] * 2 + ["budget 64/96"] * 6:
            started = time.perf_counter()
            out = at_once(server.url, batch, seeds, kinds[kind])
            rows.append((kind, time.perf_counter() - started, statistics.median(v[0] for v in out.values()),
                         server.rss_kib() / 1024))
    finally:
        server.close()
    print(f"mixed: {streams} streams at once, N={n}, toy preset")
    print(f"mixed:   {'settings':<22} {'wall s':>7} {'first chunk p50 s':>18} {'RSS after MiB':>14}")
    for kind, wall, first, rss in rows:
        print(f"mixed:   {kind:<22} {wall:7.2f} {first:18.3f} {rss:14.1f}")

    def medians(kind: str) -> tuple[float, float]:
        chosen = [r for r in rows if r[0] == kind]
        return statistics.median(r[1] for r in chosen), statistics.median(r[2] for r in chosen)

    (same_wall, same_first), (temp_wall, temp_first) = medians("same settings"), medians("temperature 0.7/0.75")
    budget_wall, _ = medians("budget 64/96")
    budget_rss = [r[3] for r in rows if r[0] == "budget 64/96"]
    print(f"mixed: medians: alternating temperature wall {temp_wall / same_wall:.2f}x the same settings' (target <= 1.25), "
          f"first chunk {temp_first / same_first:.2f}x (<= 1.5); alternating budget wall {budget_wall / same_wall:.2f}x "
          f"(<= 1.5; the first, which makes the budget-96 engine, {rows[4][1] / same_wall:.2f}x); RSS after six budget "
          f"alternations {budget_rss[-1] / budget_rss[0]:.3f}x the RSS after the first (<= 1.2)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="overhead,latency,soak,rpc,refusals,mixed")
    parser.add_argument("--problems", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("-n", type=int, default=2)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--soak-seconds", type=float, default=600)
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    problems = [p.problem for p in toy_dataset().problems[:max(args.problems, args.streams)]]
    if "overhead" in parts:
        overhead(problems[:args.problems], args.concurrency, args.n)
    if parts & {"latency", "soak"}:
        latency_and_soak(problems, args.streams, args.n, args.soak_seconds, parts)
    if "rpc" in parts:
        rpc(problems[0])
    if "refusals" in parts:
        refusals(problems, args.n)
    if "mixed" in parts:
        mixed(problems, args.streams, args.n)


if __name__ == "__main__":
    main()
