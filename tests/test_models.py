"""Our models against transformers' on tiny random checkpoints (float32, eager attention).

Prompts of different lengths are packed into one ForwardBatch over a paged KV
cache whose blocks are handed out shuffled; logits at every position must
match transformers' within 1e-4 relative error, in one prefill or in chunks
(prefill, a second chunk over the cached first one, then a decode step).
"""

from __future__ import annotations

import random

import pytest
import torch

from splitserve.workers.attention.torch_backend import TorchAttentionBackend
from splitserve.workers.kv.cache import KVCache
from splitserve.workers.model.loader import load_hf_config, load_model
from splitserve.workers.runner.input_batch import StepRequest, build_forward_batch
from tests.checkpoints import (
    load_reference,
    read_tensor,
    write_glm4_moe,
    write_llama,
    write_qwen3,
    write_qwen3_moe,
    write_qwen3_sharded,
)

TOLERANCE = 1e-4
PROMPT_LENS = [7, 13, 4]

VARIANTS = {
    "qwen3-tied": lambda d: write_qwen3(d, tie_word_embeddings=True),
    "qwen3-untied": lambda d: write_qwen3(d, tie_word_embeddings=False),
    "qwen3-sharded": lambda d: write_qwen3_sharded(d, with_index=True),
    "qwen3-sharded-no-index": lambda d: write_qwen3_sharded(d, with_index=False),
    "llama": write_llama,
    "qwen3-moe": write_qwen3_moe,
    "glm4-moe": lambda d: write_glm4_moe(d, with_correction_bias=True),
    "glm4-moe-no-bias": lambda d: write_glm4_moe(d, with_correction_bias=False),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    """(our model, transformers' model, checkpoint dir) of one variant."""
    path = VARIANTS[request.param](tmp_path_factory.mktemp(request.param))
    config, ckpt = load_hf_config(str(path))
    ours = load_model(config, ckpt, torch.float32, "cpu")
    return ours, load_reference(path), path


def prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]


@torch.no_grad()
def reference_logits(hf_model, prompt: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([prompt])).logits[0].float()


class Runner:
    """Steps requests through a paged KV cache with shuffled (non-contiguous) blocks."""

    def __init__(self, model, block_size: int, max_len: int = 32):
        self.model, self.block_size = model, block_size
        blocks_per_seq = -(-max_len // block_size)
        num_blocks = 1 + blocks_per_seq * len(PROMPT_LENS)
        cache_spec = model.kv_layout.with_storage(block_size, torch.float32)
        self.kv_cache = KVCache(cache_spec, num_blocks, "cpu")
        free = list(range(1, num_blocks))
        random.Random(block_size).shuffle(free)
        self.tables = [
            free[i :: len(PROMPT_LENS)][:blocks_per_seq] for i in range(len(PROMPT_LENS))
        ]
        self.backend = TorchAttentionBackend()

    @torch.no_grad()
    def step(self, chunks: list[list[int]], num_computed: list[int]) -> list[torch.Tensor]:
        reqs = [
            StepRequest(chunk, done, table, sample=True)
            for chunk, done, table in zip(chunks, num_computed, self.tables)
        ]
        fb = build_forward_batch(reqs, self.kv_cache, self.backend, "cpu")
        hidden = self.model(fb.input_ids, fb.positions, fb)
        logits = self.model.compute_logits(hidden)
        assert logits.shape == (fb.num_tokens, 512)
        assert logits.dtype == self.model.lm_head.weight.dtype  # the model's own
        return list(logits.split(fb.query_lens))


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).norm() / ref.norm())


def test_prefill_matches_transformers(pair):
    ours, hf, _ = pair
    runner = Runner(ours, block_size=4)
    batch = prompts()
    logits = runner.step(batch, [0] * len(batch))
    for prompt, got in zip(batch, logits):
        ref = reference_logits(hf, prompt)
        assert rel_err(got, ref) < TOLERANCE
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert runner.kv_cache.null_page_is_zero()


