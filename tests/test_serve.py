"""The OpenAI-compatible server against the bundled toy preset, through the official openai client."""

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import click
import httpx
import pytest
from click.testing import CliRunner

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from kvrescue_local.cli import main  # noqa: E402
from kvrescue_local.cli.serve import build_served, serve  # noqa: E402
from kvrescue_local.errors import KVRescueError, SettingError  # noqa: E402
from kvrescue_local.files import file_hash  # noqa: E402
from kvrescue_local.rescue import Rescue, longest_prompt, loop  # noqa: E402
from kvrescue_local.rescue.rules import Judge  # noqa: E402
from kvrescue_local.runtime import Context  # noqa: E402
from kvrescue_local.serve import engine as engine_module  # noqa: E402
from kvrescue_local.serve.schemas import MAX_MESSAGES  # noqa: E402
from kvrescue_local.toy.dataset import toy_dataset  # noqa: E402
from serving import LoopbackServer  # noqa: E402

# An f32 KV cache: with f16 cells the rounding of a K or V value amplifies the float-order differences that
# other problems' cells make in the softmax, and one stream of 32 now and then samples another step than `solve`
# of its problem alone (docs/throughput.md); at f32 a stream equals its solve.
TOY_ARGS = ["--preset", "toy", "-t", "1", "-n", "2", "--concurrency", "32", "--prompt-tokens", "128", "-ctk", "f32",
            "-ctv", "f32"]


@pytest.fixture(scope="module")
def toy_server():
    server = LoopbackServer(TOY_ARGS)
    yield server
    server.close()


def client(server) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def toy_solver():
    """The toy server's settings and models of its own (a PRM is sized for the engine that holds it)."""
    return build_served(serve.make_context("serve", list(TOY_ARGS)).params)


def solved(served, problem: str, seed: int, **settings):
    """What `solve` gives for the problem at this seed with the server's settings, `settings` (RescueConfig's
    overrides) changed (one problem, one slot)."""
    config = served.config.with_overrides({"seed": seed, **settings})
    models = served.engine.models
    engine = Rescue(config, models.base, models.helper, models.prm,
                    prompt_tokens_max=longest_prompt(config, [models.base, models.helper], [problem]))
    return engine.solve(problem)


def test_chat_and_completions_streamed_and_not_equal_solve(toy_server, toy_solver):
    problem = toy_dataset().problems[0].problem
    expected = solved(toy_solver, problem, seed=5)
    api = client(toy_server)
    chat = api.chat.completions.create(model="toy", messages=[{"role": "user", "content": problem}], seed=5)
    assert chat.choices[0].message.content == expected.text
    assert chat.choices[0].finish_reason == "stop"
    steps = chat.choices[0].model_extra["kvrescue"]["steps"]
    assert [s["source"] for s in steps] == [s.source for s in expected.steps]
    assert chat.usage.model_extra["base_tokens"] == expected.tokens["base"]
    assert chat.usage.model_extra["helper_tokens"] == expected.tokens["helper"]
    assert chat.usage.completion_tokens == expected.tokens["committed"]

    chunks = list(api.chat.completions.create(model="toy", messages=[{"role": "user", "content": problem}],
                                              seed=5, stream=True))
    texts = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert texts == [s.text for s in expected.steps if s.text]
    assert [c.choices[0].model_extra["kvrescue"]["source"] for c in chunks[:-1]] == [s.source for s in expected.steps]
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].usage.prompt_tokens > 0

    completion = api.completions.create(model="toy", prompt=problem, seed=5)
    assert completion.choices[0].text == expected.text
    streamed = "".join(c.choices[0].text for c in api.completions.create(model="toy", prompt=problem, seed=5, stream=True))
    assert streamed == expected.text
    assert [m.id for m in api.models.list().data] == [toy_server.served.model_id]
    assert api.models.retrieve("toy").id == api.models.retrieve(toy_server.served.model_id).id == "toy-kvrescue"
    assert httpx.get(f"{toy_server.url}/health").json() == {"status": "ok"}


def test_an_unknown_model_is_a_404_in_openai_shape(toy_server):
    api = client(toy_server)
    for ask in (lambda: api.models.retrieve("gpt-4o-nonexistent"),
                lambda: api.chat.completions.create(model="gpt-4o-nonexistent",
                                                    messages=[{"role": "user", "content": "a=1\nCompute 1 terms: a."}])):
        with pytest.raises(openai.NotFoundError) as missing:
            ask()
        assert missing.value.code == "model_not_found" and missing.value.type == "invalid_request_error"


def test_stop_and_max_tokens_end_a_request_early(toy_server, toy_solver):
    problem = toy_dataset().problems[1].problem
    expected = solved(toy_solver, problem, seed=2)
    api = client(toy_server)
    first_step = expected.steps[0].text
    stop = first_step[len(first_step) // 2:][:3]
    cut = api.completions.create(model="toy", prompt=problem, seed=2, stop=[stop])
    assert cut.choices[0].text == expected.text[:expected.text.find(stop)]
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].model_extra["kvrescue"]["stop"] == "stop_sequence"
    short = api.completions.create(model="toy", prompt=problem, seed=2, max_tokens=1)
    assert short.choices[0].text == first_step and short.choices[0].finish_reason == "length"
    assert short.choices[0].model_extra["kvrescue"]["stop"] == "max_tokens"
    # max_completion_tokens is max_tokens' new name; a chat message's content may be a list of text parts
    chat = api.chat.completions.create(model="toy", seed=2, max_completion_tokens=1,
                                       messages=[{"role": "user", "content": [{"type": "text", "text": problem}]}])
    assert chat.choices[0].message.content == first_step and chat.choices[0].finish_reason == "length"
    streamed = list(api.chat.completions.create(model="toy", seed=2, max_completion_tokens=1, stream=True,
                                                messages=[{"role": "user", "content": problem}]))
    assert streamed[-1].choices[0].finish_reason == "length"
    assert streamed[-1].choices[0].model_extra["kvrescue"]["stop"] == "max_tokens"
    # an empty stop sequence is dropped, given alone as in a list: it would end every answer before its first word
    for empty in ("", [""]):
        ignored = api.completions.create(model="toy", prompt=problem, seed=2, stop=empty)
        assert ignored.choices[0].text == expected.text and ignored.choices[0].model_extra["kvrescue"]["stop"] != \
            "stop_sequence", repr(empty)
    toy_server.wait_idle()


