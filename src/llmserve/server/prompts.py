"""A request's prompts as token ids: a text that cannot fit the context window is refused
before it is tokenized, and long texts are tokenized off the event loop (``TokenizerPool``).
Bad prompts are 400s naming the field."""

from __future__ import annotations

from typing import Any

from llmserve.engine.async_llm import AsyncLLM
from llmserve.server.errors import bad_request
from llmserve.server.tokenizing import TokenizerPool
from llmserve.tokenizer.chat_template import ChatTemplateError


def check_length(engine: AsyncLLM, chars: int, param: str) -> None:
    """Refuse, without tokenizing, a text that cannot fit the context window: no token
    covers more than ``longest_token_chars`` characters."""
    limit = engine.max_model_len * engine.tokenizer.longest_token_chars
    if engine.max_model_len and chars > limit:
        raise bad_request(
            f"the prompt has {chars} characters; with a context window of "
            f"{engine.max_model_len} tokens it cannot fit (at most {limit} characters: "
            f"no token is longer than {engine.tokenizer.longest_token_chars})",
            param=param, code="context_length_exceeded")


async def encode_prompt(engine: AsyncLLM, tokenizers: TokenizerPool, text: str,
                  add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
    check_length(engine, len(text), param)
    return await tokenizers.encode(text, add_special_tokens)


async def encode_chat(engine: AsyncLLM, tokenizers: TokenizerPool,
                       messages: list[dict[str, Any]], add_generation_prompt: bool,
                       variables: dict[str, Any] | None = None) -> list[int]:
    check_length(engine, sum(len(m.get("content") or "") for m in messages), "messages")
    try:
        return await tokenizers.encode_chat(messages, add_generation_prompt, variables or {})
    except (ChatTemplateError, ValueError) as e:
        raise bad_request(str(e), param="messages") from None


async def completion_prompts(engine: AsyncLLM, tokenizers: TokenizerPool,
                              prompt) -> list[tuple[str | None, list[int]]]:
    if isinstance(prompt, str):
        return [(prompt, await encode_prompt(engine, tokenizers, prompt))]
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [(None, list(prompt))]
    if all(isinstance(p, str) for p in prompt):
        return [(p, await encode_prompt(engine, tokenizers, p)) for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        return [(None, list(p)) for p in prompt]
    raise bad_request("prompt must be a string, a list of strings, a list of token ids or a "
                      "list of token-id lists", param="prompt")
