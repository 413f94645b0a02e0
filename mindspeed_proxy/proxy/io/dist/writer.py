"""Write a torch_dist proxy through megatron `dist_checkpointing.save`, streaming one chunk at a time.

megatron-core's own torch_dist strategy needs every tensor in memory before it writes. Here the
sharded state dict carries `meta` placeholders (shape and dtype only); megatron still validates the
sharding, writes the common state (`common.pt`; from 0.19 a `common_state` object in the .distcp files)
and `metadata.json`, and translates the keys, and the tensor files and `.metadata` are written by
torch.distributed.checkpoint's FileSystemWriter with megatron's MCoreSavePlanner, whose `resolve_data`
is asked for one write item at a time: that is when the chunk is read from the source (and cut to the
kept experts), written, and let go. The strategy is a TorchDistSaveShardedStrategy: from megatron-core
0.17 `dist_checkpointing.save` replaces any other strategy with its own.
"""
from __future__ import annotations

import contextlib
import os
import threading
import warnings
from typing import Optional

import torch

from mindspeed_proxy.proxy.core.errors import ConversionError
from mindspeed_proxy.proxy.core.keys import is_sliced, key_layer
from mindspeed_proxy.proxy.core.plan_types import kept_of
from mindspeed_proxy.proxy.core.tracker import TRACKER, iteration_dir_name
from mindspeed_proxy.proxy.io import hashing, pages
from mindspeed_proxy.proxy.io.dist.chunks import ChunkReader, expected, proxy_chunks
from mindspeed_proxy.proxy.io.dist.common import COMMON_FILE, KEPT_COMMON
from mindspeed_proxy.proxy.io.dist.group import ensure_group
from mindspeed_proxy.proxy.io.dist.reader import DistCheckpoint
from mindspeed_proxy.proxy.io.output_guard import disk_full
from mindspeed_proxy.proxy.select.policy import kept_fields


def _strategy(fetch: dict, progress=None, common_file: bool = False, threads: int = 1, digests=None):
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    class LazyPlanner(MCoreSavePlanner):
        """MCoreSavePlanner whose tensor data is read from the source when the writer asks for it."""

        def resolve_data(self, write_item):
            key = (write_item.index.fqn, tuple(write_item.index.offset or ()))
            if key not in fetch:
                return super().resolve_data(write_item)
            data = fetch[key]()
            if progress:
                progress(key[0])
            return data

    class StreamingSave(TorchDistSaveShardedStrategy):
        """torch_dist (version 1) save strategy that writes chunk by chunk from a single process."""

        def save(self, sharded_state_dict, checkpoint_dir):
            """Translate to PyTorch sharded tensors and write them with the lazy planner."""
            common = sharded_state_dict.get(COMMON_STATE_KEY)
            if common_file and common is not None:  # megatron-core 0.19 saving for a common.pt source
                del sharded_state_dict[COMMON_STATE_KEY]
                torch.save(common.data, os.path.join(str(checkpoint_dir), COMMON_FILE))
            state, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
            pyt_state = mcore_to_pyt_state_dict(state, False)
            writer = FileSystemWriter(str(checkpoint_dir), single_file_per_rank=True, sync_files=False,
                                      thread_count=threads)
            writer.fs = _KeepErrors(writer.fs, digests)
            try:
                dcp_save(pyt_state, storage_writer=writer,
                         planner=LazyPlanner(dedup_replicated_tensors=None, flatten_state_dict=False))
            finally:
                if writer.fs.errors:  # a writer thread's failure (DCP's extra threads would only print it)
                    raise writer.fs.errors[0]

        def can_handle_sharded_objects(self):
            """Sharded objects go into the same files (as megatron's torch_dist strategy does)."""
            return True

    return StreamingSave("torch_dist", 1)


class _Recording:
    """A DCP output stream whose writes of MIN_RECORD bytes or more (torch.save hands each tensor record to
    one write) are hashed on their way to the file: digests[(file offset, size)] = digest."""

    MIN_RECORD = 4 << 10

    def __init__(self, stream, digests: dict):
        self.stream, self.digests = stream, digests

    def write(self, data) -> int:
        """Write `data`, hashing it when large."""
        view = memoryview(data)
        if view.nbytes >= self.MIN_RECORD and view.c_contiguous:
            offset, view = self.stream.tell(), view.cast("B")
            h = hashing.new()
            for start in range(0, len(view), pages.WRITE_BYTES):
                piece = view[start:start + pages.WRITE_BYTES]
                h.update(piece)
                self.stream.write(piece)
            self.digests[(offset, len(view))] = h.hexdigest()
            return len(view)
        return self.stream.write(data)

    def __getattr__(self, name):
        return getattr(self.stream, name)


class _KeepErrors:
    """torch.distributed.checkpoint's file system with each file's write failure kept instead of raised in
    the writer thread (where DCP's extra threads would print it and go on); save() raises the first. With
    `digests`, every file's large writes are hashed: digests[real path] = {(offset, size): digest}."""

    def __init__(self, fs, digests: Optional[dict] = None):
        self.fs, self.errors, self.digests = fs, [], digests

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        """The file system's stream; an exception while writing it is recorded and swallowed."""
        try:
            with self.fs.create_stream(path, mode) as stream:
                if self.digests is None or "w" not in mode:
                    yield stream
                else:
                    yield _Recording(stream, self.digests.setdefault(os.path.realpath(str(path)), {}))
        except Exception as exc:
            self.errors.append(exc)

    def __getattr__(self, name):
        return getattr(self.fs, name)


COMMON_STATE_KEY = "common_state"  # where megatron-core 0.19's save puts the common state in the sharded dict


