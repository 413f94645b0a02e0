"""Convert a Megatron MoE checkpoint into a proxy: plan, write to a temporary folder, verify, rename."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import Callable, Optional, Protocol

from mindspeed_proxy.proxy.core.errors import ConversionError
from mindspeed_proxy.proxy.core.options import Options
from mindspeed_proxy.proxy.core.tracker import resolve_iteration
from mindspeed_proxy.proxy.core import process_state
from mindspeed_proxy.proxy.io import hashing, output_guard, pages
from mindspeed_proxy.proxy.io.legacy.reader import LegacyCheckpoint
from mindspeed_proxy.proxy.io.legacy.writer import write_legacy
from mindspeed_proxy.proxy.io.layer_summary import describe_layer_types, layer_type_summary
from mindspeed_proxy.proxy.io.manifest import build_manifest, write_manifest
from mindspeed_proxy.proxy.plan import describe, launch_flags, make_plan
from mindspeed_proxy.proxy.printed_launch import launch_lines
from mindspeed_proxy.proxy.verify.legacy import verify_legacy


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def check_paths(load: str, save: Optional[str], overwrite: bool, dry_run: bool) -> None:
    """Refuse a missing source, OUT_DIR inside CKPT_DIR (or the reverse), an existing OUT_DIR."""
    if not os.path.isdir(load):
        raise ConversionError(f"--load {load}: no such directory")
    if save is None:
        if not dry_run:
            raise ConversionError("--save is required unless --dry-run")
        return
    if _inside(save, load):
        raise ConversionError(f"--save {save} is inside --load {load}: the source is never written")
    if _inside(load, save):
        raise ConversionError(f"--load {load} is inside --save {save}: writing there could destroy the source")
    if os.path.exists(save) and not overwrite and not dry_run:
        raise ConversionError(f"--save {save} already exists (pass --overwrite to replace it)")
    parent = os.path.dirname(os.path.abspath(save))
    if not os.path.isdir(parent):
        raise ConversionError(f"--save {save}: parent folder {parent} does not exist")


def open_checkpoint(load: str, iteration: Optional[int], fmt: str = "auto", trust: bool = False):
    """The checkpoint reader for the format found under `load` (`fmt`: auto, megatron or hf); `trust`:
    full unpickling of the `.pt` files (--trust-checkpoint), else megatron-core's safe globals only."""
    if fmt == "hf" or (fmt == "auto" and os.path.isdir(load)):
        from mindspeed_proxy.proxy.io.hf.checkpoint import HFCheckpoint, looks_like_hf

        if fmt == "hf" or looks_like_hf(load):
            return HFCheckpoint(load)
    _, folder = resolve_iteration(load, iteration)
    names = os.listdir(folder)
    if "metadata.json" in names or "common.pt" in names or ".metadata" in names:
        from mindspeed_proxy.proxy.io.dist.reader import DistCheckpoint

        return DistCheckpoint(load, iteration, trust)
    return LegacyCheckpoint(load, iteration, trust)


def _progress(desc: str) -> Callable:
    def wrap(items):
        try:
            from tqdm import tqdm
        except ImportError:
            return items
        return tqdm(items, desc=desc, unit="layer", file=sys.stderr, disable=not sys.stderr.isatty())
    return wrap


def default_workers() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def convert(load: str, save: Optional[str], options: Options, iteration: Optional[int] = None,
            dry_run: bool = False, overwrite: bool = False, echo: Callable = print, fmt: str = "auto",
            workers: int = 1):
    """Run the conversion (or only plan it with `dry_run`); return the Plan. ConversionError on bad input.
    `fmt`: auto (a folder with config.json and safetensors is Hugging Face), megatron or hf. `workers`:
    legacy files written by that many forked processes, torch_dist by that many writer threads."""
    if workers < 1:
        raise ConversionError(f"--workers {workers}: must be at least 1")
    check_paths(load, save, overwrite, dry_run)
    with process_state.preserved():  # the process as found: RNG streams, megatron's RNG tracker, environment
        if dry_run:
            return _open_and_convert(load, save, options, iteration, dry_run, echo, fmt, workers)
        with output_guard.OutputLock(save):
            check_paths(load, save, overwrite, dry_run)  # again under the lock: a finished rival's OUT_DIR counts
            return _open_and_convert(load, save, options, iteration, dry_run, echo, fmt, workers)


def _open_and_convert(load, save, options, iteration, dry_run, echo, fmt, workers):
    if options.trust_checkpoint:
        from mindspeed_proxy.checkpoint_io import warn_trusted

        warn_trusted(f"--load {load}")
    ckpt = open_checkpoint(load, iteration, fmt, options.trust_checkpoint)
    try:
        if ckpt.format == "hf":
            from mindspeed_proxy.proxy.io.hf.checkpoint import check_options

            check_options(options, iteration)
        return _convert(ckpt, save, options, dry_run, echo, workers)
    finally:
        ckpt.close()


def _convert(ckpt, save: Optional[str], options: Options, dry_run: bool, echo: Callable, workers: int = 1):
    pages.register(*ckpt.file_paths())  # source pages read through mmap are dropped once used
    # every source byte is read once, by this pass (whole-file digests; legacy: every tensor record's too)
    hasher = None if dry_run else hashing.SourcePass(ckpt.file_paths(), records=_record_spans(ckpt))
    try:
        return _write(ckpt, save, options, dry_run, echo, hasher, workers)
    finally:
        if hasher is not None:
            hasher.cancel()
        pages.unregister_all()


