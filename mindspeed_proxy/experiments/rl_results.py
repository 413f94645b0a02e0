"""The RL matrix's recorded stages read back from its work dir, calibrated, replayed and analysed for the page;
the raw files of every run exported gzipped."""
from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

from mindspeed_proxy.experiments import rl_heldout as H
from mindspeed_proxy.experiments.matrix import RunResult, fault_onset
from mindspeed_proxy.experiments.rl_calibration import replayed_alerts, write_calibration
from mindspeed_proxy.experiments.rl_tables import run_data

NONFINITE_STOP = "NaN or inf in the loss or the gradients"  # mindspeed_proxy.rl.train's NonFiniteStep message
SOURCES = {"all": ("original", "proxy"), "original": ("original",), "proxy": ("proxy",)}


def seed_dir(work, seed: int) -> Path:
    """A seed's work dir."""
    return Path(work) / f"seed{seed}"


def collect(work, seeds) -> dict:
    """{(seed, stage name): RunResult} of every completed stage of `seeds` under `work`."""
    out = {}
    for s in seeds:
        for record in sorted(seed_dir(work, s).rglob("*.done.json")):
            saved = json.loads(record.read_text())
            out[(s, saved["result"]["name"])] = RunResult(**saved["result"])
    return out


def is_run(r: RunResult) -> bool:
    """A matrix run (not SFT, warm-up, conversion or E4)."""
    return r.name.startswith(("original_", "proxy_")) and Path(r.run_dir).parent.name == "runs"


def calibration_base(cfg: dict) -> Path:
    """The base config `calibrate` reads: `calibrate_config` (the protocol's tested statistics), else the runs'."""
    return Path(cfg["config_path"]).parent / (cfg.get("calibrate_config") or cfg["monitor_config"])


def is_healthy(r: RunResult) -> bool:
    """A healthy matrix run: `<model>_none` or an extra `<model>_none_s<RL seed>`."""
    return is_run(r) and r.fault == "none" and not r.name.endswith("_r3")


def calibrate_all(cfg: dict, work, stages: dict) -> dict:
    """Calibrate on the tuning seeds' healthy runs: all, original only, proxy only (work/calibration/*.yaml)."""
    base = calibration_base(cfg)
    out_dir = Path(work) / "calibration"
    out_dir.mkdir(parents=True, exist_ok=True)
    cals = {}
    for source, models in SOURCES.items():
        dirs = [r.run_dir for (s, _), r in sorted(stages.items())
                if s in cfg["tuning_seeds"] and r.model in models and is_healthy(r)]
        if not dirs:
            cals[source] = {"error": "no completed healthy tuning run", "path": None, "runs": 0}
            continue
        cals[source] = write_calibration(out_dir / f"{source}.yaml", dirs, base, cfg["false_alarms_per_1000_steps"],
                                         cfg["calibrate_form"])
    return cals


def online_nonfinite(run_dir) -> list[dict]:
    """The run's online `non-finite` alerts (provenance of a non-finite step: no threshold, nothing to replay)."""
    from mindspeed_proxy.experiments.rl_matrix import read_jsonl

    monitor = Path(run_dir) / "mechanism_monitor" / "monitor.jsonl"
    return [a for a in read_jsonl(monitor) if a.get("type") == "alert" and a.get("kind") == "non-finite"] \
        if monitor.is_file() else []


def record(cfg: dict, r: RunResult, config_path) -> dict:
    """A run's analysis record with the alerts `config_path` replays (online alerts when None)."""
    alerts = replayed_alerts(r.run_dir, config_path) + online_nonfinite(r.run_dir) if config_path else None
    log = Path(r.run_dir) / "run.log"
    stopped = bool(r.returncode) and log.is_file() and NONFINITE_STOP in log.read_text(errors="replace")
    return {**run_data(r.run_dir, fault_onset(r.spec), cfg["collapse"], alerts=alerts, stopped=stopped), "result": r}


def attention_series(run_dir, config) -> dict:
    """{statistic: {step: layer-mean value}} of the attention-spectral statistics `config` tests."""
    from mindspeed_proxy.report.replay import per_layer_metrics
    from mindspeed_proxy.report.runs import load_run

    out: dict = {}
    for sample in load_run(str(run_dir)).samples.get("attention-spectral", []):
        if sample["step"] < config.detect_start:
            continue
        values = config.detection_series("attention-spectral", per_layer_metrics("attention-spectral", sample["layers"]))
        for (_, metric, *_rest), value in values.items():
            out.setdefault(metric, {})[sample["step"]] = value
    return out


