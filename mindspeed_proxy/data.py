"""Data layer for the tiny-MoE example trainer, built on megatron-core's own dataset stack.

* ``ByteTokenizer``: 256 byte values + EOD (id 256), a ``MegatronTokenizerBase`` usable by
  ``GPTDatasetConfig``/``GPTDataset``.
* ``default_corpus_prefix``: the embedded default data set, i.e. the running interpreter's own
  standard-library ``.py`` sources, written once in Megatron's indexed format (.bin/.idx) with
  ``IndexedDatasetBuilder`` and cached under ``~/.cache/mindspeed_proxy``.
* ``build_gpt_datasets``: train/valid ``GPTDataset`` through ``BlendedMegatronDatasetBuilder``.
* ``get_batch``: stack samples into ``[b, s]`` tensors.
"""

import contextlib
import hashlib
import json
import os
import platform
import shutil
import sysconfig
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

import numpy
import torch

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import (
    DType,
    IndexedDataset,
    IndexedDatasetBuilder,
    _IndexReader,
    get_bin_path,
    get_idx_path,
)
from megatron.core.tokenizers import MegatronTokenizerBase

from mindspeed_proxy.byte_vocab import BYTE_VOCAB_SIZE, EOD_ID

CORPUS_FORMAT_VERSION = 1
CORPUS_MAX_BYTES = 4 * 1024 * 1024  # total source bytes in the default corpus
CORPUS_MAX_FILE_BYTES = 256 * 1024  # files above this (generated data tables) are skipped
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


class ByteTokenizer(MegatronTokenizerBase):
    """Byte-level tokenizer: token id == byte value (0..255), EOD == 256, no pad token."""

    def __init__(self) -> None:
        super().__init__(path="byte-level", config={})

    @property
    def vocab_size(self) -> int:
        """Unpadded vocabulary size (257); see ``padded_vocab_size`` for the model's size."""
        return BYTE_VOCAB_SIZE

    @property
    def eod(self) -> int:
        """End-of-document token id, appended after every document."""
        return EOD_ID

    @property
    def vocab(self) -> Dict[str, int]:
        """Token text -> id, bytes spelled ``<0xNN>`` as in sentencepiece byte fallback."""
        vocab = {f"<0x{i:02X}>": i for i in range(256)}
        vocab["<eod>"] = EOD_ID
        return vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        """Id -> token text."""
        return {i: t for t, i in self.vocab.items()}

    @property
    def unique_identifiers(self) -> OrderedDict:
        """Identity used by megatron's dataset index-cache hashing."""
        return OrderedDict(
            [("class", f"{__name__}.ByteTokenizer"), ("vocab_size", BYTE_VOCAB_SIZE), ("eod", EOD_ID)]
        )

    def tokenize(self, text) -> list:
        """Encode ``str`` (as UTF-8) or ``bytes`` to a list of byte ids (no EOD added)."""
        return list(text.encode("utf-8") if isinstance(text, str) else bytes(text))

    def decode_bytes(self, ids) -> bytes:
        """Ids -> raw bytes, dropping special ids (>= 256) such as EOD."""
        ids = numpy.asarray(ids, dtype=numpy.int64).reshape(-1)
        return ids[(ids >= 0) & (ids < 256)].astype(numpy.uint8).tobytes()

    def detokenize(self, ids) -> str:
        """Ids -> text (UTF-8, undecodable bytes replaced), special ids dropped."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, *args, **kwargs):
        """Not supported: raw pre-training tokenizer."""
        raise NotImplementedError("ByteTokenizer has no chat template")


def padded_vocab_size(make_vocab_size_divisible_by: int = 128, tensor_model_parallel_size: int = 1,
                      vocab_size: int = BYTE_VOCAB_SIZE) -> int:
    """Megatron-LM's padding rule: round vocab_size up to a multiple of divisible_by * TP (257 -> 384)."""
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


def _cache_root(cache_dir: Optional[str]) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mindspeed_proxy"


