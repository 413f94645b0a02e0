"""The RL fault matrix: faults × {original, proxy} in GRPO, with E1–E4 and cost, written to docs/results.

    OMP_NUM_THREADS=1 .venv/bin/python examples/experiments/rl_fault_matrix.py [--work-dir runs/rl_fault_matrix]
        [--config examples/configs/rl_fault_matrix.yaml] [--out docs/results/rl_fault_matrix.md] [--faults a,b]

Runs one process tree at a time (2 cores): SFT + GRPO warm-up, three conversions, every (fault, model) run,
the R3 controls, the E4 proxies; then the tables (mindspeed_proxy/experiments/rl_tables.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def main(argv=None) -> int:
    """Warm-up, convert, runs, tables."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "rl_fault_matrix"))
    p.add_argument("--config", default=os.path.join(ROOT, "examples", "configs", "rl_fault_matrix.yaml"))
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "rl_fault_matrix.md"))
    p.add_argument("--faults", default=None, help="comma-separated subset of the config's faults")
    p.add_argument("--tables-only", action="store_true",
                   help="rewrite the page from the runs recorded in --work-dir (results.json), running nothing")
    a = p.parse_args(argv)
    from mindspeed_proxy.experiments.matrix import Progress
    from mindspeed_proxy.experiments.rl_matrix import RLMatrix, load_rl_config
    from mindspeed_proxy.experiments.rl_tables import analyse, markdown

    cfg = load_rl_config(a.config)
    if a.faults:
        wanted = a.faults.split(",")
        bad = [f for f in wanted if f not in cfg["faults"]]
        if bad:
            p.error(f"--faults: unknown {bad} (known: {', '.join(cfg['faults'])})")
        cfg["faults"] = {k: v for k, v in cfg["faults"].items() if k in wanted or k == "none"}
        cfg["r3_controls"] = [f for f in cfg["r3_controls"] if f in cfg["faults"]]
    t0 = time.time()
    progress = Progress()
    m = RLMatrix(cfg, a.work_dir, ROOT, progress)
    if a.tables_only:
        from mindspeed_proxy.experiments.matrix import RunResult

        saved = json.load(open(os.path.join(m.work, "results.json"), encoding="utf-8"))
        results = [RunResult(**v["result"]) for v in saved["runs"].values()]
        page = markdown(cfg, analyse(cfg, results), saved["e4"], saved["extra"])
        open(a.out, "w", encoding="utf-8").write(page)
        print(page)
        return 0
    progress(f"RL fault matrix: {len(cfg['faults'])} faults x 2 models + {len(cfg['r3_controls'])} R3 controls; "
             f"work dir {m.work}")
    m.warmup()
    m.convert()
    results = []
    for fault in cfg["faults"]:
        for model in ("original", "proxy"):
            results.append(m.run(fault, model))
            if fault in cfg["r3_controls"]:
                results.append(m.run(fault, model, r3=True))
    e4 = m.e4()
    data = analyse(cfg, results)
    command = "OMP_NUM_THREADS=1 .venv/bin/python examples/experiments/rl_fault_matrix.py" + \
        (f" --faults {a.faults}" if a.faults else "")
    extra = {"command": command, "wall_min": (time.time() - t0) / 60, "cores": os.cpu_count()}
    page = markdown(cfg, data, e4, extra)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as fh:
        fh.write(page)
    with open(os.path.join(m.work, "results.json"), "w", encoding="utf-8") as fh:
        json.dump({"e4": e4, "extra": extra, "runs": {k: {**{x: y for x, y in v.items() if x != "result"},
                                          "result": v["result"].to_dict()} for k, v in data.items()}},
                  fh, default=str, indent=1)
    print(page)
    progress(f"written {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
