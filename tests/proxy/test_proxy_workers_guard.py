"""The converter's speed path and its output guard on real checkpoints: --workers N writes bit-identical
proxies, verification from the written stream's digests catches a corrupted written byte, two conversions
to one OUT_DIR never both succeed, and a full disk (before or during the write) is one line, exit 2,
nothing written."""
import errno
import json
import os
import subprocess
import sys
import traceback
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from mindspeed_proxy.proxy.io import output_guard
from mindspeed_proxy.proxy.cli import main

REPO = Path(__file__).resolve().parents[2]
FLAGS = ["--target-expert-parallel-size", "2", "--target-num-experts", "4"]


def _files(root):
    """{relative path: bytes} of every file under root but the manifest."""
    out = {}
    for base, _, names in os.walk(root):
        for name in names:
            path = os.path.join(base, name)
            if name != "proxy_manifest.json":
                out[os.path.relpath(path, root)] = open(path, "rb").read()
    return out


def _left_behind(parent, keep=()):
    return sorted(n for n in os.listdir(parent) if n not in keep)


def _one_line(err: str) -> str:
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_workers_write_bit_identical_legacy_proxies_verified_from_digests(checkpoints, tmp_path):
    """EP4 -> EP2: two proxy files, written in-process (--workers 1) and by two forked workers: every file
    byte-identical, same manifest apart from its time stamp; the kept experts were verified from digests."""
    src = checkpoints("ep4")
    outs = {n: str(tmp_path / f"w{n}") for n in (1, 2)}
    for n, out in outs.items():
        assert main(["--load", src, "--save", out, *FLAGS, "--workers", str(n)]) == 0
    one, two = _files(outs[1]), _files(outs[2])
    assert len([p for p in one if p.endswith(".pt")]) == 2 and one == two
    manifests = [json.load(open(os.path.join(o, "proxy_manifest.json"))) for o in outs.values()]
    for m in manifests:
        m.pop("created")
    assert manifests[0] == manifests[1]
    counts = manifests[0]["verification"]
    from mindspeed_proxy.proxy.io.legacy.writer import RecordingWriter

    tensors = [(k, v) for p in one if p.endswith(".pt")
               for k, v in torch.load(os.path.join(outs[1], p), mmap=True, weights_only=False)["model"].items()
               if isinstance(v, torch.Tensor)]
    expert_bytes = sum(v.nbytes for k, v in tensors if ".experts." in k)
    whole = sum(v.nbytes for k, v in tensors if v.nbytes >= RecordingWriter.MIN_RECORD and ".router." not in k)
    assert counts["experts"] == 2 * 4 and counts["bytes_from_digests"] == whole >= expert_bytes > 0
    assert _left_behind(tmp_path) == ["w1", "w2"]  # no lock file, temp or scratch folder left


def test_workers_zero_refused_in_one_line(checkpoints, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["--load", checkpoints("ep4"), "--save", str(out), *FLAGS, "--workers", "0"]) == 2
    assert "--workers 0: must be at least 1" in _one_line(capsys.readouterr().err)
    assert not out.exists()