def stdlib_corpus_files(max_bytes: int = CORPUS_MAX_BYTES,
                        max_file_bytes: int = CORPUS_MAX_FILE_BYTES) -> Tuple[Path, list]:
    """Return (stdlib dir, [(relative posix path, size)]) of the default corpus, in document order.

    Order: all non-empty ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` (symlinked dirs
    not followed; dirs named test/tests/idle_test/site-packages/dist-packages/__pycache__ skipped;
    files larger than ``max_file_bytes`` skipped), sorted by relative POSIX path; the corpus is the
    longest prefix of that list whose total size is <= ``max_bytes``.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                size = path.stat().st_size
                if 0 < size <= max_file_bytes:
                    found.append((path.relative_to(root).as_posix(), size))
    found.sort()
    chosen, total = [], 0
    for rel, size in found:
        if total + size > max_bytes:
            break
        chosen.append((rel, size))
        total += size
    if not chosen:
        raise RuntimeError(f"no standard-library .py sources found under {root}")
    return root, chosen


def default_corpus_prefix(cache_dir: Optional[str] = None) -> str:
    """Build once (atomically) and return the .bin/.idx prefix of the stdlib-source default corpus.

    Location: ``<cache_dir or $XDG_CACHE_HOME/mindspeed_proxy or ~/.cache/mindspeed_proxy>/
    corpus-<python version>-<hash of file list and sizes>/stdlib.{bin,idx}`` plus
    ``manifest.json`` (see ``load_corpus_manifest``). The directory is written under a temporary
    name and renamed into place, so concurrent processes never see a partial corpus; if it already
    exists it is reused without reading any source file.
    """
    src, files = stdlib_corpus_files()
    key = hashlib.sha256(
        f"v{CORPUS_FORMAT_VERSION}|{src}|{CORPUS_MAX_BYTES}|{CORPUS_MAX_FILE_BYTES}\n".encode()
        + "".join(f"{rel}\t{size}\n" for rel, size in files).encode()
    ).hexdigest()[:16]
    root = _cache_root(cache_dir)
    final = root / f"corpus-{platform.python_version()}-{key}"
    prefix = str(final / "stdlib")
    if (final / "manifest.json").is_file():
        return prefix

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        dtype = DType.optimal_dtype(BYTE_VOCAB_SIZE)  # numpy.uint16
        tmp_prefix = str(tmp / "stdlib")
        builder = IndexedDatasetBuilder(get_bin_path(tmp_prefix), dtype=dtype)
        n_bytes = n_tokens = 0
        for rel, _ in files:
            data = (src / rel).read_bytes()
            doc = numpy.empty(len(data) + 1, dtype=dtype)
            doc[:-1] = numpy.frombuffer(data, dtype=numpy.uint8)
            doc[-1] = EOD_ID
            builder.add_document(doc, [doc.size])
            n_bytes += len(data)
            n_tokens += doc.size
        builder.finalize(get_idx_path(tmp_prefix))
        manifest = {
            "format_version": CORPUS_FORMAT_VERSION,
            "source_dir": str(src),
            "python_version": platform.python_version(),
            "files": len(files),
            "bytes": n_bytes,
            "tokens": n_tokens,
            "dtype": numpy.dtype(dtype).name,
            "vocab_size": BYTE_VOCAB_SIZE,
            "eod": EOD_ID,
            "max_bytes": CORPUS_MAX_BYTES,
            "max_file_bytes": CORPUS_MAX_FILE_BYTES,
            "paths": [rel for rel, _ in files],
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache may be shared
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "manifest.json").is_file():  # not a concurrent winner: stale leftover
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return prefix


def load_corpus_manifest(prefix: str) -> dict:
    """Read the JSON manifest (source_dir, files, bytes, tokens, paths, ...) next to a corpus prefix."""
    return json.loads((Path(prefix).parent / "manifest.json").read_text())


def validate_data_prefix(prefix: str) -> None:
    """Raise ValueError naming the path if ``prefix``.bin/.idx are missing or not a Megatron indexed dataset."""
    prefix = str(prefix)
    hint = ""
    if prefix.endswith((".bin", ".idx")):
        hint = f" (pass the prefix without extension, e.g. {prefix[:-4]!r})"
    missing = [p for p in (get_bin_path(prefix), get_idx_path(prefix)) if not os.path.isfile(p)]
    if missing:
        raise ValueError(f"data prefix {prefix!r}: missing file(s) {', '.join(missing)}{hint}")
    try:
        # megatron's own readers: _IndexReader first (a failing IndexedDataset() leaves a
        # half-built object whose __del__ raises), then IndexedDataset's consistency asserts.
        _IndexReader(get_idx_path(prefix), multimodal=False)
        dataset = IndexedDataset(prefix, mmap=False)
        index = dataset.index  # (its arrays are views of an mmap closed when `dataset` dies)
        expected = 0
        if index.sequence_count:
            expected = int(index.sequence_pointers[-1]) + int(index.sequence_lengths[-1]) * index.dtype_size
        actual = os.path.getsize(get_bin_path(prefix))
        if expected != actual:
            raise ValueError(f".idx describes {expected} bytes of tokens but .bin has {actual}")
    except Exception as err:
        raise ValueError(
            f"data prefix {prefix!r}: {get_idx_path(prefix)} / {get_bin_path(prefix)} is not a valid "
            f"Megatron indexed dataset (bad magic, truncated or inconsistent): "
            f"{type(err).__name__}: {err}{hint}"
        ) from err


@contextlib.contextmanager
def _process_lock(directory: Path):
    """Exclusive flock across independent processes, held by global rank 0 only inside torch.distributed
    (megatron builds on rank 0, barriers, then loads on the others: a lock on every rank could deadlock)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank():
        yield
        return
    from mindspeed_proxy.locking import file_lock

    with file_lock(directory / ".lock"):
        yield


