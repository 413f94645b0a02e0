"""Proxy fidelity (issue 5): eval loss of the clustered proxy vs random and most-used expert selection.

Pipeline (all through the real trainer and the real converter, on CPU):

1. Train the tiny MoE (4 layers, hidden 64, 8 experts top-2, seq 64) on the embedded corpus with
   `mindspeed_proxy.training.loop.train` on 2 ranks at EP=2, legacy (`torch`) checkpoint.
2. `convert_to_proxy.py --target-num-experts 8 --target-expert-parallel-size 1` keeps every expert
   and reshards the checkpoint to EP=1: this is the "original" reference, loadable on one rank.
3. Held-out data: the *valid* split of `build_gpt_datasets(prefix, 64, seed, train_iters x GBS)` with
   the trainer's own split ("98,2,0"), so its documents are disjoint from the training documents.
   Valid samples [0, COUNT) are used only to count expert usage of the original model (forward hook on
   every TopKRouter, tokens routed per expert per layer); samples [COUNT, COUNT+EVAL) are used only
   for eval loss. The most-used baseline is therefore not selected on the eval batches.
4. For each K: proxies at EP2=1 by `convert_to_proxy.py` with `--selection cluster` (default:
   weights features, agglomerative, medoid), `--selection random --seed S` for several seeds, and
   `--selection usage --usage-file usage.json` (the K most-used experts per layer).
5. Eval loss of every proxy: Trainer at EP=1 with `--num-experts K`, `load_legacy(..., load_optim=False,
   load_rng=False)`, forward-only model call with labels, token-weighted mean loss over the eval
   samples. Nothing is fine-tuned: this is zero-shot fidelity of the pruned model.

Writes the table to docs/results/proxy_fidelity.md (with --doc) and prints it.

    .venv/bin/python examples/experiments/proxy_fidelity.py --work-dir runs/proxy_fidelity \
        --doc docs/results/proxy_fidelity.md
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

SEQ, SEED, GBS, MBS = 64, 1234, 8, 4


def _child_args(num_experts: int, train_iters: int):
    from mindspeed_proxy.training import arguments as A

    args = A.build_parser().parse_args(["--num-experts", str(num_experts), "--expert-model-parallel-size", "1",
                                        "--train-iters", str(train_iters), "--global-batch-size", str(GBS),
                                        "--micro-batch-size", str(MBS), "--seq-length", str(SEQ),
                                        "--seed", str(SEED), "--ckpt-format", "torch"])
    A.validate_static(args)
    return args


def evaluate(ckpt: str, num_experts: int, train_iters: int, count_range, eval_range, batch: int = 16) -> dict:
    """On one rank: load `ckpt` (EP=1, `num_experts`), count routing on count_range, mean loss on eval_range."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from megatron.core.transformer.moe.router import TopKRouter

    from mindspeed_proxy import data
    from mindspeed_proxy.training import loop
    from mindspeed_proxy.training.checkpointing import load_legacy
    from mindspeed_proxy.training.engine import Trainer

    args = _child_args(num_experts, train_iters)
    loop._init_distributed(args)
    prefix = data.default_corpus_prefix()
    _, valid = data.build_gpt_datasets(prefix, SEQ, SEED, train_iters * GBS)  # the trainer's own split
    trainer = Trainer(loop.A.model_config(args), loop.A.train_config(args))
    info = load_legacy(ckpt, trainer, load_optim=False, load_rng=False)
    model = trainer.model[0]
    model.eval()
    counts, hooks, state = {}, [], {"on": False}
    for name, module in trainer.unwrapped()[0].named_modules():
        if isinstance(module, TopKRouter):
            layer = int(name.split("decoder.layers.")[1].split(".")[0])  # 0-based global layer (PP=1)
            counts[layer] = torch.zeros(num_experts, dtype=torch.float64)

            def hook(mod, inp, out, layer=layer):
                if state["on"]:  # out = (probs, routing_map [tokens, E] bool)
                    counts[layer] += out[1].sum(0).double()
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

    out = {"iteration": info.get("iteration"), "num_valid": len(valid)}
    if count_range is not None:
        state["on"] = True
        run(*count_range, with_loss=False)
        state["on"] = False
        out["usage"] = {str(k): v.tolist() for k, v in sorted(counts.items())}
    out["loss"] = run(*eval_range, with_loss=True)
    for h in hooks:
        h.remove()
    return out


