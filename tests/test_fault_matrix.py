"""The fault matrix's --quick mode on a reduced grid: healthy original, original and proxy under lowp-attention, and E4.

Real pipeline end to end: warm-up of the 16-expert original on 2 ranks at EP=2, `convert_to_proxy.py` to 4
experts at EP=1, fine-tuning runs through `torchrun -m mindspeed_proxy.run examples/train_moe.py` with the
monitor on (examples/configs/fault_matrix.yaml; only the run lengths are shortened), then report, compare
and the tables. The healthy run is a branch (`--branch-healthy`): it continues the faulted original's checkpoint of
step 110, the last step before the onset at which the monitor resumes exactly, so only 40 of its 150 steps run
again; that its pre-onset steps equal the faulted run's bit for bit is asserted here. Also covers the former acceptance run of the patches issue (tests/test_lowp_demo.py):
every family sampled, no alert on the healthy run, alerts only from the spectral families, after the onset,
on the faulted runs.
"""
import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GRID = "original:none,original:lowp-attention,proxy:lowp-attention"


def test_quick_matrix_alerts_on_the_faulted_pair_and_not_on_the_healthy_run(tmp_path):
    doc = tmp_path / "fm.md"
    cmd = [sys.executable, str(REPO / "examples" / "experiments" / "fault_matrix.py"), "--quick", "--grid", GRID,
           "--work-dir", str(tmp_path / "work"), "--doc", str(doc), "--iters", "150", "--warmup-iters", "100", "--branch-healthy"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "regenerate with: OMP_NUM_THREADS=1 .venv/bin/python examples/experiments/fault_matrix.py" in out.stdout
    res = json.loads((tmp_path / "fm" / "results.json").read_text())
    runs = res["runs"]
    assert set(runs) == {"original_none", "original_lowp-attention", "proxy_lowp-attention"}
    onset = res["config"]["faults"]["lowp-attention"].split("start=")[1].split(",")[0]
    for name, r in runs.items():
        monitor = [json.loads(line) for line in gzip.open(tmp_path / "fm" / "raw" / f"{name}.monitor.jsonl.gz", "rt")]
        assert {m["family"] for m in monitor if m["type"] == "sample"} == {
            "attention-spectral", "update-spectral", "router"}
        alerts = [m for m in monitor if m["type"] == "alert"]
        assert r["summary"]["alerts"] == len(alerts)
        if name == "original_none":
            assert alerts == [], f"healthy run alerted: {alerts[:3]}"
        else:
            assert alerts, f"{name} raised no alert"
            assert {a["family"] for a in alerts} <= {"attention-spectral", "update-spectral"}
            assert min(a["step"] for a in alerts) >= int(onset) == r["onset"]
            assert any(m["type"] == "faults" and m["faults"][0]["name"] == "lowp-attention" for m in monitor)
    assert runs["original_none"]["ranks"] == 2 and runs["proxy_lowp-attention"]["ranks"] == 1
    healthy, faulted = runs["original_none"], runs["original_lowp-attention"]
    assert (healthy["branched_from"], healthy["branch_step"]) == ("original_lowp-attention", 110)
    assert "branched_from" not in faulted and "branched_from" not in runs["proxy_lowp-attention"]

    def steps(name):
        return {m["iteration"]: (m["loss"], m["grad_norm"]) for m in map(json.loads, gzip.open(
            tmp_path / "fm" / "raw" / f"{name}.metrics.jsonl.gz", "rt")) if m["type"] == "step"}

    branch, source = steps("original_none"), steps("original_lowp-attention")
    assert sorted(branch) == list(range(111, 151)) and sorted(source) == list(range(1, 151))
    # the branch resumed (weights, Adam, RNG, data position) exactly: healthy steps 111-119 as the source ran them
    assert all(branch[i] == source[i] for i in range(111, int(onset))) and branch[int(onset)] != source[int(onset)]
    assert all(r["cpu_s"] > 0 for r in runs.values())
    page = doc.read_text()
    for heading in ("## E1 lead time", "## E2 orthogonality", "## E3 proxy consistency", "## E4 capability", "## Cost"):
        assert heading in page
    e4 = {row["selection"].split(" ")[0]: row for row in res["e4"]["rows"]}  # held-out eval of 1+1+3+1 checkpoints
    assert set(e4) == {"original", "clustered", "random,", "most-used"} and len(e4["random,"]["all"]) == 3
    assert all(2.0 < row["loss"] < 8.0 for row in e4.values())  # token-weighted LM losses, not NaN or zero
    assert e4["original"]["loss"] < min(e4["random,"]["all"])  # all 16 experts beat every random 4
    assert re.search(r"\| none \| original \| — \| 0 \| 0 \| 0 \| none \| 0 \| met \(0 alerts\) \|", page)
    e3 = res["comparisons"]["lowp-attention"]
    assert e3["a"]["first_alert_step"] == runs["original_lowp-attention"]["summary"]["first_alert"]["step"]
    for name in runs:  # the report's plots copied beside the page, referenced by its summary.html
        html = (tmp_path / "fm" / name / "summary.html").read_text()
        srcs = re.findall(r'<img src="([^"]+)"', html)
        assert "loss_grad_norm.png" in srcs and all((tmp_path / "fm" / name / s).stat().st_size > 1000 for s in srcs)


def test_run_grid_fills_the_cores_in_order_and_returns_results_in_order(tmp_path):
    """The scheduler alone (run_one replaced by a stand-in that records what runs at once): never more ranks
    than slots at once, runs start in the given order, the 1-rank runs pair up on 2 slots."""
    import threading
    import time

    from mindspeed_proxy.experiments import Matrix

    class Recorded(Matrix):
        def run_one(self, model, fault):
            with lock:
                running.append(model)
                peaks.append(list(running))
                started.append((model, fault))
            time.sleep(0.2)
            with lock:
                running.remove(model)
            return (model, fault)

    lock, running, peaks, started = threading.Lock(), [], [], []
    cfg = {"original": {"ranks": 2}, "proxy": {"ranks": 1}}
    pairs = [("original", "a"), ("original", "b"), ("proxy", "a"), ("proxy", "b"), ("proxy", "c")]
    assert Recorded(cfg, tmp_path, tmp_path).run_grid(pairs, slots=2) == pairs
    assert started == pairs
    ranks = [sum(cfg[m]["ranks"] for m in snapshot) for snapshot in peaks]
    assert max(ranks) == 2, f"more ranks than slots at once: {peaks}"
    assert ["proxy", "proxy"] in peaks, f"the 1-rank runs never overlapped: {peaks}"


def test_branched_healthy_run_starts_after_its_source_from_a_step_the_monitor_resumes_at(tmp_path):
    """run_grid(branch=True) with run_one replaced by a stand-in: the healthy run of each model that has a faulted
    run continues that run's checkpoint of the last multiple of lcm(interval 10, router_interval 5) before the onset
    (120 -> 110), starts only after its source has finished (even with free cores), and results keep the given order."""
    import threading
    import time

    from mindspeed_proxy.experiments import Matrix
    from mindspeed_proxy.experiments.matrix import load_config

    events, lock = [], threading.Lock()

    class Recorded(Matrix):
        def run_one(self, model, fault, save_at=None, branch=None):
            with lock:
                events.append(("start", model, fault, save_at, branch))
            time.sleep(0.2)
            with lock:
                events.append(("end", model, fault))
            return (model, fault)

    cfg = load_config(REPO / "examples" / "configs" / "fault_matrix.yaml")
    m = Recorded(cfg, tmp_path, REPO)
    pairs = [("original", "none"), ("original", "lowp-attention"), ("proxy", "lowp-attention"), ("proxy", "none")]
    assert m.branch_points(pairs) == {("original", "none"): (("original", "lowp-attention"), 110),
                                      ("proxy", "none"): (("proxy", "lowp-attention"), 110)}
    assert m.branch_points([("original", "none"), ("proxy", "lowp-attention")]) == {}
    assert m.run_grid(pairs, slots=4, branch=True) == pairs
    starts = {(e[1], e[2]): (i, e[3], e[4]) for i, e in enumerate(events) if e[0] == "start"}
    ends = {(e[1], e[2]): i for i, e in enumerate(events) if e[0] == "end"}
    for model in ("original", "proxy"):
        index, save_at, branch = starts[(model, "none")]
        assert branch == (f"{model}_lowp-attention", 110) and save_at is None
        assert index > ends[(model, "lowp-attention")]
        assert starts[(model, "lowp-attention")][1:] == (110, None)
    events.clear()
    assert Recorded(cfg, tmp_path, REPO).run_grid(pairs, slots=2) == pairs  # without branch: every run from step 0
    assert all(e[3:] == (None, None) for e in events if e[0] == "start")


def test_bad_grid_is_refused_before_any_training(tmp_path):
    cmd = [sys.executable, str(REPO / "examples" / "experiments" / "fault_matrix.py"), "--grid",
           "proxy:nofault,original", "--no-e4", "--work-dir", str(tmp_path / "work"), "--doc", ""]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("error:") == 1
    assert "proxy:nofault,original" in out.stderr and "lowp-attention" in out.stderr
    assert not (tmp_path / "work").exists()


def test_reuse_only_with_the_same_settings(tmp_path):
    """--reuse keeps a work dir's results only when it recorded the same settings; otherwise they are removed
    and everything runs (a changed pinned env or monitor config file counts)."""
    import shutil

    from mindspeed_proxy.experiments import Matrix
    from mindspeed_proxy.experiments.matrix import load_config

    configs = tmp_path / "configs"
    shutil.copytree(REPO / "examples" / "configs", configs)
    cfg = load_config(configs / "fault_matrix.yaml")
    work = tmp_path / "work"
    result = work / "runs" / "original_none.result.json"

    def fake_results():
        result.parent.mkdir(parents=True, exist_ok=True)
        result.write_text("{}")

    assert Matrix(cfg, work, REPO, reuse=True).reuse is False  # nothing recorded yet
    fake_results()
    assert Matrix(cfg, work, REPO, reuse=True).reuse is True and result.is_file()
    changed = load_config(configs / "fault_matrix.yaml")
    changed["env"] = {**changed["env"], "ATEN_CPU_CAPABILITY": "default"}
    assert Matrix(changed, work, REPO, reuse=True).reuse is False and not result.exists()
    fake_results()
    assert Matrix(changed, work, REPO, reuse=True).reuse is True
    monitor = configs / "fault_matrix_monitor.yaml"
    monitor.write_text(monitor.read_text() + "\n# edited\n")
    assert Matrix(changed, work, REPO, reuse=True).reuse is False and not result.exists()
