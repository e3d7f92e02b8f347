"""Every number and text checked where it enters: null fields, NaN and infinity, sizes against what the model
was trained on and the memory allowed (before llama.cpp allocates), text that UTF-8 JSON cannot hold; Ctrl-C
anywhere ends with rc 130 and no traceback; messages that say what is true. The toy preset, one thread."""

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from test_hardening import FAST, PROBLEM, TOY, invoke, one_error_line

from kvrescue_local.errors import KVRescueError, SettingError
from kvrescue_local.settings import command_line_name, request_name


def data_file(tmp_path, *rows: str):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(row + "\n" for row in rows))
    return path


# --- 6. null is no text ---------------------------------------------------------------------------

@pytest.mark.parametrize("row, field", [('{"id": 2, "problem": null, "answer": "3"}', "problem"),
                                        ('{"id": 2, "problem": "1+2", "answer": null}', "answer"),
                                        ('{"id": 2, "problem": "1+2", "answer": []}', "answer"),
                                        ('{"id": null, "problem": "1+2", "answer": "3"}', "id"),
                                        ('{"id": 2, "problem": ["1+2"], "answer": "3"}', "problem"),
                                        ('{"id": 2, "problem": "1+2", "answer": ""}', "answer"),
                                        ('{"id": 2, "problem": "1+2", "answer": " \\n "}', "answer"),
                                        ('{"id": 2, "problem": "1+2", "answer": ["  "]}', "answer")])
def test_a_null_or_empty_field_is_refused_naming_its_line(tmp_path, row, field):
    data = data_file(tmp_path, '{"id": 1, "problem": "1+1", "answer": "2"}', row)
    message = one_error_line(invoke("bench", "run", "--data", data, *FAST, "--results", tmp_path / "r.jsonl"))
    assert f"data.jsonl:2: the {field!r} field" in message and not (tmp_path / "r.jsonl").exists()


def test_a_problem_longer_than_any_context_holds_is_refused_from_its_length_before_tokenizing(tmp_path, monkeypatch):
    from kvrescue_local.runtime import Model

    tokenized = []
    tokenize = Model.tokenize
    monkeypatch.setattr(Model, "tokenize", lambda self, text, special=True: tokenized.append(len(text)) or
                        tokenize(self, text, special))
    data = data_file(tmp_path, '{"id": 1, "problem": "1+1", "answer": "2"}',
                     '{"id": 2, "problem": "%s", "answer": "3"}' % ("a=1 " * 250_000))
    message = one_error_line(invoke("bench", "run", "--data", data, *FAST, "--results", tmp_path / "r.jsonl"))
    assert "data problem 2 takes at least 76,927 tokens (1,000,050 bytes, at most 13 a token)" in message, message
    assert tokenized and max(tokenized) < 100_000, "the long problem was tokenized"


def test_numbers_and_answer_lists_are_still_read_as_text(tmp_path):
    from kvrescue_local.bench.datasets import read_jsonl

    data = data_file(tmp_path, '{"id": 7, "problem": "1+1", "answer": 2}', '{"problem": "2+2", "answer": ["4", "four"]}')
    assert [(p.id, p.problem, p.answer) for p in read_jsonl(data)] == [("7", "1+1", "2"), ("data-2", "2+2", "4")]


# --- 7. NaN and infinity ----------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_reward_head_holding_a_number_that_is_not_finite_is_refused(tmp_path, bad):
    from kvrescue_local.prm.head import RewardHead

    head = RewardHead.load(TOY / "prm.head.npz")
    head.weights[0][0, 0] = bad
    (tmp_path / "prm.gguf").symlink_to(TOY / "prm.gguf")
    head.save(tmp_path / "prm.head.npz")
    message = one_error_line(invoke("solve", *FAST, "-n", 2, "--prm", tmp_path / "prm.gguf", PROBLEM))
    assert "prm.head.npz" in message and "weight0" in message and "not finite" in message


def test_a_results_line_holding_nan_is_refused_naming_the_field():
    from kvrescue_local.files import json_text

    with pytest.raises(KVRescueError, match=r"toy-0's steps\[1\]\.score is nan"):
        json_text({"steps": [{"score": 0.5}, {"score": float("nan")}]}, "toy-0's")
    with pytest.raises(KVRescueError, match="answer holds text that UTF-8 cannot encode"):
        json_text({"answer": "\udc80"}, "the record's")


# --- 8. / 14. Ctrl-C anywhere: rc 130, no traceback --------------------------------------------------

