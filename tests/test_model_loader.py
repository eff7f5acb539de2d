"""Loader: config resolution, checkpoint reading, errors a user can act on, presets."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from splitserve.config import resolve_dtype
from splitserve.workers.model.loader import list_presets, load_hf_config, load_model
from tests.checkpoints import (
    append_shard,
    drop_tensors,
    read_tensor,
    write_glm4_moe,
    write_qwen3_moe,
    write_qwen3_sharded,
)
from tests.test_models import Runner, prompts


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return write_qwen3_sharded(tmp_path_factory.mktemp("qwen3"), with_index=True)


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    return write_glm4_moe(tmp_path_factory.mktemp("glm"))


@pytest.fixture
def copy_of(tmp_path):
    return lambda src: shutil.copytree(src, tmp_path / src.name)


def load(path, dtype=torch.float32):
    config, ckpt = load_hf_config(str(path))
    return load_model(config, ckpt, dtype, "cpu")


def logits_of(model) -> torch.Tensor:
    return torch.cat(Runner(model, block_size=4).step(prompts(), [0, 0, 0]))


# ---- errors


def test_unknown_architecture_is_named(qwen3_dir, copy_of):
    path = copy_of(qwen3_dir)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["FooForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=r"unknown architecture 'FooForCausalLM'; supported: .*"
        r"Qwen3ForCausalLM.*Glm4MoeForCausalLM",
    ):
        load(path)


@pytest.mark.parametrize(
    "name",
    ["model.layers.1.self_attn.k_proj.weight", "model.norm.weight", "lm_head.weight"],
)
def test_missing_weight_is_named(qwen3_dir, copy_of, name):
    path = copy_of(qwen3_dir)
    drop_tensors(path, lambda n: n == name)
    with pytest.raises(ValueError, match="missing 1 weights") as err:
        load(path)
    assert name in str(err.value) and str(path) in str(err.value)


def test_missing_expert_is_named(glm_dir, copy_of):
    path = copy_of(glm_dir)
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    drop_tensors(path, lambda n: n == name)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load(path)


def test_unknown_dtype_lists_accepted():
    with pytest.raises(
        ValueError, match="unknown dtype 'fp8'; accepted: float32, bfloat16, float16"
    ):
        resolve_dtype("fp8")


def test_unknown_preset_lists_presets(tmp_path):
    with pytest.raises(
        ValueError,
        match="'qwen9-huge'.*presets: glm4-moe-tiny, glm45-air-8l-shape, glm45-air-shape, "
        "qwen3-8b-shape, qwen3-moe-tiny, qwen3-tiny",
    ):
        load_hf_config("qwen9-huge")
    with pytest.raises(ValueError, match="directory without config.json"):
        load_hf_config(str(tmp_path))


def test_no_safetensors_is_an_error(qwen3_dir, copy_of):
    path = copy_of(qwen3_dir)
    for shard in path.glob("*.safetensors"):
        shard.unlink()
    (path / "model.safetensors.index.json").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors files in"):
        load(path)


def test_unexpected_tensors_are_logged_not_fatal(qwen3_dir, copy_of, caplog):
    path = copy_of(qwen3_dir)
    append_shard(path, "extra.safetensors", {"model.layers.0.mystery.weight": torch.ones(3)})
    with caplog.at_level(logging.WARNING, logger="splitserve.workers.model.loader"):
        model = load(path)
    assert "model.layers.0.mystery.weight" in caplog.text
    assert torch.isfinite(logits_of(model)).all()


def test_progress_bar_when_reading_files(qwen3_dir, capfd):
    load(qwen3_dir)
    assert "shard" in capfd.readouterr().err


# ---- GLM: MTP layer and optional correction bias


def test_mtp_weights_are_loaded(glm_dir):
    model = load(glm_dir)
    n = model.config.num_hidden_layers
    mtp = model.mtp
    for ours, name in [
        (mtp.eh_proj.weight, "eh_proj.weight"),
        (mtp.enorm.weight, "enorm.weight"),
        (mtp.shared_head.head.weight, "shared_head.head.weight"),
        (mtp.embed_tokens.weight, "embed_tokens.weight"),
        (mtp.mlp.gate.e_score_correction_bias, "mlp.gate.e_score_correction_bias"),
        (mtp.mlp.experts.w13_weight[3, 32:], "mlp.experts.3.up_proj.weight"),
        (mtp.mlp.experts.w2_weight[6], "mlp.experts.6.down_proj.weight"),
    ]:
        assert torch.equal(ours, read_tensor(glm_dir, f"model.layers.{n}.{name}")), name
    assert model.num_kv_layers == n + 1


def test_glm_without_correction_bias_routes_by_plain_scores(glm_dir, copy_of):
    path = copy_of(glm_dir)
    drop_tensors(path, lambda n: n.endswith("e_score_correction_bias"))
    model = load(path)
    gates = [model.model.layers[i].mlp.gate for i in (1, 2)] + [model.mtp.mlp.gate]
    assert all(g.e_score_correction_bias is None for g in gates)
    assert not torch.equal(logits_of(model), logits_of(load(glm_dir)))  # the bias mattered


def test_glm_checkpoint_without_mtp_layer(glm_dir, copy_of, caplog):
    path = copy_of(glm_dir)
    n = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    drop_tensors(path, lambda name: name.startswith(f"model.layers.{n}."))
    with caplog.at_level(logging.WARNING):
        model = load(path)
    assert model.mtp is None and model.num_kv_layers == n
    assert "no MTP layer" in caplog.text
    assert torch.equal(logits_of(model), logits_of(load(glm_dir)))


def test_glm_incomplete_mtp_layer_is_an_error(glm_dir, copy_of):
    path = copy_of(glm_dir)
    n = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    drop_tensors(path, lambda name: name == f"model.layers.{n}.eh_proj.weight")
    with pytest.raises(ValueError, match=f"incomplete MTP layer.*model.layers.{n}.eh_proj.weight"):
        load(path)


# ---- layouts and dtypes


def test_stacked_expert_layout_loads_the_same(tmp_path):
    """transformers 5's in-memory layout (experts.gate_up_proj [E, 2I, H]) works too."""
    path = write_qwen3_moe(tmp_path / "moe")
    expected = load(path)
    stacked = {}
    for layer in (0, 2):
        prefix = f"model.layers.{layer}.mlp.experts"
        experts = [
            {p: read_tensor(path, f"{prefix}.{e}.{p}_proj.weight") for p in ("gate", "up", "down")}
            for e in range(8)
        ]
        stacked[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([x["gate"], x["up"]]) for x in experts]
        )
        stacked[f"{prefix}.down_proj"] = torch.stack([x["down"] for x in experts])
    drop_tensors(path, lambda n: ".experts." in n)
    append_shard(path, "stacked.safetensors", stacked)
    model = load(path)
    for (name, a), b in zip(model.state_dict().items(), expected.state_dict().values()):
        assert torch.equal(a, b), name


