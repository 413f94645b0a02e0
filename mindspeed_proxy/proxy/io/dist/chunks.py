"""Stored chunks of a torch_dist checkpoint, read one at a time, and the chunks of its proxy.

A torch_dist folder stores each global tensor as chunks (one per saving rank's shard: a layer, a TP
piece, one expert); `.metadata` says where each chunk's bytes are. `ChunkReader` parses `.metadata`
once and maps a single chunk straight from its byte range, read-only (no copy, no whole-tensor request
through a load plan), or assembles a region from the chunks that overlap it, keeping only the last
chunk read.
`proxy_chunks` lays out the proxy: the source's own chunking for every tensor, with the expert axis of
routed experts and router tensors cut from E to K (one chunk per kept expert when the source stores one
chunk per expert, else one chunk holding all K).
"""
from __future__ import annotations

import io
import os
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from mindspeed_proxy.proxy.core.errors import ConversionError
from mindspeed_proxy.proxy.core.keys import expert_axis, is_sliced, key_layer
from mindspeed_proxy.proxy.core.plan_types import kept_of
from mindspeed_proxy.proxy.io import pages


class _Slice(io.RawIOBase):
    """Read-only view of bytes [offset, offset + length) of an open binary file."""

    def __init__(self, fh, offset: int, length: int):
        super().__init__()
        self.fh, self.start, self.length, self.pos = fh, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = max(0, pos + (0, self.pos, self.length)[whence])
        return self.pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self.length - self.pos))
        self.fh.seek(self.start + self.pos)
        got = self.fh.readinto(view[:n]) if n else 0
        self.pos += got
        return got


def _layout(fh, offset: int, length: int) -> Optional[tuple]:
    """Where and how the tensor torch.save'd at [offset, offset + length) of open file `fh` is stored:
    (offset of its bytes in the file, nbytes, dtype, shape, stride, storage offset), or None if the record
    is not a plain stored one. The pickle is read with torch.load under `skip_data` (shape, strides, dtype;
    no data), the data record's place from the zip's local header."""
    import struct
    import zipfile

    view = _Slice(fh, offset, length)
    with zipfile.ZipFile(view) as archive:
        infos = archive.infolist()
    data = [i for i in infos if i.filename.endswith("/data/0")]
    order = [i for i in infos if i.filename.endswith("/byteorder")]
    if len([i for i in infos if "/data/" in i.filename and not i.filename.endswith(".pkl")]) != 1 or len(data) != 1 \
            or data[0].compress_type != zipfile.ZIP_STORED:
        return None
    if order:
        with zipfile.ZipFile(view) as archive:
            if archive.read(order[0]).decode() != "little":
                return None
    view.seek(data[0].header_offset)
    header = view.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        return None
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    start = data[0].header_offset + 30 + name_len + extra_len
    view.seek(0)
    with torch.serialization.skip_data():
        meta = torch.load(view, map_location="cpu", weights_only=True)
    nbytes = meta.untyped_storage().nbytes()
    if not isinstance(meta, torch.Tensor) or nbytes != data[0].file_size or start + nbytes > length:
        return None
    return offset + start, nbytes, meta.dtype, tuple(meta.shape), meta.stride(), meta.storage_offset()


