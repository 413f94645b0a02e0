"""Fault matrix (issue 6): faults {none, lowp-attention, lr-spike, small-gbs} x models {original, proxy}.

1. Healthy warm-up of the original tiny MoE (16 experts, 2 ranks, EP=2), legacy checkpoint.
2. `convert_to_proxy.py` of that checkpoint to 4 experts at EP=1 (clustered).
3. One fine-tuning run per (model, fault) from its checkpoint (--finetune: weights only, same data order
   and seed), mechanism monitor on, fault from its `start` step.
4. `mindspeed-proxy report` per run, `compare` per fault, E4 eval loss (examples/experiments/proxy_fidelity.py's
   `convert` and `evaluate`), cost from each run's process-tree rusage.
Every setting is in examples/configs/fault_matrix.yaml (+ fault_matrix_monitor.yaml).

    .venv/bin/python examples/experiments/fault_matrix.py --quick  # docs/results/fault_matrix_quick.md
    .venv/bin/python examples/experiments/fault_matrix.py --full   # docs/results/fault_matrix.md
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, HERE]


def e4(matrix, cfg: dict, progress, workers: int = 1) -> dict:
    """Eval loss of the original (all experts, EP=1) and clustered / random / most-used proxies at the same K,
    `workers` evaluations (1 rank each) at a time."""
    from concurrent.futures import ThreadPoolExecutor

    import proxy_fidelity as pf  # examples/experiments/proxy_fidelity.py
    import proxy_fidelity_eval as pfe

    from mindspeed_proxy.testing import run_distributed

    c, k, n = cfg["e4"], cfg["proxy"]["num_experts"], cfg["original"]["num_experts"]
    iters, src, work = cfg["warmup"]["iters"], str(matrix.warm_ckpt), matrix.work / "e4"
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")  # the spawned eval ranks: megatron's CPU-only notices
    count, ev = (0, c["count_samples"]), (c["count_samples"], c["count_samples"] + c["eval_samples"])

    # conversions run in this process, whose stdout redirect and page registry are global: one at a time, and
    # progress lines wait for them (printed during one, they would land in its captured output)
    converting = threading.Lock()

    def loss(job):
        name, experts, extra, count_range = job
        with converting:
            pf.convert(src, str(work / name), experts, extra)
        job = {"name": name, "ckpt": str(work / name), "num_experts": experts, "eval_range": ev,
               "count_range": count_range}
        out = run_distributed(pfe.evaluate_many, 1, [job], iters, timeout=900)[0][0]
        with converting:
            progress(f"E4 {name}: eval loss {out['loss']:.4f}")
        return out

    progress(f"E4: eval loss on valid samples [{ev[0]}, {ev[1]}) ...")
    usage = work / "usage.json"
    jobs = [("original_ep1", n, [], count), ("cluster", k, cfg["proxy"].get("convert_args", []), None)]
    jobs += [(f"random_s{s}", k, ["--selection", "random", "--seed", str(s)], None) for s in c["random_seeds"]]
    with ThreadPoolExecutor(max(1, workers)) as pool:
        ref, clustered, *rand = [o["loss"] if i else o for i, o in enumerate(pool.map(loss, jobs))]
    usage.write_text(json.dumps(ref["usage"]))  # most-used selection needs the original's usage counts
    used = loss(("usage", k, ["--selection", "usage", "--usage-file", str(usage)], None))["loss"]
    rows = [{"k": n, "selection": "original (all experts)", "loss": ref["loss"]},
            {"k": k, "selection": "clustered (the proxy's selection)", "loss": clustered},
            {"k": k, "selection": f"random, seeds {c['random_seeds']}", "loss": statistics.mean(rand),
             "std": statistics.stdev(rand) if len(rand) > 1 else 0.0, "all": rand},
            {"k": k, "selection": "most-used (usage counts)", "loss": used}]
    desc = (f"Held-out data: the trainer's valid split (disjoint documents); usage counted on valid samples "
            f"[{count[0]}, {count[1]}), eval loss = token-weighted mean LM loss on [{ev[0]}, {ev[1]}) "
            f"({c['eval_samples'] * 64} tokens), functions of examples/experiments/proxy_fidelity_eval.py; the original "
            f"is the warm-up checkpoint resharded to EP=1 with all {n} experts.")
    return {"rows": rows, "description": desc}


def main(argv=None) -> int:
    """Run the matrix (or --grid subset), write the page, plots and raw JSONL, print the regenerating command."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick")
    mode.add_argument("--full", dest="mode", action="store_const", const="full")
    p.add_argument("--config", default=os.path.join(ROOT, "examples", "configs", "fault_matrix.yaml"))
    p.add_argument("--work-dir", default=None, help="run outputs (default runs/fault_matrix_<mode>)")
    p.add_argument("--doc", default=None, help="markdown page to write ('' = none; default docs/results/"
                   "fault_matrix.md, fault_matrix_quick.md with --quick); plots and raw JSONL go in <doc stem>/")
    p.add_argument("--grid", default=None, help="subset, e.g. original:none,original:lowp-attention,proxy:lowp-attention")
    p.add_argument("--no-e4", action="store_true", help="skip E4 (capability retention)")
    p.add_argument("--slots", type=int, default=os.cpu_count() or 1,
                   help="cores to fill with runs (one per rank; default: all): the 2-rank original runs one at a "
                        "time on 2 cores, the 1-rank proxy runs two at a time; 1 = strictly one run at a time")
    p.add_argument("--reuse", action="store_true", help="reuse the warm-up checkpoint and finished runs in --work-dir")
    p.add_argument("--branch-healthy", action="store_true",
                   help="run each model's healthy run as a branch of one of its faulted runs: it continues that run's "
                        "checkpoint of the last step before the onset at which the monitor resumes exactly (the two "
                        "are the same run up to there), so only the later steps run again; its records start there")
    p.add_argument("--warmup-iters", type=int, default=None, help="override the warm-up length (CI only)")
    p.add_argument("--iters", type=int, default=None, help="override the run length (CI only)")
    a = p.parse_args(argv)
    a.mode = a.mode or "quick"
    if a.doc is None:
        a.doc = os.path.join(ROOT, "docs", "results", "fault_matrix" + ("_quick" if a.mode == "quick" else "") + ".md")
    from mindspeed_proxy.experiments import Matrix, Progress, load_config, tables
    from mindspeed_proxy.experiments.publish import publish, reports

    from mindspeed_proxy.experiments.matrix import cpu_times, steal_fraction

    t0, load_start, cpu_start = time.time(), os.getloadavg(), cpu_times()
    cfg = load_config(a.config, a.mode)
    if a.warmup_iters:
        cfg["warmup"] = {**cfg["warmup"], "iters": a.warmup_iters}
    if a.iters:
        cfg["run"] = {**cfg["run"], "iters": a.iters}
    work = a.work_dir or os.path.join(ROOT, "runs", f"fault_matrix_{a.mode}")
    progress = Progress()
    pairs = ([tuple(x.split(":")) for x in a.grid.split(",")] if a.grid else
             [(m, f) for f in cfg["faults"] for m in ("original", "proxy")])
    bad = [":".join(x) for x in pairs if len(x) != 2 or x[0] not in ("original", "proxy") or x[1] not in cfg["faults"]]
    if bad:  # before the warm-up, not after it
        p.error(f"--grid {','.join(bad)}: expected MODEL:FAULT with MODEL original|proxy and FAULT one of "
                f"{', '.join(cfg['faults'])}")
    order = sorted(range(len(pairs)), key=lambda i: -cfg[pairs[i][0]]["ranks"])  # widest first, so narrow runs pair up
    progress(f"fault matrix ({a.mode}): {len(pairs)} runs, work dir {work}")
    m = Matrix(cfg, work, ROOT, progress, reuse=a.reuse)
    m.warmup()
    m.convert()
    done = m.run_grid([pairs[i] for i in order], slots=a.slots, branch=a.branch_healthy)
    results = [done[order.index(i)] for i in range(len(pairs))]
    cached = m.work / "e4" / "result.json"
    if a.no_e4:
        e4_data = None
    elif m.reuse and cached.is_file() and json.loads(cached.read_text())["config"] == cfg["e4"]:
        e4_data = json.loads(cached.read_text())
        progress(f"E4: reusing {cached}")
    else:
        e4_data = e4(m, cfg, progress, workers=a.slots)
        cached.write_text(json.dumps({**e4_data, "config": cfg["e4"]}))
    progress("reports ...")
    summaries = reports(results, m.work / "reports", tables.rule_of(cfg))
    data = tables.analyse(cfg, results)
    cmd = "OMP_NUM_THREADS=1 .venv/bin/python examples/experiments/fault_matrix.py " + " ".join(
        shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:]))
    extra = {"seconds": time.time() - t0, "cpus": os.cpu_count(), "command": cmd,
             "load_start": " ".join(f"{x:.1f}" for x in load_start),
             "load_end": " ".join(f"{x:.1f}" for x in os.getloadavg()), "kept": m.convert_info.get("kept"),
             "steal": steal_fraction(cpu_start, cpu_times()),
             "warmup": None if m.warmup_result is None else m.warmup_result.to_dict(),
             "reuse": m.reuse, "folder": os.path.basename(os.path.splitext(a.doc)[0]) if a.doc else "fault_matrix"}
    page = tables.markdown(cfg, data, e4_data, extra)
    if a.doc:
        dest = os.path.splitext(a.doc)[0]
        publish(results, m.work / "reports", dest, {**data, "e4": e4_data, "config": cfg}, extra)
        with open(a.doc, "w", encoding="utf-8") as fh:
            fh.write(page)
        progress(f"wrote {a.doc} and {dest}/")
    print(page)
    for name, s in summaries.items():
        print(f"{name}: report in {s['out_dir']}")
    print(f"regenerate with: {cmd}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
