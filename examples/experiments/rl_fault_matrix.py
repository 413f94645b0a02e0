"""The RL fault matrix over seeds: faults × {original, proxy} in GRPO, thresholds calibrated on tuning seeds,
held-out tables from the replayed alerts, written to docs/results.

    OMP_NUM_THREADS=1 .venv/bin/python examples/experiments/rl_fault_matrix.py [--work-dir runs/rl_fault_matrix]
        [--config examples/configs/rl_fault_matrix.yaml] [--out docs/results/rl_fault_matrix.md]
        [--seeds 3,4] [--faults a,b] [--reuse] [--tables-only]

The loop is the config's: `rl_fault_matrix.yaml` runs our GRPO loop (mindspeed_proxy.rl.train);
`megatron_rl_fault_matrix.yaml` runs Megatron-LM's own train_rl.py (needs a checkout, --megatron-lm or
MEGATRON_LM_PATH, on PYTHONPATH with its RL packages: docs/megatron_lm.md). --out and --work-dir default to the
config's name under docs/results/ and runs/.

Per seed, one process tree at a time (2 cores): SFT (+ GRPO warm-up in our loop), conversion, then the tuning seeds'
healthy runs or the held-out seeds' full matrix (R3 controls; E4 on the first held-out seed). With --reuse every
stage already completed with the same command is skipped, so a killed or partial matrix resumes where it stopped.
Then, from everything recorded in --work-dir: `calibrate`, replay, tables (mindspeed_proxy/experiments/rl_*.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def parse(argv):
    """The driver's arguments."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work-dir", default=None, help="default: runs/<config name>")
    p.add_argument("--config", default=os.path.join(ROOT, "examples", "configs", "rl_fault_matrix.yaml"))
    p.add_argument("--out", default=None, help="default: docs/results/<config name>.md")
    p.add_argument("--megatron-lm", default=os.environ.get("MEGATRON_LM_PATH"),
                   help="the Megatron-LM checkout (core_v0.16) of a train_rl loop config")
    p.add_argument("--raw-dir", default=None, help="gzipped raw files (default: next to --out, named as it)")
    p.add_argument("--faults", default=None, help="comma-separated subset of the config's faults")
    p.add_argument("--seeds", default=None, help="comma-separated subset of the config's tuning + held-out seeds")
    p.add_argument("--reuse", action="store_true", help="skip every stage completed with the same command")
    p.add_argument("--tables-only", action="store_true", help="rewrite the page from --work-dir, running nothing")
    return p, p.parse_args(argv)