def interrupted_run(prelude: str):
    """`python -m kvrescue_local solve` after `prelude`, which arranges for a SIGINT to arrive somewhere."""
    script = textwrap.dedent(prelude) + textwrap.dedent(f"""
        import runpy, sys
        sys.argv = ["kvrescue-local", "solve", *{FAST!r}, {PROBLEM!r}]
        runpy.run_module("kvrescue_local", run_name="__main__", alter_sys=True)
    """)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "KVRESCUE_THREADS": "1"})


def test_ctrl_c_while_a_model_loads_ends_the_run():
    done = interrupted_run("""
        import os, signal
        from kvrescue_local.runtime import lib
        lib.log_errors = lambda level, text: os.kill(os.getpid(), signal.SIGINT)  # llama.cpp logs as it loads
    """)
    assert done.returncode == 130, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr and "answer:" not in done.stdout


def test_ctrl_c_during_the_imports_ends_the_run():
    done = interrupted_run("""
        import os, signal, sys

        class InterruptAtNumpy:
            def find_spec(self, name, path=None, target=None):
                if name == "numpy":
                    os.kill(os.getpid(), signal.SIGINT)
                return None

        sys.meta_path.insert(0, InterruptAtNumpy())
    """)
    assert done.returncode == 130, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "interrupted" in done.stderr


def test_ctrl_c_inside_a_command_is_rc_130_not_click_abort(monkeypatch):
    solve_module = sys.modules["kvrescue_local.cli.solve"]  # the package's `solve` is the command

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(solve_module, "select_models", interrupt)
    done = invoke("solve", *FAST, PROBLEM)
    assert done.exit_code == 130 and "Aborted" not in done.output and "interrupted" in done.output, done.output


# --- 9. sizes against the model and the memory, before llama.cpp allocates -----------------------------

@pytest.mark.parametrize("option", ["--max-tokens", "--prm-ctx", "--max-step-tokens"])
def test_a_context_beyond_the_trained_one_is_refused_naming_its_option(option):
    result = invoke("solve", *FAST, "-n", 2, option, 100000000, PROBLEM)
    message = one_error_line(result)
    assert f"{option} 100000000 exceeds the 1,024 positions" in message, message
    assert "failed to allocate" not in result.output


def test_a_huge_problem_is_refused_naming_the_problem_not_an_option(tmp_path):
    problem = tmp_path / "p.txt"
    problem.write_text("a=1 " * 2_000_000)  # 8 MB: the PRM's context would be sized from its bytes
    result = invoke("solve", *FAST, "-n", 2, "--file", problem)
    message = one_error_line(result)
    assert f"--file {problem} takes" in message and "--max-tokens" not in message, message
    assert "failed to allocate" not in result.output


def test_a_run_beyond_the_memory_allowed_is_refused_naming_what_sized_it(tmp_path):
    result = invoke("bench", "run", "--dataset", "toy", "--limit", 1, "--modes", "bon", "--ns", 2, *FAST,
                    "--prm-ctx", 1000, "--memory", "300K", "--results", tmp_path / "r.jsonl")
    message = one_error_line(result)
    assert "300K" in message and "--prm-ctx 1000" in message, message


def test_the_size_check_is_a_plain_function_of_settings_and_facts():
    from kvrescue_local.rescue import Mode, RescueConfig
    from kvrescue_local.rescue.limits import ModelFacts, RunModels, check_context_sizes
    from kvrescue_local.runtime.context import kv_bytes_per_cell

    facts = ModelFacts.read(TOY / "base.gguf")
    assert facts.n_ctx_train == 1024 and kv_bytes_per_cell(facts, "f16", "f16") == 3 * 2 * 24 * 2 * 2
    config = RescueConfig(mode=Mode.FULL, n=1, max_tokens=512, max_step_tokens=32)
    check_context_sizes(config, RunModels(base=facts), memory=1 << 30)
    # the refusals name settings by field, and each interface words them: the command line by its flags
    with pytest.raises(SettingError) as refused:
        check_context_sizes(RescueConfig(mode=Mode.FULL, n=1, max_tokens=2048), RunModels(base=facts), 1 << 30)
    assert refused.value.worded(command_line_name).startswith("--max-tokens 2048 exceeds the 1,024 positions base.gguf")
    assert refused.value.worded(request_name).startswith("max_tokens 2048 exceeds")
    with pytest.raises(SettingError) as refused:
        check_context_sizes(config, RunModels(base=facts), 1024, "the memory allowed (--memory 1K)")
    assert re.search(r"of the memory allowed \(--memory 1K\).*--max-tokens 512", refused.value.worded(command_line_name))


# --- 10. infinite and overflowing sizes -----------------------------------------------------------------

