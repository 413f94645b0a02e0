"""Tests for mindspeed_proxy.data (byte tokenizer, stdlib default corpus, megatron GPTDataset)."""

import os
import sysconfig
from pathlib import Path

import numpy
import pytest
import torch

from mindspeed_proxy import data as D
from mindspeed_proxy.testing import run_distributed

SEQ = 64


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("msp_cache")


@pytest.fixture(scope="module")
def prefix(cache):
    return D.default_corpus_prefix(str(cache))


def _raw_docs(prefix):
    """Read the documents straight from the .bin with numpy, using only the .idx lengths."""
    ds = D.IndexedDataset(prefix)  # keep alive: its arrays are views of mmaps closed in __del__
    lengths = numpy.array(ds.sequence_lengths, dtype=numpy.int64)
    del ds
    raw = numpy.fromfile(prefix + ".bin", dtype=numpy.uint16)
    assert raw.size == lengths.sum()
    bounds = numpy.concatenate([[0], numpy.cumsum(lengths)])
    return [raw[bounds[i]:bounds[i + 1]] for i in range(len(lengths))]


def test_tokenizer_roundtrip_and_vocab():
    tok = D.ByteTokenizer()
    assert tok.vocab_size == 257 and tok.eod == 256
    ids = tok.tokenize("héllo\n")
    assert ids == list("héllo\n".encode())
    assert tok.detokenize(ids + [tok.eod]) == "héllo\n"
    assert tok.decode_bytes(numpy.array([0, 255, 256])) == b"\x00\xff"
    assert len(tok.vocab) == 257 and tok.inv_vocab[256] == "<eod>"
    assert D.padded_vocab_size(8) == 264 and D.padded_vocab_size() == 384
    assert D.padded_vocab_size(128, 4) == 512


def test_default_corpus_builds_and_is_reused(cache, prefix):
    files = [Path(prefix + ".bin"), Path(prefix + ".idx"), Path(prefix).parent / "manifest.json"]
    assert all(f.is_file() for f in files)
    assert Path(prefix).parent.parent == cache
    mtimes = [f.stat().st_mtime_ns for f in files]
    again = D.default_corpus_prefix(str(cache))
    assert again == prefix
    assert [f.stat().st_mtime_ns for f in files] == mtimes  # reused, not rebuilt (its speed: not a test's job)
    assert not [p for p in cache.iterdir() if ".tmp-" in p.name]  # temp dir renamed away

    m = D.load_corpus_manifest(prefix)
    ds = D.IndexedDataset(prefix)
    assert m["files"] == len(ds) == len(m["paths"]) > 10
    assert m["tokens"] == int(ds.sequence_lengths.sum()) == m["bytes"] + m["files"]
    assert 1_000_000 < m["bytes"] <= D.CORPUS_MAX_BYTES
    assert m["source_dir"] == sysconfig.get_paths()["stdlib"]
    assert ds.index.dtype == numpy.uint16
    D.validate_data_prefix(prefix)


def test_documents_are_exact_stdlib_files_in_documented_order(prefix):
    m = D.load_corpus_manifest(prefix)
    src = Path(m["source_dir"])
    # independent recomputation of the documented order: sorted relative posix paths
    eligible = sorted(
        p.relative_to(src).as_posix()
        for p in src.rglob("*.py")
        if not (set(p.relative_to(src).parts[:-1]) & {"test", "tests", "idle_test", "site-packages",
                                                       "dist-packages", "__pycache__"})
        and 0 < p.stat().st_size <= D.CORPUS_MAX_FILE_BYTES
    )
    assert m["paths"] == eligible[: len(m["paths"])]
    assert m["paths"] == sorted(m["paths"])
    tok = D.ByteTokenizer()
    ds = D.IndexedDataset(prefix)
    docs = _raw_docs(prefix)
    for i in [0, 1, len(docs) - 1]:
        expected = (src / m["paths"][i]).read_bytes()
        assert tok.decode_bytes(ds[i]) == expected  # through megatron's reader
        assert docs[i][-1] == D.EOD_ID and (docs[i][:-1] < 256).all()
        assert docs[i][:-1].astype(numpy.uint8).tobytes() == expected  # raw .bin


