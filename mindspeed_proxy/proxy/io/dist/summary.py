"""The global model tensors of a torch_dist folder, for the per-layer-type summary (io/layer_summary.py)."""
from __future__ import annotations

from mindspeed_proxy.proxy.core.keys import is_model_key


def metadata_tensors(folder: str) -> dict:
    """{key: (global shape, dtype)} of the model tensors listed in a torch_dist folder's `.metadata`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(folder).read_metadata().state_dict_metadata
    return {k: (tuple(m.size), m.properties.dtype) for k, m in meta.items()
            if isinstance(m, TensorStorageMetadata) and is_model_key(k)}
