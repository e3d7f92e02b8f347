"""The arithmetic check: which equalities it calls false, and a round that sets such a step aside, through llama.cpp
on the toy preset (its steps are additions: "total=16-5=11")."""

import json

import pytest
from click.testing import CliRunner

from kvrescue_local.bench.metrics import config_key
from kvrescue_local.bench.run import sweep_axes
from kvrescue_local.cli import main
from kvrescue_local.compose import preset_config
from kvrescue_local.errors import KVRescueError
from kvrescue_local.rescue.arithmetic import evaluate, false_equalities
from kvrescue_local.rescue.config import RescueConfig, cache_fields
from kvrescue_local.rescue.generator import Draft
from kvrescue_local.rescue.rules.arith import arithmetic_checked
from kvrescue_local.toy.task import held_out
from test_engine import solve_all, toy  # noqa: F401 - toy is a fixture

FALSE = [
    r"\[ 15 \times 0.08 = 12 \]",
    r"\$68 + \$330 = \$408",
    r"\frac{261}{4} = 62.75",
    "we have 5 + 3 = 9, so",
    r"10 \times 15 \times 0.08 = 15 \times 0.08 = 12",  # the chain's second link is false
    r"1.50 \times 130,000 = 205,000",
    r"\frac{500.00}{1,000.00} = 5",
    r"(5 + 3) \times 2 = 15",
    "11/15 = 0.6667",
    "4840 ÷ 99 = 50",
    "12 - 3 = 9\n9 * 2 = 17",
    "total=16-5=12",
]
RIGHT_OR_UNCHECKED = [
    r"\[ 15 \times 0.08 = 1.2 \]",
    "x + 5 + 3 = 10",  # a variable: not closed arithmetic
    "2:15 + 15 = 2:30",  # a time
    "2/3 = 0.67",  # rounded at the precision written
    "7 / 2 = 3",  # cut at it
    "3 x 4 = 12",
    r"111 \text{ feet} - 120 \text{ inches} = 101 \text{ feet}",  # a unit inside
    r"60 - 8 = 2(A - 4)",  # an expression on the right
    r"25 - \frac{47}{3} = \frac{28}{3}",
    "total = 15 * 3",
    "if x % 2 == 0:",
    "5 + 3 = 8x",
    "2^3 = 8",
    "9^99999 = 1",  # not evaluated: no word problem needs it
    "total=16-5=11",
]


@pytest.mark.parametrize("text", FALSE)
def test_a_false_equality_is_found(text):
    assert false_equalities(text)


@pytest.mark.parametrize("text", RIGHT_OR_UNCHECKED)
def test_a_right_or_unchecked_equality_is_not_called_false(text):
    assert false_equalities(text) == []


def test_only_plain_arithmetic_is_evaluated():
    assert evaluate("(1 + 2) * 3 / 4 - 2^2") == pytest.approx(-1.75)
    for expression in ("__import__('os')", "1 / 0", "2 ** 99999", "(1, 2)", "[1] * 3", "1 if 1 else 2", "True + 1"):
        assert evaluate(expression) is None, expression


def drafts(*texts_by_side):
    return [Draft(side, 0, i, text=bytearray(text.encode())) for i, (side, text) in enumerate(texts_by_side)]


def test_a_survivor_stating_false_arithmetic_is_set_aside_while_another_states_none():
    base, helper = drafts(("base", "7 + 9 = 17"), ("helper", "7 + 9 = 16"))
    assert arithmetic_checked([base, helper]) == [helper]
    assert (base.false_arithmetic, helper.false_arithmetic) == (["7 + 9 = 17"], [])
    both_false = drafts(("base", "7 + 9 = 17"), ("helper", "2 * 3 = 7"))
    assert arithmetic_checked(both_false) == both_false, "nothing to prefer: the rule chooses among all"
    lone = drafts(("base", "7 + 9 = 17"))
    assert arithmetic_checked(lone) == lone and lone[0].false_arithmetic is None, "a lone survivor is not checked"


def test_the_check_is_a_configuration_of_its_own_where_rounds_choose():
    axes = sweep_axes(["bon", "kvrescue"], [64], [1], ["rkv"], ["arith:by-budget:64,judge,lead:base"])
    assert [a.key for a in axes] == ["bon-b64-n1-rkv", "kvrescue-b64-n1-rkv-regime-arith"]
    assert [a.rule for a in axes] == ["judge", "arith:by-budget:64,judge,lead:base"], "N = 1 bon: nothing to check"
    row = {"dataset": "gsm8k", "config": {"mode": "kvrescue", "budget": 64, "n": 1, "policy": "rkv",
                                          "rule": "arith:by-budget:64,judge,lead:base"}}
    assert config_key(row).label == "kvrescue/regime+arith b64 n1 rkv"
    with pytest.raises(KVRescueError, match="unknown rule .yes."):
        RescueConfig(rule="arith:yes")


def test_rounds_set_false_arithmetic_aside_through_llama_cpp(toy):  # noqa: F811 - the fixture
    """The toy base, evicted to 48 entries at temperature 1, writes wrong sums; base-first with the margin never
    exceeded commits its step unless the check sets it aside: every round where a survivor states false arithmetic
    and another does not commits one that does not, and the rows count those set aside."""
    problems = [p.text for p in held_out(8)]
    common = dict(n=1, kv={"budget": 48}, **cache_fields("f32", "f32"))
    checked, _ = solve_all(toy, preset_config(toy[0], mode="kvrescue", rule="arith:lead:base", **common), problems, 4)
    demoted = 0
    for trajectory in checked.values():
        for step in trajectory.steps:
            survivors = [c for c in step.candidates if not c.killed]
            if len(survivors) < 2:
                continue
            assert all(c.false_arithmetic is not None for c in survivors), "every survivor of a choice is checked"
            winner = next(c for c in survivors if c.text == step.text and c.side == step.source)
            if any(c.false_arithmetic == [] for c in survivors):
                assert winner.false_arithmetic == []
                demoted += sum(bool(c.false_arithmetic) for c in survivors)
    assert sum(t.set_aside for t in checked.values()) == demoted
    assert demoted >= 1, "the evicted toy base wrote a wrong sum that a right one replaced"
    unchecked, _ = solve_all(toy, preset_config(toy[0], mode="kvrescue", rule="lead:base", **common), problems, 4)
    assert all(c.false_arithmetic is None for t in unchecked.values() for s in t.steps for c in s.candidates)


def test_solve_shows_and_records_what_it_set_aside(tmp_path):
    """`solve --rule arith:lead:base` on the toy preset: a step line says how many survivors its round set aside, and the
    --json record lists each checked candidate's false equalities."""
    for i, problem in enumerate(held_out(8)):
        out = tmp_path / f"{i}.json"
        result = CliRunner().invoke(main, ["solve", "--preset", "toy", "-n", "1", "--budget", "48", "--rule",
                                           "arith:lead:base", "-ctk", "f32", "-ctv", "f32",
                                           "--json", str(out), problem.text])
        assert result.exit_code == 0, result.output
        if "set aside: false arithmetic" in result.output:
            break
    else:
        pytest.fail("no round of 8 toy problems set a step aside")
    candidates = [c for s in json.loads(out.read_text())["steps"] for c in s["candidates"]]
    assert any(c.get("false_arithmetic") for c in candidates)
    assert any(c.get("false_arithmetic") == [] for c in candidates)
