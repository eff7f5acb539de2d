"""What every causal LM shares: embed -> decoder layers -> norm -> LM head, and weight loading.

A model family subclasses ``CausalLM`` and says how to build layer ``i``'s MLP
(dense or MoE) and which attention options it uses; everything else is here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from splitserve.workers.kv.layout import KVLayout
from splitserve.workers.model import weights as wmap
from splitserve.workers.model.layers.decoder import DecoderLayer, RopeAttention
from splitserve.workers.model.layers.embedding import LMHead, VocabEmbedding
from splitserve.workers.model.layers.layernorm import RMSNorm
from splitserve.workers.model.layers.moe import ExpertShard
from splitserve.workers.model.layers.rotary_embedding import RotaryEmbedding, get_rope
from splitserve.workers.runner.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecoderModel(nn.Module):
    """``model.*`` of a HF checkpoint: embed_tokens, layers, norm."""

    def __init__(self, config: Any, layers: list[DecoderLayer], rotary_emb: RotaryEmbedding):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = rotary_emb

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, forward_batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class CausalLM(nn.Module):
    qk_norm: bool = False  # per-head RMSNorm of q and k before rotary (Qwen3; GLM: use_qk_norm)
    o_proj_bias: bool = True  # o_proj has a bias when config.attention_bias (GLM: never)

    def __init__(self, config: Any, expert_shard: ExpertShard | None = None):
        """``expert_shard``: an expert-parallel rank's routed experts (None: all of them)."""
        super().__init__()
        self.expert_shard = expert_shard
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; supported: silu")
        self.config = config
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        rotary_emb = get_rope(config, self.head_dim)
        layers = [self.make_layer(i, rotary_emb) for i in range(config.num_hidden_layers)]
        self.model = DecoderModel(config, layers, rotary_emb)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tie_to=tied)

    # ---- what a family decides
    def make_mlp(self, layer_id: int) -> nn.Module:
        raise NotImplementedError

    def make_attention(self, layer_id: int, rotary_emb: RotaryEmbedding) -> RopeAttention:
        c = self.config
        bias = bool(getattr(c, "attention_bias", False))
        return RopeAttention(
            layer_id,
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            self.head_dim,
            rotary_emb,
            qkv_bias=bias,
            o_bias=bias and self.o_proj_bias,
            qk_norm=self.qk_norm or bool(getattr(c, "use_qk_norm", False)),
            rms_norm_eps=c.rms_norm_eps,
        )

    def make_layer(self, layer_id: int, rotary_emb: RotaryEmbedding) -> DecoderLayer:
        attn = self.make_attention(layer_id, rotary_emb)
        c = self.config
        return DecoderLayer(attn, self.make_mlp(layer_id), c.hidden_size, c.rms_norm_eps)

    # ---- the model interface
    @property
    def num_kv_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def kv_layout(self) -> KVLayout:
        """The KV cache this model needs; the engine adds block size and dtype."""
        return KVLayout(self.num_kv_layers, self.num_kv_heads, self.head_dim)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` after the final norm."""
        return self.model(input_ids, positions, forward_batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[num_rows, vocab]`` in the model's dtype."""
        return self.lm_head(hidden)

    # ---- weights
    def checkpoint_to_model(self, name: str) -> str | None:
        """Checkpoint name -> model-side name; None: skip the tensor on purpose."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None  # some tied checkpoints still carry a copy
        return name

    def model_to_checkpoint(self, name: str) -> str:
        return name

    def holds_elsewhere(self, ckpt_name: str) -> bool:
        """A per-expert checkpoint tensor of an expert another expert-parallel rank holds
        (the loader does not read it)."""
        name = self.checkpoint_to_model(ckpt_name)
        if self.expert_shard is None or name is None:
            return False
        _, shard = wmap.param_target(name)
        return isinstance(shard, tuple) and shard[1] not in (None, *self.expert_shard.ids)

    def is_optional(self, param_name: str) -> bool:
        """Parameters a checkpoint may leave out."""
        return False

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor that a checkpoint fills, by parameter name (tied copies once)."""
        tensors = dict(self.state_dict(keep_vars=True))
        if self.config.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
        return tensors

    def expected_weights(self) -> set[str]:
        """Checkpoint names a complete checkpoint must provide."""
        return self.checkpoint_names(lambda name: not self.is_optional(name))

    def checkpoint_names(self, keep: Callable[[str], bool]) -> set[str]:
        """Checkpoint names of the parameters whose (model-side) name ``keep`` accepts."""
        return {
            self.model_to_checkpoint(n)
            for name, t in self.weight_tensors().items()
            if keep(name)
            for n in wmap.checkpoint_names(name, t)
        }

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors in (cast to each parameter's dtype).

        Returns the checkpoint names taken: loaded, or skipped on purpose (a
        tied ``lm_head.weight``). A name not returned is unexpected. Call it
        once with the whole checkpoint: afterwards ``finish_loading`` drops what
        the checkpoint did not provide but may leave out.
        """
        tensors = self.weight_tensors()
        taken: set[str] = set()
        for ckpt_name, loaded in weights:
            name = self.checkpoint_to_model(ckpt_name)
            if name is None:
                taken.add(ckpt_name)
                continue
            target, shard = wmap.param_target(name)
            param = tensors.get(target)
            if param is None:
                continue
            if shard is None:
                if param.shape != loaded.shape:
                    raise ValueError(
                        f"checkpoint tensor {ckpt_name} has shape {tuple(loaded.shape)}, "
                        f"the model expects {tuple(param.shape)}"
                    )
                param.data.copy_(loaded)
            else:
                param.weight_loader(param, loaded, shard)
            if isinstance(shard, tuple) and shard[1] is None:  # all experts in one tensor
                taken.update(
                    self.model_to_checkpoint(n) for n in wmap.checkpoint_names(target, param)
                )
            taken.add(ckpt_name)
        self.finish_loading(taken)
        return taken

    def finish_loading(self, taken: set[str]) -> None:
        """Hook: drop optional parts the checkpoint did not provide."""
