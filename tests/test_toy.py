"""The toy world: task generator, torch -> GGUF parity, the shipped `toy` preset and its table."""

import json
import re

import numpy as np
import pytest
from click.testing import CliRunner

from kvrescue_local.bench.datasets import load_dataset
from kvrescue_local.cli import main
from kvrescue_local.compose import preset_config
from kvrescue_local.gguf_export import Qwen2Shape, write_qwen2_gguf
from kvrescue_local.rescue import Rescue
from kvrescue_local.runtime import Context, ContextParams, Model
from kvrescue_local.toy.task import (END, EVAL_SEED, LOOKUP, N_VOCAB, TOY_PROMPT, Knobs, encode, grade, held_out,
                                     problems, prompt, wrong_step)


def solve_by_hand(text: str) -> int:
    """The answer read off the problem text alone."""
    ledger_line, question = text.split("\n")
    ledger = dict((k, int(v)) for k, v in (item.split("=") for item in ledger_line.split()))
    count, expr = re.fullmatch(r"Compute (\d+) terms: (.*)\.", question).groups()
    assert int(count) == len(re.findall(r"[a-z]", expr))
    return eval(re.sub(r"[a-z]", lambda m: str(ledger[m.group()]), expr))


def test_generator_is_deterministic_and_correct_by_construction():
    first, again, other = problems(3, 50), problems(3, 50), problems(4, 50)
    assert [p.text for p in first] == [p.text for p in again]
    assert [p.text for p in first] != [p.text for p in other]
    for p in first:
        assert solve_by_hand(p.text) == p.answer
        assert p.steps[-1] == f"\\boxed{{{p.answer}}}" and all(s.endswith("\n\n") for s in p.steps[:-1])
        assert len(p.steps) == 2 * len(p.terms) + 1
        assert grade(p, str(p.answer)) and not grade(p, str(p.answer + 1)) and not grade(p, None)
        assert all(int(s.rstrip().split("=")[-1]) >= 0 for s in p.steps if s.startswith("total="))


def test_difficulty_knobs():
    knobs = Knobs(n_vars=12, min_terms=6, max_terms=6, lo=100, hi=999, minus=False)
    for p in problems(0, 20, knobs):
        assert len(p.ledger) == 12 and len(p.terms) == 6
        assert all(100 <= v <= 999 for v in p.ledger.values())
        assert "-" not in p.text and solve_by_hand(p.text) == p.answer
    sizes = {len(p.ledger) for p in problems(0, 50, Knobs(min_vars=3, min_terms=2))}
    assert sizes == set(range(3, 9))
    with pytest.raises(ValueError):
        Knobs(n_vars=4, max_terms=5)


def test_wrong_steps_are_wrong():
    rng = np.random.default_rng(0)
    for p in problems(1, 20):
        for k, step in enumerate(p.steps):
            assert wrong_step(p, k, rng) != step


def test_careless_solutions_drop_the_blind_spots_carries_only():
    blind_spot = frozenset({8, 9})
    dropped = kept = 0
    for p in problems(5, 40):
        assert p.careless_solution(frozenset()) == p.solution
        lines = p.careless_solution(blind_spot).split("\n\n")
        assert lines[0::2][:-1] == [s.rstrip() for s in p.steps[0::2][:-1]]  # the lookups stay right
        total = 0
        for (sign, name), line in zip(p.terms, lines[1::2]):
            value = p.ledger[name]
            exact = total + value if sign == "+" else total - value
            written = int(line.rpartition("=")[2])
            carry = line.count("=") == 2 and total // 10 != exact // 10
            if carry and value in blind_spot:
                assert written == (exact - 10 if sign == "+" else exact + 10)
                dropped += 1
            else:
                assert written == exact
                kept += carry
            total = written
        assert lines[-1] == f"\\boxed{{{total}}}"
    assert dropped > 10 and kept > 10


