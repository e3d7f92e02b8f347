"""The patch's ops on a device against the CPU, on the tiny base: attention scores (per layer and per KV head,
flash attention off and on), K rows, and what a budget keeps at its first eviction, both contexts fed the same
tokens. The reference is the same model with no layer offloaded; the device side has every layer offloaded to
each device this build finds: a CUDA GPU where there is one (perf/gpu_check.sh), and always the CPU itself, so
that these bodies run in CI and an API change fails there, not on the next GPU machine.

Tolerance: two kernels' rounding, as tests/test_attention.py states it for flash attention on against off
(relative error <= 5e-3); the kept sets must be the same."""

import numpy as np
import pytest

from kvrescue_local.eviction import BudgetedSequences, KVBudget
from kvrescue_local.runtime import Context, ContextParams, Model
from kvrescue_local.runtime.attention import cell_scores, enable_scores, head_scores, key_rows
from kvrescue_local.runtime.lib import backends

TEXT = "Q: Tom has 17 apples and buys 93 more, then eats 5. How many are left?\nA: 17+93=110, 110-5=105.\n" * 4
TOLERANCE = 5e-3
N_OBS = 4
ALL_LAYERS = 99


def relative_error(actual, expected) -> float:
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


# every layer offloaded to: the CPU (a CPU build, or a GPU build's CPU fallback), and a CUDA GPU where one is found
DEVICES = ["cpu"] + (["cuda"] if dict(backends()).get("CUDA", 0) else [])


@pytest.fixture(scope="module", params=DEVICES)
def cpu_and_device(request, base_path):
    return Model(base_path, n_gpu_layers=0), Model(base_path, n_gpu_layers=ALL_LAYERS if request.param == "cuda" else 0)


def fed(model: Model, tokens, params: ContextParams, per_head: bool) -> Context:
    """A context that read the tokens with scores on: the first half as a prompt, the rest one decode each."""
    ctx = Context(model, params)
    enable_scores(ctx, N_OBS, per_head=per_head)
    half = len(tokens) // 2
    ctx.prefill(0, tokens[:half])
    for token in tokens[half:]:
        ctx.step([0], [int(token)])
    return ctx


@pytest.mark.parametrize("flash_attn", ["off", "on"])
@pytest.mark.parametrize("per_head", [False, True], ids=["per-layer", "per-head"])
def test_scores_and_k_rows_on_a_device_are_the_cpu_s(cpu_and_device, flash_attn, per_head):
    tokens = cpu_and_device[0].tokenize(TEXT)[:80]
    params = ContextParams(n_ctx=256, type_k="f32", type_v="f32", flash_attn=flash_attn)
    cpu, gpu = (fed(model, tokens, params, per_head) for model in cpu_and_device)
    cells = cpu.cells(0)[0]
    np.testing.assert_array_equal(gpu.cells(0)[0], cells)
    for layer in range(cpu.model.n_layer):
        read = head_scores if per_head else cell_scores
        assert relative_error(read(gpu, 0, layer), read(cpu, 0, layer)) <= TOLERANCE, layer
        assert relative_error(key_rows(gpu, layer, cells), key_rows(cpu, layer, cells)) <= TOLERANCE, layer
    if not per_head:
        assert relative_error(cell_scores(gpu, 0), cell_scores(cpu, 0)) <= TOLERANCE


@pytest.mark.parametrize("policy", ["rkv:heads=shared", "rkv", "snapkv"])
def test_the_first_eviction_keeps_on_a_device_what_it_keeps_on_the_cpu(cpu_and_device, policy):
    """Per-head policies also compact the cells there (patch 0004): the next logits agree too."""
    budget = KVBudget(budget=48, buffer=32, window=8, policy=policy)
    tokens = cpu_and_device[0].tokenize(TEXT)
    choices, logits = [], []
    for model in cpu_and_device:
        ctx = Context(model, ContextParams(n_ctx=budget.context_cells(1, 256), type_k="f32", type_v="f32", flash_attn="off"))
        seqs = BudgetedSequences(ctx, budget)
        ctx.prefill(0, tokens[:16])
        for token in tokens[16:]:
            ctx.step([0], [int(token)])
            if seqs.enforce(0):
                break
        assert seqs.last_choice is not None, "the text is longer than budget + buffer"
        choices.append(seqs.last_choice)
        ctx.step([0], [int(tokens[-1])])
        logits.append(ctx.logits(0).copy())
    (cpu_inputs, cpu_kept), (gpu_inputs, gpu_kept) = choices
    assert relative_error(gpu_inputs.window_attention, cpu_inputs.window_attention) <= TOLERANCE
    if cpu_inputs.keys is not None:  # read by the policies that weigh redundancy
        assert relative_error(gpu_inputs.keys, cpu_inputs.keys) <= TOLERANCE
    differing = int(np.count_nonzero(gpu_kept != cpu_kept))
    assert differing == 0, f"{differing} of {cpu_kept.size} keep decisions differ between the CPU and the GPU"
    assert relative_error(logits[1], logits[0]) <= TOLERANCE