def test_chunked_prefill_and_decode_match_transformers(pair):
    """Chunk 1, then chunk 2 attending chunk 1 through the cache, then one decode step."""
    ours, hf, _ = pair
    runner = Runner(ours, block_size=8)
    batch = prompts(seed=1)
    splits = [(3, n - 1) for n in PROMPT_LENS]  # [0, a) [a, b) [b, n)
    got = [[] for _ in batch]
    for step in range(3):
        chunks, done = [], []
        for p, (a, b) in zip(batch, splits):
            start, end = [(0, a), (a, b), (b, len(p))][step]
            chunks.append(p[start:end])
            done.append(start)
        for i, logits in enumerate(runner.step(chunks, done)):
            got[i].append(logits)
    for prompt, parts in zip(batch, got):
        assert rel_err(torch.cat(parts), reference_logits(hf, prompt)) < TOLERANCE
    assert runner.kv_cache.null_page_is_zero()


def test_kv_layout_counts_mtp_layer(pair):
    ours, hf, _ = pair
    config = hf.config
    extra = 1 if config.model_type == "glm4_moe" else 0
    assert ours.num_kv_layers == config.num_hidden_layers + extra
    assert ours.kv_layout.num_kv_heads == config.num_key_value_heads
    assert ours.kv_layout.head_dim == config.head_dim


def test_weights_are_the_checkpoints(pair):
    """Spot checks that fused parameters hold the right checkpoint shards."""
    ours, _, path = pair
    layer = ours.model.layers[0]
    q, k, v = layer.self_attn.qkv_proj.weight.split(layer.self_attn.qkv_proj.sizes)
    assert torch.equal(k, read_tensor(path, "model.layers.0.self_attn.k_proj.weight"))
    assert torch.equal(v, read_tensor(path, "model.layers.0.self_attn.v_proj.weight"))
    if ours.config.tie_word_embeddings:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
    else:
        assert torch.equal(ours.lm_head.weight, read_tensor(path, "lm_head.weight"))


# ---- kernels and layers against transformers' modules


def test_routing_matches_transformers_routers():
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from splitserve.kernels.moe_routing import noaux_tc_topk, softmax_topk
    from tests.checkpoints import glm4_moe_config, qwen3_moe_config

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 64, generator=g)
    qwen = Qwen3MoeTopKRouter(qwen3_moe_config())
    qwen.weight.data = torch.randn(8, 64, generator=g) / 8
    _, ref_w, ref_ids = qwen(x)
    w, ids = softmax_topk(x @ qwen.weight.t(), top_k=2, renormalize=True)
    assert torch.equal(ids, ref_ids) and torch.allclose(w, ref_w)

    glm = Glm4MoeTopkRouter(glm4_moe_config())
    glm.weight.data = torch.randn(8, 64, generator=g) / 8
    glm.e_score_correction_bias.copy_(torch.rand(8, generator=g) * 0.3)
    args = dict(top_k=2, n_group=2, topk_group=1, renormalize=True, routed_scaling_factor=1.8)
    _, ref_w, ref_ids = glm(x)
    w, ids = noaux_tc_topk(x @ glm.weight.t(), glm.e_score_correction_bias, **args)
    assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
    assert torch.allclose(w.gather(1, ids.argsort(-1)), ref_w.gather(1, ref_ids.argsort(-1)))
    # the bias changes some choices; None means plain scores (= a zero bias)
    plain_w, plain_ids = noaux_tc_topk(x @ glm.weight.t(), None, **args)
    assert not torch.equal(plain_ids.sort(-1).values, ids.sort(-1).values)
    zero_w, zero_ids = noaux_tc_topk(x @ glm.weight.t(), torch.zeros(8), **args)
    assert torch.equal(plain_ids, zero_ids) and torch.equal(plain_w, zero_w)
    # grouped: both experts of a token come from one group of 4
    assert torch.equal(ids[:, 0] // 4, ids[:, 1] // 4)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    ],
    ids=lambda r: r["rope_type"],
)
def test_rotary_matches_transformers(rope):
    from transformers.models.glm4_moe.modeling_glm4_moe import (
        Glm4MoeRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    from splitserve.workers.model.layers.rotary_embedding import get_rope
    from tests.checkpoints import glm4_moe_config

    config = glm4_moe_config()
    config.rope_parameters = rope
    ours = get_rope(config, head_dim=32)
    positions = torch.tensor([0, 1, 5, 700, 4000])
    q, k = torch.randn(5, 4, 32), torch.randn(5, 2, 32)
    cos, sin = Glm4MoeRotaryEmbedding(config)(q, positions[None])
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got_q, got_k = ours(positions, q, k)
    assert torch.allclose(got_q, ref_q[0].transpose(0, 1), atol=1e-5)
    assert torch.allclose(got_k, ref_k[0].transpose(0, 1), atol=1e-5)


def test_unsupported_rope_type_is_named():
    from splitserve.workers.model.layers.rotary_embedding import get_rope
    from tests.checkpoints import qwen3_config

    config = qwen3_config()
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}
    with pytest.raises(
        ValueError, match="unsupported rope scaling type 'dynamic'; supported: default"
    ):
        get_rope(config, head_dim=16)


