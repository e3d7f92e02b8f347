"""The OpenAI-compatible server against the bundled toy preset, through the official openai client."""

import dataclasses
import json
import socket
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from kvrescue_local.bench.datasets import toy_dataset  # noqa: E402
from kvrescue_local.cli.serve import build_served, serve  # noqa: E402
from kvrescue_local.rescue import Rescue, longest_prompt  # noqa: E402
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


def solved(served, problem: str, seed: int):
    """What `solve` gives for the problem at this seed with the server's settings (one problem, one slot)."""
    config = dataclasses.replace(served.config, seed=seed)
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
    assert httpx.get(f"{toy_server.url}/health").json() == {"status": "ok"}


def test_stop_and_max_tokens_end_a_request_early(toy_server, toy_solver):
    problem = toy_dataset().problems[1].problem
    expected = solved(toy_solver, problem, seed=2)
    api = client(toy_server)
    first_step = expected.steps[0].text
    stop = first_step[len(first_step) // 2:][:3]
    cut = api.completions.create(model="toy", prompt=problem, seed=2, stop=[stop])
    assert cut.choices[0].text == expected.text[:expected.text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    short = api.completions.create(model="toy", prompt=problem, seed=2, max_tokens=1)
    assert short.choices[0].text == first_step and short.choices[0].finish_reason == "length"
    toy_server.wait_idle()


def test_32_concurrent_streams_each_equal_solve_with_its_seed(toy_server, toy_solver):
    problems = [p.problem for p in toy_dataset().problems[:32]]
    api = client(toy_server)
    got: dict[int, list] = {}

    def ask(i: int) -> None:
        got[i] = list(api.chat.completions.create(model="toy", messages=[{"role": "user", "content": problems[i]}],
                                                  seed=100 + i, stream=True))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(32))
    for i, chunks in got.items():
        expected = solved(toy_solver, problems[i], seed=100 + i)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text, i
        assert chunks[-1].usage.model_extra["helper_tokens"] == expected.tokens["helper"], i
    toy_server.wait_idle()


def test_errors_are_openai_bodies_and_leave_nothing_in_the_engine(toy_server):
    url = f"{toy_server.url}/v1/completions"
    problem = toy_dataset().problems[0].problem
    cases = {
        "bad json": dict(content=b"{not json", headers={"content-type": "application/json"}),
        "wrong type": dict(json={"prompt": problem, "max_tokens": "many"}),
        "unknown mode": dict(json={"prompt": problem, "mode": "fast"}),
        "unknown policy": dict(json={"prompt": problem, "mode": "bon", "policy": "lru"}),
        "too long": dict(json={"prompt": "a=1 " * 2000}),
        "over max_tokens": dict(json={"prompt": problem, "max_tokens": 10 ** 6}),
    }
    for name, request in cases.items():
        response = httpx.post(url, **request)
        assert response.status_code == 400, name
        assert response.json()["error"]["message"], name
    with pytest.raises(openai.BadRequestError, match="mode"):
        client(toy_server).completions.create(model="toy", prompt=problem, extra_body={"mode": "fast"})

    # N=8 needs 9 sequences per problem: 32 slots do not fit, the engine refuses it alone; the others go on
    results = {}

    def post(name: str, body: dict) -> None:
        results[name] = httpx.post(url, json=body, timeout=120)

    threads = [threading.Thread(target=post, args=("n8", {"prompt": problem, "n": 8})),
               threading.Thread(target=post, args=("ok", {"prompt": problem, "seed": 1}))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["n8"].status_code == 500 and "concurrency 32 does not fit" in results["n8"].json()["error"]["message"]
    assert results["ok"].status_code == 200 and results["ok"].json()["choices"][0]["text"]
    toy_server.wait_idle()


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


@pytest.fixture
def endless_server(looping_model):
    """A model that repeats one token never ends a trajectory by itself: only its client leaving ends a request."""
    server = LoopbackServer(["--base", str(looping_model.path), "--helper", str(looping_model.path), "--mode",
                             "helper", "-n", "1", "-t", "1", "--prompt-template", "{problem}", "--max-tokens",
                             "100000", "--max-steps", "100000", "--max-step-tokens", "4", "--concurrency", "2"])
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
    server.wait_idle()
    assert server.metric("kvrescue_requests_cancelled_total") == 1


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