class _PerThread(threading.local):
    """Each writer thread's own source reader and last chunk (DCP resolves items on `threads` threads)."""

    def __init__(self, base: ChunkReader, readers: list):
        self.reader, self.previous = base.sibling(), []
        readers.append(self)


def _fetcher(local, chunk):
    def fetch():
        # the writer has finished with the chunk this thread fetched before this one: its mapped pages can
        # go now (torch's loader still holds a reference to it while it resolves the next item)
        previous = local.previous
        pages.drop(*previous)
        previous.clear()
        data = expected(local.reader, chunk)
        if tuple(data.shape) != tuple(chunk.sizes) or data.dtype != chunk.dtype:
            raise ConversionError(f"{chunk.key} at {list(chunk.offsets)}: source gives {tuple(data.shape)} "
                                  f"{data.dtype}, expected {chunk.sizes} {chunk.dtype}")
        data = data.contiguous()
        previous.append(data)
        return data
    return fetch


def save_streaming(ckpt, plan, common_state: dict, objects: dict, folder: str, content_metadata=None,
                   progress=None, threads: int = 1, digests: Optional[dict] = None) -> None:
    """Write the proxy's model tensors (chunk by chunk from the source), `objects` (ShardedObjects) and
    `common_state` into `folder` with megatron `dist_checkpointing.save`, on `threads` writer threads
    (torch.distributed.checkpoint then writes that many .distcp files); with `digests`, fill it with the
    digests of the records written ({real path: {(offset, size): digest}})."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from torch.distributed.checkpoint.api import CheckpointException

    reader = ckpt.chunk_reader().sibling()  # the layouts the feature pass parsed are not parsed again
    readers: list = []
    local = _PerThread(reader, readers)
    model, fetch = dict(objects), {}
    for chunk in proxy_chunks(ckpt, plan, reader, sorted(ckpt.index.tensors)):
        if any(g % s for g, s in zip(chunk.global_shape, chunk.sizes)):
            raise ConversionError(f"{ckpt.folder}: {chunk.key} is stored in uneven chunks {chunk.sizes} of "
                                  f"{chunk.global_shape} (not supported)")
        model[f"{chunk.key}@{chunk.offsets}"] = ShardedTensor(
            key=chunk.key, data=torch.empty(chunk.sizes, dtype=chunk.dtype, device="meta"), dtype=chunk.dtype,
            local_shape=chunk.sizes, global_shape=chunk.global_shape, global_offset=chunk.offsets,
            axis_fragmentations=tuple(g // s for g, s in zip(chunk.global_shape, chunk.sizes)), replica_id=0)
        fetch[(chunk.key, chunk.offsets)] = _fetcher(local, chunk)
    state = dict(common_state, model=model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # the proxy keeps the source's form of the common state: a common.pt source (megatron-core < 0.19,
            # which reads nothing else) gets a common.pt proxy whichever megatron-core converts
            common_file = os.path.isfile(os.path.join(ckpt.folder, COMMON_FILE))
            dist_checkpointing.save(state, folder, sharded_strategy=_strategy(fetch, progress, common_file, threads,
                                                                            digests),
                                    content_metadata=content_metadata)
    except ConversionError:
        raise
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        if disk_full(exc):
            raise  # convert() maps it to one line naming the device and the free space
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ConversionError(f"writing the torch_dist proxy failed: {type(exc).__name__}: {first}") from None
    finally:
        for each in readers:
            each.previous.clear()
            each.reader.forget()
        reader.forget()
    if not os.path.isfile(os.path.join(folder, ".metadata")):
        raise ConversionError(f"writing the torch_dist proxy failed: no .metadata in {folder}")


def proxy_objects(ckpt: DistCheckpoint, plan) -> dict:
    """{proxy object name: (key, shape, offset, source object name)} for every kept sharded object."""
    out = {}
    K = plan.target.num_experts
    for name, (key, shape, offset) in ckpt.index.objects.items():
        if not is_sliced(key):
            out[name] = (key, shape, offset, name)
            continue
        layer = key_layer(key)
        if len(shape) != (1 if layer is not None else 2):
            raise ConversionError(f"{ckpt.folder}: expert object {name} has shape {shape}, expected "
                                  f"{'(E,)' if layer is not None else '(L, E)'}")
        kept = kept_of(plan, offset[0] if layer is None else layer)
        if offset[-1] in kept:
            new = offset[:-1] + (kept.index(offset[-1]),)
            new_shape = shape[:-1] + (K,)
            out[f"{key}/shard_{'.'.join(map(str, new))}_{'.'.join(map(str, new_shape))}"] = (key, new_shape, new, name)
    return out


def write_dist(ckpt: DistCheckpoint, plan, new_args, out_root: str, progress=None, workers: int = 1,
               digests: Optional[dict] = None) -> str:
    """Write the proxy with megatron `dist_checkpointing.save` under `out_root`, one chunk in memory at a
    time per writer thread (`workers` threads; see save_streaming); return its iteration folder. `digests`:
    filled with the written records' digests (save_streaming)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    ensure_group()
    index, model = ckpt.index, {}
    objects = proxy_objects(ckpt, plan)
    for name, (key, shape, offset, source) in objects.items():
        model[name] = ShardedObject(key, index.object_value(source), shape, offset, replica_id=0)
    common = index.common
    state = {k: common[k] for k in kept_fields(KEPT_COMMON, plan.options) if k in common and k != "content_metadata"}
    state["args"] = new_args
    folder = os.path.join(out_root, iteration_dir_name(ckpt.iteration))
    os.makedirs(folder)
    save_streaming(ckpt, plan, state, model, folder, common.get("content_metadata"), progress, threads=workers,
                   digests=digests)
    with open(os.path.join(out_root, TRACKER), "w", encoding="utf-8") as fh:
        fh.write(str(ckpt.iteration))
    return folder
