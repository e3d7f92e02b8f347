"""The request bodies of /v1/chat/completions and /v1/completions (OpenAI's fields, plus the rescue
settings as extension fields) and the chunks and responses sent back."""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from ..rescue import MODES
from ..rescue.config import CHOICES

EXTENSION = "kvrescue"  # the key of the extension field on chunks and choices: standard clients ignore it


class RescueFields(BaseModel):
    """What every completion request may set; unknown fields are ignored, as OpenAI's own server does with
    fields it does not use (logprobs, user, ...)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    # the rescue settings: defaults are the server's
    mode: Literal[MODES] | None = None  # type: ignore[valid-type]
    n: int | None = Field(None, ge=1)
    budget: int | None = Field(None, ge=1)
    policy: str | None = None
    choice: Literal[CHOICES] | None = None  # type: ignore[valid-type]

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatRequest(RescueFields):
    messages: list[ChatMessage] = Field(min_length=1)

    def problem(self) -> str | None:
        """The problem is the last user message: the engine wraps it in the model's own prompt template."""
        users = [m.content for m in self.messages if m.role == "user"]
        return users[-1] if users else None


class CompletionRequest(RescueFields):
    prompt: str

    def problem(self) -> str:
        return self.prompt
