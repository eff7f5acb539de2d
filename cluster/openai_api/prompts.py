"""Turn a request into the prompt the engine takes: its text (when there is one) and token ids.

Text is measured before it is tokenized: a prompt with more characters than
``max_prompt_chars`` allows cannot fit the context whatever its tokens, and is
rejected without spending the tokenizer's time on it.
"""

from __future__ import annotations

from jinja2 import TemplateError

from splitserve.cluster.openai_api.chat_template import render_chat
from splitserve.cluster.openai_api.errors import invalid_request
from splitserve.cluster.openai_api.protocol import ChatCompletionRequest, CompletionRequest


def max_prompt_chars(tokenizer, max_model_len: int) -> int:
    """The most characters a prompt that fits ``max_model_len`` can have: every token
    stands for at most as many characters as the longest vocabulary entry has."""
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    return max(longest, 1) * (max_model_len - 1)


def completion_prompt(
    req: CompletionRequest, tokenizer, vocab_size: int, max_chars: int | None = None
) -> tuple[str | None, list[int]]:
    """A text prompt is tokenized as the model expects (BOS included where the tokenizer adds
    one); a token-id prompt is taken as is, with text None. ``vocab_size`` is the model's."""
    if isinstance(req.prompt, str):
        _check_chars(len(req.prompt), max_chars, "prompt")
        text, token_ids = req.prompt, tokenizer.encode(req.prompt)
    else:
        text, token_ids = None, list(req.prompt)
    _check_token_ids(token_ids, vocab_size, "prompt")
    return text, token_ids


def chat_prompt(
    req: ChatCompletionRequest,
    tokenizer,
    vocab_size: int | None = None,
    max_chars: int | None = None,
) -> tuple[str, list[int]]:
    """Apply the tokenizer's chat template with the assistant's turn opened; what the
    messages say is tokenized as plain text (``chat_template.py``)."""
    if not getattr(tokenizer, "chat_template", None):
        raise invalid_request(
            "this model's tokenizer has no chat template: use /v1/completions with a prompt",
            "messages",
        )
    messages = [_template_message(m) for m in req.messages]
    _check_chars(
        sum(len(m["content"]) + len(m.get("name", "")) for m in messages), max_chars, "messages"
    )
    try:
        text, token_ids = render_chat(tokenizer, messages)
    except (TemplateError, ValueError) as e:  # the template's own checks (role order, ...)
        raise invalid_request(f"the chat template rejected the messages: {e}", "messages") from e
    _check_token_ids(token_ids, vocab_size, "messages")
    return text, token_ids


def _template_message(message) -> dict[str, str]:
    # "developer" is OpenAI's newer name for "system"; chat templates know only the latter.
    role = "system" if message.role == "developer" else message.role
    out = {"role": role, "content": message.content or ""}
    if message.name is not None:
        out["name"] = message.name
    return out


def _check_chars(num_chars: int, max_chars: int | None, param: str) -> None:
    if max_chars is not None and num_chars > max_chars:
        raise invalid_request(
            f"the prompt has {num_chars} characters, more than any prompt that fits this "
            f"model's context can have ({max_chars}); shorten it",
            param,
            "context_length_exceeded",
        )


def _check_token_ids(token_ids: list[int], vocab_size: int | None, param: str) -> None:
    if not token_ids:
        raise invalid_request("the prompt is empty: give at least one token", param)
    if vocab_size is None or (min(token_ids) >= 0 and max(token_ids) < vocab_size):
        return
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        shown = ", ".join(_short(t) for t in bad[:5])
        raise invalid_request(
            f"prompt token ids [{shown}] are out of range: ids must be in [0, {vocab_size})", param
        )


def _short(value: int) -> str:
    if value.bit_length() > 256:
        return f"<an integer of {value.bit_length()} bits>"
    text = str(value)
    return text if len(text) <= 24 else f"{text[:10]}...({len(text)} digits)"
