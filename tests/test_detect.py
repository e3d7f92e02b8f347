"""The degeneration detector on logits and text produced by llama.cpp."""

import numpy as np
import pytest

from kvrescue_local.detect import Detector, DetectorParams, calibrate, compression_ratio, otsu_threshold, token_entropy
from kvrescue_local.detect.calibrate import load_params, save_params
from kvrescue_local.errors import KVRescueError
from kvrescue_local.runtime import Context, ContextParams, Sampler, SamplingParams

ORDINARY_STEPS = [
    "First, we need the value of a. The ledger says a = 17, so we start the running total at 17.\n\n",
    "Next we add d. Looking it up, d = 93, and 17 + 93 = 110, so the running total is now 110.\n\n",
    "Then we subtract c, which is 5: 110 - 5 = 105. Subtraction lowers the total, as expected.\n\n",
    "Finally g = 30 is added, giving 105 + 30 = 135. Checking each term once more: 17, 93, -5 and 30 "
    "sum to 135, which matches the running total we kept along the way.\n\n",
    "Let $x$ be the number of apples. Since $3x + 4 = 19$, we get $3x = 15$ and $x = 5$.\n\n",
    "The area of a circle of radius $r$ is $\\pi r^2$; with $r = 3$ this is $9\\pi$. So the answer is "
    "$\\boxed{9\\pi}$, about 28.27 square units.\n\n",
]


def run_candidate(model, n_tokens=400, detector=Detector()):
    """Sample from model through llama.cpp, feeding the detector every token as the rescue loop does."""
    ctx = Context(model, ContextParams(n_ctx=1024))
    row = ctx.prefill(0, model.tokenize("<|im_start|>assistant\n"))
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=1.0, seed=1))
    monitor = detector.monitor()
    for _ in range(n_tokens):
        logits = ctx.logits(row)
        token = sampler.sample(ctx, row)
        if monitor.update(token_entropy(logits), model.token_bytes(token)):
            break
        ctx.step([0], [token])
        row = 0
    return monitor


def test_a_looping_candidate_is_killed_for_repetition(looping_model):
    monitor = run_candidate(looping_model)
    assert monitor.killed == "repetition"
    assert monitor.n_tokens <= 256 + 8, "killed as soon as one text window is full"
    assert monitor.min_compression < 0.35


def test_a_high_entropy_candidate_is_killed_for_incoherence(uniform_model):
    monitor = run_candidate(uniform_model)
    assert monitor.killed == "entropy"
    assert monitor.n_tokens == 16, "killed once the first entropy window is full"
    assert monitor.max_mean_entropy == pytest.approx(np.log(uniform_model.n_vocab), abs=1e-3)


def test_ordinary_reasoning_steps_are_not_killed(looping_model):
    """Teacher-forced ordinary text; logits from a confident llama.cpp model keep entropy low."""
    ctx = Context(looping_model, ContextParams(n_ctx=2048))
    detector = Detector()
    tail = b""
    for step in ORDINARY_STEPS:
        tokens = looping_model.tokenize(step)
        monitor = detector.monitor(tail)
        ctx.prefill(0, looping_model.tokenize("<|im_start|>assistant\n"))
        for token in tokens:
            ctx.step([0], [int(token)])
            entropy = token_entropy(ctx.logits(0))
            assert not monitor.update(entropy, looping_model.token_bytes(int(token))), (step, monitor.stats())
        assert not monitor.finish(), (step, monitor.stats())
        ctx.drop(0)
        tail = (tail + step.encode())[-256:]
        assert monitor.min_compression > 0.5


def test_a_step_shorter_than_a_check_is_judged_where_it_ends_with_the_tail_before_it(looping_model):
    """A loop across steps of a few tokens each: no token of such a step is checked, its end is."""
    detector = Detector()
    step = "\\]\n\n"
    tokens = looping_model.tokenize(step, special=False)
    assert len(tokens) < detector.params.check_every
    ordinary = detector.monitor("".join(ORDINARY_STEPS).encode())
    looping = detector.monitor((step * 100).encode())
    for monitor in (ordinary, looping):
        assert not any([monitor.update(0.0, looping_model.token_bytes(int(t))) for t in tokens])
    assert not ordinary.finish() and ordinary.min_compression > 0.5
    assert looping.finish() and looping.killed == "repetition"
    assert looping.finish(), "a killed candidate stays killed"


