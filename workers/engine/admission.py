"""What an engine admits and how much room it has: the context length, the EOS ids, the
KV block count, and prompt validation."""

from __future__ import annotations

from splitserve.config import EngineConfig
from splitserve.errors import InvalidRequestError
from splitserve.workers.kv.layout import KVLayout


def max_model_len(config: EngineConfig, hf_config) -> int:
    limit = hf_config.max_position_embeddings
    asked = config.scheduler.max_model_len
    if asked is not None and asked > limit:
        raise ValueError(
            f"max_model_len={asked} exceeds the model's max_position_embeddings={limit}"
        )
    return asked or limit


def eos_token_ids(hf_config, tokenizer) -> frozenset[int]:
    eos = getattr(hf_config, "eos_token_id", None)
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def num_kv_blocks(config: EngineConfig, layout: KVLayout, max_model_len: int) -> int:
    num_blocks = config.cache.num_kv_blocks
    if num_blocks is None:
        num_blocks = int(config.cache.kv_cache_memory_gb * 2**30) // layout.bytes_per_block()
    needed = -(-max_model_len // layout.block_size) + 1  # one full-length request + the null page
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache has {num_blocks} blocks but one request of max_model_len="
            f"{max_model_len} needs {needed}: raise num_kv_blocks / kv_cache_memory_gb "
            "or lower max_model_len"
        )
    return num_blocks


def tokenize_prompt(
    prompt: str | list[int], tokenizer, vocab_size: int, max_model_len: int
) -> tuple[str | None, list[int]]:
    """``(text or None, token ids)`` of a prompt; InvalidRequestError naming what is wrong."""
    if isinstance(prompt, str):
        text, token_ids = prompt, tokenizer.encode(prompt)
    elif isinstance(prompt, list | tuple) and all(isinstance(t, int) for t in prompt):
        text, token_ids = None, list(prompt)
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token ids {bad[:5]} are out of range: ids must be in [0, {vocab_size})"
            )
    else:
        raise InvalidRequestError(
            f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
        )
    if not token_ids:
        raise InvalidRequestError("prompt is empty: give at least one token")
    if len(token_ids) >= max_model_len:
        raise InvalidRequestError(
            f"prompt has {len(token_ids)} tokens, but the context length is "
            f"{max_model_len}: a prompt may have at most {max_model_len - 1} tokens"
        )
    return text, token_ids