def test_legacy_top_level_rope_fields():
    from types import SimpleNamespace

    from splitserve.workers.model.layers.rotary_embedding import rope_parameters

    old = SimpleNamespace(rope_theta=5e5, partial_rotary_factor=0.5, rope_scaling=None)
    assert rope_parameters(old) == {
        "rope_type": "default",
        "rope_theta": 5e5,
        "partial_rotary_factor": 0.5,
    }
    scaled = SimpleNamespace(rope_theta=1e4, rope_scaling={"type": "linear", "factor": 2.0})
    assert rope_parameters(scaled)["rope_type"] == "linear"


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    path = write_glm4_moe(tmp_path_factory.mktemp("glm-mtp"))
    config, ckpt = load_hf_config(str(path))
    return load_model(config, ckpt, torch.float32, "cpu"), path


def _reference_mtp(config, path):
    """transformers' GLM decoder layer + plain norms/projection holding the file's MTP weights."""
    from transformers.models.glm4_moe.modeling_glm4_moe import (
        Glm4MoeDecoderLayer,
        Glm4MoeRMSNorm,
        Glm4MoeRotaryEmbedding,
    )

    n, prefix = config.num_hidden_layers, f"model.layers.{config.num_hidden_layers}."
    tensor = lambda name: read_tensor(path, prefix + name)  # noqa: E731
    layer = Glm4MoeDecoderLayer(config, n).eval()
    state = {k: tensor(k) for k in layer.state_dict() if "experts." not in k or "shared" in k}
    experts = range(config.n_routed_experts)
    state["mlp.experts.gate_up_proj"] = torch.stack(
        [
            torch.cat([tensor(f"mlp.experts.{e}.{p}_proj.weight") for p in ("gate", "up")])
            for e in experts
        ]
    )
    state["mlp.experts.down_proj"] = torch.stack(
        [tensor(f"mlp.experts.{e}.down_proj.weight") for e in experts]
    )
    layer.load_state_dict(state)

    def norm(name):
        module = Glm4MoeRMSNorm(config.hidden_size, config.rms_norm_eps)
        module.weight.data = tensor(name)
        return module

    enorm, hnorm, final = (
        norm("enorm.weight"),
        norm("hnorm.weight"),
        norm("shared_head.norm.weight"),
    )
    rotary = Glm4MoeRotaryEmbedding(config)

    @torch.no_grad()
    def mtp(ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
        length = len(ids)
        embeds = tensor("embed_tokens.weight")[ids]
        embeds[0] = 0  # position 0
        x = torch.cat([enorm(embeds), hnorm(hidden)], -1) @ tensor("eh_proj.weight").t()
        positions = torch.arange(length)[None]
        mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
        out = layer(
            x[None],
            attention_mask=mask,
            position_ids=positions,
            position_embeddings=rotary(x[None], positions),
        )
        return final(out[0])

    return mtp


@torch.no_grad()
def test_glm_mtp_forward_matches_reference(glm):
    model, path = glm
    reference = _reference_mtp(model.config, path)
    runner = Runner(model, block_size=4)
    batch = prompts(seed=2)
    reqs = [StepRequest(p, 0, t, sample=True) for p, t in zip(batch, runner.tables)]
    fb = build_forward_batch(reqs, runner.kv_cache, runner.backend, "cpu")
    hidden = model(fb.input_ids, fb.positions, fb)
    mtp_batch = [p[1:] + [7] for p in batch]  # the next token at each position
    mtp_ids = torch.tensor(sum(mtp_batch, []))
    mtp_layer = model.config.num_hidden_layers
    assert not runner.kv_cache.k[mtp_layer].any()
    out = model.mtp_forward(mtp_ids, fb.positions, hidden, fb)
    assert runner.kv_cache.k[mtp_layer].any()  # the MTP layer has its own KV layer
    for ids, h, got in zip(mtp_batch, hidden.split(fb.query_lens), out.split(fb.query_lens)):
        ref = reference(ids, h)
        assert rel_err(got, ref) < TOLERANCE
    logits = model.mtp_compute_logits(out)
    assert logits.shape == (fb.num_tokens, 512)
    assert logits.dtype == model.mtp.shared_head.head.weight.dtype  # the model's own


def test_qkv_lets_attention_start_at_once_only_when_attention_follows_it(monkeypatch):
    """The one-row qkv projection lets the next kernel launch as it starts only when that
    kernel is attention, which norms and rotates q/k itself (split-KV at one request)."""
    from types import SimpleNamespace

    from splitserve.workers.attention.base import AttentionKernel
    from splitserve.workers.model.layers import layernorm
    from splitserve.workers.model.layers.decoder import RopeAttention
    from splitserve.workers.model.layers.rotary_embedding import RotaryEmbedding
    from splitserve.workers.runner.step_plan import plan_rows

    class Projected(Exception):
        """Stops the layer once its qkv projection was asked for."""

    asked = []

    def projection(*args):
        asked.append(args[-1])  # next_starts_at_once
        raise Projected

    monkeypatch.setattr(layernorm, "rms_norm_linear", projection)
    rope = RotaryEmbedding(16, 16, 32, torch.ones(8))
    with_norm, without = (RopeAttention(0, 32, 2, 1, 16, rope, qk_norm=n) for n in (True, False))
    cuda = torch.device("cuda")  # only named: nothing runs on it
    fused = plan_rows(1, cuda, AttentionKernel(norms_qk=True))
    apart = plan_rows(1, cuda, AttentionKernel())
    x = layernorm.AddNorm(layernorm.RMSNorm(32), torch.zeros(1, 32), None)
    for layer, plan in ((with_norm, fused), (with_norm, apart), (without, fused)):
        with pytest.raises(Projected):
            layer(torch.zeros(1, dtype=torch.long), x, SimpleNamespace(plan=plan))
    assert asked[0]
    assert not asked[1]  # the q/k kernel comes between
    assert not asked[2]  # the rotary kernel comes between


def test_lm_head_gives_logits_in_the_models_dtype():
    """No float32 copy of the logits: a plain greedy batch takes their argmax as they are,
    and the sampler casts them where it edits them (``sampler.py``)."""
    from splitserve.workers.model.layers.embedding import LMHead

    head = LMHead(vocab_size=11, hidden=8).to(torch.bfloat16)
    torch.nn.init.normal_(head.weight)
    hidden = torch.randn(3, 8, dtype=torch.bfloat16)
    logits = head(hidden)
    assert logits.dtype == torch.bfloat16 and logits.shape == (3, 11)
    assert torch.equal(logits, torch.nn.functional.linear(hidden, head.weight))
