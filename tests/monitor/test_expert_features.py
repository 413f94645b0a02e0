"""Expert features collected by the monitor during training: layout-independent, failure-safe."""
import json
import os

import numpy as np
import pytest

from mindspeed_proxy.layout_init import global_init
from mindspeed_proxy.testing import run_distributed
from mindspeed_proxy.testing.batches import synthetic_microbatches
from mindspeed_proxy.testing.parallel import init_parallel
from mindspeed_proxy.tiny_moe import TinyMoEConfig
from mindspeed_proxy.training.engine import TrainConfig, Trainer, microbatch_sample_ids

STEPS = 3


def features_run(out_dir, tp=1, ep=1, fail_on_rank=None):
    """Train 3 steps at LR 0 (the same weights in every layout and step) with the monitor's expert-feature
    collector on steps 1 and 3 (patched megatron-core)."""
    import torch.distributed as dist

    from mindspeed_proxy import patches
    from mindspeed_proxy.monitor import MonitorConfig

    patches.apply(MonitorConfig(families=["router"], router_interval=1, sinks=["jsonl"], output_dir=out_dir,
                                expert_features=True, expert_features_interval=2, expert_features_steps=2))
    if fail_on_rank is not None and dist.get_rank() == fail_on_rank:
        from mindspeed_proxy.proxy.calibrate import forward as outputs

        def broken(*args, **kwargs):
            raise RuntimeError("injected failure in expert_sums")
        outputs.expert_sums = broken
    init_parallel(tp=tp, ep=ep)
    model_cfg = TinyMoEConfig(num_layers=2, sequence_parallel=tp > 1)
    train_cfg = TrainConfig(micro_batch_size=2, global_batch_size=4, lr=0.0, min_lr=0.0)
    trainer = Trainer(model_cfg, train_cfg, init_fn=lambda m: global_init(m, seed=5))
    losses = []
    for it in range(STEPS):
        batches = synthetic_microbatches(microbatch_sample_ids(train_cfg, it), 64, model_cfg.vocab_size)
        losses.append(trainer.train_step(batches)["loss"])
    monitor = patches.active_monitor()
    disabled = sorted(monitor.disabled)
    monitor.close()
    return {"losses": losses, "disabled": disabled}


def _read(folder):
    with np.load(os.path.join(folder, "expert_features.npz")) as archive:
        feats = {k: archive[k] for k in archive.files}
    usage = json.load(open(os.path.join(folder, "expert_usage.json")))
    records = [json.loads(line) for line in open(os.path.join(folder, "monitor.jsonl"))]
    return feats, usage, records


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("ef-1rank"))
    return run_distributed(features_run, 1, folder)[0], _read(folder)


@pytest.fixture(scope="module")
def ep2(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("ef-ep2"))
    return run_distributed(features_run, 2, folder, ep=2), folder


@pytest.mark.parametrize("layout", ["ep2", "dp2", "tp2-sp"])
def test_two_ranks_write_what_one_rank_writes(one_rank, ep2, tmp_path, layout):
    """EP=2 (tokens gathered over EP), DP=2 (sums over expert-DP), TP=2 with SP (expert-TP partial sums)."""
    if layout == "ep2":
        runs, folder = ep2
    else:
        kwargs = dict(ep=1) if layout == "dp2" else dict(tp=2)
        runs, folder = run_distributed(features_run, 2, str(tmp_path), **kwargs), str(tmp_path)
    feats, usage, records = _read(folder)
    ref_feats, ref_usage, _ = one_rank[1]
    assert sorted(feats) == sorted(ref_feats) == ["0", "1"]
    for key, ref in ref_feats.items():
        assert feats[key].shape == ref.shape == (8, 64)
        error = np.abs(feats[key] - ref).max() / np.abs(ref).max()
        print(f"{layout} layer {key}: max |2 ranks - 1 rank| / max |1 rank| = {error:.2e}")
        assert error <= 1e-5, key
    assert usage == ref_usage
    for counts in usage.values():
        assert sum(counts) == 2 * 2 * 4 * 64  # top-2 of the tokens of 2 sampled steps (gbs 4 x 64)
    written = [r for r in records if r["type"] == "expert-features"]
    assert len(written) == 1 and written[0]["steps"] == [1, 3] and written[0]["tokens"] == {"0": 512, "1": 512}
    assert runs[0]["disabled"] == runs[1]["disabled"] and "expert-features" not in runs[0]["disabled"]


def test_failure_on_one_rank_disables_everywhere_and_training_is_untouched(ep2, tmp_path):
    healthy = ep2[0]
    runs = run_distributed(features_run, 2, str(tmp_path / "failing"), ep=2, fail_on_rank=1)
    for run in runs:
        assert "expert-features" in run["disabled"] and "router" not in run["disabled"]
        assert run["losses"] == healthy[0]["losses"]
    assert not os.path.exists(tmp_path / "failing" / "expert_features.npz")
    assert not os.path.exists(tmp_path / "failing" / "expert_usage.json")
    records = [json.loads(line) for line in open(tmp_path / "failing" / "monitor.jsonl")]
    errors = [r for r in records if r["type"] == "monitor-error"]
    assert len(errors) == 1 and errors[0]["statistic"] == "expert-features"
