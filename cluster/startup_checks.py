"""What ``splitserve serve`` checks in the driver before it deploys anything.

A replica that fails in its constructor is retried by Ray Serve and its cause
lands in the replica's log, so whatever can be known beforehand is checked
here, where the error reaches the terminal once: the model (a checkpoint
directory with config.json and its tokenizer, or a preset), its architecture,
the context length, whether the KV cache holds one request of that length,
that a checkpoint asked to draft with MTP has an MTP layer, and (when the
workers run on this machine) the device and that the HTTP port is free.
"""

from __future__ import annotations

import math

import torch

from splitserve.cluster.ports import in_use
from splitserve.cluster.serve_config import ServeConfig


def fit_to_model(config: ServeConfig, local: bool = False) -> list[str]:
    """Check ``config`` against its model; lower ``scheduler.max_model_len`` to the model's
    own context where the config asks for more. Returns notes on what was changed;
    raises ValueError (or OSError) with the cause. ``local``: the workers run on this
    machine (no ``--address``), so its devices are theirs and are checked too."""
    from splitserve.config import resolve_device
    from splitserve.workers.model.loader import load_hf_config
    from splitserve.workers.model.registry import get_model_class
    from splitserve.workers.model.tokenizer import load_tokenizer

    engine = config.engine
    if local:
        resolve_device(engine.device)  # "cuda" on a machine without a GPU
    hf_config, path = load_hf_config(engine.model)
    get_model_class(hf_config.architectures)  # an architecture this server runs
    ep = engine.parallel.expert_parallel_size
    if ep > 1:  # E divisible by N; locally, N GPUs on this host (a cluster: check_node_gpus)
        from splitserve.workers.parallel.group import check_expert_parallel

        device = resolve_device(engine.device) if local else torch.device("cpu")
        check_expert_parallel(ep, hf_config, device)
    if path is not None:
        load_tokenizer(path)
    if engine.speculative_config is not None:
        check_mtp_layer(hf_config, path)
    notes = []
    limit = hf_config.max_position_embeddings
    scheduler = engine.scheduler
    if scheduler.max_model_len is not None and scheduler.max_model_len > limit:
        notes.append(
            f"max_model_len {scheduler.max_model_len} is beyond the model's context "
            f"(max_position_embeddings={limit}); serving with max_model_len {limit}"
        )
        scheduler.max_model_len = limit
    max_model_len = scheduler.max_model_len or limit
    blocks = engine.cache.num_kv_blocks
    needed = math.ceil(max_model_len / engine.cache.block_size) + 1  # + the null page
    if blocks is not None and blocks < needed:
        raise ValueError(
            f"cache.num_kv_blocks={blocks} cannot hold one request of max_model_len="
            f"{max_model_len} ({needed} blocks of {engine.cache.block_size} tokens with "
            "the null page): raise num_kv_blocks or lower scheduler.max_model_len"
        )
    return notes


def check_port_free(host: str, port: int) -> None:
    """Raise ValueError when something listens on the address the server is to take: its
    HTTP front would exit at start-up with only a line deep in Ray's log."""
    if in_use(host, port):
        raise ValueError(
            f"{host}:{port} is in use (another server, or an HTTP front a killed one left "
            "behind); stop it or pass --port"
        )


def check_node_gpus(config: ServeConfig, nodes: list[dict]) -> None:
    """ValueError when a pool's replica needs more GPUs than any one node of the Ray
    cluster has (``ray.nodes()``): an expert-parallel group's GPUs are one node's."""
    most = max((n["Resources"].get("GPU", 0) for n in nodes if n["Alive"]), default=0)
    for name, pool in config.pools.items():
        gpus = pool.replica_gpus(config.engine)
        if pool.active and gpus > most:
            ep = config.engine.parallel.expert_parallel_size
            raise ValueError(
                f"a {name} replica needs {gpus:g} GPUs on one node (parallel."
                f"expert_parallel_size={ep}), but the largest node of the Ray cluster has "
                f"{most:g}; lower the expert-parallel size or add a node with {gpus:g} GPUs"
            )


def check_mtp_layer(hf_config, path) -> None:
    """ValueError unless the checkpoint declares an MTP layer and, when its shards have an
    index, the index holds it (``model.layers.{num_hidden_layers}.eh_proj.weight``)."""
    import json

    n = hf_config.num_hidden_layers
    fix = "or leave speculative_config out"
    if (getattr(hf_config, "num_nextn_predict_layers", 0) or 0) < 1:
        raise ValueError(
            f"speculative_config method 'mtp' needs an MTP layer, and {hf_config.architectures} "
            f"declares none (num_nextn_predict_layers); use a GLM-4.5 checkpoint with it, {fix}"
        )
    index = path / "model.safetensors.index.json" if path is not None else None
    if index is not None and index.is_file():
        names = json.loads(index.read_text())["weight_map"]
        if f"model.layers.{n}.eh_proj.weight" not in names:
            raise ValueError(
                f"speculative_config method 'mtp' needs the MTP layer's weights at "
                f"model.layers.{n}.*, which {index} does not list; {fix}"
            )


def deployment_failure(app_name: str, error: Exception) -> str:
    """Why ``serve.run`` failed, in one line: the cause a failed replica reported (from
    ``serve.status()``), else the error's own last line."""
    from ray import serve

    messages = []
    try:
        app = serve.status().applications.get(app_name)
        deployments = app.deployments.values() if app is not None else []
        messages = [d.message for d in deployments if d.message and d.status != "HEALTHY"]
    except Exception:  # the controller may be gone too; fall back on the error
        pass
    return last_cause("\n".join(messages) or str(error))


def last_cause(text: str) -> str:
    """The last ``SomeError: message`` line of a traceback, else the text's last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if _is_error_line(line)]
    return (errors or lines or ["unknown error"])[-1]


def _is_error_line(line: str) -> bool:
    name, sep, _ = line.partition(": ")
    name = name.rsplit(".", 1)[-1]
    return bool(sep) and name.isidentifier() and name.endswith(("Error", "Exception"))