def analyse_all(cfg: dict, work) -> dict:
    """Everything the page needs, from the work dir: calibrations, replayed records, transfer, noise floor."""
    from mindspeed_proxy.monitor.config import MonitorConfig

    seeds = [*cfg["tuning_seeds"], *cfg["heldout_seeds"]]
    stages = collect(work, seeds)
    cals = calibrate_all(cfg, work, stages)
    runs = {k: r for k, r in stages.items() if is_run(r) and k[0] in cfg["heldout_seeds"]}
    pooled = cals["all"].get("path") if "error" not in cals["all"] else None
    data = {k: record(cfg, r, pooled) for k, r in runs.items()}
    by_source = {}
    for source in ("original", "proxy"):
        path = cals[source].get("path") if "error" not in cals[source] else None
        if path:
            by_source[source] = {k: record(cfg, r, path) for k, r in runs.items() if r.model == "original"}
    noise = []
    if "lowp-attention" in cfg["faults"]:
        base = MonitorConfig.from_file(str(Path(cfg["config_path"]).parent / cfg["monitor_config"]))
        series = {k: attention_series(r.run_dir, base) for k, r in runs.items()
                  if r.fault in ("none", "lowp-attention") and not r.name.endswith("_r3")}
        ths = {k.split("/", 1)[1]: v["threshold"] for k, v in cals["all"].get("thresholds", {}).items()
               if k.startswith("attention-spectral/")}
        noise = H.noise_floor_rows(cfg, series, cfg["heldout_seeds"], ths)
    e4 = {}
    e4_path = seed_dir(work, cfg["heldout_seeds"][0]) / "e4.json"
    if e4_path.is_file():
        e4 = json.loads(e4_path.read_text())
    from mindspeed_proxy.experiments.rl_protocol import tested_statistics

    tested = tested_statistics(MonitorConfig.from_file(str(calibration_base(cfg))))
    return {"data": data, "by_source": by_source, "calibrations": cals, "noise": noise, "e4": e4,
            "tested_statistics": tested,
            "results": list(stages.values()), "stages": stages}


def trim_layers(family: str, layers: dict, tested: set) -> dict:
    """A sample's `layers` keeping only the statistics in `tested` (the monitor's metric names)."""
    out = {}
    for key, rec in layers.items():
        if not isinstance(rec, dict):
            continue
        if family in ("router", "rl"):
            out[key] = {m: v for m, v in rec.items() if m in tested}
        elif family == "update-spectral":
            out[key] = {slot: {st: v for st, v in stats.items() if f"{slot}/{st}" in tested}
                        for slot, stats in rec.items() if any(f"{slot}/{st}" in tested for st in stats)}
        else:
            out[key] = {term: {"mean": {st: v for st, v in body.get("mean", {}).items() if f"{term}/{st}" in tested}}
                        for term, body in rec.items() if isinstance(body, dict)}
    return out


def trimmed_monitor(path) -> str:
    """monitor.jsonl with every sample cut to the statistics its recorded config tests (what replay reads) and
    its output folder without this machine's path."""
    from mindspeed_proxy.monitor.config import MonitorConfig
    from mindspeed_proxy.report.replay import per_layer_metrics

    lines, config = [], None
    for line in open(path, encoding="utf-8"):
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("type") == "config":
            config = MonitorConfig.from_dict(rec["config"])
            if rec["config"].get("output_dir"):  # this machine's path: kept as the folder's own name
                rec = {**rec, "config": {**rec["config"], "output_dir": Path(rec["config"]["output_dir"]).name}}
        elif rec.get("type") == "sample" and config is not None and rec.get("family"):
            tested = set(config.tested_metrics(rec["family"], per_layer_metrics(rec["family"], rec["layers"])))
            rec = {**rec, "layers": trim_layers(rec["family"], rec["layers"], tested)}
        lines.append(json.dumps(rec) + "\n")
    return "".join(lines)


def write_stage(r: RunResult, path: Path) -> int:
    """A run's record without this machine's paths (run dir, command), and whether the trainer stopped it at a
    non-finite step (from its log); bytes written."""
    log = Path(r.run_dir) / "run.log"
    stop = bool(r.returncode) and log.is_file() and NONFINITE_STOP in log.read_text(errors="replace")
    result = {k: v for k, v in r.to_dict().items() if k not in ("run_dir", "command")}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"result": result, "nonfinite_stop": stop}, indent=1) + "\n")
    return path.stat().st_size