def test_signals_match_design_sanity_values():
    ordinary = "".join(ORDINARY_STEPS).encode()[:256]
    assert 0.7 < compression_ratio(ordinary) < 1.1
    assert compression_ratio((b"so the total is 110. " * 20)[:256]) < 0.3
    assert token_entropy(np.zeros(1000)) == pytest.approx(np.log(1000))
    peaked = np.zeros(1000)
    peaked[3] = 50
    assert token_entropy(peaked) < 1e-6


def test_entropies_of_a_decode_s_rows_are_each_row_s(base_model):
    """One call per decode: the rows of output_logits (llama.cpp's own, in batch order) get each row's entropy."""
    ctx = Context(base_model, ContextParams(n_ctx=1024, n_seq_max=20))
    prompt = base_model.tokenize("<|im_start|>assistant\nthe total is")
    for seq in range(20):
        ctx.prefill(seq, prompt[: 3 + seq % 7])
    ctx.step(list(range(20)), [int(t) for t in base_model.tokenize("abcdefghijklmnopqrst")])
    rows = ctx.output_logits()
    assert rows.shape == (20, base_model.n_vocab)
    entropies = token_entropy(rows)
    assert len(set(np.round(entropies, 6))) > 1, "different contexts, different entropies"
    for row in range(20):
        assert np.array_equal(rows[row], ctx.logits(row))
        assert entropies[row] == pytest.approx(token_entropy(ctx.logits(row)), rel=1e-12)


def test_calibration_recovers_a_threshold_between_two_modes(tmp_path):
    rng = np.random.default_rng(0)
    healthy = [{"max_mean_entropy": e, "min_compression": c}
               for e, c in zip(rng.normal(0.8, 0.2, 300), rng.normal(0.85, 0.05, 300))]
    degenerate = [{"max_mean_entropy": e, "min_compression": c}
                  for e, c in zip(rng.normal(5.0, 0.4, 40), rng.normal(0.15, 0.04, 40))]
    params, report = calibrate(healthy + degenerate)
    assert 1.5 < params.tau_entropy < 4.0 and report["tau_entropy"]["used"]
    assert 0.3 < params.tau_compression < 0.7 and report["tau_compression"]["used"]
    # one mode only: keep the old thresholds
    unimodal, report = calibrate(healthy)
    assert unimodal == DetectorParams() and not report["tau_entropy"]["used"]
    assert load_params(save_params(params, tmp_path / "detector.json")) == params
    with pytest.raises(KVRescueError, match="at least 8"):
        calibrate(healthy[:3])


def test_otsu_on_degenerate_input():
    assert otsu_threshold([1.0] * 10)[1] == 0.0


def test_bad_detector_settings():
    with pytest.raises(KVRescueError):
        DetectorParams(tau_compression=0)
    with pytest.raises(KVRescueError):
        DetectorParams(entropy_window=0)


def test_only_a_step_that_no_check_saw_is_checked_where_it_ends():
    """A step as long as a check or longer was judged by its checks: its end adds none, so it cannot die there by
    the chance of one more window near the threshold."""
    ordinary = "".join(ORDINARY_STEPS).encode()
    loop = b"a" * 256  # the window at the end would be all repetition
    seen = Detector().monitor(ordinary)
    for piece in [b"word "] * 8 + [loop]:
        assert not seen.update(0.0, piece)
    assert seen.n_tokens > seen.params.check_every and not seen.finish()
    unseen = Detector().monitor(ordinary)
    assert not unseen.update(0.0, loop)
    assert unseen.finish() and unseen.killed == "repetition"
