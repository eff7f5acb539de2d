"""CUDA graphs of a worker: whole decode steps, piecewise prefill and mixed steps,
all owned, captured and cleared together by one ``GraphOwner``."""
