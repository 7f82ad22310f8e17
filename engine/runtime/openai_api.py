"""The OpenAI API's request bodies and error shape, as the server reads and writes them.

``POST /v1/completions`` takes a :class:`CompletionRequest`, ``POST /v1/chat/completions`` a
:class:`ChatRequest` (its messages rendered with ChatML, :func:`render_chat`); both share the
sampling fields of :class:`SamplingFields`. Unknown fields are ignored, as OpenAI clients send
fields this server does not use. Refusals are :class:`APIError`, whose body is OpenAI's
``{"error": {"message", "type", "param", "code"}}`` (:func:`error_body`). :class:`StopStrings`
applies the ``stop`` field to generated text.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

CHAT_END = "<|im_end|>"
"""ChatML's end of a turn: a chat answer stops there."""


class APIError(Exception):
    """A request the server refuses, with the OpenAI error fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        """The error as an HTTP response: its status and OpenAI's error body."""
        return JSONResponse(status_code=self.status, content=error_body(self.message, self.type, self.param, self.code))


def error_body(message: str, type: str, param: str | None, code: str | None) -> dict[str, Any]:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    """``stream_options``: with ``include_usage`` a stream ends with a usage chunk."""

    include_usage: bool = False


class SamplingFields(BaseModel):
    """The fields both completion endpoints share (OpenAI's names and ranges).

    Raises:
        pydantic.ValidationError: a value out of range (the server answers 400).
    """

    model_config = ConfigDict(extra="ignore")  # clients send fields we do not use (logit_bias, ...)

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    user: str | None = None

    def stops(self) -> list[str]:
        """The ``stop`` strings as a list.

        Raises:
            APIError: 400, an empty stop string.
        """
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise APIError(400, "stop strings must not be empty", param="stop")
        return stops


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: one prompt (text, token ids, or a list holding one of those)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)


class TextPart(BaseModel):
    """A text part of a chat message's content."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat turn: its role and its text (a string or text parts)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class ChatRequest(SamplingFields):
    """``POST /v1/chat/completions``: one conversation; ``max_completion_tokens`` wins over
    ``max_tokens`` (both None: the server's default)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)


def render_chat(messages: list[ChatMessage]) -> str:
    """ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, then the opening of
    the assistant's turn."""
    parts = []
    for m in messages:
        text = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
        parts.append(f"<|im_start|>{m.role}\n{text}<|im_end|>\n")
    return "".join(parts) + "<|im_start|>assistant\n"


class StopStrings:
    """Cuts generated text before the first stop string, holding back the tail that could still
    become one (as vLLM's detokenizer does)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""

    def push(self, piece: str) -> tuple[str, bool]:
        """New text to emit and whether a stop string ended the output."""
        self.pending += piece
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        cut = max(len(self.pending) - self.hold, 0)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        """The text held back, once the output has ended without a stop string."""
        out, self.pending = self.pending, ""
        return out
