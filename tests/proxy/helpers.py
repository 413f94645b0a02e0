"""Shared by the proxy tests: load a checkpoint into real megatron-core model chunks through the trainer's
loading path, mask the original routers to the kept experts, and run a forward (pipelined when PP > 1)."""
import os

import torch

MONITOR_EVERY_STEP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "monitor_every_step.json")
TINY = ["--num-layers", "2", "--train-iters", "2", "--lr-warmup-iters", "1", "--global-batch-size", "8",
        "--micro-batch-size", "2"]
# name: (world size, flags). "bias" = sigmoid scoring + aux-free expert bias + a shared expert.
CONFIGS = {
    "ep2_bias": (2, ["--expert-model-parallel-size", "2", "--moe-shared-expert-intermediate-size", "32",
                     "--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid"]),
    "ep4": (4, ["--expert-model-parallel-size", "4"]),
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    # legacy GroupedMLP (bf16 only in megatron-core); layers 1 and 3 dense (--moe-layer-freq 2)
    "grouped": (2, ["--expert-model-parallel-size", "2", "--moe-grouped-gemm", "--bf16", "--num-layers", "4",
                    "--moe-layer-freq", "2"]),
    # DeepSeek-V3 shape: a multi-token prediction layer (MoE, on the last stage), sigmoid router with expert bias,
    # shared expert; the monitor on at every step, collecting expert features at step 2 (tests/monitor/test_monitor_mtp.py)
    "mtp": (2, ["--expert-model-parallel-size", "2", "--mtp-num-layers", "1", "--moe-shared-expert-intermediate-size",
                "32", "--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid",
                "--enable-mechanism-monitor", "--mechanism-monitor-config", MONITOR_EVERY_STEP,
                "--mechanism-monitor-collect-expert-features", "--mechanism-monitor-expert-features-start", "2"]),
    "mtp_pp2": (2, ["--pipeline-model-parallel-size", "2", "--mtp-num-layers", "1",
                    "--moe-shared-expert-intermediate-size", "32", "--moe-router-enable-expert-bias",
                    "--moe-router-score-function", "sigmoid"]),
    # PP=2 with two virtual stages (model0/model1 chunks of one layer each), EP=2
    "pp2_vpp": (4, ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
                    "--num-layers-per-virtual-pipeline-stage", "1"]),
}


def legacy_grouped_gemm() -> bool:
    """Whether the imported megatron-core still has the legacy GroupedMLP (megatron-core < 0.17)."""
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    return "moe_use_legacy_grouped_gemm" in {f.name for f in dataclasses.fields(TransformerConfig)}


def model_flags(name: str) -> list:
    """The trainer flags that describe checkpoint `name`'s model (without its parallel layout)."""
    flags = CONFIGS[name][1]
    out, skip = [], False
    for i, flag in enumerate(flags):
        if skip:
            skip = False
            continue
        if flag in ("--expert-model-parallel-size", "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                    "--num-layers-per-virtual-pipeline-stage"):
            skip = True
            continue
        out.append(flag)
    return TINY + out


def load_model(root, cfg, tp, ep, fmt="torch", pp=1, etp=None):
    """This rank's model chunks with checkpoint `root` loaded through the real loading path (strict).

    `fmt` is "torch" (C.load_legacy: Megatron-LM's per-rank files) or "torch_dist" (C.load_dist:
    megatron's sharded load, resharding to this layout); `etp` sets the expert tensor-parallel size."""
    from megatron.core import parallel_state as ps

    from mindspeed_proxy.testing import init_parallel
    from mindspeed_proxy.training import checkpointing as C
    from mindspeed_proxy.training.engine import TrainConfig, Trainer

    vpp = cfg.extra.get("virtual_pipeline_model_parallel_size")
    if etp is None:
        init_parallel(tp=tp, pp=pp, ep=ep, vpp=vpp)
    else:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        model_parallel_cuda_manual_seed(1234)
        cfg = cfg.replace(extra={**cfg.extra, "expert_tensor_parallel_size": etp})
    dp = ps.get_data_parallel_world_size()
    trainer = Trainer(cfg, TrainConfig(micro_batch_size=2, global_batch_size=2 * dp * max(pp, 1)))
    loader = C.load_dist if fmt == "torch_dist" else C.load_legacy
    loader(root, trainer, load_optim=False, load_rng=False)
    chunks = trainer.unwrapped()
    for chunk in chunks:
        chunk.eval()
    return chunks


def _layers(chunks):
    for chunk in chunks if isinstance(chunks, list) else [chunks]:
        while not hasattr(chunk, "decoder"):
            chunk = chunk.module
        yield from chunk.decoder.layers


def mask_router(chunks, kept):
    """Mask the original routers: logits of dropped experts -> -1e9 (and their expert_bias, if any).

    `kept` maps the global layer number (0-based) to the kept global expert ids."""
    for layer in _layers(chunks):
        router = getattr(layer.mlp, "router", None)
        if router is None:
            continue
        keep = kept[layer.layer_number - 1]
        mask = torch.full((router.weight.shape[0],), -1e9)
        mask[keep] = 0.0
        gating = router.gating
        router.gating = lambda x, gating=gating, mask=mask: gating(x) + mask.to(x.device)
        if router.expert_bias is not None:
            with torch.no_grad():
                router.expert_bias[mask < 0] = -1e9


def forward(chunks, batch):
    """Logits of `batch` ([b, s, V] fp32) from the model chunks; with PP > 1 through megatron's pipeline
    schedule, returned on the last stage only (None elsewhere)."""
    from megatron.core import parallel_state as ps

    chunks = chunks if isinstance(chunks, list) else [chunks]
    if ps.get_pipeline_model_parallel_world_size() == 1:
        with torch.no_grad():
            return chunks[0](batch["tokens"], batch["position_ids"], None).float().clone()
    from megatron.core.pipeline_parallel import get_forward_backward_func

    captured = []

    def step(data_iterator, model):
        data = next(data_iterator)
        output = model(data["tokens"], data["position_ids"], None)

        def keep(output_tensor):
            captured.append(output_tensor.float().clone())
            return output_tensor.float().sum(), {}
        return output, keep

    batches = [batch] * ps.get_pipeline_model_parallel_world_size()  # interleaving needs >= PP micro-batches
    with torch.no_grad():
        get_forward_backward_func()(forward_step_func=step, data_iterator=[iter(batches) for _ in chunks]
                                    if len(chunks) > 1 else iter(batches), model=chunks,
                                    num_microbatches=len(batches), seq_length=batch["tokens"].shape[1],
                                    micro_batch_size=batch["tokens"].shape[0], forward_only=True)
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    assert len(captured) == len(batches) and all(torch.equal(c, captured[0]) for c in captured)
    return captured[0]


def dist_common(folder):
    """The common state of torch_dist `folder`, wherever the writing megatron-core kept it (common.pt before 0.19)."""
    from torch.distributed.checkpoint import FileSystemReader

    from mindspeed_proxy.proxy.io.dist.common import read_common

    return read_common(folder, FileSystemReader(folder).read_metadata())


def common_files():
    """The files besides .distcp that this megatron-core's torch_dist save writes."""
    from packaging.version import Version

    from mindspeed_proxy.patches.registry import megatron_core_version

    return [".metadata", "metadata.json"] if megatron_core_version() >= Version("0.19") else \
        [".metadata", "common.pt", "metadata.json"]