@pytest.mark.parametrize("args, says", [(["report", "--kv-cap", "infG", "x.jsonl"], "--kv-cap takes a size"),
                                        (["report", "--kv-cap", "1e400k", "x.jsonl"], "--kv-cap takes a size"),
                                        (["report", "--kv-cap", "1e30G", "x.jsonl"], "--kv-cap 1e30G is larger"),
                                        (["estimate", "--contexts", "infk"], "context lengths are"),
                                        (["estimate", "--contexts", "nan"], "context lengths are"),
                                        (["estimate", "--contexts", "1e30k"], "larger than")])
def test_an_infinite_or_overflowing_size_is_one_error_line(args, says):
    assert says in one_error_line(invoke(*args))


def test_an_infinite_memory_is_refused(tmp_path):
    result = invoke("bench", "run", "--dataset", "toy", *FAST, "--memory", "1e400k", "--results", tmp_path / "r.jsonl")
    assert "--memory takes a size" in one_error_line(result)


# --- 11. text that UTF-8 JSON cannot hold ---------------------------------------------------------------

@pytest.mark.parametrize("row", ['{"id": 2, "problem": "1+\\udc80", "answer": "3"}',
                                 '{"id": "\\ud800", "problem": "1+2", "answer": "3"}',
                                 '{"id": 2, "problem": "1+2", "answer": "\\udfff"}'])
def test_a_lone_surrogate_in_a_data_line_is_refused_naming_the_line(tmp_path, row):
    data = data_file(tmp_path, '{"id": 1, "problem": "1+1", "answer": "2"}', row)
    message = one_error_line(invoke("bench", "run", "--data", data, *FAST, "--results", tmp_path / "r.jsonl"))
    assert "data.jsonl:2" in message and "UTF-8" in message, message


def test_a_lone_surrogate_in_the_problem_argument_is_refused():
    assert "the PROBLEM argument" in one_error_line(invoke("solve", *FAST, "a=1 \udc80"))


def test_a_lone_surrogate_in_the_prompt_template_is_refused_before_solving():
    message = one_error_line(invoke("solve", *FAST, "--prompt-template", "\udc80 {problem}", PROBLEM))
    assert "--prompt-template" in message and "UTF-8 cannot encode" in message, message


# --- 15. messages that say what is true --------------------------------------------------------------

def test_a_concurrency_beyond_llama_cpps_sequences_says_so_not_memory(tmp_path):
    result = invoke("bench", "run", "--dataset", "toy", "--limit", 1, "--modes", "bon", "--ns", 8, *FAST, "-k", 64,
                    "--results", tmp_path / "r.jsonl")
    message = one_error_line(result)
    assert "sequences" in message and "GiB" not in message, message


def test_a_window_beyond_the_buffer_names_options_not_none():
    message = one_error_line(invoke("solve", *FAST, "--window", 100000000, PROBLEM))
    assert "None" not in message and "--window 100000000" in message and "--buffer" in message, message


def test_a_step_cap_beyond_the_context_says_to_lower_it_not_shorten_to_nothing():
    message = one_error_line(invoke("solve", *FAST, "--max-step-tokens", 1020, PROBLEM))
    assert "about 0 characters" not in message and "--max-step-tokens" in message, message


def test_a_network_failure_is_not_called_offline(monkeypatch, tmp_path):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    from kvrescue_local import hub
    from kvrescue_local.bench import datasets

    def unreachable(*args, **kwargs):
        raise LocalEntryNotFoundError("connection error, and the file is not in the cache")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", unreachable)
    for fetch in (lambda: hub.download("o/r", "f.gguf", tmp_path, offline=False),
                  lambda: datasets.fetch_hub_dataset(datasets.HUB["aime24"], tmp_path, offline=False)):
        with pytest.raises(KVRescueError) as refused:
            fetch()
        assert "offline" not in str(refused.value) and "network" in str(refused.value)
    with pytest.raises(KVRescueError, match="downloads are off"):
        hub.download("o/r", "f.gguf", tmp_path, offline=True)


@pytest.mark.parametrize("args", [["bench", "run", "--dataset", "toy", "--limit", 1, "--modes", "bon", *FAST,
                                   "--results", "--html"],
                                  ["solve", *FAST, "--json", "--resume", PROBLEM]])
def test_an_option_name_taken_for_an_output_file_is_refused_and_writes_nothing(tmp_path, args):
    message = one_error_line(invoke(*args))
    assert "an option's name" in message and f"{tmp_path}/--" in message, message
    assert not list(tmp_path.iterdir()), "nothing written in the folder the command ran in"
    assert invoke("bench", "run", "--dataset", "toy", "--limit", 1, "--modes", "full", "--ns", 1, *FAST,
                  "--results", tmp_path / "--html").exit_code == 0, "with its folder, a file of that name"
    assert (tmp_path / "--html").exists()