def test_corrupted_written_byte_caught_from_digests(checkpoints, tmp_path, monkeypatch, capsys):
    """A writer that puts one wrong byte into a kept expert: the written record's digest differs from the
    source record's, the conversion is refused in one line and nothing is left; the verifier never re-read
    the expert from the written file to find out."""
    from mindspeed_proxy.proxy.io.legacy import writer as legacy_writer
    from mindspeed_proxy.proxy.verify import common, legacy

    build = legacy_writer.build_rank_state
    hit = []

    def corrupt(ckpt, plan, *args, **kwargs):
        state = build(ckpt, plan, *args, **kwargs)
        if not hit:
            model = state[ckpt.chunks[0]]
            key = next(k for k in sorted(model) if ".experts." in k and k.endswith("weight"))
            bad = model[key].clone()
            bad.view(-1).view(torch.uint8)[bad.nbytes // 2] ^= 0x10
            model[key] = bad
            hit.append(key)
        return state

    reread = []
    compare = common.equal_in_blocks
    monkeypatch.setattr(legacy_writer, "build_rank_state", corrupt)
    for module in (common, legacy):
        monkeypatch.setattr(module, "equal_in_blocks", lambda a, b, *r: reread.append(a.nbytes) or compare(a, b, *r))
    out = tmp_path / "out"
    assert main(["--load", checkpoints("ep4"), "--save", str(out), *FLAGS, "--workers", "1"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert hit and "verification failed" in line and "differs from source expert" in line
    assert not reread or max(reread) < 4 << 10  # only small tensors compared by reading
    assert _left_behind(tmp_path) == []


def test_locked_output_refuses_a_second_conversion(checkpoints, tmp_path):
    """While one conversion holds OUT_DIR, another to it is refused in one line naming the holder (exit 2,
    nothing of its own written, the holder's lock left alone); once released, a conversion succeeds."""
    src, out = checkpoints("ep4"), tmp_path / "out"
    cmd = [sys.executable, str(REPO / "convert_to_proxy.py"), "--load", src, "--save", str(out), *FLAGS]
    with output_guard.OutputLock(str(out)) as lock:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert run.returncode == 2
        line = _one_line(run.stderr)
        assert f"another conversion (pid {os.getpid()}) is writing it" in line and str(out) in line
        assert _left_behind(tmp_path) == [os.path.basename(lock.path)] and not out.exists()
    assert _left_behind(tmp_path) == []
    assert subprocess.run(cmd, capture_output=True, text=True, timeout=300).returncode == 0
    assert _left_behind(tmp_path) == ["out"]


def test_two_conversions_started_together_one_succeeds(checkpoints, tmp_path):
    """Two CLI conversions to one OUT_DIR with different K, started together: exactly one reports success,
    the other is refused in one line (locked, or OUT_DIR already there), and OUT_DIR holds the winner's K."""
    src, out = checkpoints("ep4"), tmp_path / "out"
    procs = {k: subprocess.Popen([sys.executable, str(REPO / "convert_to_proxy.py"), "--load", src, "--save",
                                  str(out), "--target-expert-parallel-size", "2", "--target-num-experts", str(k)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in (2, 4)}
    results = {k: (p.wait(timeout=300), *p.communicate()) for k, p in procs.items()}
    won = [k for k, (rc, stdout, _) in results.items() if rc == 0 and "proxy written" in stdout]
    assert len(won) == 1, results
    (lost,) = set(results) - set(won)
    rc, stdout, stderr = results[lost]
    assert rc == 2 and "proxy written" not in stdout
    line = _one_line(stderr)
    assert "another conversion" in line or "already exists" in line
    manifest = json.load(open(out / "proxy_manifest.json"))
    assert manifest["num_experts"]["proxy"] == won[0]
    assert _left_behind(tmp_path) == ["out"]


def test_free_space_precheck_refuses_in_one_line(checkpoints, tmp_path, monkeypatch, capsys):
    """Less free space than the plan's bytes x 1.02: one line naming the device, bytes needed and free."""
    src, out = checkpoints("ep4"), tmp_path / "out"
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(output_guard.shutil, "disk_usage", lambda path: usage(1 << 30, (1 << 30) - 4096, 4096))
    assert main(["--load", src, "--save", str(out), *FLAGS]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "not enough free space on" in line and "bytes needed" in line and "4096 bytes free" in line
    assert output_guard.device_of(str(tmp_path)).split()[0] in line
    assert _left_behind(tmp_path) == []


def test_disk_full_during_write_is_one_line(checkpoints, tmp_path, monkeypatch, capsys):
    """The pre-check passed but the disk fills while torch.save writes (ENOSPC from the file): torch's
    inline_container error becomes one line, exit 2, nothing left behind."""
    from mindspeed_proxy.proxy.io import pages

    written = [0]
    real = pages.DropAfterWrite.write

    def fill(self, data):
        written[0] += memoryview(data).nbytes
        if written[0] > 64 << 10:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(pages.DropAfterWrite, "write", fill)
    monkeypatch.setattr("mindspeed_proxy.proxy.io.legacy.writer.RecordingWriter.write", fill)
    out = tmp_path / "out"
    assert main(["--load", checkpoints("ep4"), "--save", str(out), *FLAGS, "--workers", "1"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "the disk filled up while writing the proxy" in line and "nothing written" in line
    assert _left_behind(tmp_path) == []


def test_full_disk_errors_recognised():
    """OSError ENOSPC, torch's inline_container message, DCP's CheckpointException holding an ENOSPC, and
    an error chained from one are a full disk; other errors are not."""
    from torch.distributed.checkpoint.api import CheckpointException

    enospc = OSError(errno.ENOSPC, "No space left on device")
    torch_save = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    dcp = CheckpointException("save failed", {0: (enospc, traceback.extract_stack())})
    try:
        try:
            raise enospc
        except OSError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as chained:
        wrapped = chained
    assert all(output_guard.disk_full(e) for e in (enospc, torch_save, dcp, wrapped))
    assert not any(output_guard.disk_full(e) for e in (OSError(errno.EACCES, "denied"), RuntimeError("shape"),
                                                        CheckpointException("x", {0: (KeyError("k"), None)})))
    line = str(output_guard.write_error(dcp, "/nonexistent-parent/out", 1000))
    assert "\n" not in line and "1020 bytes needed" in line


def test_bench_convert_creates_its_workdir(tmp_path):
    """bench_convert.py --workdir D creates D (and its parents), runs a tiny legacy measurement and prints
    the ratios against the targets."""
    work = tmp_path / "a" / "b"
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_convert.py"), "--workdir", str(work),
                          "--size-gib", "0.01", "--vocab", "64", "--format", "legacy", "--no-cold", "--workers", "2"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    assert work.is_dir() and os.listdir(work) == []
    for what in ("legacy warm", "marginal s/GiB", "workers 1 -> 2", "peak RSS", "DeepSeek-V3"):
        assert what in run.stdout, run.stdout


@pytest.mark.parametrize("block", [4096, 1 << 20])
def test_source_pass_digests_every_record_in_one_read(tmp_path, block):
    """The one source pass: each file's digest and each tensor record's digest equal the digests of those
    bytes hashed directly, for records smaller than a block, spanning several blocks, and several per block."""
    from mindspeed_proxy.proxy.io import hashing

    gen = torch.Generator().manual_seed(0)
    paths = []
    for i, sizes in enumerate([(3, 1000, 50000), (7, 20000)]):
        path = str(tmp_path / f"f{i}.pt")
        torch.save({f"t{j}": torch.randn(n, generator=gen) for j, n in enumerate(sizes)}, path)
        paths.append(path)
    paths.append(str(tmp_path / "plain.json"))
    Path(paths[-1]).write_text('{"not": "a zip"}')
    source = hashing.SourcePass(paths, block=block)
    files = source.result()
    assert files == {p: hashing.file_digest(p) for p in paths}
    for path in paths[:2]:
        data = open(path, "rb").read()
        spans = hashing.torch_records(path)
        assert len(spans) == (3 if path.endswith("f0.pt") else 2)
        for (offset, size) in spans:
            assert source.record(path, offset, size) == hashing.digest(data[offset:offset + size])
    assert hashing.torch_records(paths[2]) == {} and len(source.records) == 5


def _chunks(folder):
    """{(key, offsets): bytes} of every stored tensor chunk of a torch_dist folder."""
    from mindspeed_proxy.proxy.io.dist.chunks import ChunkReader

    reader = ChunkReader(folder)
    return {(key, offsets): reader.read(key, offsets).contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            for key in reader.metadata.state_dict_metadata
            if hasattr(reader.metadata.state_dict_metadata[key], "chunks")
            for offsets, _ in reader.chunks(key)}


def test_dist_workers_same_tensors_verified_from_digests(dist_checkpoints, tmp_path):
    """torch_dist with 1 and 2 writer threads: 1 and 2 .distcp files holding the same chunks byte for byte;
    every kept tensor verified from the written records' digests against the source pass's chunk digests."""
    src = dist_checkpoints("ep2_bias")
    outs = {n: tmp_path / f"w{n}" for n in (1, 2)}
    for n, out in outs.items():
        assert main(["--load", src, "--save", str(out), "--target-expert-parallel-size", "1",
                     "--target-num-experts", "4", "--workers", str(n)]) == 0
    folders = {n: out / "iter_0000002" for n, out in outs.items()}
    assert [len([f for f in os.listdir(d) if f.endswith(".distcp")]) for d in folders.values()] == [1, 2]
    one, two = _chunks(folders[1]), _chunks(folders[2])
    assert one == two and len(one) > 8
    counts = json.load(open(outs[2] / "proxy_manifest.json"))["verification"]
    big = sum(len(v) for v in one.values() if len(v) >= 4 << 10)
    assert counts["bytes_from_digests"] == big > 0 and counts["source_bytes_hashed_again"] == 0
    assert _left_behind(tmp_path) == ["w1", "w2"]


def test_dist_corrupted_written_byte_caught_from_digests(dist_checkpoints, tmp_path, monkeypatch, capsys):
    """A torch_dist writer that hands DCP one wrong byte in a kept expert chunk: refused, nothing left."""
    from mindspeed_proxy.proxy.io.dist import writer as dist_writer
    from mindspeed_proxy.proxy.verify import common, dist

    expected, hit = dist_writer.expected, []

    def corrupt(reader, chunk):
        data = expected(reader, chunk)
        if not hit and ".experts." in chunk.key and data.nbytes >= 4 << 10:
            data = data.clone()
            data.view(-1).view(torch.uint8)[7] ^= 0x01
            hit.append(chunk.key)
        return data

    reread = []
    compare = common.equal_in_blocks
    monkeypatch.setattr(dist_writer, "expected", corrupt)
    for module in (common, dist):
        monkeypatch.setattr(module, "equal_in_blocks", lambda a, b, *r: reread.append(a.nbytes) or compare(a, b, *r))
    out = tmp_path / "out"
    assert main(["--load", dist_checkpoints("ep2_bias"), "--save", str(out), "--target-expert-parallel-size", "1",
                 "--target-num-experts", "4", "--workers", "1"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert hit and "verification failed" in line and "differs from source expert" in line
    assert not reread or max(reread) < 4 << 10
    assert _left_behind(tmp_path) == []
