"""Weight quantization through llama.cpp's quantizer (`models quantize`) and the KV cache types (-ctk/-ctv)."""

import ctypes
import importlib.util
import json

import numpy as np
import pytest
from click.testing import CliRunner

from kvrescue_local import quantize
from kvrescue_local.gguf_header import index_end
from kvrescue_local.paths import SHIPPED_MODELS
from kvrescue_local.cli import main
from kvrescue_local.runtime import Context, ContextParams, Model
from kvrescue_local.runtime.context import CACHE_TYPES, kv_bytes_per_cell
from kvrescue_local.runtime.lib import loaded_library

TOY_PRM = SHIPPED_MODELS / "toy" / "prm.gguf"  # a judge given: the tiny pair is no preset's, and has none of its own

TOY = "a=7 b=4 c=5 d=9 e=6 f=2 g=8 h=3\nCompute 4 terms: a+d-c+g."


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_error_line(result) -> str:
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    return errors[0]


@pytest.fixture(scope="module")
def q8_base(base_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("quantized") / "base-q8_0.gguf"
    done = invoke("models", "quantize", base_path, "--type", "Q8_0", "--out", out)
    assert done.exit_code == 0, done.output
    return out


def test_a_quantized_model_loads_and_generates_greedily_like_its_source(base_path, q8_base):
    assert quantize.file_type(q8_base) == "Q8_0" and quantize.tensor_types(q8_base)["Q8_0"] > 0
    assert q8_base.stat().st_size < base_path.stat().st_size / 3
    tokens = []
    for path in (base_path, q8_base):
        model = Model(path)
        ctx = Context(model, ContextParams(n_ctx=256, type_k="f32", type_v="f32", flash_attn="off"))
        row = ctx.prefill(0, model.tokenize("Q: 17+93=?"))
        generated = []
        for _ in range(8):
            generated.append(int(np.argmax(ctx.logits(row))))
            ctx.step([0], [generated[-1]])
            row = 0
        tokens.append(generated)
    assert len(tokens[1]) == 8
    assert sum(a == b for a, b in zip(*tokens)) >= 4  # random weights: Q8_0 keeps most greedy choices


def test_a_quantized_source_is_refused_unless_requantizing_is_allowed(q8_base, tmp_path):
    out = tmp_path / "q4.gguf"
    refused = invoke("models", "quantize", q8_base, "--type", "Q4_0", "--out", out)
    assert "already Q8_0" in one_error_line(refused) and "--allow-requantize" in refused.output
    assert not out.exists()
    done = invoke("models", "quantize", q8_base, "--type", "Q4_0", "--out", out, "--allow-requantize")
    assert done.exit_code == 0, done.output
    assert quantize.file_type(out) == "Q4_0"


def test_a_gguf_header_scalar_is_read_past_arrays_and_a_file_without_its_type_is_named_by_its_matrices(tmp_path):
    import gguf

    path = tmp_path / "untyped.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_string("general.name", "untyped")
    writer.add_uint32("test.count", 7)
    writer.add_float32("test.eps", 0.25)
    writer.add_tensor("w", np.zeros((4, 8), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    fields = quantize.read_gguf(path).fields
    for key in ("test.count", "test.eps"):
        assert quantize.metadata_scalar(path, key) == fields[key].parts[-1][0]
    assert quantize.metadata_scalar(path, "general.file_type") is None
    assert quantize.file_type(path) == "F16"
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[:60])
    with pytest.raises(quantize.KVRescueError, match="not a readable GGUF model"):
        quantize.metadata_scalar(truncated, "test.count")
    version_one = tmp_path / "v1.gguf"  # 32-bit counts: read as version 3 it would yield garbage keys
    version_one.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + path.read_bytes()[8:])
    with pytest.raises(quantize.KVRescueError, match="not a readable GGUF model"):
        quantize.metadata_scalar(version_one, "test.count")


def test_a_bad_weight_type_is_one_error_line(base_path, tmp_path):
    result = invoke("models", "quantize", base_path, "--type", "Q7_K", "--out", tmp_path / "x.gguf")
    assert "Q7_K" in one_error_line(result) and "Q4_K_M" in result.output
    assert list(tmp_path.iterdir()) == []


def test_a_broken_source_is_one_error_line_and_leaves_nothing(base_path, tmp_path):
    broken = tmp_path / "broken.gguf"
    data = base_path.read_bytes()
    broken.write_bytes(data[:index_end(data) + 4096])  # the header whole, the tensors cut off
    out = tmp_path / "out" / "x.gguf"
    out.parent.mkdir()
    result = invoke("models", "quantize", broken, "--type", "Q8_0", "--out", out)
    assert "not a readable GGUF" in one_error_line(result)
    assert list(out.parent.iterdir()) == []


def test_ctrl_c_mid_quantization_stops_the_quantizer_and_leaves_nothing(base_path, tmp_path):
    started = []

    def interrupt(done, total):
        started.append((done, total))
        raise KeyboardInterrupt  # as Ctrl-C lands in the command while llama.cpp quantizes

    with pytest.raises(KeyboardInterrupt):
        quantize.quantize(base_path, tmp_path / "x.gguf", "Q8_0", progress=interrupt)
    assert started[0][0] == 1 and started[0][1] > 1
    assert list(tmp_path.iterdir()) == []


def test_the_cache_quantizes_a_source_once_and_a_preset_file_s_copy_keeps_its_recipe(monkeypatch, tmp_path):
    from kvrescue_local.presets import SHIPPED_MODELS, preset_of

    monkeypatch.setattr(quantize, "QUANTIZED_DIR", tmp_path)
    source = SHIPPED_MODELS / "toy" / "base.gguf"
    first, made = quantize.quantized(source, "Q4_0")
    again, made_again = quantize.quantized(source, "q4_0")
    assert made and not made_again and first == again and first.parent == tmp_path
    assert quantize.quantized(source, "F16") == (source, False)  # the source is F16 already
    assert preset_of("base", first).name == "toy"


def test_the_coder_helper_is_the_pulled_0_5b_at_f16_made_once_and_the_prm_reads_the_pulled_file(base_path, monkeypatch,
                                                                                                  tmp_path):
    import dataclasses

    from kvrescue_local import presets

    monkeypatch.setattr(quantize, "QUANTIZED_DIR", tmp_path / "quantized")
    monkeypatch.setattr(presets, "MODELS_CACHE", tmp_path)
    pulled = {name: quantize.quantize(base_path, tmp_path / f"{name}.gguf", "Q8_0") for name in presets.CODER_MODELS}
    monkeypatch.setattr(presets, "WHEEL_MODELS", {name: dataclasses.replace(model, size=pulled[name].stat().st_size)
                                                  for name, model in presets.WHEEL_MODELS.items() if name in pulled})
    preset = presets.coder_preset()
    assert preset.helper.parent == tmp_path / "quantized" and quantize.file_type(preset.helper) == "F16"
    assert preset.base == pulled["coder-1.5b"] and preset.prm in (pulled["coder-0.5b"], presets.HELPER)
    made = preset.helper.stat().st_mtime_ns
    assert presets.coder_preset().helper.stat().st_mtime_ns == made, "made once"


def test_cache_type_sizes_are_ggml_s():
    ggml = ctypes.CDLL(str(loaded_library("libggml-base")))  # the copy already loaded, not a second one
    ggml.ggml_type_size.restype = ctypes.c_size_t
    ggml.ggml_blck_size.restype = ctypes.c_int64
    for name, kind in CACHE_TYPES.items():
        assert (ggml.ggml_blck_size(kind.ggml_type), ggml.ggml_type_size(kind.ggml_type)) == (kind.block, kind.block_bytes)


def test_bytes_per_cell_follow_the_cache_types(base_model):
    f16 = kv_bytes_per_cell(base_model, "f16", "f16")
    assert f16 == 2 * base_model.n_layer * base_model.n_embd_k_gqa * 2
    assert kv_bytes_per_cell(base_model, "q8_0", "q4_0") == f16 * (34 + 18) / (32 * 4)  # per value: 34/32 + 18/32 bytes, against 2 + 2


@pytest.mark.parametrize("args, expected", [
    (["-ctv", "q8_0"], "-fa on"),  # llama.cpp refuses a quantized V without flash attention
    (["-ctk", "q4_0", "-ctv", "q4_0", "-fa", "on"], "head size 24"),  # the toy base's heads are 24 wide
    (["-ctk", "q3"], "'q3' is not one of"),
])
def test_unsupported_cache_types_are_one_error_line(args, expected):
    result = invoke("solve", "--mode", "bon", "-n", "1", "--budget", "48", *args, TOY)
    assert expected in one_error_line(result)


@pytest.mark.parametrize("cache", ["q8_0", "q4_0"])
def test_eviction_per_head_runs_on_quantized_caches(base_path, helper_path, cache, tmp_path):
    record = tmp_path / "t.json"
    result = invoke("solve", "--mode", "bon", "-n", "2", "--rule", "random", "--budget", "16", "--buffer", "8",
                    "--base", base_path, "--helper", helper_path, "--max-tokens", "96", "--evict-prompt",
                    "-ctk", cache, "-ctv", cache, "-fa", "on", "--json", record, TOY)
    assert result.exit_code == 0, result.output
    trajectory = json.loads(record.read_text())
    assert trajectory["config"]["kv"]["policy"] == "rkv"  # per (layer, KV head): compaction moves the blocks
    assert trajectory["evictions"]["evictions"] > 0 and trajectory["evictions"]["fallback_evictions"] == 0
    assert trajectory["config"]["cache_type_k"] == trajectory["config"]["cache_type_v"] == cache


@pytest.fixture
def sweep(base_path, helper_path, monkeypatch, tmp_path):
    """A sweep of the tiny pair over weights (F32 as written, Q8_0 made into the cache) and KV cache types."""
    monkeypatch.setattr(quantize, "QUANTIZED_DIR", tmp_path / "cache")
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "problem": f"{i}+{i}=?", "answer": str(2 * i)}) + "\n"
                            for i in range(2)))

    def run(results, *more):
        return invoke("bench", "run", "--data", data, "--base", base_path, "--helper", helper_path, "--prm", TOY_PRM,
                      "--modes",
                      "full,bon,kvrescue", "--budgets", "16", "--buffer", "8", "--ns", "1", "--evict-prompt",
                      "--max-tokens", "40", "--max-step-tokens", "12", "-t", "1", "-fa", "on", "--results", results,
                      *more)
    return run


