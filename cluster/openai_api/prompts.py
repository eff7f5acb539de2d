"""Turn a request into the prompt the engine takes: its text (when there is one) and token ids."""

from __future__ import annotations

from jinja2 import TemplateError

from splitserve.cluster.openai_api.errors import invalid_request
from splitserve.cluster.openai_api.protocol import ChatCompletionRequest, CompletionRequest


def completion_prompt(
    req: CompletionRequest, tokenizer, vocab_size: int
) -> tuple[str | None, list[int]]:
    """A text prompt is tokenized as the model expects (BOS included where the tokenizer adds
    one); a token-id prompt is taken as is, with text None. ``vocab_size`` is the model's."""
    if isinstance(req.prompt, str):
        text, token_ids = req.prompt, tokenizer.encode(req.prompt)
    else:
        text, token_ids = None, list(req.prompt)
    _check_token_ids(token_ids, vocab_size, "prompt")
    return text, token_ids


def chat_prompt(
    req: ChatCompletionRequest, tokenizer, vocab_size: int | None = None
) -> tuple[str, list[int]]:
    """Apply the tokenizer's chat template with the assistant's turn opened."""
    if not getattr(tokenizer, "chat_template", None):
        raise invalid_request(
            "this model's tokenizer has no chat template: use /v1/completions with a prompt",
            "messages",
        )
    messages = [_template_message(m) for m in req.messages]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except (TemplateError, ValueError) as e:  # the template's own checks (role order, ...)
        raise invalid_request(f"the chat template rejected the messages: {e}", "messages") from e
    # The template writes BOS and the role markers itself.
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    _check_token_ids(token_ids, vocab_size, "messages")
    return text, token_ids


def _template_message(message) -> dict[str, str]:
    # "developer" is OpenAI's newer name for "system"; chat templates know only the latter.
    role = "system" if message.role == "developer" else message.role
    out = {"role": role, "content": message.content or ""}
    if message.name is not None:
        out["name"] = message.name
    return out


def _check_token_ids(token_ids: list[int], vocab_size: int | None, param: str) -> None:
    if not token_ids:
        raise invalid_request("the prompt is empty: give at least one token", param)
    if vocab_size is None:
        return
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise invalid_request(
            f"prompt token ids {bad[:5]} are out of range: ids must be in [0, {vocab_size})", param
        )
