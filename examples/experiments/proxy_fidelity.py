"""Proxy fidelity (issue 5, issue 13 item 1): expert-selection methods side by side, over training seeds.

Pipeline (all through the real trainer and the real converter, on CPU), for every training seed S:

1. Train the tiny MoE (4 layers, hidden 64, 8 experts top-2, seq 64) on the embedded corpus with
   `mindspeed_proxy.training.loop.train --seed S` on 2 ranks at EP=2, legacy (`torch`) checkpoint.
2. `convert_to_proxy.py --target-num-experts 8 --target-expert-parallel-size 1` keeps every expert and
   reshards to EP=1: the "original" reference, loadable on one rank.
3. Held-out data: the *valid* split of `build_gpt_datasets(prefix, 64, 1234, train_iters x GBS)` (the
   trainer's split "98,2,0": documents disjoint from training; the same samples for every S). Valid
   samples [0, COUNT) are the calibration data (expert usage, outputs features, saliency; written as
   calib.npy); samples [COUNT, COUNT+EVAL) are used only for evaluation.
4. For each K and each method in METHODS: a proxy at EP2=1 by `convert_to_proxy.py`, then its eval loss
   (token-weighted mean LM loss, no fine-tuning) and its router top-k agreement with the original
   (defined in proxy_fidelity_eval.py).

Results go to WORK_DIR/results.json (reused with --reuse) and the markdown report to --doc.

    python examples/experiments/proxy_fidelity.py --work-dir runs/proxy_fidelity --doc docs/results/proxy_fidelity.md
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, HERE]

from proxy_fidelity_eval import GBS, evaluate_many  # noqa: E402
from proxy_fidelity_report import report  # noqa: E402

CAL = ["--calibration-data", "{calib}", "--calibration-sequences", "{count}"]
OUT = ["--features", "outputs"] + CAL
# name: (description, converter flags); {calib}, {count} and {usage} are filled in per training seed
METHODS = {
    "weights-medoid": ("clustered: weights features, agglomerative, medoid (previous default)", []),
    "outputs-medoid": ("clustered: outputs features, agglomerative, medoid", OUT),
    "outputs-usage": ("clustered: outputs, agglomerative, representative = most-used member",
                      OUT + ["--representative", "usage"]),
    "outputs-saliency": ("clustered: outputs, agglomerative, representative = REAP-like saliency",
                         OUT + ["--representative", "saliency"]),
    "uw-outputs-medoid": ("usage-weighted k-means on outputs, medoid", OUT + ["--usage-weighted"]),
    "uw-outputs-usage": ("usage-weighted k-means on outputs, representative = most-used member",
                         OUT + ["--usage-weighted", "--representative", "usage"]),
    "uw-outputs-saliency": ("usage-weighted k-means on outputs, representative = saliency",
                            OUT + ["--usage-weighted", "--representative", "saliency"]),
    "uw-weights-usage": ("usage-weighted k-means on weights, representative = most-used member",
                         ["--usage-file", "{usage}", "--usage-weighted", "--representative", "usage"]),
    "outputs-merge": ("merge (not bit-exact): outputs, agglomerative, usage-weighted average per cluster",
                      OUT + ["--representative", "merge"]),
    "uw-outputs-merge": ("merge (not bit-exact): usage-weighted k-means on outputs, usage-weighted average",
                         OUT + ["--usage-weighted", "--representative", "merge"]),
    "reconstruction": ("reconstruction: per layer, in order, the K-subset whose output (with the proxy's "
                       "re-routing) is closest to the original layer's, on the inputs of the model pruned so far",
                       CAL + ["--selection", "reconstruction"]),
    "reconstruction-local": ("reconstruction, layer-local: the same search on the original model's inputs",
                             CAL + ["--selection", "reconstruction", "--reconstruction-inputs", "original"]),
    "most-used": ("most-used (usage counts on the calibration samples)",
                  ["--selection", "usage", "--usage-file", "{usage}"]),
}


def convert(src: str, dst: str, k: int, extra: list) -> list:
    """Run the converter in this process; return the manifest's kept ids per layer."""
    from mindspeed_proxy.proxy.cli import main as convert_main

    argv = ["--load", src, "--save", dst, "--target-expert-parallel-size", "1", "--target-num-experts", str(k),
            "--overwrite"] + extra
    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
        rc = convert_main(argv)
    if rc:
        raise RuntimeError(f"convert_to_proxy.py {shlex.join(argv)} failed:\n{buf.getvalue()[-2000:]}\n"
                           f"{err.getvalue()[-2000:]}")
    manifest = json.load(open(os.path.join(dst, "proxy_manifest.json"), encoding="utf-8"))
    return [layer["kept_global_ids_in_new_order"] for layer in manifest["layers"]]


def train_seed(a, seed: int, seed_dir: str) -> dict:
    """Train the original for one seed (unless reused); return its last metrics line."""
    from mindspeed_proxy.testing import run_distributed
    from mindspeed_proxy.training.loop import train

    ckpt = os.path.join(seed_dir, "ckpt_ep2")
    logs = os.path.join(seed_dir, "train_logs")
    if not (a.reuse and os.path.isfile(os.path.join(ckpt, "latest_checkpointed_iteration.txt"))):
        import shutil

        for path in (ckpt, logs):
            shutil.rmtree(path, ignore_errors=True)
        run_distributed(train, 2, ["--expert-model-parallel-size", "2", "--train-iters", str(a.train_iters),
                                   "--ckpt-format", "torch", "--seed", str(seed), "--save", ckpt,
                                   "--log-dir", logs], timeout=1800)
    return [json.loads(l) for l in open(os.path.join(logs, "metrics.jsonl")) if '"step"' in l][-1]