def test_wrong_sums_include_a_misread_total_and_answers_one_lookup_too_many():
    """The errors an evicted base makes that the PRM must see in training: a sum carried on, rightly,
    from a wrong previous total, and one more lookup where the answer is due."""
    rng = np.random.default_rng(0)
    misread = extra_lookup = 0
    for p in problems(2, 40):
        k = 2 * int(rng.integers(1, len(p.terms))) + 1
        total, sign, value = re.fullmatch(r"total=(\d+)([+-])(\d+)=\d+", p.steps[k].rstrip()).groups()
        for _ in range(10):
            wrong = re.fullmatch(r"total=(\d+)([+-])(\d+)=(\d+)", wrong_step(p, k, rng).rstrip())
            if wrong and wrong[1] != total and wrong.group(2, 3) == (sign, value):
                assert eval(f"{wrong[1]}{sign}{value}") == int(wrong[4]) >= 0
                misread += 1
            lookup = LOOKUP.fullmatch(wrong_step(p, len(p.steps) - 1, rng).rstrip())
            if lookup and int(lookup[1]) == len(p.terms) + 1:
                assert p.ledger[lookup[3]] == int(lookup[4])
                extra_lookup += 1
    assert misread > 40 and extra_lookup > 180


def test_prm_training_rows_mark_what_each_step_should_say():
    pytest.importorskip("torch")
    from kvrescue_local.toy.train import prm_batch

    x, (labels, expected, names, following) = prm_batch(np.random.default_rng(0), 64, Knobs())
    reward_token = encode("<extra_0>")[0]
    extra = x == reward_token
    assert ((labels >= 0) == extra).all() and ((expected >= 0) == extra).all() and (following[extra] < 0).all()
    assert ((names >= 0) <= extra).all() and (names >= 0).sum() > 64
    assert 0 < (labels == 0).sum() <= 64  # at most one wrong step per row, always the last
    rows = zip(x.tolist(), labels.tolist(), expected.tolist(), names.tolist(), following.tolist())
    for row, label, want, name, follow in rows:
        marks = [i for i, t in enumerate(row) if t == reward_token]
        assert all(label[i] == 1 for i in marks[:-1])
        for i in marks[:-1]:  # a correct step ends with the number expected at its reward token, and is learned
            assert chr(row[i - 2]) == chr(want[i]) or chr(row[i - 3]) == chr(want[i])
            assert follow[i - 3] == row[i - 2]
            step = bytes(t for t in row[marks[marks.index(i) - 1] + 1 if i != marks[0] else 0:i] if t < 256).decode()
            lookup = LOOKUP.search(step)  # after a lookup, the term it looks up is expected too
            assert name[i] == (ord(lookup.group(3)) if lookup and step.rstrip().endswith(lookup.group(0)) else -100)
        if label[marks[-1]] == 0 and len(marks) > 1:  # nothing inside the wrong step is learned as text
            assert all(t < 0 for t in follow[marks[-2] + 1:marks[-1]])


def test_encode_matches_llama_cpp_tokenizer(base_model):
    for p in problems(2, 5):
        text = prompt(p) + p.solution + END
        assert encode(text) == base_model.tokenize(text).tolist()
    assert N_VOCAB == base_model.n_vocab


def test_llama_cpp_logits_match_torch(tmp_path):
    torch = pytest.importorskip("torch")
    from kvrescue_local.toy.model import Qwen2

    torch.manual_seed(0)
    shape = Qwen2Shape(n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=96)
    model = Qwen2(shape, N_VOCAB)
    with torch.no_grad():  # away from the near-zero init, so that every weight matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    p = problems(0, 1)[0]
    ids = encode(prompt(p) + p.solution + END)
    gguf = Model(write_qwen2_gguf(tmp_path / "parity.gguf", shape, model.gguf_weights()))
    ctx = Context(gguf, ContextParams(n_ctx=512, type_k="f32", type_v="f32", flash_attn="off"))
    n = len(ids)
    ctx.decode(np.array(ids, np.int32), np.arange(n, dtype=np.int32), np.zeros(n, np.int32), np.ones(n, np.int8))
    ours = np.stack([ctx.logits(i) for i in range(n)])
    with torch.no_grad():
        theirs = model(torch.tensor([ids]))[0].numpy()
    assert np.abs(theirs).max() > 0.5
    np.testing.assert_allclose(ours, theirs, atol=1e-4)


