"""splitserve: LLM serving on Ray with disaggregated prefill and decode."""

from splitserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it on first use.
    if name == "LLM":
        from splitserve.llm import LLM

        return LLM
    raise AttributeError(name)