def test_a_sweep_crosses_weight_types_and_cache_types_and_records_them(sweep, tmp_path):
    results = tmp_path / "r.jsonl"
    done = sweep(results, "--weight-types", "F16,Q8_0", "--cache-types", "f16,q8_0,q4_0/f16")
    assert done.exit_code == 0, done.output
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    axes = {(r["config"]["mode"], r["config"]["weights"], r["config"]["kv_cache"]) for r in rows}
    assert len(rows) == 2 * len(axes) and len(axes) == 2 * 3 * 3  # (full, bon, kvrescue) x weights x caches
    assert len(list((tmp_path / "cache").glob("*.gguf"))) == 2  # each type made once (and its source recorded)
    for row in rows:
        kv, weights = row["setup"]["kv"], row["setup"]["weights"]
        type_k, _, type_v = row["config"]["kv_cache"].partition("/")
        assert (kv["base"]["type_k"], kv["base"]["type_v"]) == (type_k, type_v or type_k)
        assert weights["type"] == weights["label"] == row["config"]["weights"]
        if row["config"]["mode"] == "kvrescue":
            # --cache-types sets the helper's too, as -ctk/-ctv do
            assert (kv["helper"]["type_k"], kv["helper"]["type_v"]) == (kv["base"]["type_k"], kv["base"]["type_v"])
    cells = {r["config"]["kv_cache"]: r["setup"]["kv"]["base"]["cell_bytes"] for r in rows}
    assert cells["q8_0"] == cells["f16"] * 34 / 64 and cells["q4_0/f16"] == cells["f16"] * (18 / 32 + 2) / 4
    again = sweep(results, "--weight-types", "F16,Q8_0", "--cache-types", "f16,q8_0,q4_0/f16", "--resume")
    assert again.exit_code == 0 and "0 new results" in again.output, again.output
    report = invoke("report", results)
    assert report.exit_code == 0, report.output
    table2 = report.output.split("Table 1")[0]
    assert "weights" in table2 and "Q8_0" in table2 and "q4_0/f16" in table2
    assert table2.count("KV-Rescue recovers") <= 2 * 3  # each kvrescue row against full and bon of its own axes
    if importlib.util.find_spec("matplotlib"):
        plots = invoke("report", results, "--plots", tmp_path / "plots")
        assert plots.exit_code == 0 and "memory_accuracy.png" in plots.output, plots.output
        assert (tmp_path / "plots" / "memory_accuracy.png").stat().st_size > 10_000