@pytest.fixture(scope="module")
def toy():
    from kvrescue_local.presets import load_preset

    return load_preset("toy")


def test_shipped_toy_preset_solves_held_out_problems(toy):
    engine = Rescue(preset_config(toy, mode="full", n=1), Model(toy.base), None, None)
    probs = problems(EVAL_SEED + 100, 8)
    trajectories = [engine.solve(p.text) for p in probs]
    assert all(t.text.startswith(p.steps[0].split("=")[0] + "=") for p, t in zip(probs, trajectories))
    assert all(t.stop == "eos" and t.answer is not None for t in trajectories)
    # the shipped base solves ~99% with full KV (train.json); a random or broken model gets an exact
    # integer right about 1 time in 30
    assert sum(grade(p, t.answer) for p, t in zip(probs, trajectories)) >= 7


def test_the_toy_dataset_and_its_table_through_bench_and_report(toy, tmp_path):
    """The toy world is a dataset and a preset like any other: `bench run --dataset toy` on the toy
    preset (its prompt and recipe), then `report` prints the table."""
    dataset = load_dataset("toy", limit=3)
    assert [p.problem for p in dataset.problems] == [p.text for p in held_out(3)]
    assert dataset.grade("19", " 19") and not dataset.grade("19", "19.5") and not dataset.grade("19", None)
    results = tmp_path / "toy.jsonl"
    run = CliRunner().invoke(main, ["bench", "run", "--dataset", "toy", "--limit", "2", "--modes",
                                    "full,bon,helper,kvrescue", "--budgets", "32", "--ns", "1", "--results", str(results)])
    assert run.exit_code == 0, run.output
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(lines) == 8 and {line["config"]["policy"] for line in lines} == {"none", "rkv"}
    assert {line["config"]["prompt"] for line in lines} == {toy.prompt} and toy.prompt == TOY_PROMPT
    assert all(line["config"]["max_steps"] == 32 and line["config"]["temperature"] == 1.0 for line in lines)
    report = CliRunner().invoke(main, ["report", str(results)])
    assert report.exit_code == 0, report.output
    for column in ("pass@1 %", "degen %", "cap %", "base tok", "steps", "early exit %"):
        assert column in report.output
    assert [line.split()[0] for line in report.output.splitlines()[3:7]] == ["full", "helper", "bon", "kvrescue"]
    sample = CliRunner().invoke(main, ["toy", "sample", "--count", "2"])
    assert sample.exit_code == 0 and sample.output.count("Compute") == 2


def test_eviction_takes_the_shipped_base_off_the_question(toy):
    """The information gap is real: at the smallest budget R-KV leaves the evicted base a few ledger
    entries but not its place in the question, so it looks up other terms than the question's, more
    or fewer of them (full KV looks up each term once)."""
    probs = problems(EVAL_SEED + 100, 16)
    evicted = Rescue(preset_config(toy, mode="bon", n=1, kv={"budget": 48}), Model(toy.base), None, None)
    trajectories = [evicted.solve(p.text) for p in probs]
    assert sum(grade(p, t.answer) for p, t in zip(probs, trajectories)) <= 3
    terms = sum(len(p.terms) for p in probs)
    miscounted = sum(abs(len(LOOKUP.findall(t.text)) - len(p.terms)) for p, t in zip(probs, trajectories))
    assert miscounted >= 0.2 * terms
    assert all(t.evictions["fallback_evictions"] == 0 for t in trajectories)
    full = Rescue(preset_config(toy, mode="full", n=1), Model(toy.base), None, None)
    assert sum(len(LOOKUP.findall(full.solve(p.text).text)) for p in probs) == terms