def run_seed(a, seed: int, results: dict, save) -> None:
    """Original + every (K, method) proxy of one training seed, evaluated; fills results[str(seed)]."""
    from mindspeed_proxy.testing import run_distributed

    from proxy_fidelity_eval import calibration_tokens

    seed_dir = os.path.join(a.work_dir, f"seed{seed}")
    ckpt = os.path.join(seed_dir, "ckpt_ep2")
    res = results.setdefault(str(seed), {"proxies": {}})
    t0 = time.time()
    res["final_train_loss"] = train_seed(a, seed, seed_dir)["loss"]
    count, ev = (0, a.count_samples), (a.count_samples, a.count_samples + a.eval_samples)
    calib, usage_file = os.path.join(a.work_dir, "calib.npy"), os.path.join(seed_dir, "usage.json")
    ref_scores = os.path.join(seed_dir, "original_router_scores.pt")
    if not os.path.isfile(calib):
        calibration_tokens(a.train_iters, *count, calib)
    if "original" not in res or not a.reuse:
        orig = os.path.join(seed_dir, "original_ep1")
        convert(ckpt, orig, 8, [])
        ref = run_distributed(evaluate_many, 1, [{"name": "original", "ckpt": orig, "num_experts": 8,
                                                  "count_range": count, "eval_range": ev, "record": ref_scores}],
                              a.train_iters, timeout=900)[0][0]
        assert ev[1] <= ref["num_valid"], f"valid split has only {ref['num_valid']} samples"
        res["original"] = {"loss": ref["loss"], "usage": ref["usage"], "num_valid": ref["num_valid"]}
        save()
    json.dump(res["original"]["usage"], open(usage_file, "w"), indent=1)
    fill = {"calib": calib, "count": str(a.count_samples), "usage": usage_file}
    jobs = []
    for k in a.ks:
        wanted = [(m, [f.format(**fill) for f in METHODS[m][1]]) for m in a.methods]
        wanted += [(f"random-s{r}", ["--selection", "random", "--seed", str(r)]) for r in a.random_seeds]
        for name, flags in wanted:
            key = f"{k}/{name}"
            if a.reuse and key in res["proxies"]:
                continue
            out = os.path.join(seed_dir, f"proxy_k{k}_{name}")
            kept = convert(ckpt, out, k, flags)
            jobs.append({"name": key, "ckpt": out, "num_experts": k, "eval_range": ev, "reference": ref_scores,
                         "kept": kept})
    print(f"seed {seed}: {len(jobs)} proxies converted ({time.time() - t0:.0f}s)", flush=True)
    if jobs:
        for out in run_distributed(evaluate_many, 1, jobs, a.train_iters, timeout=1800)[0]:
            job = next(j for j in jobs if j["name"] == out["name"])
            res["proxies"][out["name"]] = {"loss": out["loss"], "agreement": out["agreement"], "kept": job["kept"]}
            print(f"  seed {seed} K={out['name']}: loss {out['loss']:.4f} (orig {res['original']['loss']:.4f}) "
                  f"agreement {out['agreement']:.3f}", flush=True)
    save()


def main(argv=None) -> int:
    """Run (or reuse) every training seed's cells, print the report, write it to --doc."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "proxy_fidelity"))
    p.add_argument("--train-iters", type=int, default=300)
    p.add_argument("--train-seeds", default="1234,1,2", help="training seeds of the original")
    p.add_argument("--ks", default="6,4,2")
    p.add_argument("--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}")
    p.add_argument("--random-seeds", default="0,1,2", help="seeds of the random-selection baseline")
    p.add_argument("--count-samples", type=int, default=256)
    p.add_argument("--eval-samples", type=int, default=768)
    p.add_argument("--reuse", action="store_true", help="reuse trained checkpoints and results in --work-dir")
    p.add_argument("--doc", default=None, help="write the markdown report here")
    a = p.parse_args(argv)
    a.ks = [int(x) for x in a.ks.split(",")]
    a.methods = [m for m in a.methods.split(",") if m]
    unknown = [m for m in a.methods if m not in METHODS]
    if unknown:
        p.error(f"unknown method {unknown[0]}")
    a.random_seeds = [int(s) for s in a.random_seeds.split(",") if s]
    seeds = [int(s) for s in a.train_seeds.split(",")]
    t0 = time.time()
    os.makedirs(a.work_dir, exist_ok=True)
    path = os.path.join(a.work_dir, "results.json")
    results = json.load(open(path)) if a.reuse and os.path.isfile(path) else {}

    def save():
        json.dump(results, open(path, "w"), indent=1)
    for seed in seeds:
        run_seed(a, seed, results, save)
    cmd = "OMP_NUM_THREADS=1 python examples/experiments/proxy_fidelity.py " + " ".join(
        shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:]))
    text = report({str(s): results[str(s)] for s in seeds}, a, METHODS, cmd, time.time() - t0, GBS)
    print(text)
    if a.doc:
        os.makedirs(os.path.dirname(os.path.abspath(a.doc)), exist_ok=True)
        open(a.doc, "w", encoding="utf-8").write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
