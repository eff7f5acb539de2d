"""splitserve: LLM serving on Ray with disaggregated prefill and decode."""

from splitserve.import_path import unshadow_kernels
from splitserve.sampling_params import SamplingParams

unshadow_kernels()

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it on first use.
    if name == "LLM":
        from splitserve.llm import LLM

        return LLM
    raise AttributeError(name)