def _record_spans(ckpt):
    """What the source pass digests besides whole files: legacy torch.save records, torch_dist chunks."""
    if ckpt.format == "torch":
        return True
    if ckpt.format != "torch_dist":
        return False
    from mindspeed_proxy.proxy.io.dist.chunks import record_spans

    found: dict = {}

    def spans(path: str) -> list:
        if not found:
            found.update(record_spans(ckpt.folder) or {"": []})
        return found.get(os.path.realpath(path), [])
    return spans


def _write(ckpt, save: Optional[str], options: Options, dry_run: bool, echo: Callable, hasher, workers: int = 1):
    plan = make_plan(ckpt, options, progress=_progress("clustering"))
    pages.trim_heap()
    echo(describe(plan))
    if dry_run:
        echo("dry run: nothing written")
        return plan
    output_guard.check_free_space(save, plan.bytes_to_write)
    parent, base = os.path.split(os.path.abspath(save))
    tmp = tempfile.mkdtemp(prefix=f".{base}.proxy-tmp-", dir=parent)
    try:
        verification = WRITE_AND_VERIFY[ckpt.format](ckpt, plan, tmp, hasher, workers)
        manifest = build_manifest(ckpt, plan, hasher.result(), verification, ckpt.format)
        sizes = _tensor_sizes(ckpt, tmp)
        if sizes is not None:
            manifest["layer_types"] = layer_type_summary(*sizes, plan)
        write_manifest(tmp, manifest)
        if os.path.exists(save):
            shutil.rmtree(save)
        os.rename(tmp, save)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        full = None if isinstance(exc, ConversionError) and not output_guard.disk_full(exc) else \
            output_guard.write_error(exc, save, plan.bytes_to_write)
        if full is not None:
            raise full from None
        if not isinstance(exc, (ConversionError, KeyboardInterrupt, SystemExit)) and _broken_pool(exc):
            raise ConversionError(f"a worker process died while writing the proxy ({exc}); nothing written") from None
        raise
    echo(f"verified: {verification}")
    if "layer_types" in manifest:
        echo(describe_layer_types(manifest["layer_types"]))
    echo(f"proxy written to {save}")
    if ckpt.format == "hf":
        echo(f"load with: AutoModelForCausalLM.from_pretrained({save!r}) ({plan.target.num_experts} experts)")
        return plan
    for line in launch_lines(launch_flags(plan, save), plan.source.world_size, plan.target):
        echo(line)
    return plan


def _tensor_sizes(ckpt, out: str) -> Optional[tuple]:
    """({key: (shape, dtype)} of the source, of the proxy written under `out`) for the per-layer-type summary;
    None for Hugging Face checkpoints, legacy TP > 1 and uneven legacy pipeline splits."""
    if ckpt.format == "torch_dist":
        from mindspeed_proxy.proxy.io.dist.summary import metadata_tensors

        return ckpt.index.tensors, metadata_tensors(os.path.join(out, os.path.relpath(ckpt.folder, ckpt.root)))
    if ckpt.format == "torch":
        from mindspeed_proxy.proxy.io.legacy.summary import legacy_tensors

        before = legacy_tensors(ckpt)
        return None if before is None else (before, legacy_tensors(LegacyCheckpoint(out, ckpt.iteration,
                                                                                     ckpt.trust)))
    return None


class WriteAndVerify(Protocol):
    """One format's writer and verifier: write the proxy of `plan` under `out`, verify it, return the verification summary."""

    def __call__(self, ckpt, plan, out: str, hasher, workers: int) -> dict: ...


def _write_hf(ckpt, plan, out: str, hasher, workers: int) -> dict:
    from mindspeed_proxy.proxy.io.hf.checkpoint import write_hf
    from mindspeed_proxy.proxy.verify.hf import verify_hf

    write_hf(ckpt, plan, out)
    pages.trim_heap()
    return verify_hf(ckpt, plan, out)


def _write_dist(ckpt, plan, out: str, hasher, workers: int) -> dict:
    from mindspeed_proxy.proxy.io.dist.writer import write_dist
    from mindspeed_proxy.proxy.verify.common import StreamCompare
    from mindspeed_proxy.proxy.verify.dist import verify_dist

    written: dict = {}
    write_dist(ckpt, plan, plan.new_args, out, workers=workers, digests=written)
    pages.trim_heap()
    return verify_dist(ckpt, plan, out, StreamCompare(written, hasher))


def _write_legacy(ckpt, plan, out: str, hasher, workers: int) -> dict:
    from mindspeed_proxy.proxy.verify.common import StreamCompare

    written = write_legacy(ckpt, plan, plan.target, plan.new_args, out, workers=workers)
    pages.trim_heap()
    hasher.result()  # the source records' digests, compared with the written records' digests
    return verify_legacy(ckpt, plan, out, StreamCompare(written, hasher))


# the writer of each source format (SourceCheckpoint.format), chosen once by the reader that opened it
WRITE_AND_VERIFY: dict[str, WriteAndVerify] = {"hf": _write_hf, "torch_dist": _write_dist, "torch": _write_legacy}


def _broken_pool(exc: BaseException) -> bool:
    from concurrent.futures.process import BrokenProcessPool

    return isinstance(exc, BrokenProcessPool)