def test_stop_sequences_over_the_limit_health_probes_and_a_prompt_past_the_trained_context(toy_server):
    five = httpx.post(f"{toy_server.url}/v1/completions", json={"prompt": "a=1", "stop": list("abcde")})
    assert five.status_code == 400 and five.json()["error"]["param"] == "stop"
    assert five.json()["error"]["message"] == ("stop: 5 stop sequences, over the 4 a request may give (OpenAI's "
                                               "limit): give at most 4")
    for path in ("/health", "/v1/health"):
        assert httpx.get(f"{toy_server.url}{path}").json() == {"status": "ok"}, path
        assert httpx.head(f"{toy_server.url}{path}").status_code == 200, path
    # the server reserves 128 prompt cells; a prompt longer than the toy's 1,024 trained positions is refused as
    # solve refuses it, naming the model's limit rather than a restart that could not help
    past = httpx.post(f"{toy_server.url}/v1/completions", json={"prompt": "a=1 " * 800}, timeout=120)
    assert past.status_code == 400 and past.json()["error"]["code"] == "context_length_exceeded"
    assert past.json()["error"]["param"] == "prompt"
    assert "was trained on 1,024" in past.json()["error"]["message"] and "--prompt-tokens" not in past.json()["error"]["message"]


def test_props_answer_the_limits_the_server_started_with(toy_server):
    """TOY_ARGS: -n 2, --concurrency 32, --prompt-tokens 128, f32 KV caches; the toy preset's --max-tokens 320 and
    the base's trained context as --max-budget."""
    served = toy_server.served
    props = httpx.get(f"{toy_server.url}/props").json()
    assert httpx.get(f"{toy_server.url}/v1/props").json() == props
    assert props["total_slots"] == 32 and props["model_alias"] == "toy-kvrescue"
    assert props["model_path"] == str(served.engine.models.base.path)
    assert props["default_generation_settings"]["params"]["n_predict"] == 320
    assert props["chat_template"] == served.config.prompt and "{problem}" in props["chat_template"]
    own = props["kvrescue"]
    expected = {"max_n": 2, "max_budget": 1024, "max_tokens": 320, "prompt_tokens": 128, "concurrency": 32,
                "max_queue": 64, "max_request_bytes": 2 ** 20, "max_stops": 4, "max_messages": MAX_MESSAGES,
                "preset": "toy", "tokenizer": "base"}
    assert {k: own[k] for k in expected} == expected
    assert own["memory_bytes"] == served.limits.memory
    assert own["settings"]["cache_type_k"] == own["settings"]["cache_type_v"] == "f32"
    assert own["settings"]["n"] == 2 and own["settings"]["kv"]["budget"] == served.config.kv.budget
    models = served.engine.models
    loaded = (("base", models.base), ("helper", models.helper), ("prm", models.prm.model))
    assert own["models"] == {side: {"file": m.path.name, "fingerprint": file_hash(m.path), "n_ctx_train": 1024,
                                    "n_vocab": m.n_vocab} for side, m in loaded}
    over = httpx.post(f"{toy_server.url}/v1/completions", json={"prompt": "a=1", "n": own["max_n"] + 1})
    assert over.status_code == 400 and f"over this server's n {own['max_n']}" in over.json()["error"]["message"]


