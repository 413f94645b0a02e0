"""The monitor's expert-feature files feed convert_to_proxy.py: equal to its own `outputs` pass, same plan."""
import json
import os

import numpy as np
import pytest

from mindspeed_proxy.proxy.calibrate import forward as outputs
from mindspeed_proxy.proxy.cli import main
from mindspeed_proxy.proxy.convert import open_checkpoint
from mindspeed_proxy.testing import run_distributed
from mindspeed_proxy.training.loop import train

from helpers import model_flags  # noqa: E402  (tests/proxy is on sys.path under pytest)


BASE = ["--target-expert-parallel-size", "1", "--target-num-experts", "4", "--dry-run", "--representative", "usage"]


def _step3_tokens():
    """The 8 x 64 token ids the resumed trainer reads at step 3 (global samples 16..23 of a 3-step run)."""
    from mindspeed_proxy import data

    train_ds, _ = data.build_gpt_datasets(data.default_corpus_prefix(), 64, 1234, 3 * 8)
    return data.get_batch(train_ds, range(16, 24))["tokens"]


@pytest.fixture(scope="module")
def collected(checkpoints, tmp_path_factory):
    """ep2_bias (saved at step 2) resumed at EP=2 on 2 ranks for step 3, the monitor collecting step 3."""
    src = checkpoints("ep2_bias")
    log = str(tmp_path_factory.mktemp("monitor-features"))
    run_distributed(train, 2, model_flags("ep2_bias") + [
        "--expert-model-parallel-size", "2", "--load", src, "--train-iters", "3", "--log-dir", log,
        "--enable-mechanism-monitor", "--mechanism-monitor-collect-expert-features",
        "--mechanism-monitor-expert-features-start", "3"], timeout=300)
    folder = os.path.join(log, "mechanism_monitor")
    return src, os.path.join(folder, "expert_features.npz"), os.path.join(folder, "expert_usage.json")


def test_monitor_file_equals_the_converters_outputs_pass(collected, tmp_path, capsys):
    src, feats_path, usage_path = collected
    tokens = _step3_tokens()
    ckpt = open_checkpoint(src, None)
    vectors, usage, count = outputs.output_features(ckpt, tokens)
    assert count == 8 * 64
    with np.load(feats_path) as archive:
        feats = {int(k): archive[k] for k in archive.files}
    assert sorted(feats) == sorted(vectors) == [0, 1]
    for g, ref in vectors.items():
        error = np.abs(feats[g] - ref).max() / np.abs(ref).max()
        with capsys.disabled():
            print(f"\nlayer {g}: max |monitor - converter outputs| / max |converter| = {error:.2e}")
        assert feats[g].shape == ref.shape == (8, 64) and error <= 1e-5, g
    assert json.load(open(usage_path)) == {str(g): u for g, u in usage.items()}
    # the same plan from the monitor's files as from the converter's own calibration pass
    calib = str(tmp_path / "step3.npy")
    np.save(calib, tokens.numpy())
    assert main(["--load", src, *BASE, "--features", "outputs", "--calibration-data", calib]) == 0
    own = capsys.readouterr().out
    assert main(["--load", src, *BASE, "--features", feats_path, "--usage-file", usage_path]) == 0
    monitored = capsys.readouterr().out
    keep = lambda text: [line for line in text.splitlines() if ": keep [" in line]  # noqa: E731
    assert keep(own) == keep(monitored) and len(keep(own)) == 2


def test_bad_monitor_files_refused(collected, tmp_path, capsys):
    src, feats_path, usage_path = collected
    out = str(tmp_path / "proxy")
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(open(feats_path, "rb").read()[:200])
    with np.load(feats_path) as archive:
        np.savez(tmp_path / "seven.npz", **{k: archive[k][:7] for k in archive.files})
    counts = json.load(open(usage_path))
    (tmp_path / "bad.json").write_text(json.dumps(counts)[:-5])
    (tmp_path / "seven.json").write_text(json.dumps({k: v[:7] for k, v in counts.items()}))
    cases = [
        (["--features", str(tmp_path / "absent.npz")], "no such file"),
        (["--features", str(truncated)], "cannot read"),
        (["--features", str(tmp_path / "seven.npz")], "layer 0 needs a numeric array [8, D], found [7, 64]"),
        (["--features", feats_path, "--usage-file", str(tmp_path / "absent.json")], "cannot read JSON"),
        (["--features", feats_path, "--usage-file", str(tmp_path / "bad.json")], "cannot read JSON"),
        (["--features", feats_path, "--usage-file", str(tmp_path / "seven.json")], "layer 0 needs a list of 8"),
    ]
    for extra, message in cases:
        rc = main(["--load", src, "--save", out, "--target-expert-parallel-size", "1", "--target-num-experts", "4",
                   "--representative", "usage", *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and message in err[0], (extra, err)
        assert not os.path.exists(out)