def test_solve_defaults_to_the_toy_preset_and_its_prompt(toy):
    p = problems(123, 1)[0]
    result = CliRunner().invoke(main, ["solve", p.text, "--mode", "full", "-n", "1", "--temp", "0"])
    assert result.exit_code == 0, result.output
    assert f"answer: {p.answer} " in result.output and "1:" in result.output
    # the toy preset's own base file, named by path, keeps the toy prompt (not the Qwen math one)
    by_path = CliRunner().invoke(main, ["solve", p.text, "--mode", "full", "-n", "1", "--temp", "0", "--base",
                                        str(toy.base)])
    assert by_path.exit_code == 0 and f"answer: {p.answer} " in by_path.output, by_path.output



def test_shipped_helper_looks_up_well_and_has_a_blind_spot_in_its_sums(toy):
    """The division of labour the toy world is built on: with the full context the helper's lookups
    are right, but it drops the carries of the values it was trained to drop them for, every time."""
    from kvrescue_local.toy.train import HELPER_BLIND_SPOT

    engine = Rescue(preset_config(toy, mode="helper", n=1), None, Model(toy.helper), None)
    lookups, blind, seen = [], [], []
    for p in problems(EVAL_SEED + 200, 16):
        text = engine.solve(p.text).text
        lookups += [p.ledger.get(name) == int(value) for _, _, name, value in LOOKUP.findall(text)]
        for total, sign, value, result in re.findall(r"total=(\d+)([+-])(\d+)=(-?\d+)", text):
            total, value, right = int(total), int(value), eval(f"{total}{sign}{value}")
            if total // 10 != right // 10:  # a carry or a borrow is due
                (blind if value in HELPER_BLIND_SPOT else seen).append(int(result) == right)
    assert len(lookups) >= 48 and sum(lookups) >= 0.95 * len(lookups)
    assert len(blind) >= 6 and sum(blind) <= 0.2 * len(blind)
    assert len(seen) >= 12 and sum(seen) >= 0.8 * len(seen)


def test_shipped_prm_checks_lookups_against_the_ledger_and_the_count(toy):
    """Scored through llama.cpp, the shipped PRM prefers the right value of a lookup to another value
    of the same ledger, the right lookup number to one off, and the answer to one lookup too many:
    the errors an evicted base makes most (a PRM trained on far-off numbers won 76% of the second)."""
    from kvrescue_local.prm import PRM, PRMParams

    prm = PRM(toy.prm, PRMParams(n_ctx=1024, max_candidates=3, flash_attn="off"))
    rng = np.random.default_rng(0)
    wins = {"value": [], "number": [], "extra lookup": []}

    def prefers_the_right_step(p, k, wrong: dict[str, str]) -> None:
        prm.start(p.text)
        for step in p.steps[:k]:
            prm.commit(step)
        right, *scores = prm.score([p.steps[k], *wrong.values()])
        for kind, score in zip(wrong, scores):
            wins[kind].append(right > score)

    for p in problems(EVAL_SEED + 300, 20):
        k = 2 * int(rng.integers(1, len(p.terms)))
        number, sign, name, value = LOOKUP.fullmatch(p.steps[k].rstrip()).groups()
        others = sorted(set(p.ledger.values()) - {int(value)})
        prefers_the_right_step(p, k, {"value": f"{number}:{sign}{name}={others[int(rng.integers(len(others)))]}",
                                      "number": f"{int(number) + 1}:{sign}{name}={value}"})
        _, last = p.terms[-1]
        prefers_the_right_step(p, len(p.steps) - 1, {"extra lookup": f"{len(p.terms) + 1}:+{last}={p.ledger[last]}"})
    assert all(sum(won) >= 0.8 * len(won) for won in wins.values()), wins