def test_a_sweep_refuses_a_quantized_v_without_flash_attention_before_loading(sweep, tmp_path):
    result = sweep(tmp_path / "r.jsonl", "--cache-types", "f16,q8_0", "-fa", "off")
    assert "--cache-types q8_0" in one_error_line(result) and "-fa on" in result.output
    assert not (tmp_path / "r.jsonl").exists() and not (tmp_path / "cache").exists()


def test_a_results_file_from_before_cache_types_reports_and_resumes_as_f16(sweep, tmp_path):
    results = tmp_path / "r.jsonl"
    assert sweep(results).exit_code == 0
    old = []
    for line in results.read_text().splitlines():  # as rows were written before KV cache types were axes
        row = json.loads(line)
        for field in ("weights", "kv_cache", "helper_kv_cache"):
            row["config"].pop(field)
        row["config"]["kv_type"] = row["setup"]["settings"]["kv_type"] = "f16"
        del row["setup"]["kv"], row["setup"]["weights"]
        old.append(json.dumps(row) + "\n")
    results.write_text("".join(old))
    report = invoke("report", results)
    assert report.exit_code == 0 and "weights" not in report.output and "setup" not in report.output, report.output
    again = sweep(results, "--resume")
    assert again.exit_code == 0 and "0 new results" in again.output, again.output


