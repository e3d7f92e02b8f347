"""The KV-Rescue loop and `kvrescue-local solve` on the tiny models through llama.cpp."""

import json
import os
import signal
import subprocess
import sys

import pytest
from click.testing import CliRunner

from kvrescue_local.cli import main
from kvrescue_local.detect import DetectorParams
from kvrescue_local.errors import KVRescueError
from kvrescue_local.eviction import KVBudget
from kvrescue_local.gguf_export import TINY_HELPER, Vocab, byte_vocab, random_qwen2_weights, write_qwen2_gguf
from kvrescue_local.answers import last_boxed
from kvrescue_local.rescue import MODES, SCHEMA_VERSION, Mode, Rescue, RescueConfig, Trajectory
from kvrescue_local.runtime import Model

PROBLEM = "Let a=17 and b=25. What is a+b?"
NO_KILL = DetectorParams(tau_entropy=50.0, tau_compression=0.01)  # random weights have near-uniform logits


def config(**overrides):
    base = dict(n=3, kv=KVBudget(budget=32, buffer=16, n_sink=4, window=8), detector=NO_KILL, max_tokens=240,
                max_step_tokens=24, temperature=1.0, top_p=0.95, seed=1)
    base.update(overrides)
    return RescueConfig(**base)


def without_timings(trajectory: Trajectory) -> dict:
    return {k: v for k, v in trajectory.to_json().items() if k != "timings"}


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_runs_end_to_end(mode, base_model, helper_model, tiny_prm):
    cfg = config(mode=mode)
    traj = Rescue(cfg, base_model, helper_model, tiny_prm).solve(PROBLEM)
    assert traj.stop in ("eos", "max_tokens", "max_steps") and traj.n_steps >= 1
    expected_sides = {"full": {"base"}, "bon": {"base"}, "helper": {"helper"}, "kvrescue": {"base", "helper"}}[mode]
    for step in traj.steps:
        assert len(step.candidates) == cfg.candidates_per_round
        assert {c.side for c in step.candidates} == expected_sides
        assert step.score == max(c.score for c in step.candidates if not c.killed)
        assert step.text in [c.text for c in step.candidates if c.side == step.source]
    for side in ("base", "helper"):
        assert (traj.tokens[side] > 0) == (side in expected_sides)
    assert set(traj.timings) >= {"prm", "orchestration", "total"}
    if mode == "kvrescue":
        assert all(traj.steps_from().values()), "both models contribute steps"
    record = json.loads(json.dumps(traj.to_json()))  # serialisable as is, and read back the same
    assert record["schema"] == SCHEMA_VERSION and record["text"] == traj.text
    assert Trajectory.from_json(record) == traj and Trajectory.from_json(record).mode is Mode(mode)


def test_records_of_schema_1_still_read(base_model, helper_model, tiny_prm):
    """Trajectories written before the schema field existed have the same layout without it."""
    traj = Rescue(config(mode="bon"), base_model, helper_model, tiny_prm).solve(PROBLEM)
    old = {k: v for k, v in traj.to_json().items() if k != "schema"}
    assert Trajectory.from_json(json.loads(json.dumps(old))) == traj
    with pytest.raises(KVRescueError, match="upgrade kvrescue-local"):
        Trajectory.from_json({**old, "schema": SCHEMA_VERSION + 1})
    with pytest.raises(KVRescueError, match="not a trajectory record"):
        Trajectory.from_json({"problem": "x"})


def test_modes_carry_their_semantics():
    assert [m for m in Mode if m.uses_base] == [Mode.FULL, Mode.BON, Mode.KVRESCUE]
    assert [m for m in Mode if m.uses_helper] == [Mode.HELPER, Mode.KVRESCUE]
    assert [m for m in Mode if m.evicts] == [Mode.BON, Mode.KVRESCUE]
    assert config(mode="bon").mode is Mode.BON and f"{Mode.BON}" == "bon" and json.dumps(Mode.BON) == '"bon"'
    with pytest.raises(KVRescueError, match="unknown mode 'fast'"):
        config(mode="fast")


def test_the_same_seed_gives_the_same_trajectory(base_model, helper_model, tiny_prm):
    engine = Rescue(config(), base_model, helper_model, tiny_prm)
    first = without_timings(engine.solve(PROBLEM))
    again = without_timings(engine.solve(PROBLEM))
    fresh = without_timings(Rescue(config(), base_model, helper_model, tiny_prm).solve(PROBLEM))
    other = without_timings(Rescue(config(seed=8), base_model, helper_model, tiny_prm).solve(PROBLEM))
    assert first == again == fresh
    assert other["text"] != first["text"]


