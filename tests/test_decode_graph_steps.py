"""Which steps the decode graph runner takes as host rows (``replay_steps``); the replay
itself is checked on a GPU in ``test_cuda_graphs.py``."""

import torch

from splitserve.workers.attention.torch_backend import TorchAttentionBackend
from splitserve.workers.kv.cache import KVCache
from splitserve.workers.kv.layout import KVLayout
from splitserve.workers.runner.cuda_graphs.decode_runner import DecodeGraphRunner
from splitserve.workers.runner.input_batch import StepRequest


def runner(num_blocks: int = 8) -> DecodeGraphRunner:
    cache = KVCache(KVLayout(1, 1, 8, 4, torch.float32), 8, "cpu")
    cache.num_blocks = num_blocks  # only counted: the slots the staged rows must hold
    sizes = [1, 2, 4]
    return DecodeGraphRunner(None, TorchAttentionBackend(), cache, sizes, 8, torch.device("cpu"))


def step(tokens=(5,), computed: int = 3, sample: bool = True) -> StepRequest:
    return StepRequest(list(tokens), computed, [1], sample)


def test_decode_steps_up_to_the_largest_size_replay_from_host_rows():
    graphs = runner()
    assert graphs.can_run_steps([step()] * 4)
    assert graphs.can_run_steps([step(tokens=(-1,))])  # a token still in flight
    assert not graphs.can_run_steps([step()] * 5)  # above the largest size
    assert not graphs.can_run_steps([])


def test_other_steps_are_built_on_the_device():
    graphs = runner()
    assert not graphs.can_run_steps([step(), step(tokens=(5, 6))])  # a chunk
    assert not graphs.can_run_steps([step(computed=0)])  # a one-token prompt
    assert not graphs.can_run_steps([step(), step(sample=False)])


def test_a_cache_whose_slots_pass_int32_is_not_staged():
    assert runner(num_blocks=2**29 - 1).can_run_steps([step()])  # 4 tokens a block
    assert not runner(num_blocks=2**29).can_run_steps([step()])
