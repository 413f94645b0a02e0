"""Experiments that exercise the whole stack (the fault matrix of original vs proxy, `make demo`)."""
from mindspeed_proxy.experiments.matrix import Matrix, Progress, RunResult, load_config

__all__ = ["Matrix", "Progress", "RunResult", "load_config"]
