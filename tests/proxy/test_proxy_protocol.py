"""Every source format implements the whole reader protocol, so that no caller dispatches on the format."""
import inspect

import pytest

from mindspeed_proxy.proxy.io.dist.reader import DistCheckpoint
from mindspeed_proxy.proxy.io.hf.checkpoint import HFCheckpoint
from mindspeed_proxy.proxy.io.legacy.reader import LegacyCheckpoint
from mindspeed_proxy.proxy.io.protocol import SourceCheckpoint

METHODS = sorted(n for n, v in vars(SourceCheckpoint).items() if inspect.isfunction(v) and not n.startswith("_"))


@pytest.mark.parametrize("reader,fmt", [(LegacyCheckpoint, "torch"), (DistCheckpoint, "torch_dist"),
                                        (HFCheckpoint, "hf")])
def test_reader_implements_every_protocol_method(reader, fmt):
    assert reader.format == fmt
    missing = [n for n in METHODS if not inspect.isfunction(getattr(reader, n, None))]
    assert missing == []
    for name in METHODS:  # same parameters as the protocol (annotations aside)
        want = list(inspect.signature(getattr(SourceCheckpoint, name)).parameters)
        assert list(inspect.signature(getattr(reader, name)).parameters)[:len(want)] == want, (reader, name)


def test_protocol_names_the_methods_the_planner_calls():
    assert {"expert", "router", "expert_row_groups", "rewrite_config", "bytes_to_write", "file_paths", "release",
            "close"} <= set(METHODS)
