"""The flagship MoE shapes as Megatron-LM's own `pretrain_gpt.py` trains them, through the converter and back.

Tiny sizes, 8 experts at EP=2 on 2 gloo ranks, no dropout, 3 steps, each shape saved in both formats:
- DeepSeek-V3: MLA with its default rope (YaRN), MTP (`--mtp-num-layers 1`), group-limited sigmoid router with
  expert bias and top-k scaling, sequence aux loss, a shared expert, a dense first layer, the monitor on; and
  the same shape without MTP.
- Qwen3-MoE: GQA with `--qk-layernorm`, no shared expert, global aux loss.
- Mixtral: GQA, softmax top-2, aux loss.
Each source converts with the README's plain command (K=4 at EP=1, `--features weights` and `outputs`), loads back
in `pretrain_gpt.py` with exactly the printed flags and trains 2 steps; K = E (= 8) at EP=1 gives a checkpoint whose
every model tensor equals the source's (experts renumbered to global ids for legacy files). With MTP (issue 34
item 2), `--features outputs` builds the MTP block too and selects the MTP layer's experts from its own calibration
outputs and usage. Needs MEGATRON_LM_PATH; skips otherwise.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from test_megatron_lm import MLM, _losses, env, mlm  # noqa: F401  (fixtures)
from test_megatron_lm_convert import _ok, calibration_tokens, convert, pretrain
from test_megatron_lm_mla import GQA, MLA_BASE

pytestmark = pytest.mark.skipif(
    not MLM,
    reason="MEGATRON_LM_PATH is not set: these tests need a Megatron-LM checkout (core_v0.16 line), "
           "which CI does not have",
)

STEPS = 3
# without GQA (Megatron-LM refuses it with MLA; the GQA shapes add it), 8 experts, no dropout
BASE = MLA_BASE + [
    "--num-experts", "8", "--moe-ffn-hidden-size", "64", "--hidden-dropout", "0", "--attention-dropout", "0"]
DEEPSEEK_V3 = ["--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
               "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--num-layers", "4",
               "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
               "--moe-router-topk-scaling-factor", "2.5", "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
               "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-4",
               "--moe-shared-expert-intermediate-size", "64", "--moe-layer-freq", "([0]+[1]*3)"]
MONITOR = ["--enable-mechanism-monitor", "--mechanism-monitor-interval", "1", "--mechanism-monitor-delta", "1"]
SHAPES = {
    "deepseek_v3": DEEPSEEK_V3 + ["--mtp-num-layers", "1"] + MONITOR,
    "deepseek_v3_no_mtp": DEEPSEEK_V3 + MONITOR,
    "qwen3_moe": GQA + ["--qk-layernorm", "--moe-router-load-balancing-type", "global_aux_loss",
                        "--moe-aux-loss-coeff", "1e-3"],
    "mixtral": GQA + ["--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2"],
}
SOURCES = [(shape, fmt) for shape in SHAPES for fmt in ("torch_dist", "torch")]


def flags(shape: str, fmt: str) -> list:
    """The source's model and training flags (without --save / --load and the monitor's output)."""
    return BASE + SHAPES[shape] + ["--ckpt-format", fmt]


@pytest.fixture(scope="module")
def sources(mlm, env, tmp_path_factory):
    """sources(shape, fmt) -> (checkpoint, cwd, output of the training run), each trained once."""
    built: dict = {}

    def build(shape: str, fmt: str):
        if (shape, fmt) not in built:
            cwd = tmp_path_factory.mktemp(f"{shape}-{fmt}")
            save = cwd / "source"
            (cwd / "monitor.json").write_text(json.dumps({"router_interval": 1}))  # router samples within 3 steps
            out = _ok(pretrain(mlm, env, cwd, 2, flags(shape, fmt) + [
                "--train-iters", str(STEPS), "--save", str(save), "--save-interval", str(STEPS),
                "--mechanism-monitor-output", str(cwd / "mon"), "--mechanism-monitor-config", str(cwd / "monitor.json")]))
            assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(STEPS)
            built[shape, fmt] = (save, cwd, out)
        return built[shape, fmt]
    return build


@pytest.mark.parametrize("shape,fmt", SOURCES)
def test_flagship_shape_trains(sources, shape, fmt):
    """3 steps at EP=2 with finite losses (and the MTP loss where MTP is on); with the monitor, its three families."""
    _, cwd, out = sources(shape, fmt)
    losses = _losses(out)
    assert sorted(losses) == list(range(1, STEPS + 1)) and all(math.isfinite(float(v)) for v in losses.values())
    assert ("mtp_1 loss" in out) is ("--mtp-num-layers" in SHAPES[shape])
    if "--enable-mechanism-monitor" not in SHAPES[shape]:
        return
    records = [json.loads(line) for line in (cwd / "mon" / "monitor.jsonl").read_text().splitlines()]
    families = {r["family"] for r in records if r.get("type") == "sample"}
    assert {"attention-spectral", "update-spectral"} <= families, families
    assert "router" in families and "disabled after an exception" not in out


@pytest.mark.parametrize("features", ["weights", "outputs"])
@pytest.mark.parametrize("shape,fmt", SOURCES)
def test_flagship_proxy_loads_back_and_trains(mlm, env, sources, shape, fmt, features):
    """K=4 at EP=1: Megatron-LM loads the proxy with the source's flags plus exactly the printed ones and trains 2
    steps with finite losses."""
    src, cwd, _ = sources(shape, fmt)
    out = cwd / f"proxy-k4-{features}"
    extra = [] if features == "weights" else [
        "--features", "outputs", "--calibration-data", calibration_tokens(cwd / "calib.npy")]
    printed, world, _ = convert(env, cwd, src, out, 1, 4, *extra)
    assert printed[printed.index("--num-experts") + 1] == "4" and world == 1, printed
    manifest = json.loads((out / "proxy_manifest.json").read_text())
    assert all(len(layer["kept_global_ids_in_new_order"]) == 4 for layer in manifest["layers"])
    mtp = [layer for layer in manifest["layers"] if layer["layer"] == "mtp.0"]
    assert len(mtp) == ("--mtp-num-layers" in SHAPES[shape])
    if features == "outputs":  # every MoE layer, MTP included, chosen from its own calibration forward
        assert all(sum(layer["calibration_usage"]) > 0 for layer in manifest["layers"])
    res = pretrain(mlm, env, cwd, world, flags(shape, fmt) + ["--train-iters", "2",
                                                              "--mechanism-monitor-output", str(out / "mon")] + printed)
    losses = _losses(_ok(res))
    assert sorted(losses) == [1, 2] and all(math.isfinite(float(v)) for v in losses.values()), losses
    assert f"successfully loaded checkpoint from {out}" in res.stdout + res.stderr


def legacy_tensors(iteration_dir: Path) -> dict:
    """Every model tensor of a legacy checkpoint at TP=PP=1, experts renamed to their global ids."""
    from mindspeed_proxy.checkpoint_io import safe_torch_load

    files = sorted(iteration_dir.glob("mp_rank_*/model_optim_rng.pt"))
    out: dict = {}
    for path in files:
        ep = int(path.parent.name.split("_")[-1]) if len(files) > 1 else 0
        model = safe_torch_load(str(path))["model"]
        n_local = 1 + max([int(m.group(1)) for k in model for m in [re.search(r"local_experts\.(\d+)\.", k)] if m]
                          or [0])
        for key, value in model.items():
            if isinstance(value, torch.Tensor):
                key = re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{ep * n_local + int(m.group(1))}.",
                             key)
                out.setdefault(key, value)
    return out


def dist_tensors(iteration_dir: Path) -> dict:
    """Every model tensor (no optimizer state, no extra state) of a torch_dist checkpoint, read whole."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(iteration_dir))
    meta = reader.read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
             if isinstance(m, TensorStorageMetadata) and not k.startswith(("optimizer.", "rng_state"))}
    load(state, storage_reader=reader, no_dist=True)
    return state


@pytest.mark.parametrize("shape,fmt", SOURCES)
def test_flagship_k_equals_e_is_the_source(env, sources, shape, fmt):
    """K = E at EP=1 keeps every expert in order: every model tensor of the proxy equals the source's."""
    src, cwd, _ = sources(shape, fmt)
    out = cwd / "proxy-k8"
    convert(env, cwd, src, out, 1, 8)
    read = dist_tensors if fmt == "torch_dist" else legacy_tensors
    latest = int((out / "latest_checkpointed_iteration.txt").read_text().strip())
    source, proxy = read(src / f"iter_{STEPS:07d}"), read(out / f"iter_{latest:07d}")
    assert source.keys() == proxy.keys(), sorted(source.keys() ^ proxy.keys())[:10]
    assert any("experts" in k for k in source)
    for key, value in source.items():
        assert torch.equal(value, proxy[key]), key
