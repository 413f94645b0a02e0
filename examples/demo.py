"""`make demo`: original vs proxy under the low-precision-attention fault, end to end on CPU (~5-10 min, 2 cores).

1. healthy warm-up of the original tiny MoE (16 experts, top-2) on 2 gloo ranks at EP=2;
2. `convert_to_proxy.py` of its checkpoint to a 4-expert proxy at EP=1 (1 rank);
3. original and proxy fine-tuned from their checkpoints with the mechanism monitor on and
   `lowp-attention` injected (spec and monitor settings: examples/configs/fault_matrix.yaml);
4. `mindspeed-proxy report` of both runs (summaries printed, plots in one folder) and `compare`.

    .venv/bin/python examples/demo.py [--work-dir runs/demo] [--fault lowp-attention] [--seed N] [--no-pin]
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def with_seed(train_args: list[str], seed: int) -> list[str]:
    """Trainer flags with the value after `--seed` replaced (appended when absent)."""
    out = list(train_args)
    if "--seed" in out:
        out[out.index("--seed") + 1] = str(seed)
        return out
    return [*out, "--seed", str(seed)]


def numerics_of(run_dir) -> dict:
    """The `numerics` of a run's metrics.jsonl args record ({} when absent)."""
    import json

    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        first = json.loads(fh.readline() or "{}")
    return first.get("numerics") or {}


def main(argv=None) -> int:
    """Warm-up, convert, original and proxy under the fault, reports and compare, with progress lines."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "demo"))
    p.add_argument("--config", default=os.path.join(ROOT, "examples", "configs", "fault_matrix.yaml"))
    p.add_argument("--fault", default="lowp-attention", help="a fault named in the config's `faults`")
    p.add_argument("--seed", type=int, default=None, help="replace the config's --seed (init, data order)")
    p.add_argument("--no-pin", action="store_true",
                   help="drop the config's `env` (threads stay 1; BLAS/ATen kernels pick this CPU's ISA)")
    a = p.parse_args(argv)
    from mindspeed_proxy.experiments import Matrix, Progress, load_config
    from mindspeed_proxy.experiments.tables import reproduction_verdict, rule_of
    from mindspeed_proxy.report.compare import compare_runs, format_table
    from mindspeed_proxy.report.report import make_report

    cfg = load_config(a.config, "quick")
    if a.fault not in cfg["faults"]:
        p.error(f"--fault {a.fault}: not in {a.config} (known: {', '.join(cfg['faults'])})")
    if a.seed is not None:
        cfg["train_args"] = with_seed(cfg["train_args"], a.seed)
    if a.no_pin:
        cfg["env"] = {"OMP_NUM_THREADS": "1"}
    progress = Progress()
    progress(f"demo: original vs proxy under {a.fault} ({cfg['faults'][a.fault]}); outputs in {a.work_dir}")
    progress("pinned numerics: " + (" ".join(f"{k}={v}" for k, v in cfg["env"].items()) or "none"))
    m = Matrix(cfg, a.work_dir, ROOT, progress)
    m.warmup()
    m.convert()
    results = m.run_grid([("original", a.fault), ("proxy", a.fault)])
    plots = os.path.join(os.path.abspath(a.work_dir), "plots")
    rule = rule_of(cfg)
    for r in results:
        summary = make_report(r.run_dir, os.path.join(plots, r.name), rule=rule)
        md = open(os.path.join(summary["out_dir"], "summary.md"), encoding="utf-8").read()
        print("\n" + "\n".join(line for line in md.splitlines()
                                if not line.startswith(("![", "## Plots"))).rstrip())
    print(f"\n## compare {results[0].name} {results[1].name}\n\nHow closely the two runs track each other "
          f"(`mindspeed-proxy compare`; its general consistency verdict, loss Pearson >= 0.95 among others, is "
          f"another question and is not the demo's)\n")
    c = compare_runs(results[0].run_dir, results[1].run_dir, rule)
    print(format_table(c, verdict=False))
    n = numerics_of(results[0].run_dir)
    if n:
        print(f"\nnumerics: torch {n['torch']}, ATen {n['cpu_capability']}, {n['threads']} thread(s) per rank, "
              f"MKL_CBWR={n['env'].get('MKL_CBWR')}, on {n['cpu']} (docs/determinism.md: what is pinned, and "
              f"what the README's numbers were on other CPUs)")
    print(f"\nplots and summaries (summary.html opens in a browser): {plots}")
    progress("demo done")
    print("\n" + reproduction_verdict(a.fault, c))
    return 0


if __name__ == "__main__":
    sys.exit(main())
