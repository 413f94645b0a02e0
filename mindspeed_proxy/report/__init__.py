"""Run reports and run-to-run comparison (`mindspeed-proxy report` / `compare`)."""
from mindspeed_proxy.report.divergence import DivergenceRule, divergence_step
from mindspeed_proxy.report.runs import Run, RunError, load_run

__all__ = ["DivergenceRule", "divergence_step", "Run", "RunError", "load_run"]