def test_base_cells_never_exceed_budget_plus_buffer(base_model, helper_model, tiny_prm):
    cfg = config(mode="bon", max_tokens=600, max_step_tokens=64)
    traj = Rescue(cfg, base_model, helper_model, tiny_prm).solve(PROBLEM)
    assert len(traj.base_cells) == traj.n_steps
    assert max(c["max_candidate"] for c in traj.base_cells) == cfg.kv.limit, "candidates fill up to the limit, then evict"
    assert all(c["committed"] <= cfg.kv.limit for c in traj.base_cells)


def test_the_detector_kills_a_looping_base_and_the_helper_rescues(looping_model, helper_model, tiny_prm):
    cfg = config(detector=DetectorParams(), max_step_tokens=300, max_tokens=200)
    traj = Rescue(cfg, looping_model, helper_model, tiny_prm).solve(PROBLEM)
    assert all(c.killed and c.detector["killed"] == "repetition" for c in traj.base_candidates)
    assert traj.early_exit_fraction == 1.0
    assert traj.steps_from() == {"base": 0, "helper": traj.n_steps}


def test_a_loop_of_steps_shorter_than_a_check_is_killed_where_a_step_ends(blank_line_model, helper_model, tiny_prm):
    """The base writes blank-line steps of two tokens, under the detector's check_every: each step is checked where
    it ends, its window starting with the trajectory's tail, so once the window holds the loop the base's candidate
    dies and the helper's step is committed instead of the loop running to the step cap."""
    detector = DetectorParams(tau_entropy=50.0, text_window=64)
    cfg = config(n=1, rule="lead:base", detector=detector, max_step_tokens=16, max_tokens=240)
    traj = Rescue(cfg, blank_line_model, helper_model, tiny_prm).solve(PROBLEM)
    base = [c for s in traj.steps for c in s.candidates if c.side == "base"]
    assert all(c.text == "\n\n" for c in base)
    killed = [c for c in base if c.killed]
    assert killed and all(c.detector["killed"] == "repetition" and c.detector["tokens"] == 2 for c in killed)
    assert not base[0].killed, "a window not yet full of the loop is not judged"
    assert traj.steps_from()["helper"] >= len(killed)


def test_a_watched_looping_helper_is_killed_and_a_round_all_killed_commits_the_least_degenerate(
        looping_model, base_model, tiny_prm):
    """The helper loops: watched by its own thresholds, each of its candidates dies, and the base's steps are
    committed; when the base loops too, every round falls back to its least degenerate candidate, says so, and the
    trajectory goes on to its cap instead of stopping."""
    watched = dict(detector=DetectorParams(tau_entropy=50.0), helper_tau_entropy=50.0, helper_tau_compression=0.35, n=2,
                   max_step_tokens=300, max_tokens=200)
    traj = Rescue(config(**watched), base_model, looping_model, tiny_prm).solve(PROBLEM)
    helper = [c for s in traj.steps for c in s.candidates if c.side == "helper"]
    assert helper and all(c.killed and c.detector["killed"] == "repetition" for c in helper)
    assert traj.helper_killed == len(helper) and traj.fallbacks == 0
    assert traj.steps_from() == {"base": traj.n_steps, "helper": 0}
    both = Rescue(config(**{**watched, "max_tokens": 400}), looping_model, looping_model, tiny_prm).solve(PROBLEM)
    assert both.fallbacks == both.n_steps > 1 and both.stop == "max_tokens"
    assert all(s.fallback and s.killed == 4 for s in both.steps)
    assert Trajectory.from_json(json.loads(json.dumps(both.to_json()))).fallbacks == both.fallbacks
    with pytest.raises(KVRescueError, match="both thresholds"):
        config(helper_tau_compression=0.35)