def test_tokenize_then_detokenize_round_trips_a_prompt_counted_as_the_server_counts_it(toy_server):
    problem = toy_dataset().problems[3].problem
    prompt = httpx.get(f"{toy_server.url}/props").json()["chat_template"].format(problem=problem)
    tokens = httpx.post(f"{toy_server.url}/tokenize", json={"content": prompt}).json()["tokens"]
    assert all(isinstance(t, int) for t in tokens)
    assert httpx.post(f"{toy_server.url}/v1/tokenize", json={"content": prompt}).json()["tokens"] == tokens
    assert httpx.post(f"{toy_server.url}/detokenize", json={"tokens": tokens}).json() == {"content": prompt}
    assert httpx.post(f"{toy_server.url}/v1/detokenize", json={"tokens": tokens}).json() == {"content": prompt}
    pieces = httpx.post(f"{toy_server.url}/tokenize", json={"content": prompt, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == tokens and "".join(p["piece"] for p in pieces) == prompt
    # <|im_start|> is one token, or its characters one by one when the text is not to be read for control tokens
    plain = httpx.post(f"{toy_server.url}/tokenize", json={"content": prompt, "parse_special": False}).json()["tokens"]
    assert len(plain) > len(tokens)
    answer = httpx.post(f"{toy_server.url}/v1/completions", json={"prompt": problem, "max_tokens": 1}, timeout=120)
    assert answer.json()["usage"]["prompt_tokens"] == len(tokens)


@pytest.mark.parametrize(("path", "body", "param", "said"), [
    ("tokenize", {}, "content", "Field required"),
    ("tokenize", {"content": 5}, "content", "valid string"),
    ("tokenize", {"content": "a", "with_pieces": "yes"}, "with_pieces", "valid boolean"),
    ("tokenize", {"content": "a", "pieces": True}, "pieces", "does not know this field"),
    ("tokenize", {"content": "a" * 1500}, "content", "content is 1,500 tokens, over the 1,024 positions base.gguf"),
    ("tokenize", {"content": "a" * 100_000}, "content", "content is at least 7,693 tokens (100,000 bytes"),
    ("detokenize", {}, "tokens", "Field required"),
    ("detokenize", {"tokens": [1, "2"]}, "tokens.1", "valid integer"),
    ("detokenize", {"tokens": [1, 2.5]}, "tokens.1", "valid integer"),
    ("detokenize", {"tokens": [True]}, "tokens.0", "valid integer"),
    ("detokenize", {"tokens": "abc"}, "tokens", "valid list"),
    ("detokenize", {"tokens": [5, 262]}, "tokens", "tokens[1] = 262 is no token of base.gguf (its ids are 0 to 261)"),
    ("detokenize", {"tokens": [-1]}, "tokens", "tokens[0] = -1 is no token"),
    ("detokenize", {"tokens": [2 ** 70]}, "tokens", f"tokens[0] = {2 ** 70} is no token")])
def test_bad_tokenize_and_detokenize_inputs_are_400s(toy_server, path, body, param, said):
    response = httpx.post(f"{toy_server.url}/{path}", json=body)
    error = response.json()["error"]
    assert response.status_code == 400 and error["type"] == "invalid_request_error" and error["param"] == param, error
    assert said in error["message"], error


def test_tokenize_refuses_a_lone_surrogate(toy_server):
    response = httpx.post(f"{toy_server.url}/tokenize", content=b'{"content": "a\\udc80"}',
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "\\udc80 at character 1" in response.json()["error"]["message"]


def test_slots_list_a_request_while_it_streams_and_none_when_idle(toy_server, monkeypatch):
    """The engine thread is held inside the request's third step (its on_step) while /slots is read: what it
    shows is the progress recorded after the request's second turn."""
    engine = toy_server.served.engine
    toy_server.wait_idle()
    assert httpx.get(f"{toy_server.url}/slots").json() == httpx.get(f"{toy_server.url}/v1/slots").json() == []
    held, release = threading.Event(), threading.Event()
    on_step = engine.on_step

    def holding(job, step):
        if step.round == 2:
            held.set()
            release.wait(60)
        on_step(job, step)

    monkeypatch.setattr(engine, "on_step", holding)
    problem = toy_dataset().problems[0].problem
    try:
        with httpx.stream("POST", f"{toy_server.url}/v1/completions", timeout=120,
                          json={"prompt": problem, "stream": True, "seed": 4, "max_tokens": 300}) as response:
            lines = (line for line in response.iter_lines() if line.startswith("data:"))
            chunks = [json.loads(next(lines).removeprefix("data:")) for _ in range(2)]
            assert held.wait(60)
            (slot,) = httpx.get(f"{toy_server.url}/slots").json()
            release.set()
            rest = [line.removeprefix("data:").strip() for line in lines]
    finally:
        release.set()
    assert slot["id"] == 0 and slot["id_task"] == chunks[0]["id"] and slot["is_processing"]
    assert slot["params"]["n_predict"] == 300 and slot["params"]["seed"] == 4
    own = slot["kvrescue"]
    assert own["steps"] == 2 and own["last_source"] == chunks[1]["choices"][0]["kvrescue"]["source"]
    assert own["budget"] == toy_server.served.config.kv.budget and own["mode"] == "kvrescue"
    assert own["prompt_tokens"] > 0 and 0 < own["base_tokens"] <= own["budget"] + toy_server.served.config.kv.buffer
    # the prompt and two steps are more than budget + buffer cells: the base has evicted
    assert own["prompt_tokens"] + slot["next_token"]["n_decoded"] > own["budget"] + toy_server.served.config.kv.buffer
    assert own["evictions"] >= 1
    assert rest[-1] == "[DONE]"
    toy_server.wait_idle()
    assert httpx.get(f"{toy_server.url}/slots").json() == []


START_ARGS = ["--preset", "toy", "-t", "1", "-n", "2"]


@pytest.mark.parametrize(("args", "said"), [
    (["--prompt-tokens", "5000"], "--prompt-tokens reserves 5,000 tokens with the prompt template, but base.gguf was "
                                  "trained on 1,024 and one step of --max-step-tokens 32 must fit after it: lower "
                                  "--prompt-tokens to at most 992"),
    (["--prompt-tokens", "100000000"], "--prompt-tokens reserves 100,000,000 tokens"),
    (["--max-tokens", "100000000"], "--max-tokens 100000000 exceeds the 1,024 positions base.gguf was trained on"),
    (["--max-tokens", "2000"], "--max-tokens 2000 exceeds the 1,024 positions base.gguf was trained on"),
    (["--max-step-tokens", "1024"], "lower --max-step-tokens to below 1,024"),
    (["--api-key", ""], "--api-key (or KVRESCUE_API_KEY) is blank"),
    (["--api-key", " \t"], "--api-key (or KVRESCUE_API_KEY) is blank")])
def test_start_sizes_and_a_blank_key_are_refused_before_any_model_opens(monkeypatch, args, said):
    """As `solve` checks its sizes, from the GGUF headers, before llama.cpp allocates anything."""
    def no_models(*args, **kwargs):
        raise AssertionError("the models opened before the start-up sizes were checked")

    monkeypatch.setattr(sys.modules[build_served.__module__], "open_models", no_models)  # cli.serve is the command
    with pytest.raises(KVRescueError) as refused:
        build_served(serve.make_context("serve", [*START_ARGS, *args]).params)
    # a refused setting is worded by the command that runs build_served: by its options' flags
    error = refused.value
    assert said in (error.worded(serve.option_name) if isinstance(error, SettingError) else str(error))


def test_start_refusals_are_one_error_line():
    with socket.socket() as probe:  # a free port: the refusal comes after the socket is bound
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    runner = CliRunner()
    for args, env in (([*START_ARGS, "--prompt-tokens", "5000"], {}), (START_ARGS, {"KVRESCUE_API_KEY": "  "})):
        refused = runner.invoke(main, ["serve", "--port", port, *args], env=env)
        errors = [line for line in refused.output.splitlines() if line.startswith("Error:")]
        assert refused.exit_code == 1 and len(errors) == 1 and "Traceback" not in refused.output, refused.output
        assert " on http://" not in refused.output  # the line "serving ID on http://..."


def test_32_concurrent_streams_each_equal_solve_with_its_seed(toy_server, toy_solver):
    problems = [p.problem for p in toy_dataset().problems[:32]]
    api = client(toy_server)
    got: dict[int, list] = {}

    def ask(i: int) -> None:
        got[i] = list(api.chat.completions.create(model="toy", messages=[{"role": "user", "content": problems[i]}],
                                                  seed=100 + i, stream=True))

    refused = {}

    def refuse(name: str, body: dict) -> None:
        refused[name] = httpx.post(f"{toy_server.url}/v1/completions", json=body, timeout=120)

    bad = {"seed": {"seed": -1, "rule": "random"}, "budget": {"budget": 10 ** 12}, "n": {"n": 3},
           "body": {"prompt": "a" * 10_000_000}, "rkv kernel": {"policy": "rkv:kernel=1000000000"},
           "snapkv kernel": {"policy": "snapkv:kernel=1000000000"}}  # a pooling loop per kernel step once stalled all
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(32)]
    threads += [threading.Thread(target=refuse, args=(name, {"prompt": problems[0], **body})) for name, body in bad.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {name: r.status_code for name, r in refused.items()} == dict.fromkeys(bad, 400)
    assert sorted(got) == list(range(32))
    for i, chunks in got.items():
        expected = solved(toy_solver, problems[i], seed=100 + i)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text, i
        assert chunks[-1].usage.model_extra["helper_tokens"] == expected.tokens["helper"], i
    toy_server.wait_idle()


def chunks_of(text: bytes, size: int):
    """A body sent without a Content-Length (chunked)."""
    for at in range(0, len(text), size):
        yield text[at:at + size]


def test_errors_are_openai_bodies_and_leave_nothing_in_the_engine(toy_server):
    problem = toy_dataset().problems[0].problem
    chat = [{"role": "user", "content": problem}]
    json_body = {"headers": {"content-type": "application/json"}}
    cases = {
        "bad json": ("completions", dict(content=b"{not json", **json_body)),
        "wrong type": ("completions", dict(json={"prompt": problem, "max_tokens": "many"})),
        "unknown mode": ("completions", dict(json={"prompt": problem, "mode": "fast"})),
        "unknown policy": ("completions", dict(json={"prompt": problem, "mode": "bon", "policy": "lru"})),
        "a policy option twice": ("completions", dict(json={"prompt": problem, "policy": "rkv:lam=0.1,lam=0.2"})),
        "too long": ("completions", dict(json={"prompt": "a=1 " * 2000})),
        "over max_tokens": ("completions", dict(json={"prompt": problem, "max_tokens": 10 ** 6})),
        "n over -n": ("completions", dict(json={"prompt": problem, "n": 3})),
        "a huge budget": ("completions", dict(json={"prompt": problem, "budget": 10 ** 12})),
        "a negative seed": ("completions", dict(json={"prompt": problem, "seed": -1, "rule": "random"})),
        "a seed over 32 bits": ("completions", dict(json={"prompt": problem, "seed": 2 ** 32})),
        "a NaN temperature": ("completions", dict(content=b'{"prompt": "a=1", "temperature": NaN}', **json_body)),
        "five stops": ("completions", dict(json={"prompt": problem, "stop": list("abcde")})),
        "echo": ("completions", dict(json={"prompt": problem, "echo": True})),
        "a 10 MB body": ("completions", dict(json={"prompt": "a" * 10_000_000})),
        "a chunked body over the limit": ("completions", dict(content=chunks_of(b"a" * 2_000_000, 65536), **json_body)),
        "too many messages": ("chat/completions", dict(json={"messages": chat * (MAX_MESSAGES + 1)})),
        "an image part": ("chat/completions", dict(json={"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]})),
        "tools": ("chat/completions", dict(json={"messages": chat, "tools": [{"type": "function"}]})),
        "logprobs": ("chat/completions", dict(json={"messages": chat, "logprobs": True})),
        "two token limits": ("chat/completions", dict(json={"messages": chat, "max_tokens": 4,
                                                            "max_completion_tokens": 8})),
    }
    for name, (path, request) in cases.items():
        response = httpx.post(f"{toy_server.url}/v1/{path}", **request, timeout=120)
        assert response.status_code == 400, name
        assert response.json()["error"]["type"] == "invalid_request_error" and response.json()["error"]["message"], name
    api = client(toy_server)
    with pytest.raises(openai.BadRequestError, match="mode"):
        api.completions.create(model="toy", prompt=problem, extra_body={"mode": "fast"})
    with pytest.raises(openai.BadRequestError) as too_long:
        api.chat.completions.create(model="toy", messages=[{"role": "user", "content": "a=1 " * 2000}])
    assert too_long.value.code == "context_length_exceeded" and too_long.value.type == "invalid_request_error"
    assert too_long.value.param == "messages"
    missing = httpx.get(f"{toy_server.url}/v1/embeddings")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"
    not_allowed = httpx.post(f"{toy_server.url}/v1/models")
    assert not_allowed.status_code == 405 and "GET" in not_allowed.json()["error"]["message"]
    counted = httpx.get(f"{toy_server.url}/metrics").text
    assert 'endpoint="unmatched",status="404"' in counted and "/v1/embeddings" not in counted
    assert toy_server.metric("kvrescue_requests_queued") == toy_server.metric("kvrescue_requests_in_flight") == 0


@pytest.mark.parametrize(("option", "field", "value"), [
    ("--seed", "seed", -1), ("--seed", "seed", 2 ** 32), ("--temp", "temperature", -0.5), ("--top-p", "top_p", 0),
    ("-n", "n", 0), ("--budget", "budget", 0), ("--policy", "policy", "rkv:lam=0.1,lam=0.2"),
    ("--policy", "policy", "lru"), ("--policy", "policy", "rkv:kernel=1000000000"), ("--mode", "mode", "fast"),
    ("--rule", "rule", "best"), ("--rule", "rule", "by-budget:32,judge")])
def test_a_request_field_is_checked_by_its_options_own_check(toy_server, option, field, value):
    with pytest.raises((click.BadParameter, KVRescueError)) as refused:
        serve.make_context("serve", [option, str(value)])
    said = refused.value.message if isinstance(refused.value, click.BadParameter) else str(refused.value)
    response = httpx.post(f"{toy_server.url}/v1/completions", json={"prompt": "a=1", field: value})
    assert response.status_code == 400 and response.json()["error"]["param"] == field
    assert said in response.json()["error"]["message"]


@pytest.mark.parametrize(("choice", "spec"), [("prm", "judge"), ("regime", "by-budget:BUDGET,judge,lead:base")])
def test_the_old_choice_field_is_refused_naming_the_rule_spec(toy_server, choice, spec):
    response = httpx.post(f"{toy_server.url}/v1/completions", json={"prompt": "a=1", "choice": choice})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "choice", error
    assert f'send "rule": "{spec}"' in error["message"], error


def test_a_request_whose_kv_caches_exceed_memory_is_refused(toy_server):
    """--memory bounds the KV caches of any request's settings at --concurrency (all its slots are made at once);
    the server's own settings must fit it to start."""
    served = toy_server.served
    own = served.kv_bytes(served.config)
    largest = served.kv_bytes(served.config.with_overrides({"kv": {"budget": served.limits.max_budget}}))
    assert largest > own
    server = LoopbackServer([*TOY_ARGS, "--memory", str((own + largest) // 2)], start_engine=False)
    try:
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a=1", "budget": served.limits.max_budget})
        assert response.status_code == 400 and "(its memory setting)" in response.json()["error"]["message"]
    finally:
        server.close()
    with pytest.raises(KVRescueError, match="--memory"):
        build_served(serve.make_context("serve", [*TOY_ARGS, "--memory", str(own - 1)]).params)


def test_a_budget_that_cannot_hold_a_protected_prompt_is_refused():
    """With --protect-prompt, a request's budget must hold its prompt and the recent window: checked with the
    prompt's tokens before the engine sees it (in the engine it would fail a round's eviction)."""
    server = LoopbackServer([*TOY_ARGS, "--protect-prompt"], start_engine=False)
    try:
        response = httpx.post(f"{server.url}/v1/completions",
                              json={"prompt": toy_dataset().problems[0].problem, "budget": 20})
        assert response.status_code == 400 and response.json()["error"]["param"] == "budget"
        assert "the server's protect-prompt keeps the prompt's" in response.json()["error"]["message"]
    finally:
        server.close()


@pytest.mark.parametrize(("args", "said"), [
    (["--max-budget", "5000"], "--max-budget 5000 exceeds the 1,024 positions"),
    (["--budget", "100", "--max-budget", "50"], "--budget 100 is over --max-budget 50")])
def test_a_max_budget_beyond_the_base_or_below_the_budget_is_an_error(args, said):
    with pytest.raises(KVRescueError, match=said):
        build_served(serve.make_context("serve", [*TOY_ARGS, *args]).params)


def test_settings_the_engine_cannot_run_fail_their_requests_alone(toy_server, monkeypatch):
    """The engine refuses the contexts of one configuration (here n=1's): its requests get a 500, the others go on."""
    engine_rescue = engine_module.Rescue

    def refusing(config, *args, **kwargs):
        if config.n == 1:
            raise KVRescueError("these contexts cannot be made")
        return engine_rescue(config, *args, **kwargs)

    monkeypatch.setattr(engine_module, "Rescue", refusing)
    url = f"{toy_server.url}/v1/completions"
    problem = toy_dataset().problems[0].problem
    results = {}

    def post(name: str, body: dict) -> None:
        results[name] = httpx.post(url, json=body, timeout=120)

    threads = [threading.Thread(target=post, args=("n1", {"prompt": problem, "n": 1})),
               threading.Thread(target=post, args=("ok", {"prompt": problem, "seed": 1}))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["n1"].status_code == 500 and "cannot be made" in results["n1"].json()["error"]["message"]
    assert results["ok"].status_code == 200 and results["ok"].json()["choices"][0]["text"]
    toy_server.wait_idle()


def test_one_bad_request_among_good_ones_fails_alone(toy_solver, monkeypatch):
    """One request that fails in the engine (its choice of a step raises, as `seed: -1` with choice random once
    did) and one the checks refuse, among six good ones in the same rounds: the first gets a 500, the second a 400
    before the engine sees it, and every good one completes with its `solve` answer."""
    doomed_seed = 999
    choose = Judge.choose

    def failing(rule, survivors, seeds):
        if seeds[0] == doomed_seed:
            raise ValueError("expected non-negative integer")
        return choose(rule, survivors, seeds)

    monkeypatch.setattr(Judge, "choose", failing)
    server = LoopbackServer(TOY_ARGS, start_engine=False)  # everything queued first: they share their rounds
    try:
        problems = [p.problem for p in toy_dataset().problems[:6]]
        api = client(server)
        got, bad = {}, {}

        def ask(i: int) -> None:
            got[i] = list(api.chat.completions.create(model="toy", messages=[{"role": "user", "content": problems[i]}],
                                                      seed=200 + i, stream=True))

        def post(name: str, body: dict) -> None:
            bad[name] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
        threads += [threading.Thread(target=post, args=("engine", {"prompt": problems[0], "seed": doomed_seed})),
                    threading.Thread(target=post, args=("checks", {"prompt": problems[1], "seed": -1,
                                                                   "rule": "random"}))]
        for t in threads:
            t.start()
        while server.metric("kvrescue_requests_queued") < 7:
            time.sleep(0.01)
        server.served.engine.start()
        for t in threads:
            t.join()
        assert bad["checks"].status_code == 400 and bad["checks"].json()["error"]["param"] == "seed"
        assert bad["engine"].status_code == 500
        assert "expected non-negative integer" in bad["engine"].json()["error"]["message"]
        for i, chunks in got.items():
            expected = solved(toy_solver, problems[i], seed=200 + i)
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text, i
            assert chunks[-1].choices[0].model_extra["kvrescue"]["answer"] == expected.answer, i
        assert sorted(got) == list(range(6))
        server.wait_idle()
    finally:
        server.close()


@pytest.mark.parametrize(("settings", "overrides", "engines"), [
    ([{"temperature": 0.7}, {"temperature": 0.75}], [{"temperature": 0.7}, {"temperature": 0.75}], 1),
    ([{"budget": 64}, {"budget": 96}], [{"kv": {"budget": 64}}, {"kv": {"budget": 96}}], 2)])
def test_requests_of_other_settings_share_the_rounds_and_each_equals_solve(toy_solver, settings, overrides, engines):
    """Four requests queued at once, their settings alternating: requests of the two settings commit their steps in
    the same rounds (each commits its first step before the other its last: neither drains first), and each equals
    `solve` with its own settings. Sampling settings share one engine; a budget has an engine of its own beside the first."""
    server = LoopbackServer(TOY_ARGS, start_engine=False)
    engine = server.served.engine
    steps = []  # (request, round) of every step, in the order the engine committed them
    on_step = engine.on_step

    def logged(job, step):
        steps.append((job.problem, step.round))
        on_step(job, step)

    engine.on_step = logged
    try:
        problems = [p.problem for p in toy_dataset().problems[:4]]
        got = {}

        def ask(i: int) -> None:
            got[i] = httpx.post(f"{server.url}/v1/completions", timeout=120,
                                json={"prompt": problems[i], "seed": 300 + i, **settings[i % 2]})

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        while server.metric("kvrescue_requests_queued") < 4:
            time.sleep(0.01)
        engine.start()
        for t in threads:
            t.join()
        for i, response in got.items():
            expected = solved(toy_solver, problems[i], seed=300 + i, **overrides[i % 2])
            assert response.status_code == 200 and response.json()["choices"][0]["text"] == expected.text, i
        order = [problem for problem, _ in steps]
        first = {i: order.index(problems[i]) for i in range(4)}
        last = {i: len(order) - 1 - order[::-1].index(problems[i]) for i in range(4)}
        for a, b in ((0, 1), (2, 3)):  # in whichever order they were queued, each starts before the other ends
            assert first[a] < last[b] and first[b] < last[a], (a, b)
        assert server.metric("kvrescue_engines") == engines
        server.wait_idle()
    finally:
        server.close()


def test_switches_of_settings_reuse_their_engines_and_bound_the_contexts(monkeypatch):
    """Six alternations of two budgets make each budget's contexts once, and five more budgets one after the other
    hold no more contexts alive than two engines do: an idle engine is reused, or closed for another's room."""
    made = []
    make = Context.__init__

    def counted(self, *args, **kwargs):
        made.append(self)
        make(self, *args, **kwargs)

    monkeypatch.setattr(Context, "__init__", counted)
    server = LoopbackServer(["--preset", "toy", "-t", "1", "-n", "2", "--concurrency", "2", "--prompt-tokens", "128"])
    try:
        problem = toy_dataset().problems[0].problem

        def ask(budget: int) -> None:
            response = httpx.post(f"{server.url}/v1/completions", json={"prompt": problem, "budget": budget}, timeout=120)
            assert response.status_code == 200

        def alive() -> int:
            return sum(1 for c in made if c.handle)

        made_before = len(made)
        ask(64)
        ask(96)
        made_by_two, alive_with_two = len(made) - made_before, alive()
        for _ in range(5):
            ask(64)
            ask(96)
        assert len(made) - made_before == made_by_two
        for budget in (48, 56, 72, 80, 88):
            ask(budget)
            assert alive() <= alive_with_two and server.metric("kvrescue_engines") <= 2
    finally:
        server.close()


def test_a_request_is_checked_off_the_event_loop(toy_server, monkeypatch):
    """A request's checks run in a worker thread (tokenizing a long prompt takes a while): /health answers while
    one is under way."""
    served = toy_server.served
    checking, release = threading.Event(), threading.Event()
    check = served.job

    def held(*args):
        checking.set()
        release.wait(60)
        return check(*args)

    monkeypatch.setattr(served, "job", held)
    answer = {}
    request = threading.Thread(target=lambda: answer.update(r=httpx.post(f"{toy_server.url}/v1/completions", timeout=120,
                                                                         json={"prompt": "a=1 " * 2000})))
    request.start()
    try:
        assert checking.wait(60)
        assert httpx.get(f"{toy_server.url}/health", timeout=30).json() == {"status": "ok"}
    finally:
        release.set()
        request.join()
    assert answer["r"].json()["error"]["code"] == "context_length_exceeded"


def test_a_bad_port_or_one_in_use_is_one_error_line():
    runner = CliRunner()
    bad = runner.invoke(main, ["serve", "--port", "99999"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
    assert [line for line in bad.output.splitlines() if line.startswith("Error:")] == [
        "Error: Invalid value for '--port': 99999 is not in the range 1<=x<=65535."]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        busy = runner.invoke(main, ["serve", "--port", str(port), "-t", "1"])
    assert busy.exit_code == 1 and " on http://" not in busy.output and "Traceback" not in busy.output
    errors = [line for line in busy.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and f"cannot listen on 127.0.0.1:{port}" in errors[0]


def test_an_api_key_and_cors_origins(monkeypatch):
    monkeypatch.setenv("KVRESCUE_API_KEY", "sekrit")
    server = LoopbackServer(["--preset", "toy", "-t", "1", "-n", "2", "--concurrency", "1", "--allowed-origins",
                             "http://app.example"], start_engine=False)
    try:
        url = f"{server.url}/v1"
        with pytest.raises(openai.AuthenticationError) as refused:
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        assert refused.value.code == "invalid_api_key" and refused.value.type == "invalid_request_error"
        assert [m.id for m in openai.OpenAI(base_url=url, api_key="sekrit").models.list().data] == ["toy-kvrescue"]
        assert httpx.post(f"{url}/completions", json={"prompt": "a=1"}).status_code == 401
        # the key is asked for before the body is read: a bad body without it is a 401, not a 400
        wrong_key = {"Authorization": "Bearer wrong"}
        for body in (dict(content=b"{not json", headers={"content-type": "application/json", **wrong_key}),
                     dict(json={"prompt": "a" * 2_000_000}, headers=wrong_key),
                     dict(json={"prompt": "a=1", "seed": -1}, headers=wrong_key)):
            wrong = httpx.post(f"{url}/completions", **body)
            assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        for path in ("/health", "/v1/health"):  # a liveness probe needs no key
            assert httpx.get(f"{server.url}{path}").status_code == httpx.head(f"{server.url}{path}").status_code == 200
        key = {"Authorization": "Bearer sekrit"}
        for prefix in ("", "/v1"):  # llama-server's routes ask for the key as the others do
            for method, path, body in (("GET", "/props", None), ("GET", "/slots", None), ("POST", "/tokenize",
                                       {"content": "a=1"}), ("POST", "/detokenize", {"tokens": [97]})):
                url_of = f"{server.url}{prefix}{path}"
                refused = httpx.request(method, url_of, json=body, headers=wrong_key)
                assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key", url_of
                assert httpx.request(method, url_of, json=body).status_code == 401, url_of
                assert httpx.request(method, url_of, json=body, headers=key).status_code == 200, url_of
        assert httpx.get(f"{server.url}/props", headers=key).json()["total_slots"] == 1
        assert 'endpoint="/v1/completions",status="401"' in httpx.get(
            f"{url.removesuffix('/v1')}/metrics", headers={"Authorization": "Bearer sekrit"}).text
        asks = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
        preflight = httpx.options(f"{url}/chat/completions", headers={"Origin": "http://app.example", **asks})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://app.example"
        other = httpx.options(f"{url}/chat/completions", headers={"Origin": "http://elsewhere.example", **asks})
        assert "access-control-allow-origin" not in other.headers
    finally:
        server.close()


def test_any_origin_by_default_and_no_key(toy_server):
    preflight = httpx.options(f"{toy_server.url}/v1/chat/completions", headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"
    assert httpx.get(f"{toy_server.url}/v1/models", headers={"Authorization": "Bearer anything"}).status_code == 200


def test_a_full_queue_answers_429_with_retry_after():
    server = LoopbackServer(["--preset", "toy", "-t", "1", "-n", "2", "--concurrency", "1", "--max-queue", "1"],
                            start_engine=False)
    try:
        problem = toy_dataset().problems[0].problem
        url = f"{server.url}/v1/completions"
        waiting = {}
        threads = [threading.Thread(target=lambda i=i: waiting.__setitem__(i, httpx.post(url, json={"prompt": problem},
                                                                                           timeout=120)))
                   for i in range(2)]
        for t in threads:
            t.start()
        while server.metric("kvrescue_requests_queued") < 2:  # both held: the engine has not started
            time.sleep(0.01)
        refused = httpx.post(url, json={"prompt": problem})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_exceeded"
        server.served.engine.start()
        for t in threads:
            t.join()
        assert [waiting[i].status_code for i in range(2)] == [200, 200]
        server.wait_idle()
    finally:
        server.close()


def committed_tokens(engine) -> int:
    with engine.cond:
        return sum(job.tokens for job in engine.running)


def endless_args(model) -> list[str]:
    """A model that repeats one token never ends a trajectory by itself: only its client leaving ends a request
    (or the server stopping)."""
    return ["--base", str(model.path), "--helper", str(model.path), "--mode", "helper", "-n", "1", "-t", "1",
            "--prompt-template", "{problem}", "--max-tokens", "4096", "--max-steps", "100000", "--max-step-tokens", "4",
            "--concurrency", "2"]


@pytest.fixture
def endless_server(looping_model):
    server = LoopbackServer(endless_args(looping_model))
    yield server
    server.close()


def test_a_client_killed_mid_stream_frees_its_slot(endless_server):
    server = endless_server
    with httpx.stream("POST", f"{server.url}/v1/completions", json={"prompt": "abc", "stream": True},
                      timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert server.metric("kvrescue_requests_in_flight") == 1
        # a helper-mode server loads no base: its slot has no budget and no base cells, /tokenize reads the helper
        (slot,) = httpx.get(f"{server.url}/slots").json()
        assert slot["kvrescue"]["budget"] is None and slot["kvrescue"]["base_tokens"] == 0
        assert slot["kvrescue"]["last_source"] in (None, "helper")
        assert httpx.get(f"{server.url}/props").json()["kvrescue"]["tokenizer"] == "helper"
        assert httpx.post(f"{server.url}/tokenize", json={"content": "abc"}).json()["tokens"] == \
            server.served.engine.models.helper.tokenize("abc").tolist()
    server.wait_idle()
    assert server.metric("kvrescue_requests_cancelled_total") == 1
    assert httpx.get(f"{server.url}/slots").json() == []


def test_a_client_killed_mid_request_frees_its_slot_without_streaming(endless_server):
    server = endless_server
    body = json.dumps({"prompt": "abc"}).encode()
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=60) as connection:  # a client that just hangs up
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        while not committed_tokens(server.served.engine):  # the request holds its slot, rounds under way
            time.sleep(0.01)
        assert server.metric("kvrescue_requests_in_flight") == 1
    server.wait_idle()
    assert server.metric("kvrescue_requests_cancelled_total") == 1
    assert 'kvrescue_responses_total{endpoint="/v1/completions",status="200"}' not in httpx.get(f"{server.url}/metrics").text


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_server_ends_each_request_and_exits(looping_model, stop_signal):
    """SIGTERM or SIGINT with a stream and a whole response in flight: the stream gets an error event and [DONE],
    the whole response a 503, and the process exits (a generous bound, a guard against a hang, not a speed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen([sys.executable, "-m", "kvrescue_local", "serve", "--port", str(port),
                                *endless_args(looping_model)], stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert "serving" in next(line for line in process.stderr if "serving" in line or "Error" in line)
        for _ in range(600):  # the socket is bound before "serving ... on http://...", and listens once uvicorn has started
            try:
                httpx.get(f"{url}/health")
                break
            except httpx.ConnectError:
                time.sleep(0.05)
        streamed, whole = [], {}
        started = threading.Event()

        def read_stream() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": "abc", "stream": True},
                              timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        streamed.append(line.removeprefix("data:").strip())
                        started.set()

        readers = [threading.Thread(target=read_stream),
                   threading.Thread(target=lambda: whole.update(r=httpx.post(f"{url}/v1/completions",
                                                                             json={"prompt": "abc"}, timeout=60)))]
        for reader in readers:
            reader.start()
        assert started.wait(60)
        while not re.search(r"^kvrescue_requests_in_flight 2", httpx.get(f"{url}/metrics").text, re.M):
            time.sleep(0.01)
        process.send_signal(stop_signal)
        process.wait(timeout=5)
        for reader in readers:
            reader.join(5)
        assert streamed[-1] == "[DONE]" and "shutting down" in json.loads(streamed[-2])["error"]["message"]
        assert json.loads(streamed[0])["choices"][0]["text"]
        assert whole["r"].status_code == 503 and whole["r"].json()["error"]["type"] == "server_error"
        assert "Traceback" not in process.stderr.read()
    finally:
        process.kill()
        process.wait()


@pytest.mark.realmodel
def test_the_real_05b_helper_answers_the_openai_client():
    server = LoopbackServer(["--preset", "coder", "--mode", "helper", "-n", "1", "-t", "1", "--max-tokens", "48",
                             "--concurrency", "2", "--prompt-tokens", "256"])
    try:
        api = client(server)
        question = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
        whole = api.chat.completions.create(model="coder", messages=question, seed=1, max_tokens=48)
        chunks = list(api.chat.completions.create(model="coder", messages=question, seed=1, max_tokens=48, stream=True))
        assert whole.choices[0].message.content
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
        assert {c.choices[0].model_extra["kvrescue"]["source"] for c in chunks[:-1]} == {"helper"}
        assert whole.usage.model_extra["helper_tokens"] > 0 and whole.usage.model_extra["base_tokens"] == 0
        server.wait_idle()
    finally:
        server.close()
