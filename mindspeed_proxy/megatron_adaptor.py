"""`import mindspeed_proxy.megatron_adaptor` at the top of a training script (the MindSpeed convention).

Applies the mindspeed-proxy patches at import, reading --enable-mechanism-monitor and its companions
from sys.argv; with MindSpeed installed they are registered with MindSpeed's patch manager and
applied together with MindSpeed's own patches.
"""
import sys

from mindspeed_proxy.run import apply_from_argv

apply_from_argv(sys.argv[1:])