def test_gpt_dataset_items_and_label_shift(prefix, cache):
    train, valid = D.build_gpt_datasets(prefix, SEQ, seed=1234, num_train_samples=100,
                                        num_valid_samples=7, cache_dir=str(cache))
    assert len(train) >= 100 and len(valid) >= 7
    # the index caches live in our cache, nothing next to the data
    assert any((cache / "gpt-index").rglob("*shuffle_index.npy"))
    assert not (Path(prefix).parent / "cache").exists()

    docs = _raw_docs(prefix)
    lengths = numpy.array([len(d) for d in docs], dtype=numpy.int64)
    ordered = train.document_index
    stream = numpy.concatenate([docs[d] for d in ordered]).astype(numpy.int64)
    starts = numpy.concatenate([[0], numpy.cumsum(lengths[ordered])])
    for i in [0, 1, 2, 50, len(train) - 1]:
        item = train[i]
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert item[key].shape == (SEQ,), key
        assert "attention_mask" not in item
        assert torch.equal(item["labels"][:-1], item["tokens"][1:])
        j = int(train.shuffle_index[i])
        doc_pos, offset = (int(x) for x in train.sample_index[j])
        begin = starts[doc_pos] + offset
        window = torch.from_numpy(stream[begin:begin + SEQ + 1])
        assert torch.equal(item["tokens"], window[:-1])
        assert torch.equal(item["labels"], window[1:])
        assert torch.equal(item["position_ids"], torch.arange(SEQ))
        assert torch.equal(item["loss_mask"], torch.ones(SEQ))

    batch = D.get_batch(train, [0, 3, 5])
    assert batch["attention_mask"] is None
    for key, dtype in [("tokens", torch.int64), ("labels", torch.int64),
                       ("loss_mask", torch.float32), ("position_ids", torch.int64)]:
        assert batch[key].shape == (3, SEQ) and batch[key].dtype == dtype
    assert torch.equal(batch["tokens"][1], train[3]["tokens"])
    assert int(batch["tokens"].max()) <= D.EOD_ID


def test_seed_changes_order_and_is_reproducible(prefix, cache):
    def first_samples(seed):
        train, _ = D.build_gpt_datasets(prefix, SEQ, seed=seed, num_train_samples=50,
                                        cache_dir=str(cache))
        return D.get_batch(train, range(8))["tokens"]

    a1 = first_samples(1)
    a2 = first_samples(1)  # second time: megatron cache hit
    b = first_samples(2)
    assert torch.equal(a1, a2)
    assert not torch.equal(a1, b)


def test_validate_data_prefix_errors(tmp_path, prefix):
    missing = str(tmp_path / "nope" / "corpus")
    with pytest.raises(ValueError, match="missing") as exc:
        D.validate_data_prefix(missing)
    assert missing in str(exc.value)

    garbage = tmp_path / "garbage"
    (tmp_path / "garbage.bin").write_bytes(os.urandom(100))
    (tmp_path / "garbage.idx").write_bytes(b"not an index at all" * 3)
    with pytest.raises(ValueError, match="not a valid Megatron indexed dataset") as exc:
        D.validate_data_prefix(str(garbage))
    assert str(garbage) in str(exc.value)

    trunc = tmp_path / "trunc"
    (tmp_path / "trunc.bin").write_bytes(Path(prefix + ".bin").read_bytes()[:1000])
    (tmp_path / "trunc.idx").write_bytes(Path(prefix + ".idx").read_bytes()[:40])
    with pytest.raises(ValueError, match=str(trunc)):
        D.validate_data_prefix(str(trunc))

    with pytest.raises(ValueError, match="without extension"):
        D.validate_data_prefix(str(garbage) + ".bin")
    with pytest.raises(ValueError, match="missing"):
        D.build_gpt_datasets(missing, SEQ, seed=0, num_train_samples=4, cache_dir=str(tmp_path))


def _build_in_group(cache: str) -> dict:
    """On each gloo rank: both ranks race to build the corpus, then read the same samples."""
    prefix = D.default_corpus_prefix(cache)
    train, valid = D.build_gpt_datasets(prefix, 32, seed=7, num_train_samples=40,
                                        num_valid_samples=4, cache_dir=cache)
    batch = D.get_batch(train, range(6))
    torch.distributed.barrier()
    return {"prefix": prefix, "len": [len(train), len(valid)], "tokens": batch["tokens"].tolist()}


def test_inside_gloo_group(tmp_path):
    cache = tmp_path / "cache"
    r0, r1 = run_distributed(_build_in_group, 2, str(cache))  # two processes forked from the fork server
    assert r0 == r1
    assert len(list(cache.glob("corpus-*"))) == 1
    assert not [p for p in cache.iterdir() if ".tmp-" in p.name]
    single, _ = D.build_gpt_datasets(r0["prefix"], 32, seed=7, num_train_samples=40,
                                     num_valid_samples=4, cache_dir=str(tmp_path / "other"))
    assert D.get_batch(single, range(6))["tokens"].tolist() == r0["tokens"]