def convert(src: str, dst: str, k: int, extra: list) -> list:
    cmd = [sys.executable, os.path.join(ROOT, "convert_to_proxy.py"), "--load", src, "--save", dst,
           "--target-expert-parallel-size", "1", "--target-num-experts", str(k), "--overwrite"] + extra
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"{shlex.join(cmd)} failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
    manifest = json.load(open(os.path.join(dst, "proxy_manifest.json"), encoding="utf-8"))
    return [layer["kept_global_ids_in_new_order"] for layer in manifest["layers"]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "proxy_fidelity"))
    p.add_argument("--train-iters", type=int, default=300)
    p.add_argument("--ks", default="4,2")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--count-samples", type=int, default=256)
    p.add_argument("--eval-samples", type=int, default=768)
    p.add_argument("--reuse", action="store_true", help="reuse an existing trained checkpoint in --work-dir")
    p.add_argument("--doc", default=None, help="write the markdown report here")
    a = p.parse_args(argv)
    from mindspeed_proxy.testing import run_distributed
    from mindspeed_proxy.training.loop import train

    t0 = time.time()
    os.makedirs(a.work_dir, exist_ok=True)
    ckpt = os.path.join(a.work_dir, "ckpt_ep2")
    if not (a.reuse and os.path.isfile(os.path.join(ckpt, "latest_checkpointed_iteration.txt"))):
        train_argv = ["--expert-model-parallel-size", "2", "--train-iters", str(a.train_iters), "--ckpt-format",
                      "torch", "--save", ckpt, "--log-dir", os.path.join(a.work_dir, "train_logs")]
        if os.path.isdir(ckpt):
            import shutil
            shutil.rmtree(ckpt)
        run_distributed(train, 2, train_argv, timeout=1800)
    last = [json.loads(l) for l in open(os.path.join(a.work_dir, "train_logs", "metrics.jsonl"))][-1]
    print(f"trained: final train loss {last.get('loss'):.4f} ({time.time() - t0:.0f}s)", flush=True)

    count = (0, a.count_samples)
    ev = (a.count_samples, a.count_samples + a.eval_samples)
    orig = os.path.join(a.work_dir, "original_ep1")
    convert(ckpt, orig, 8, [])
    ref = run_distributed(evaluate, 1, orig, 8, a.train_iters, count, ev, timeout=900)[0]
    assert ev[1] <= ref["num_valid"], f"valid split has only {ref['num_valid']} samples"
    usage_file = os.path.join(a.work_dir, "usage.json")
    json.dump(ref["usage"], open(usage_file, "w"), indent=1)
    print(f"original (8 experts, EP=1): eval loss {ref['loss']:.4f}", flush=True)

    rows = [("8", "original (all experts)", ref["loss"], None, "")]
    seeds = [int(s) for s in a.seeds.split(",")]
    for k in [int(x) for x in a.ks.split(",")]:
        def one(name, extra):
            out = os.path.join(a.work_dir, f"proxy_k{k}_{name}")
            kept = convert(ckpt, out, k, extra)
            loss = run_distributed(evaluate, 1, out, k, a.train_iters, None, ev, timeout=900)[0]["loss"]
            print(f"K={k} {name}: eval loss {loss:.4f} kept {kept}", flush=True)
            return loss, kept
        loss, kept = one("cluster", [])
        rows.append((str(k), "clustered (weights, agglomerative, medoid)", loss, None, _kept(kept)))
        rand = [one(f"random_s{s}", ["--selection", "random", "--seed", str(s)]) for s in seeds]
        rl = [r[0] for r in rand]
        rows.append((str(k), f"random, seeds {a.seeds}", statistics.mean(rl),
                     statistics.stdev(rl) if len(rl) > 1 else 0.0,
                     "; ".join(f"s{s}: {r[0]:.4f} {_kept(r[1])}" for s, r in zip(seeds, rand))))
        loss, kept = one("usage", ["--selection", "usage", "--usage-file", usage_file])
        rows.append((str(k), "most-used (usage counts)", loss, None, _kept(kept)))

    cmd = "OMP_NUM_THREADS=1 .venv/bin/python examples/experiments/proxy_fidelity.py " + " ".join(
        shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:]))
    report = _report(rows, ref, a, cmd, last, time.time() - t0)
    print(report)
    if a.doc:
        os.makedirs(os.path.dirname(os.path.abspath(a.doc)), exist_ok=True)
        open(a.doc, "w", encoding="utf-8").write(report)
    return 0


def _kept(kept: list) -> str:
    return " ".join("[" + ",".join(map(str, l)) + "]" for l in kept)


def _report(rows, ref, a, cmd, last, seconds) -> str:
    base = ref["loss"]
    lines = ["# Proxy fidelity: clustered vs random vs most-used expert selection", "",
             f"Generated by `examples/experiments/proxy_fidelity.py` ({seconds:.0f} s on CPU). Command:", "",
             "```", cmd, "```", "",
             f"Model: tiny MoE (4 layers, hidden 64, 8 experts, top-2, seq 64) trained {a.train_iters} iterations "
             f"(GBS {GBS}) at EP=2 on the embedded corpus with the real trainer; final train loss "
             f"{last.get('loss'):.4f}. Proxies made by `convert_to_proxy.py` at EP2=1, no fine-tuning.", "",
             f"Held-out data: valid split (trainer's split 98,2,0, disjoint documents) of "
             f"{ref['num_valid']} samples. Usage counted on valid samples [0, {a.count_samples}); eval loss is the "
             f"token-weighted mean LM loss on valid samples [{a.count_samples}, "
             f"{a.count_samples + a.eval_samples}) ({a.eval_samples * SEQ} tokens). The original is the EP=2 "
             "checkpoint resharded to EP=1 with all 8 experts kept.", "",
             "| K | selection | eval loss | Δ vs original | kept experts per layer (layers 0-3) |",
             "|---|---|---|---|---|"]
    for k, method, loss, std, kept in rows:
        val = f"{loss:.4f}" + (f" ± {std:.4f}" if std is not None else "")
        lines.append(f"| {k} | {method} | {val} | {loss - base:+.4f} | {kept} |")
    lines += ["", "Usage counts of the original (tokens routed per expert, top-2, per layer):", ""]
    for layer, c in ref["usage"].items():
        lines.append(f"- layer {layer}: {[int(x) for x in c]}")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