def test_bfloat16_load(glm_dir):
    model = load(glm_dir, torch.bfloat16)
    assert model.model.layers[1].mlp.experts.w13_weight.dtype == torch.bfloat16
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert model.model.rotary_emb.cos.dtype == torch.float32
    runner = Runner(model, block_size=4)
    runner.kv_cache = type(runner.kv_cache)(
        model.kv_layout.with_storage(4, torch.bfloat16), runner.kv_cache.num_blocks, "cpu"
    )
    got = torch.cat(runner.step(prompts(), [0, 0, 0]))
    ref = logits_of(load(glm_dir))
    assert float((got - ref).norm() / ref.norm()) < 0.05


# ---- presets


TINY_PRESETS = [p for p in list_presets() if p.endswith("-tiny")]  # full shapes: benchmarks only


def test_full_size_shape_preset_loads_its_config():
    config, path = load_hf_config("qwen3-8b-shape")
    assert path is None and config.num_hidden_layers == 36 and config.num_key_value_heads == 8
    assert config.head_dim == 128 and config.hidden_size == 4096


def test_dummy_weights_are_drawn_on_the_device_and_seeded():
    config, _ = load_hf_config("qwen3-tiny")
    first = load_model(config, None, torch.float32, "cpu", seed=3, load_format="dummy")
    again = load_model(config, None, torch.float32, "cpu", seed=3, load_format="dummy")
    other = load_model(config, None, torch.float32, "cpu", seed=4, load_format="dummy")
    portable = load_model(config, None, torch.float32, "cpu", seed=3)
    emb = first.model.embed_tokens.weight
    assert abs(float(emb.std()) - 0.02) < 0.002
    assert torch.equal(emb, again.model.embed_tokens.weight)
    assert not torch.equal(emb, other.model.embed_tokens.weight)
    assert not torch.equal(emb, portable.model.embed_tokens.weight)  # not the preset's init
    assert torch.equal(first.model.norm.weight, torch.ones_like(first.model.norm.weight))


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_preset_random_init_is_deterministic(preset):
    config, path = load_hf_config(preset)
    assert path is None and config.vocab_size == 512 and config.eos_token_id == 0
    first = load_model(config, None, torch.float32, "cpu", seed=0)
    second = load_model(config, None, torch.float32, "cpu", seed=0)
    other = load_model(config, None, torch.float32, "cpu", seed=1)
    for (name, a), b, c in zip(
        first.state_dict().items(), second.state_dict().values(), other.state_dict().values()
    ):
        assert torch.equal(a, b), name
        if "norm" not in name:
            assert not torch.equal(a, c), name
    emb = first.model.embed_tokens.weight
    assert abs(float(emb.std()) - 0.02) < 0.002
    assert torch.equal(first.model.norm.weight, torch.ones_like(first.model.norm.weight))
    logits = logits_of(first)
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_preset_values_are_pinned():
    """Same seed, same numbers, on any machine: a few values pinned from numpy's PCG64."""
    config, _ = load_hf_config("qwen3-tiny")
    model = load_model(config, None, torch.float32, "cpu", seed=0)
    got = model.model.embed_tokens.weight[0, :3].tolist()
    assert got == pytest.approx(PINNED_EMBED, abs=1e-7)


PINNED_EMBED = [0.028751663863658905, -0.005569211672991514, 0.013265733607113361]
