"""Render chat messages so that what a user wrote can never become a special token.

A chat template writes role markers (``<|im_start|>user``) that tokenize to special
tokens; a message that contains the same text must not (else a user could forge a
system turn). The template is rendered with each message's content and name replaced
by a marker no client can guess; the rendered text is cut at the markers, the
template's own pieces are tokenized with special tokens honoured and the user's
pieces with special tokens split into plain text (``split_special_tokens``).

A template that inspects a content's text (a reasoning template that splits it at
``</think>``) sees the marker instead; such templates render the content whole.
"""

from __future__ import annotations

import re
import secrets


def render_chat(tokenizer, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
    """``(text, token ids)`` of ``messages`` with the assistant's turn opened.

    Raises what ``apply_chat_template`` raises (the template's own checks).
    """
    nonce = secrets.token_hex(8)
    user_text: dict[str, str] = {}
    marked = []
    for i, message in enumerate(messages):
        message = dict(message)
        for key in ("content", "name"):
            if key in message:
                mark = f"<<{nonce}:{key}:{i}>>"
                user_text[mark] = message[key]
                message[key] = mark
        marked.append(message)
    rendered = tokenizer.apply_chat_template(marked, tokenize=False, add_generation_prompt=True)
    text, token_ids = [], []
    # Odd pieces are the markers (the pattern's one group), even pieces the template's.
    pieces = re.split(f"(<<{nonce}:(?:content|name):\\d+>>)", rendered)
    for i, piece in enumerate(pieces):
        if not piece:
            continue
        from_user = i % 2 == 1
        piece = user_text[piece] if from_user else piece
        text.append(piece)
        # The template writes BOS and the role markers itself.
        token_ids += tokenizer.encode(
            piece, add_special_tokens=False, split_special_tokens=from_user
        )
    return "".join(text), token_ids
