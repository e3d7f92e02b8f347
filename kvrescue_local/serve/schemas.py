"""The request bodies of /v1/chat/completions and /v1/completions (OpenAI's fields, plus the rescue
settings as extension fields) and the chunks and responses sent back; those of /tokenize and /detokenize
(llama-server's fields).

The rescue settings a request may set are made from the settings schema (settings.SETTINGS: those with a request
name), each checked by its setting's own kind, so a request cannot ask what the command line refuses; the limits of
the running server (-n, --max-budget, --max-tokens, --memory) are Served's checks (app.py). A JSON value of the wrong
type is refused, not coerced (pydantic's strict mode: an integer is a number too), and so is a field this server does
not know: docs/serving.md lists every OpenAI field as supported, ignored (IGNORED: accepted, without effect) or
refused."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import click
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from ..rescue.rules import CHOICE_SPECS
from ..settings import BY_FIELD, SETTINGS, checked

EXTENSION = "kvrescue"  # the key of the extension field on chunks and choices: standard clients ignore it
MAX_MESSAGES = 1024  # the problem is the last user message; a longer chat is no request this server answers
MAX_STOPS = 4  # OpenAI's limit on stop sequences
# OpenAI's fields accepted without effect (docs/serving.md): sampling penalties (candidates sample with the run's
# temperature and top-p, as solve does) and what concerns OpenAI's own service
IGNORED = ("frequency_penalty", "presence_penalty", "logit_bias", "metadata", "store", "user", "safety_identifier",
           "prompt_cache_key", "service_tier", "reasoning_effort", "verbosity", "parallel_tool_calls",
           "stream_options")


def option(kind: click.ParamType) -> AfterValidator:
    """A field checked by the type of the command-line option that sets its default."""
    return AfterValidator(lambda value: value if value is None else checked(kind, value))


def unsupported(*neutral) -> AfterValidator:
    """An OpenAI field whose effect this server cannot give (tool calls, log-probabilities, a JSON schema): refused
    unless it asks for nothing (None or one of `neutral`), as a client relying on it would act on an answer that
    ignored it."""
    def check(value):
        if value is not None and value not in neutral:
            raise ValueError("this server does not support it (the engine answers in committed steps of text): "
                             "leave it out")
        return value
    return AfterValidator(check)


def refuse_choice(value):
    if value is not None:
        raise ValueError(f"choice is gone: commit rules are specs now, send \"rule\": "
                         f"\"{CHOICE_SPECS.get(str(value), 'judge')}\" (docs/serving.md)")
    return value


class OpenAIFields(BaseModel):
    """OpenAI's fields that every completion request may set; a field of another name, or a value of another JSON
    type, is refused."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    logprobs: Annotated[Any, unsupported(False, 0)] = None
    # the field that named a rule before rules were specs: refused, naming the spec that says the same
    choice: Annotated[Any, AfterValidator(refuse_choice)] = None

    @field_validator("stop", mode="before")
    @classmethod
    def at_most_max_stops(cls, stop):
        """Checked before the union's branches, which would each name their own failure (stop.str, ...)."""
        if isinstance(stop, list) and len(stop) > MAX_STOPS:
            raise ValueError(f"{len(stop)} stop sequences, over the {MAX_STOPS} a request may give (OpenAI's limit): "
                             f"give at most {MAX_STOPS}")
        return stop

    def stops(self) -> list[str]:
        """The stop sequences; an empty one is dropped, alone as in a list (it would end every answer at once)."""
        if self.stop is None:
            return []
        return [s for s in ([self.stop] if isinstance(self.stop, str) else self.stop) if s]

    @property
    def token_limit(self) -> int | None:
        """The committed tokens the request may take: max_tokens (chat: or max_completion_tokens, its new name)."""
        return self.max_tokens


# OpenAI's fields, the ignored ones, and the settings a request may set (the server's are their defaults)
RescueFields = create_model(
    "RescueFields", __base__=OpenAIFields, **{name: (Any, None) for name in IGNORED},
    **{setting.request: (Annotated[setting.json | None, option(setting.kind)], None)
       for setting in SETTINGS if setting.request})


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | None = None  # an assistant message that called tools has none

    @field_validator("content", mode="before")
    @classmethod
    def text_of_parts(cls, content):
        """Content as a list of parts is the text of its text parts, one per line; a part of another kind (an
        image, audio, a file) is refused, as this server reads text only."""
        if not isinstance(content, list):
            return content
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"a content part of type {kind!r}: this server reads text parts only, "
                                 '{"type": "text", "text": "..."}')
            texts.append(part["text"])
        return "\n".join(texts)


class ChatRequest(RescueFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: Annotated[int | None, option(BY_FIELD["max_tokens"].kind)] = None  # max_tokens' new name
    top_logprobs: Annotated[Any, unsupported(0)] = None
    tools: Annotated[Any, unsupported([])] = None
    tool_choice: Annotated[Any, unsupported("none")] = None
    functions: Annotated[Any, unsupported([])] = None
    function_call: Annotated[Any, unsupported("none")] = None
    response_format: Annotated[Any, unsupported({"type": "text"})] = None
    audio: Annotated[Any, unsupported()] = None
    modalities: Annotated[Any, unsupported(["text"])] = None
    prediction: Annotated[Any, unsupported()] = None
    web_search_options: Annotated[Any, unsupported()] = None

    @model_validator(mode="after")
    def one_token_limit(self) -> ChatRequest:
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise ValueError(f"max_tokens={self.max_tokens} and max_completion_tokens={self.max_completion_tokens} "
                             "disagree: give one of them (max_completion_tokens is max_tokens' new name)")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def problem(self) -> str | None:
        """The problem is the last user message: the engine wraps it in the model's own prompt template."""
        users = [m.content or "" for m in self.messages if m.role == "user"]
        return users[-1] if users else None


class CompletionRequest(RescueFields):
    prompt: str
    echo: Annotated[Any, unsupported(False)] = None
    best_of: Annotated[Any, unsupported(1)] = None
    suffix: Annotated[Any, unsupported("")] = None

    def problem(self) -> str:
        return self.prompt


class TokenizeRequest(BaseModel):
    """llama-server's /tokenize: `content` in the tokens of the model that reads prompts (Served.tokenizer); as the
    completions' bodies, a field of another name or a value of another JSON type is refused."""

    model_config = ConfigDict(extra="forbid", strict=True)

    content: str
    add_special: bool = False  # the vocabulary's BOS/EOS, as llama-server; the server's prompts add none
    parse_special: bool = True  # control tokens written in the text (<|im_start|>) are one token each
    with_pieces: bool = False  # each token as {"id", "piece"}


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    tokens: list[int]
