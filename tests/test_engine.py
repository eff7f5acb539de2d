"""End to end: the engine's greedy output is token-identical to transformers.generate."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from splitserve import LLM, SamplingParams
from tests import checkpoints

NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
PROMPT_LENS = [5, 17, 33, 9]


def _prompts(vocab: int, lens: list[int], seed: int, shared_prefix: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(1, vocab, (shared_prefix,), generator=g).tolist()
    return [prefix + torch.randint(1, vocab, (n,), generator=g).tolist() for n in lens]


def _hf_greedy(path, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    model.generation_config.eos_token_id = None  # ignore_eos: greedy through EOS, no masking
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            seq = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(seq[0, len(ids) :].tolist())
    return outs


WRITERS = {
    "qwen3": lambda d: checkpoints.write_qwen3(d, tie_word_embeddings=True),
    "qwen3_moe": checkpoints.write_qwen3_moe,
    "glm4_moe": checkpoints.write_glm4_moe,
}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def family(request, tmp_path_factory):
    """(checkpoint dir, prompts, transformers' greedy continuations)."""
    path = tmp_path_factory.mktemp(request.param)
    WRITERS[request.param](path)
    prompts = _prompts(512, PROMPT_LENS, seed=1, shared_prefix=12)
    return path, prompts, _hf_greedy(path, prompts)


def _llm(path, **kwargs) -> LLM:
    return LLM(str(path), max_model_len=128, **kwargs)


def _generate(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.outputs[0].token_ids for o in outs]


def test_batched_matches_transformers(family):
    path, prompts, expected = family
    llm = _llm(path, block_size=8, num_kv_blocks=256, enable_prefix_caching=False)
    assert _generate(llm, prompts) == expected
    assert llm.engine.block_manager.num_free_blocks == 255


def test_one_by_one_matches_transformers(family):
    path, prompts, expected = family
    llm = _llm(path, block_size=16, num_kv_blocks=64)
    assert [_generate(llm, [p])[0] for p in prompts] == expected


def test_chunked_prefill_matches_transformers(family):
    path, prompts, expected = family
    llm = _llm(path, block_size=4, num_kv_blocks=256, max_num_batched_tokens=8)
    assert _generate(llm, prompts) == expected


def test_prefix_cache_hits_match_transformers(family):
    path, prompts, expected = family
    llm = _llm(path, block_size=4, num_kv_blocks=256)
    assert _generate(llm, prompts[:1]) == expected[:1]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    # Every prompt shares the 12-token prefix (3 full blocks) with the first one.
    assert all(o.num_cached_tokens >= 12 for o in outs)


def test_preemption_matches_transformers(family):
    path, prompts, expected = family
    # 40 usable blocks of 4 tokens cannot hold four requests of up to 77 tokens at once.
    llm = _llm(path, block_size=4, num_kv_blocks=41, max_num_batched_tokens=16)
    assert _generate(llm, prompts) == expected
    assert llm.engine.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 40