def build_gpt_datasets(data_prefix: str, seq_length: int, seed: int, num_train_samples: int,
                       num_valid_samples: int = 0, split: str = "98,2,0",
                       cache_dir: Optional[str] = None):
    """Build (train_ds, valid_ds) megatron GPTDatasets over one indexed-dataset prefix.

    Items are dicts of ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` (length seq_length,
    no attention mask: causal). ``num_valid_samples=0`` gives one epoch of the valid split;
    ``valid_ds`` is None when ``split`` gives the valid split no weight. Megatron's index caches
    go under ``<cache root>/gpt-index/<hash of the data files' path/size/mtime>`` (never next to
    the data). Works without torch.distributed and inside an initialised group (all ranks must
    call; rank 0 builds the caches, barrier, other ranks load them).
    """
    validate_data_prefix(data_prefix)
    data_prefix = os.path.realpath(data_prefix)
    stats = [os.stat(p) for p in (get_idx_path(data_prefix), get_bin_path(data_prefix))]
    ident = f"{data_prefix}|" + "|".join(f"{s.st_size}:{s.st_mtime_ns}" for s in stats)
    path_to_cache = _cache_root(cache_dir) / "gpt-index" / hashlib.sha256(ident.encode()).hexdigest()[:16]
    path_to_cache.mkdir(parents=True, exist_ok=True)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([data_prefix], None),
        split=split,
        path_to_cache=str(path_to_cache),
        tokenizer=ByteTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        mmap_bin_files=True,
    )
    sizes = [num_train_samples, num_valid_samples or None, None]
    with _process_lock(path_to_cache):
        train_ds, valid_ds, _ = BlendedMegatronDatasetBuilder(
            GPTDataset, sizes, lambda: True, config
        ).build()
    return train_ds, valid_ds


def get_batch(dataset, sample_indices: Sequence[int]) -> Dict[str, Optional[torch.Tensor]]:
    """Stack dataset items into [b, s] tokens/labels/position_ids (int64), loss_mask (float); attention_mask None."""
    items = [dataset[int(i)] for i in sample_indices]
    return {
        "tokens": torch.stack([it["tokens"] for it in items]).long(),
        "labels": torch.stack([it["labels"] for it in items]).long(),
        "loss_mask": torch.stack([it["loss_mask"] for it in items]).float(),
        "position_ids": torch.stack([it["position_ids"] for it in items]).long(),
        "attention_mask": None,
    }