def import_raw(raw_dir, work, seeds) -> int:
    """Unpack every exported run of `seeds` under `raw_dir` that `work` lacks (no record, no run dir) into `work`
    as a completed stage (record hash `imported`: `--reuse` keeps it), and the other stages' records (cost only,
    under `imported/`); the number of runs imported."""
    count = 0
    for e4 in sorted(Path(raw_dir).glob("*/e4.json")):  # E4's eval rewards (its runs record no monitor)
        target = seed_dir(work, int(e4.parent.name)) / "e4.json"
        if int(e4.parent.name) in seeds and not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(e4, target)
    for kept in sorted(Path(raw_dir).glob("*/stages.json")):  # SFT, warm-up, conversion, E4: their cost only
        seed = int(kept.parent.name)
        if seed not in seeds:
            continue
        for name, result in json.loads(kept.read_text()).items():
            record = seed_dir(work, seed) / "imported" / f"{name}.done.json"
            if not record.is_file() and not any(k == (seed, name) for k in collect(work, [seed])):
                record.parent.mkdir(parents=True, exist_ok=True)
                record.write_text(json.dumps({"hash": "cost only", "seed": seed,
                                              "result": {**result, "run_dir": str(record.parent), "command": []}}))
    for stage in sorted(Path(raw_dir).glob("*/*/stage.json")):
        seed, name = int(stage.parent.parent.name), stage.parent.name
        run_dir = seed_dir(work, seed) / "runs" / name
        record = Path(str(run_dir) + ".done.json")
        if seed not in seeds or record.is_file() or run_dir.exists():  # a run dir without record: killed, rerun
            continue
        saved = json.loads(stage.read_text())
        (run_dir / "mechanism_monitor").mkdir(parents=True, exist_ok=True)
        for src, dst in (("metrics.jsonl.gz", "metrics.jsonl"), ("monitor.jsonl.gz", "mechanism_monitor/monitor.jsonl")):
            if (stage.parent / src).is_file():
                with gzip.open(stage.parent / src, "rb") as fin, open(run_dir / dst, "wb") as fout:
                    shutil.copyfileobj(fin, fout)
        if saved.get("nonfinite_stop"):
            (run_dir / "run.log").write_text(f"(imported from {stage.parent.name}) {NONFINITE_STOP}\n")
        result = {**saved["result"], "run_dir": str(run_dir), "command": []}
        record.write_text(json.dumps({"hash": "imported", "seed": seed, "result": result}))
        count += 1
    return count


def export_raw(stages: dict, out_dir, e4: dict | None = None, e4_seed: int | None = None) -> int:
    """Gzip every matrix run's metrics.jsonl and trimmed monitor.jsonl to out_dir/<seed>/<run>/ with its record
    (stage.json), and E4's rewards to out_dir/<e4_seed>/e4.json; bytes written."""
    out_dir = Path(out_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    total = 0
    if e4 and e4_seed is not None:
        (out_dir / str(e4_seed)).mkdir(parents=True, exist_ok=True)
        (out_dir / str(e4_seed) / "e4.json").write_text(json.dumps(e4, indent=1) + "\n")
        total += (out_dir / str(e4_seed) / "e4.json").stat().st_size
    other: dict = {}
    for (seed, name), r in sorted(stages.items()):
        if not is_run(r):
            other.setdefault(seed, {})[name] = {k: v for k, v in r.to_dict().items() if k not in ("run_dir", "command")}
            continue
        total += write_stage(r, out_dir / str(seed) / name / "stage.json")
        for src in (Path(r.run_dir) / "metrics.jsonl", Path(r.run_dir) / "mechanism_monitor" / "monitor.jsonl"):
            if not src.is_file():
                continue
            dst = out_dir / str(seed) / name / (src.name + ".gz")
            dst.parent.mkdir(parents=True, exist_ok=True)
            text = trimmed_monitor(src) if src.name == "monitor.jsonl" else src.read_text(encoding="utf-8")
            with gzip.GzipFile(dst, "wb", compresslevel=9, mtime=0) as fout:
                fout.write(text.encode("utf-8"))
            total += dst.stat().st_size
    for seed, records in other.items():
        (out_dir / str(seed)).mkdir(parents=True, exist_ok=True)
        (out_dir / str(seed) / "stages.json").write_text(json.dumps(records, indent=1) + "\n")
        total += (out_dir / str(seed) / "stages.json").stat().st_size
    return total