def _mapped(path: str, layout: tuple) -> torch.Tensor:
    """The tensor stored as `layout` (_layout) in `path`, as a read-only memory map of its bytes (nothing
    copied; pages come and go with use)."""
    import numpy as np

    start, nbytes, dtype, shape, stride, storage_offset = layout
    if nbytes == 0:
        return torch.empty_strided(shape, stride, dtype=dtype)
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=start, shape=(nbytes,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only array: the tensor must never be written (it is not)
        flat = torch.from_numpy(raw)
    return flat.view(dtype).as_strided(shape, stride, storage_offset)


def record_spans(folder: str) -> dict:
    """{real path of a .distcp file: [(file offset, size) of each stored chunk's tensor bytes]} from the
    folder's `.metadata` and each chunk's zip headers (small reads; no tensor byte is read); chunks that are
    not plain stored records are left out. {} for a folder whose metadata cannot be read."""
    import struct
    import zipfile

    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(folder).read_metadata().storage_data
    except Exception:
        return {}
    out: dict = {}
    by_file: dict = {}
    for info in storage.values():
        by_file.setdefault(info.relative_path, []).append(info)
    for name, infos in by_file.items():
        path = os.path.join(folder, name)
        spans = out.setdefault(os.path.realpath(path), [])
        try:
            with open(path, "rb", buffering=0) as fh:
                for info in infos:
                    view = _Slice(fh, info.offset, info.length)
                    with zipfile.ZipFile(view) as archive:
                        data = [i for i in archive.infolist() if i.filename.endswith("/data/0")]
                    if len(data) != 1 or data[0].compress_type != zipfile.ZIP_STORED:
                        continue
                    view.seek(data[0].header_offset)
                    header = view.read(30)
                    if len(header) != 30 or header[:4] != b"PK\x03\x04":
                        continue
                    name_len, extra_len = struct.unpack("<HH", header[26:30])
                    spans.append((info.offset + data[0].header_offset + 30 + name_len + extra_len, data[0].file_size))
        except Exception:  # unreadable or truncated: the pass still digests the file; verification reports it
            continue
    return out


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


class ChunkReader:
    """The chunks of one torch_dist folder: listed from `.metadata`, loaded one at a time."""

    def __init__(self, folder: str, like: Optional["ChunkReader"] = None):
        """`like`: a reader of the same folder whose metadata and parsed chunk layouts this one shares."""
        from torch.distributed.checkpoint import FileSystemReader

        self.folder = folder
        if like is not None:
            self.metadata, self._chunk_sizes, self._layouts = like.metadata, like._chunk_sizes, like._layouts
        else:
            try:
                self.metadata = FileSystemReader(folder).read_metadata()
            except Exception as exc:
                raise ConversionError(f"truncated or unreadable shard: {folder}: {exc}") from None
            self._chunk_sizes: dict = {}
            self._layouts: dict = {}  # (file, offset, length) -> _layout of the chunk stored there
        self._last: tuple = (None, None)
        pages.register(*{os.path.join(folder, i.relative_path) for i in self.metadata.storage_data.values()})

    def _sizes_by_offsets(self, key: str) -> dict:
        sizes = self._chunk_sizes.get(key)
        if sizes is None:
            sizes = {tuple(c.offsets): tuple(c.sizes) for c in self.metadata.state_dict_metadata[key].chunks}
            self._chunk_sizes[key] = sizes
        return sizes

    def chunks(self, key: str) -> list:
        """[(offsets, sizes)] of the chunks stored for tensor `key`."""
        return list(self._sizes_by_offsets(key).items())

    def read(self, key: str, offsets: tuple) -> torch.Tensor:
        """The stored chunk of `key` that starts at `offsets` (a fresh tensor)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        if self._last[0] == (key, offsets):
            return self._last[1]
        info = self.metadata.storage_data.get(MetadataIndex(key, offsets))
        if info is None:
            raise ConversionError(f"{self.folder}: no stored chunk of {key} at {list(offsets)}")
        if getattr(info, "transform_descriptors", None):
            raise ConversionError(f"{self.folder}: chunk of {key} is stored with transforms "
                                  f"{info.transform_descriptors} (compressed checkpoints are not supported)")
        self._last = (None, None)
        path = os.path.join(self.folder, info.relative_path)
        place = (info.relative_path, info.offset, info.length)
        try:
            layout = self._layouts.get(place)
            if layout is None:  # not parsed yet
                with open(path, "rb", buffering=0) as fh:
                    layout = self._layouts[place] = _layout(fh, info.offset, info.length) or False
            if layout:
                tensor = _mapped(path, layout)
            else:  # not a plain stored record: torch.load copies it
                with open(path, "rb", buffering=0) as fh:
                    tensor = torch.load(_Slice(fh, info.offset, info.length), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ConversionError(f"truncated or unreadable shard: {path}: chunk of {key} at {list(offsets)} "
                                  f"({type(exc).__name__})") from None
        self._last = ((key, offsets), tensor)
        return tensor

    def region(self, key: str, offsets: tuple, sizes: tuple) -> torch.Tensor:
        """Global region [offsets, offsets + sizes) of `key`, from the chunks that overlap it."""
        offsets, sizes = tuple(offsets), tuple(sizes)
        if self._sizes_by_offsets(key).get(offsets) == sizes:
            return self.read(key, offsets)
        pieces = []
        for c_off, c_size in self.chunks(key):
            lo = [max(o, co) for o, co in zip(offsets, c_off)]
            hi = [min(o + s, co + cs) for o, s, co, cs in zip(offsets, sizes, c_off, c_size)]
            if all(a < b for a, b in zip(lo, hi)):
                pieces.append((c_off, c_size, lo, hi))
        if sum(_numel([b - a for a, b in zip(lo, hi)]) for _, _, lo, hi in pieces) != _numel(sizes):
            raise ConversionError(f"{self.folder}: stored chunks of {key} do not cover {list(offsets)}+{list(sizes)}")
        out = None
        for c_off, _, lo, hi in pieces:
            chunk = self.read(key, c_off)
            if out is None:
                out = torch.empty(sizes, dtype=chunk.dtype)
            src, dst = chunk, out
            for axis, (a, b) in enumerate(zip(lo, hi)):
                src = src.narrow(axis, a - c_off[axis], b - a)
                dst = dst.narrow(axis, a - offsets[axis], b - a)
            dst.copy_(src)
        return out

    def sibling(self) -> "ChunkReader":
        """A new reader of this folder sharing this one's metadata and parsed chunk layouts (nothing re-read)."""
        return ChunkReader(self.folder, like=self)

    def forget(self) -> None:
        """Drop the cached last chunk."""
        self._last = (None, None)


def layer_row_groups(reader: ChunkReader, key: str, layer: Optional[int], num_experts: int):
    """Lists of `num_experts` memory-mapped tensors, one per expert, each list the same stored region of
    every expert of `layer` (None: a per-layer key [E, ...]) in tensor `key`: one list per region of the
    stored chunk grid, mapped only while it is in use. Returns None (nothing read) if the chunks do not
    tile the experts as a grid (each region stored for every expert exactly once)."""
    a = 0 if layer is None else 1
    stored = [(o, s) for o, s in reader.chunks(key) if layer is None or o[0] <= layer < o[0] + s[0]]
    regions: dict = {}
    for o, s in stored:
        regions.setdefault((o[a + 1:], s[a + 1:]), []).append((o, s))
    shape = tuple(reader.metadata.state_dict_metadata[key].size)
    if sum(_numel(s) for o, s in regions) != _numel(shape[a + 1:]):
        return None
    for group in regions.values():
        group.sort(key=lambda c: c[0][a])
        starts = [o[a] for o, _ in group]
        ends = [o[a] + s[a] for o, s in group]
        if starts[0] != 0 or ends[-1] != num_experts or starts[1:] != ends[:-1]:
            return None
    return _row_groups(reader, key, layer, [regions[r] for r in sorted(regions)])


def _row_groups(reader: ChunkReader, key: str, layer: Optional[int], groups: list):
    a = 0 if layer is None else 1
    for group in groups:
        rows = []
        for o, s in group:
            chunk = reader.read(key, o)
            if layer is not None:
                chunk = chunk[layer - o[0]]
            rows += [chunk[j] for j in range(s[a])]
        reader.forget()
        yield rows
        del rows, chunk


@dataclass(frozen=True)
class OutChunk:
    """One chunk of a proxy tensor and where its content comes from in the source.

    Unsliced: the source region at the same place. Sliced: for each index j along `axis` of this chunk,
    the source region with that index replaced by `kept[j]`."""

    key: str
    global_shape: tuple
    dtype: torch.dtype
    offsets: tuple
    sizes: tuple
    axis: Optional[int] = None
    kept: Optional[tuple] = None


def expected(reader: ChunkReader, chunk: OutChunk) -> torch.Tensor:
    """The content `chunk` must hold, assembled from the source (`reader` over the source folder)."""
    if chunk.axis is None:
        return reader.region(chunk.key, chunk.offsets, chunk.sizes)
    a, first, count = chunk.axis, chunk.offsets[chunk.axis], chunk.sizes[chunk.axis]
    ids = list(chunk.kept[first:first + count])
    if count == 1:
        off = chunk.offsets[:a] + (ids[0],) + chunk.offsets[a + 1:]
        return reader.region(chunk.key, off, chunk.sizes)
    full = reader.region(chunk.key, chunk.offsets[:a] + (0,) + chunk.offsets[a + 1:],
                         chunk.sizes[:a] + (reader.metadata.state_dict_metadata[chunk.key].size[a],)
                         + chunk.sizes[a + 1:])
    return full.index_select(a, torch.tensor(ids, dtype=torch.long))


def proxy_chunks(ckpt, plan, reader: ChunkReader, keys) -> list:
    """The proxy's chunks of tensors `keys`: the source chunking, expert axes cut to the kept experts."""
    K, out = plan.target.num_experts, []
    for key in keys:
        shape, dtype = ckpt.index.tensors[key]
        stored = reader.chunks(key)
        if not is_sliced(key):
            out += [OutChunk(key, tuple(shape), dtype, o, s) for o, s in stored]
            continue
        a = expert_axis(key)
        new_shape = tuple(K if i == a else n for i, n in enumerate(shape))
        per_expert = all(s[a] == 1 for _, s in stored)
        rests = sorted({(o[a + 1:], s[a + 1:]) for o, s in stored})
        if a == 0:
            leads = [((), (), key_layer(key))]
        else:
            leads = [((l,), (1,), l) for l in sorted({o[0] + i for o, s in stored for i in range(s[0])})]
        for lead_o, lead_s, layer in leads:
            kept = tuple(kept_of(plan, layer))
            for rest_o, rest_s in rests:
                starts = range(K) if per_expert else [0]
                for j in starts:
                    out.append(OutChunk(key, new_shape, dtype, lead_o + (j,) + rest_o,
                                        lead_s + (1 if per_expert else K,) + rest_s, a, kept))
    return out
