"""The settings schema (kvrescue_local/settings.py): every setting is an option of the commands that run the
rescue and, where a request may set it, a field of the served request with the same check; a refused value is named
in the words of the interface it came through; the request refuses wrong JSON types and unknown fields; the help
shows the options in their groups; docs/usage.md's reference is the schema's."""

import re
from pathlib import Path

import click
import httpx
import pytest
from pydantic import ValidationError
from test_hardening import FAST, PROBLEM, invoke, one_error_line

pytest.importorskip("fastapi")

from kvrescue_local.cli import main  # noqa: E402
from kvrescue_local.cli.common import HEADINGS, settings_reference  # noqa: E402
from kvrescue_local.errors import KVRescueError  # noqa: E402
from kvrescue_local.serve.schemas import IGNORED, ChatRequest, CompletionRequest  # noqa: E402
from kvrescue_local.settings import GROUPS, SETTINGS, Finite  # noqa: E402
from serving import LoopbackServer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SERVER_ARGS = ["--preset", "toy", "-t", "1", "-n", "2", "--concurrency", "2", "--prompt-tokens", "128",
               "--max-tokens", "24", "--max-step-tokens", "12"]
COMMANDS = {"solve": main.commands["solve"], "serve": main.commands["serve"],
            "bench run": main.commands["bench"].commands["run"]}


@pytest.fixture(scope="module")
def server():
    server = LoopbackServer(SERVER_ARGS)
    yield server
    server.close()


def complete(server, **fields) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json={"prompt": PROBLEM, **fields}, timeout=120)


def options_of(command: click.Command) -> dict[str, click.Option]:
    return {flag: param for param in command.params if isinstance(param, click.Option)
            for flag in (*param.opts, *param.secondary_opts)}


def refused_value(kind: click.ParamType):
    """A value just outside a kind's range."""
    if isinstance(kind, click.IntRange):
        return kind.min - 1 if kind.min is not None else kind.max + 1
    if isinstance(kind, Finite):
        return kind.low - 1 if kind.low is not None else kind.high + 1
    return "bogus"


def test_a_budget_too_small_for_the_window_is_named_as_the_request_field(server):
    response = complete(server, budget=1)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "budget"
    assert "budget 1 leaves no room for the policy" in error["message"] and "--" not in error["message"]
    assert "raise budget to at least 9 or lower the server's window" in error["message"]


def test_a_setting_a_request_cannot_set_is_named_as_the_servers(server):
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a=1 " * 2000}, timeout=120)
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "one step of the server's max-step-tokens 12 must fit after it" in error["message"]
    assert "--" not in error["message"]


def test_the_command_line_names_the_same_refusal_by_its_option(tmp_path):
    assert one_error_line(invoke("solve", *FAST, "--budget", 1, PROBLEM)).startswith(
        "Error: --budget 1 leaves no room for the policy")
    # bench run sweeps the budget: its option for it is --budgets
    message = one_error_line(invoke("bench", "run", "--dataset", "toy", "--limit", 1, *FAST, "--budgets", 1,
                                    "--results", tmp_path / "r.jsonl"))
    assert message.startswith("Error: --budgets 1 leaves no room for the policy")


@pytest.mark.parametrize("field, value", [("max_tokens", True), ("n", True), ("stream", "yes"), ("seed", "7"),
                                          ("temperature", "0.5"), ("top_p", "1"), ("budget", 64.0), ("mode", 1)])
def test_a_value_of_the_wrong_json_type_is_refused_not_coerced(server, field, value):
    response = complete(server, **{field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field and response.json()["error"]["message"].startswith(f"{field}: ")


def test_an_integer_is_a_number_and_an_ignored_field_is_accepted(server):
    response = complete(server, temperature=1, top_p=1, user="someone", presence_penalty=0.5, max_tokens=8)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"]


@pytest.mark.parametrize("path, body", [("completions", {"prompt": PROBLEM, "budgt": 1}),
                                        ("completions", {"prompt": PROBLEM, "top_k": 40}),
                                        ("chat/completions", {"messages": [{"role": "user", "content": PROBLEM}],
                                                              "grammar": "root ::= x"})])
def test_an_unknown_request_field_is_refused_naming_it(server, path, body):
    unknown = [name for name in body if name not in ("prompt", "messages")][0]
    response = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=120)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == unknown
    assert error["message"].startswith(f"{unknown}: this server does not know this field")


def test_docs_list_the_ignored_fields_the_request_accepts():
    serving = (ROOT / "docs/serving.md").read_text()
    listed = set()
    for row in re.findall(r"^\| (.*) \| ignored.*\|$", serving, flags=re.M):
        listed |= set(re.findall(r"`([a-z_]+)`", row))
    assert listed == set(IGNORED)
    for model in (ChatRequest, CompletionRequest):
        assert set(IGNORED) <= set(model.model_fields)


@pytest.mark.parametrize("name", COMMANDS)
def test_help_shows_the_common_options_then_the_groups_in_order(name):
    path = name.split()
    result = invoke(*path, "--help")
    assert result.exit_code == 0, result.output
    headings = re.findall(r"^(\S[^\n]*):$", result.output, flags=re.M)
    assert headings == [HEADINGS[group] for group in GROUPS]
    assert headings[0] == "Options" and headings[-1] == "llama.cpp options"
    sections = dict(zip(headings, re.split(r"^\S[^\n]*:$", result.output, flags=re.M)[1:]))
    assert "--window" in sections["Eviction options"] and "--temp" in sections["Sampling options"]
    assert "-ngl" in sections["llama.cpp options"] and "--tau-entropy" in sections["Detector options"]
    assert "--preset" in sections["Options"] and "--window" not in sections["Options"]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.field)
def test_every_setting_is_an_option_and_a_request_field_with_the_same_check(setting):
    for name, command in COMMANDS.items():
        options = options_of(command)
        swept = name == "bench run" and setting.axis is not None  # an axis of its own takes the option's place
        flag = setting.axis if swept else setting.flag
        assert flag in options, f"{name} has no {flag}"
        if not swept:
            option = options[flag]
            assert option.name == setting.param and set(setting.flags[0].split("/")) | set(setting.flags[1:]) == \
                set(option.opts) | set(option.secondary_opts)
            assert setting.kind is None or option.type is setting.kind
    if setting.request is None:
        return
    bad = refused_value(setting.kind)
    with pytest.raises((click.BadParameter, KVRescueError)) as on_the_command_line:
        setting.kind.convert(bad, None, None)
    said = getattr(on_the_command_line.value, "message", str(on_the_command_line.value))
    for model in (ChatRequest, CompletionRequest):
        assert setting.request in model.model_fields
        body = {"prompt": PROBLEM, "messages": [{"role": "user", "content": PROBLEM}], setting.request: bad}
        with pytest.raises(ValidationError) as in_a_request:
            model.model_validate({k: v for k, v in body.items() if k in model.model_fields})
        (error,) = in_a_request.value.errors()
        assert error["loc"] == (setting.request,) and said in error["msg"]


def test_the_usage_docs_hold_the_schemas_reference():
    usage = (ROOT / "docs/usage.md").read_text()
    table = re.search(r"<!-- settings reference: tests/test_settings.py -->\n(.*?)\n<!-- end -->", usage, flags=re.S)
    assert table is not None, "docs/usage.md has no settings reference"
    assert table.group(1) + "\n" == settings_reference(), (
        "docs/usage.md's settings table differs from the schema: paste kvrescue_local.cli.common.settings_reference()")