def select(p, a, cfg) -> list[int]:
    """Apply --faults to cfg; the seeds to run (argparse error on an unknown one)."""
    if a.faults:
        wanted = a.faults.split(",")
        bad = [f for f in wanted if f not in cfg["faults"]]
        if bad:
            p.error(f"--faults: unknown {bad} (known: {', '.join(cfg['faults'])})")
        cfg["faults"] = {k: v for k, v in cfg["faults"].items() if k in wanted or k == "none"}
        cfg["r3_controls"] = [f for f in cfg["r3_controls"] if f in cfg["faults"]]
    known = [*cfg["tuning_seeds"], *cfg["heldout_seeds"]]
    if not a.seeds:
        return known
    try:
        seeds = [int(s) for s in a.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds {a.seeds!r}: comma-separated integers expected")
    bad = [s for s in seeds if s not in known]
    if bad:
        p.error(f"--seeds: {bad} not in the config's tuning_seeds {cfg['tuning_seeds']} or heldout_seeds "
                f"{cfg['heldout_seeds']}")
    return seeds


def matrix(cfg, folder, seed, reuse, progress, megatron_lm):
    """The config's loop for one seed: RLMatrix (our GRPO loop) or MegatronRLMatrix (train_rl.py)."""
    if cfg["loop"] == "train_rl":
        from mindspeed_proxy.experiments.megatron_rl_matrix import MegatronRLMatrix

        return MegatronRLMatrix(cfg, folder, ROOT, megatron_lm, progress, seed=seed, reuse=reuse)
    from mindspeed_proxy.experiments.rl_matrix import RLMatrix

    return RLMatrix(cfg, folder, ROOT, progress, seed=seed, reuse=reuse)


def run_seeds(cfg, work, seeds, reuse, progress, megatron_lm=None) -> None:
    """Every stage of every seed in `seeds`; prints each seed's and the sitting's wall and CPU totals."""
    from mindspeed_proxy.experiments.rl_results import seed_dir

    t0, cpu = time.time(), 0.0
    for seed in seeds:
        m = matrix(cfg, seed_dir(work, seed), seed, reuse, progress, megatron_lm)
        e4_done = seed != cfg["heldout_seeds"][0] or not cfg["e4_eval_prompts"] or (m.work / "e4.json").is_file()
        if reuse and m.recorded(cfg["faults"]) and e4_done:
            progress(f"seed {seed}: every run recorded (or kept in the repo), nothing to run")
            continue
        m.warmup()
        m.convert()
        if seed in cfg["tuning_seeds"]:
            m.tuning_runs(slots=cfg.get("slots", 1))
        else:
            m.heldout_runs(cfg["faults"], slots=cfg.get("slots", 1))
            if not e4_done:
                (m.work / "e4.json").write_text(json.dumps(m.e4()))
        seed_cpu = sum(r.cpu_s or 0.0 for r in m.results)
        cpu += seed_cpu
        progress(f"seed {seed}: {sum(r.wall_s or 0.0 for r in m.results) / 60:.1f} min wall, {seed_cpu / 60:.1f} CPU min "
                 "in its stages (reused ones count their recorded cost)")
    wall = time.time() - t0
    progress(f"this sitting: {wall / 60:.1f} min wall; recorded stages {cpu / 60:.1f} CPU min")
    log = os.path.join(work, "sittings.json")
    sittings = json.load(open(log, encoding="utf-8")) if os.path.isfile(log) else []
    sittings.append({"seeds": seeds, "reuse": reuse, "wall_s": wall, "stages_cpu_s": cpu, "ended": time.time()})
    with open(log, "w", encoding="utf-8") as fh:
        json.dump(sittings, fh, indent=1)


def main(argv=None) -> int:
    """Runs, then calibration, replay, tables and raw files."""
    p, a = parse(argv)
    from mindspeed_proxy.experiments.matrix import Progress
    from mindspeed_proxy.cli import error
    from mindspeed_proxy.experiments.rl_matrix import load_rl_config
    from mindspeed_proxy.experiments.rl_page import markdown
    from mindspeed_proxy.experiments.rl_results import analyse_all, export_raw

    try:
        cfg = load_rl_config(a.config)
    except (OSError, ValueError, KeyError) as exc:
        return error("rl_fault_matrix.py", exc)
    seeds = select(p, a, cfg)
    name = os.path.splitext(os.path.basename(a.config))[0]
    a.out = a.out or os.path.join(ROOT, "docs", "results", name + ".md")
    if cfg["loop"] == "train_rl" and not a.tables_only and not (
            a.megatron_lm and os.path.isfile(os.path.join(a.megatron_lm, "train_rl.py"))):
        p.error(f"--megatron-lm {a.megatron_lm!r}: not a Megatron-LM checkout with train_rl.py (the config's loop is "
                "train_rl; set MEGATRON_LM_PATH or pass --megatron-lm)")
    if cfg["loop"] == "train_rl" and not a.tables_only:
        sys.path.append(os.path.abspath(a.megatron_lm))  # the rollout pickles hold megatron.rl objects
    progress = Progress()
    work = os.path.abspath(a.work_dir or os.path.join(ROOT, "runs", name))
    raw = a.raw_dir or os.path.splitext(os.path.abspath(a.out))[0]
    if os.path.isdir(raw):
        from mindspeed_proxy.experiments.rl_results import import_raw

        progress(f"{import_raw(raw, work, [*cfg['tuning_seeds'], *cfg['heldout_seeds']])} runs imported from {raw}")
    if not a.tables_only:
        progress(f"RL fault matrix: seeds {seeds}; {len(cfg['faults'])} faults x 2 models + "
                 f"{len(cfg['r3_controls'])} R3 controls per held-out seed; work dir {work}")
        run_seeds(cfg, work, seeds, a.reuse, progress, a.megatron_lm)
    ctx = analyse_all(cfg, work)
    results = ctx["results"]
    command = "OMP_NUM_THREADS=1 .venv/bin/python examples/experiments/rl_fault_matrix.py --reuse" + \
        ("" if name == "rl_fault_matrix" else f" --config examples/configs/{name}.yaml") + \
        (f" --faults {a.faults}" if a.faults else "")
    # the work dir's sittings, else the copy kept with the raw files (a fresh clone regenerates the same page)
    log = next((f for f in (os.path.join(work, "sittings.json"), os.path.join(raw, "sittings.json"))
                if os.path.isfile(f)), None)
    sittings = json.load(open(log, encoding="utf-8")) if log else []
    ctx["extra"] = {"command": command, "wall_min": sum(r.wall_s or 0.0 for r in results) / 60,
                    "cpu_min": sum(r.cpu_s or 0.0 for r in results) / 60, "notes": cfg.get("notes", []), "cores": os.cpu_count(),
                    "sittings_min": [round(x["wall_s"] / 60, 1) for x in sittings]}
    page = markdown(cfg, ctx)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as fh:
        fh.write(page)
    size = export_raw(ctx["stages"], raw, ctx["e4"], cfg["heldout_seeds"][0])
    with open(os.path.join(raw, "sittings.json"), "w", encoding="utf-8") as fh:
        json.dump(sittings, fh, indent=1)
    with open(os.path.join(work, "results.json"), "w", encoding="utf-8") as fh:
        json.dump({"extra": ctx["extra"], "calibrations": ctx["calibrations"], "e4": ctx["e4"],
                   "stages": {f"{s}/{n}": r.to_dict() for (s, n), r in sorted(ctx["stages"].items())}},
                  fh, default=str, indent=1)
    print(page)
    progress(f"written {a.out}; raw files {raw} ({size / 1e6:.2f} MB); recorded stages: "
             f"{ctx['extra']['wall_min']:.1f} min wall, {ctx['extra']['cpu_min']:.1f} CPU min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