def test_last_boxed_answer():
    assert last_boxed("so \\boxed{1} then \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert last_boxed("no answer") is None
    assert last_boxed("\\boxed{unclosed") is None


def model_without_chat_tokens(path):
    vocab = byte_vocab()
    keep = [i for i, t in enumerate(vocab.tokens) if t != "<|im_start|>"]
    reduced = Vocab([vocab.tokens[i] for i in keep], [vocab.types[i] for i in keep], vocab.merges)
    weights = random_qwen2_weights(TINY_HELPER, seed=4)
    weights["token_embd.weight"] = weights["token_embd.weight"][keep]
    return Model(write_qwen2_gguf(path, TINY_HELPER, weights, vocab=reduced))


def test_bad_input(base_model, helper_model, tiny_prm, tmp_path):
    with pytest.raises(KVRescueError, match="no <\\|im_start\\|> control token.*same family"):
        Rescue(config(), base_model, model_without_chat_tokens(tmp_path / "odd.gguf"), tiny_prm)
    with pytest.raises(KVRescueError, match="helper context 300 cannot hold.*raise it or lower --max-tokens"):
        Rescue(config(helper_ctx=300), base_model, helper_model, tiny_prm)
    with pytest.raises(KVRescueError, match="n must be at least 1"):
        config(n=0)
    with pytest.raises(KVRescueError, match="unknown eviction policy"):
        config(kv=KVBudget(policy="fifo"))
    with pytest.raises(KVRescueError, match="need a PRM"):
        Rescue(config(), base_model, helper_model, None)
    with pytest.raises(KVRescueError, match="needs a helper model"):
        Rescue(config(), base_model, None, tiny_prm)


def solve_args(base_path, helper_path, tiny_prm_path, *extra):
    return ["solve", PROBLEM, "--base", str(base_path), "--helper", str(helper_path), "--prm", str(tiny_prm_path),
            "-n", "2", "--budget", "32", "--buffer", "16", "--max-tokens", "150", "--max-step-tokens", "24",
            "--tau-entropy", "50", *extra]


def test_solve_streams_steps_and_writes_the_trajectory(base_path, helper_path, tiny_prm_path, tmp_path):
    out = tmp_path / "run" / "trajectory.json"
    out.parent.mkdir()  # an output's folder is never created
    result = CliRunner().invoke(main, solve_args(base_path, helper_path, tiny_prm_path, "--json", str(out)))
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    lines = [l for l in result.output.splitlines() if l.startswith("[")]
    assert len(lines) == record["n_steps"] and all(("base" in l) or ("helper" in l) for l in lines)
    assert "answer:" in result.output and "early exits" in result.output
    bad = CliRunner().invoke(main, solve_args(base_path, helper_path, tiny_prm_path, "--policy", "fifo"))
    assert bad.exit_code != 0 and "Error: unknown eviction policy 'fifo'" in bad.output and "Traceback" not in bad.output
    bad = CliRunner().invoke(main, solve_args(base_path, helper_path, tiny_prm_path, "-n", "0"))
    assert bad.exit_code != 0 and "'-n' / '--n': 0 is not in the range x>=1" in bad.output


def test_ctrl_c_during_solve_leaves_no_output_file(base_path, helper_path, tiny_prm_path, tmp_path):
    out = tmp_path / "trajectory.json"
    args = solve_args(base_path, helper_path, tiny_prm_path, "--json", str(out))
    args[args.index("--max-tokens") + 1] = "4096"  # the tiny models' trained context: a run of many steps
    args[args.index("--max-step-tokens") + 1] = "200"
    args += ["--max-steps", "100000", "--mode", "full", "--n", "8"]
    proc = subprocess.Popen([sys.executable, "-m", "kvrescue_local", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout.readline().startswith("[  1]"), "the first step was shown"
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "interrupted" in stderr and "Traceback" not in stderr
    assert not out.exists() and not list(tmp_path.glob(".*tmp"))


def test_thread_count_reaches_every_llama_context(base_model, helper_model, tiny_prm_path):
    from kvrescue_local.prm import PRM, PRMParams
    from kvrescue_local.runtime import llama

    prm = PRM(tiny_prm_path, PRMParams(n_ctx=1024, max_candidates=6, n_threads=1))
    engine = Rescue(config(n_threads=1), base_model, helper_model, prm)
    contexts = [g.ctx for g in engine.sides.values()] + [prm.ctx]
    assert [llama().llama_n_threads(c.handle) for c in contexts] == [1, 1, 1]
    assert engine.solve(PROBLEM).n_steps >= 1


def test_the_prompt_template_comes_from_the_gguf_unless_given(base_path, tiny_prm_path, tmp_path):
    """A GGUF the project writes may name its prompt template (kvrescue.prompt_template); --prompt-template
    overrides it; the trajectory records the one used."""
    template = "<|im_start|>user\nQ: {problem}<|im_end|>\n<|im_start|>assistant\n"
    tagged = write_qwen2_gguf(tmp_path / "tagged.gguf", TINY_HELPER, random_qwen2_weights(TINY_HELPER, seed=2),
                              metadata={"kvrescue.prompt_template": template})

    def used_prompt(*extra) -> str:
        out = tmp_path / "t.json"
        args = ["solve", PROBLEM, "--mode", "helper", "-n", "1", "--helper", str(tagged), "--prm", str(tiny_prm_path),
                "--max-tokens", "24", "--max-step-tokens", "8", "--json", str(out), *extra]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        return json.loads(out.read_text())["config"]["prompt"]

    assert used_prompt() == template
    assert used_prompt("--prompt-template", "{problem}\n") == "{problem}\n"
    assert Model(base_path).metadata("kvrescue.prompt_template") is None
    bad = CliRunner().invoke(main, ["solve", PROBLEM, "--mode", "helper", "--helper", str(tagged), "--prompt-template",
                                    "no slot"])
    assert bad.exit_code != 0 and "must contain {problem}" in bad.output