def test_the_concurrency_memory_check_counts_the_cache_types_bytes(base_model, helper_model):
    from kvrescue_local.rescue import RescueConfig
    from kvrescue_local.rescue.config import cache_fields
    from kvrescue_local.rescue.limits import kv_memory

    def need(type_k, type_v, **helper):
        # streaming keeps no attention scores, whose accumulators are floats whatever the cache types
        config = RescueConfig(mode="kvrescue", n=1, flash_attn="on", **{**cache_fields(type_k, type_v), **helper})
        config = config.with_overrides({"kv": {"policy": "streaming"}})
        return kv_memory(config, 4, base_model, helper_model, None, 0, 64)

    f16, q4 = need("f16", "f16"), need("q4_0", "q4_0")
    assert q4 == pytest.approx(f16 * 18 / 64, rel=0.01)  # every cell of both contexts at 18 bytes per 32 values
    base_only = need("q4_0", "q4_0", helper_cache_type_k="f16", helper_cache_type_v="f16")
    assert q4 < base_only < f16


def test_ctk_ctv_set_both_sides_and_ctkh_ctvh_the_helper_alone():
    from kvrescue_local.compose import preset_config
    from kvrescue_local.settings import config_overrides

    both = preset_config(None, **config_overrides({"cache_type_k": "q8_0", "cache_type_v": "q4_0", "flash_attn": "on"}))
    assert both.cache_types("base") == both.cache_types("helper") == ("q8_0", "q4_0")
    base_only = preset_config(None, **config_overrides({"cache_type_k": "q4_0", "cache_type_k_helper": "f16"}))
    assert base_only.cache_types("base") == ("q4_0", "f16") and base_only.cache_types("helper") == ("f16", "f16")
