"""Evaluation side of proxy_fidelity.py: eval loss, routing counts and router top-k agreement of checkpoints.

`evaluate_many` runs in one process (world of 1, EP=1) and evaluates a list of legacy checkpoints in turn,
each built with the trainer's own model builder at its number of experts and loaded with `load_legacy`.

Router top-k agreement of a proxy with the original, on the eval tokens: at every MoE layer and every
token t, let P(t) be the proxy's top-k experts (mapped back to the original's ids through the manifest's
kept list) and R(t) the top-k of the *original* router's scores for that token (recorded on the original
model's own forward) restricted to the kept experts. Agreement = mean over tokens and layers of
|P(t) ∩ R(t)| / k. 1.0 means that on every token the proxy routes to the kept experts the original would
have chosen among them; the two models' hidden states may differ from the first pruned layer on.
"""
from __future__ import annotations

import warnings

SEQ, SEED, GBS, MBS = 64, 1234, 8, 4  # the held-out data always uses the dataset seed SEED


def child_args(num_experts: int, train_iters: int):
    """Trainer args of the tiny MoE at EP=1 with `num_experts` experts."""
    from mindspeed_proxy.training import arguments as A

    args = A.build_parser().parse_args(["--num-experts", str(num_experts), "--expert-model-parallel-size", "1",
                                        "--train-iters", str(train_iters), "--global-batch-size", str(GBS),
                                        "--micro-batch-size", str(MBS), "--seq-length", str(SEQ),
                                        "--seed", str(SEED), "--ckpt-format", "torch"])
    A.validate_static(args)
    return args


def valid_dataset(train_iters: int):
    """The trainer's valid split (documents disjoint from training) with the fixed dataset seed."""
    from mindspeed_proxy import data

    _, valid = data.build_gpt_datasets(data.default_corpus_prefix(), SEQ, SEED, train_iters * GBS)
    return valid


def _router_scores(module, x):
    """The router's ranking scores for input x: logits (softmax) or sigmoid, plus the expert bias if used."""
    import torch

    logits = module.gating(x).reshape(-1, module.weight.shape[0]).double()
    cfg = module.config
    scores = torch.sigmoid(logits) if cfg.moe_router_score_function == "sigmoid" else logits
    bias = getattr(module, "expert_bias", None)
    if bias is not None and getattr(cfg, "moe_router_enable_expert_bias", False):
        scores = scores + bias.double()
    return scores


def _evaluate_one(job: dict, train_iters: int, valid, batch: int) -> dict:
    import torch
    from megatron.core.transformer.moe.router import TopKRouter

    from mindspeed_proxy import data
    from mindspeed_proxy.training import loop
    from mindspeed_proxy.training.checkpointing import load_legacy
    from mindspeed_proxy.training.engine import Trainer

    k = job["num_experts"]
    args = child_args(k, train_iters)
    trainer = Trainer(loop.A.model_config(args), loop.A.train_config(args))
    load_legacy(job["ckpt"], trainer, load_optim=False, load_rng=False)
    model = trainer.model[0]
    model.eval()
    counts, scores, maps, hooks, state = {}, {}, {}, [], {"on": None}
    for name, module in trainer.unwrapped()[0].named_modules():
        if isinstance(module, TopKRouter):
            layer = int(name.split("decoder.layers.")[1].split(".")[0])
            counts[layer], scores[layer], maps[layer] = torch.zeros(k, dtype=torch.float64), [], []

            def hook(mod, inp, out, layer=layer):
                if state["on"] == "count":  # out = (probs, routing_map [tokens, E] bool)
                    counts[layer] += out[1].reshape(-1, k).sum(0).double()
                elif state["on"] == "eval":
                    scores[layer].append(_router_scores(mod, inp[0]).float())
                    maps[layer].append(out[1].reshape(-1, k).clone())
            hooks.append(module.register_forward_hook(hook))

    def run(lo, hi, with_loss):
        total, tokens = 0.0, 0.0
        for start in range(lo, hi, batch):
            b = data.get_batch(valid, range(start, min(start + batch, hi)))
            with torch.no_grad():
                loss = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
            if with_loss:
                total += float((loss.float() * b["loss_mask"]).sum())
                tokens += float(b["loss_mask"].sum())
        return total / tokens if with_loss else None

    out = {"name": job["name"]}
    if job.get("count_range"):
        state["on"] = "count"
        run(*job["count_range"], with_loss=False)
        out["usage"] = {str(l): c.tolist() for l, c in sorted(counts.items())}
    state["on"] = "eval"
    out["loss"] = run(*job["eval_range"], with_loss=True)
    for h in hooks:
        h.remove()
    if job.get("record"):  # the original: keep its router scores on the eval tokens
        torch.save({l: torch.cat(s) for l, s in scores.items()}, job["record"])
    if job.get("reference"):
        out["agreement"] = topk_agreement(torch.load(job["reference"]), {l: torch.cat(m) for l, m in maps.items()},
                                          job["kept"], int(args.moe_router_topk))
    return out


def topk_agreement(ref_scores: dict, proxy_maps: dict, kept: list, topk: int) -> float:
    """Mean over layers and tokens of |proxy top-k ∩ top-k of the original's scores on the kept experts| / k."""
    import torch

    hits, total = 0.0, 0
    for index, layer in enumerate(sorted(proxy_maps)):
        ids = torch.tensor(kept[index], dtype=torch.long)
        ref = ref_scores[layer][:, ids].topk(topk, dim=-1).indices  # positions in the kept list
        want = torch.zeros_like(proxy_maps[layer]).scatter_(1, ref, True)
        hits += float((want & proxy_maps[layer]).sum())
        total += proxy_maps[layer].shape[0] * topk
    return hits / total


def evaluate_many(jobs: list, train_iters: int, batch: int = 16) -> list:
    """On one rank: evaluate every job (dict: name, ckpt, num_experts, eval_range, optional count_range,
    record, reference and kept); return one result dict per job."""
    warnings.filterwarnings("ignore")
    from mindspeed_proxy.training import loop

    loop.init_distributed(child_args(8, train_iters))
    valid = valid_dataset(train_iters)
    results = []
    for job in jobs:
        res = _evaluate_one(job, train_iters, valid, batch)
        res["num_valid"] = len(valid)
        results.append(res)
    return results


def calibration_tokens(train_iters: int, lo: int, hi: int, path: str) -> None:
    """Write the tokens of valid samples [lo, hi) as an int64 .npy [N, SEQ] (the converter's calibration data)."""
    import numpy as np

    from mindspeed_proxy import data

    valid = valid_dataset(train_iters)
    b = data.get_batch(valid, range(lo, hi))
    np.save(path, b["tokens"].numpy().astype(np.int64))
