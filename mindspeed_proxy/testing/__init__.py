"""Test harness: multi-rank launcher, parallel_state set-up and tiny models, for our tests and users'."""
from mindspeed_proxy.testing.launcher import DistributedTestError, run_distributed, run_python
from mindspeed_proxy.testing.parallel import destroy_parallel, init_parallel

__all__ = ["DistributedTestError", "run_distributed", "run_python", "init_parallel", "destroy_parallel"]
