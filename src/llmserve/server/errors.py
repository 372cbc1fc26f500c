"""Errors in OpenAI's envelope: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def param_of(message: str) -> str | None:
    """The parameter a validation message is about: SamplingParams messages start with the
    field's name."""
    from dataclasses import fields

    from llmserve.sampling_params import SamplingParams

    name = message.split(" ", 1)[0].split("[", 1)[0].rstrip(":")
    known = {f.name for f in fields(SamplingParams)} | _REQUEST_FIELDS
    return name if name.split(".", 1)[0] in known else None


# Request fields whose messages start with their (dotted) name, as SamplingParams' do.
_REQUEST_FIELDS = frozenset({"response_format", "guided_json", "guided_regex", "guided_choice",
                             "guided_grammar", "tool_choice", "function_call", "tools",
                             "functions", "reasoning_effort", "audio", "verbosity",
                             "web_search_options", "modalities", "guided_decoding_backend",
                             "guided_whitespace_pattern", "stream_options", "top_logprobs"})
