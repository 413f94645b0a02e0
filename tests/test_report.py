"""`report` and `compare` on small runs recorded by this test (1 rank, tiny MoE, mechanism monitor on).

Runs: `alerting` uses a deliberately sensitive monitor config (detect_start 4, warm-up 4, z 3, persistence 1)
plus an lr-spike fault from step 20, so alerts and a divergence happen within 40 steps; `quiet` uses the
default detector (detect_start 100) for 16 steps, so it cannot alert. `derived` is a COPY of `quiet` with
synthetic step records appended to its metrics.jsonl (a derived fixture, not hand-written data).
"""
import json
import math
import shutil
import statistics

import pytest

from mindspeed_proxy.report.divergence import DivergenceRule
from mindspeed_proxy.report.report import make_report
from mindspeed_proxy.report.compare import compare_runs
from mindspeed_proxy.testing import run_distributed
from mindspeed_proxy.training.loop import train

SENSITIVE = """interval: 2
delta: 2
router_interval: 2
detect_start: 4
detector: {warmup: 4, z_threshold: 3.0, persistence: 1, cusum: true}
router_detector: {warmup: 4, z_threshold: 3.0, persistence: 1}
detect_scopes: {attention-spectral: [layer, mean], update-spectral: [mean], router: [layer, mean]}
"""


def record(log_dir, iters, *extra):
    """Train the tiny MoE on one spawned rank with the monitor on; return the run dir."""
    argv = ["--num-layers", "2", "--train-iters", str(iters), "--lr-warmup-iters", "2", "--log-dir", str(log_dir),
            "--enable-mechanism-monitor", *extra]
    assert run_distributed(train, 1, argv, timeout=240)[0] in (0, None)
    return log_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    (root / "cfg.yaml").write_text(SENSITIVE)
    alerting = record(root / "alerting", 40, "--mechanism-monitor-config", str(root / "cfg.yaml"),
                      "--inject-fault", "lr-spike:start=20,x=100")
    quiet = record(root / "quiet", 16, "--mechanism-monitor-interval", "4", "--mechanism-monitor-delta", "2")
    return {"alerting": alerting, "quiet": quiet, "root": root}


def jsonl(path):
    return [json.loads(line) for line in open(path) if line.strip()]


def independent_divergence(steps, rule):
    """The documented rule, re-implemented here from the raw step records (per-step loss: loss_window 1)."""
    assert rule.loss_window == 1
    loss, gn, it = ([r[k] for r in steps] for k in ("loss", "grad_norm", "iteration"))
    start = None  # index of the first step of the current loss rise
    for i in range(len(steps)):
        if not math.isfinite(loss[i]):
            return it[i if start is None else start]
        rises = i >= rule.warmup and loss[i] > rule.loss_factor * min(loss[:i])
        start = (i if start is None else start) if rises else None
        if start is not None and i - start + 1 == rule.persistence:
            return it[start]
        if i >= rule.warmup and gn[i] > rule.grad_factor * statistics.median(gn[:i]):
            return it[i if start is None else start]
    return None


def expected_lead(run_dir):
    steps = [r for r in jsonl(run_dir / "metrics.jsonl") if r["type"] == "step"]
    alerts = [r for r in jsonl(run_dir / "mechanism_monitor" / "monitor.jsonl") if r["type"] == "alert"]
    div = independent_divergence(steps, DivergenceRule())
    first = min((a["step"] for a in alerts), default=None)
    return div, first, (None if div is None or first is None else div - first)


def test_report_writes_plots_and_the_lead_time_matches_the_jsonl(runs, tmp_path):
    summary = make_report(runs["alerting"], tmp_path / "rep")
    pngs = sorted((tmp_path / "rep").glob("*.png"))
    assert len(pngs) == 7 and all(p.stat().st_size > 1000 for p in pngs)
    div, first, lead = expected_lead(runs["alerting"])
    assert first is not None and div is not None, "the recorded run should alert and diverge"
    assert (summary["divergence_step"], summary["first_alert"]["step"], summary["lead_time"]) == (div, first, lead)
    on_disk = json.loads((tmp_path / "rep" / "summary.json").read_text())
    assert on_disk["lead_time"] == lead and on_disk["divergence_rule"]["loss_factor"] == DivergenceRule().loss_factor
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert f"lead time (divergence step − first alert step): {lead}" in md and "mechanism:" in md


def test_run_without_alerts_says_so_and_synthetic_divergence_is_found(runs, tmp_path):
    summary = make_report(runs["quiet"], tmp_path / "rep")
    assert summary["alerts"] == 0 and summary["lead_time"] is None
    assert "first alert: no alerts" in (tmp_path / "rep" / "summary.md").read_text()
    derived = tmp_path / "derived"  # derived fixture: a copy of the recorded run plus synthetic NaN-loss steps
    shutil.copytree(runs["quiet"], derived)
    last = [r for r in jsonl(derived / "metrics.jsonl") if r["type"] == "step"][-1]
    with open(derived / "metrics.jsonl", "a") as f:
        for k, loss in ((1, last["loss"]), (2, float("nan"))):
            f.write(json.dumps({**last, "iteration": last["iteration"] + k, "loss": loss}) + "\n")
    s2 = make_report(derived, tmp_path / "rep2")
    assert s2["divergence_step"] == expected_lead(derived)[0] == last["iteration"] + 2
    assert s2["lead_time"] is None and "no alerts" in (tmp_path / "rep2" / "summary.md").read_text()


def test_compare_of_a_run_with_itself_is_consistent(runs, capsys):
    from mindspeed_proxy.cli import main

    result = compare_runs(runs["alerting"], runs["alerting"])
    assert result["loss"]["pearson"] == pytest.approx(1.0) and result["verdict"] == "consistent"
    assert all(c["pearson"] == pytest.approx(1.0) for c in result["families"].values() if c["pearson"] is not None)
    assert main(["compare", str(runs["alerting"]), str(runs["quiet"])]) == 0
    assert "verdict:" in capsys.readouterr().out


def test_bad_input_exits_2_and_writes_nothing(tmp_path, capsys):
    from mindspeed_proxy.cli import main

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert main(["report", str(empty), "--out", str(tmp_path / "out")]) == 2
    assert main(["compare", str(empty), str(empty)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all("error:" in line for line in err)
    assert not (tmp_path / "out").exists() and list(empty.iterdir()) == []


def test_summary_html_embeds_every_plot_and_heatmaps_are_optional(runs, tmp_path):
    import re

    summary = make_report(runs["alerting"], tmp_path / "rep")
    page = (tmp_path / "rep" / "summary.html").read_text()
    srcs = re.findall(r'<img src="([^"]+)"', page)
    assert sorted(srcs) == sorted(summary["plots"]) and len(srcs) == 7
    assert all((tmp_path / "rep" / s).stat().st_size > 1000 for s in srcs)
    assert f"<li>lead time (divergence step − first alert step): {summary['lead_time']}</li>" in page
    assert page.count("<table>") == 1 and "<th>family</th>" in page
    lean = make_report(runs["alerting"], tmp_path / "lean", heatmaps=False)
    assert lean["plots"] == [p for p in summary["plots"] if "heatmap" not in p] and len(lean["plots"]) == 4
    assert not list((tmp_path / "lean").glob("*heatmap*"))


def test_replay_reproduces_the_online_alerts_and_answers_what_if(runs, tmp_path, capsys):
    from mindspeed_proxy.cli import main
    from mindspeed_proxy.monitor.config import MonitorConfig
    from mindspeed_proxy.report.replay import replay_alerts
    from mindspeed_proxy.report.runs import load_run

    run = load_run(runs["alerting"])
    online = [r for r in jsonl(runs["alerting"] / "mechanism_monitor" / "monitor.jsonl") if r["type"] == "alert"]
    assert online, "the sensitive run should alert"
    key = lambda a: (a["step"], a["family"], a["metric"], -1 if a["layer"] is None else a["layer"], a["kind"])  # noqa: E731
    replayed = replay_alerts(run, MonitorConfig.from_dict(run.config))
    assert sorted(map(key, replayed)) == sorted(map(key, online))
    assert {a["family"] for a in online if a["layer"] is None} and all(  # layer-mean series alerted online
        a["layer"] is None for a in online if a["family"] == "update-spectral")
    assert all(math.isclose(r["value"], o["value"], rel_tol=1e-12) or not math.isfinite(o["value"])
               for r, o in zip(sorted(replayed, key=key), sorted(online, key=key)))
    deaf = tmp_path / "deaf.yaml"  # thresholds no finite series reaches: only non-finite alerts may remain
    deaf.write_text(SENSITIVE.replace("z_threshold: 3.0", "z_threshold: 1.0e9").replace("cusum: true", "cusum: false"))
    assert all(a["kind"] == "non-finite" for a in replay_alerts(run, MonitorConfig.from_file(str(deaf))))
    late = MonitorConfig.from_dict({**run.config, "detect_start": 10 ** 6})
    assert replay_alerts(run, late) == []
    # samples a resume cut short (the monitor writes them with `window_steps` and does not test them): nor does replay
    cut = tmp_path / "cut"
    shutil.copytree(runs["alerting"], cut)
    records = jsonl(cut / "mechanism_monitor" / "monitor.jsonl")
    with open(cut / "mechanism_monitor" / "monitor.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps({**r, "window_steps": 1} if r["type"] == "sample" else r) + "\n")
    assert replay_alerts(load_run(cut), MonitorConfig.from_dict(run.config)) == []
    assert main(["replay", str(runs["alerting"])]) == 0
    out = capsys.readouterr().out
    first = min(online, key=lambda a: a["step"])
    assert f"first at step {first['step']}" in out
    assert main(["replay", str(tmp_path / "missing")]) == 2


def test_compare_verdict_correlates_the_losses_before_the_first_divergence(runs, tmp_path):
    derived = tmp_path / "derived"  # derived fixture: the recorded run with its loss blown up from step 30 on
    shutil.copytree(runs["alerting"], derived)
    recs = jsonl(derived / "metrics.jsonl")
    with open(derived / "metrics.jsonl", "w") as f:
        for r in recs:
            if r["type"] == "step" and r["iteration"] >= 30:
                r = {**r, "loss": 50.0 + 3.0 * r["iteration"] - r["loss"]}
            f.write(json.dumps(r) + "\n")
    result = compare_runs(runs["alerting"], derived)
    div_a = result["a"]["divergence_step"]
    cut = min(s for s in (div_a, 30) if s is not None)
    assert result["b"]["divergence_step"] == 30 or (div_a is not None and div_a < 30)
    pre = result["loss_before_divergence"]
    assert pre["before"] == cut and pre["common_steps"] == cut - 1
    assert pre["pearson"] == pytest.approx(1.0) and result["loss"]["pearson"] < 0.99
    assert not any("Pearson" in r for r in result["reasons"])



def _derived(src, dst, step=None, drop_alerts=False):
    """A copy of a recorded run with each step record replaced by `step(record)` and/or its alerts dropped."""
    shutil.copytree(src, dst)
    if step is not None:
        recs = jsonl(dst / "metrics.jsonl")
        with open(dst / "metrics.jsonl", "w") as f:
            f.writelines(json.dumps(step(r) if r["type"] == "step" else r) + "\n" for r in recs)
    if drop_alerts:
        recs = jsonl(dst / "mechanism_monitor" / "monitor.jsonl")
        with open(dst / "mechanism_monitor" / "monitor.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in recs if r["type"] != "alert")
    return dst


def test_demo_verdict_is_the_e3_rule_and_does_not_hinge_on_the_loss_pearson(runs, tmp_path):
    from mindspeed_proxy.experiments.tables import reproduction_verdict

    a = runs["alerting"]
    base = compare_runs(a, a)
    assert base["a"]["diverged"] and base["a"]["first_alert_step"] is not None  # the fixture alerts and diverges
    cut = base["a"]["divergence_step"]
    pre = [r["loss"] for r in jsonl(a / "metrics.jsonl") if r["type"] == "step" and r["iteration"] < cut]
    mean = statistics.fmean(pre)

    def wobble(r):  # before the divergence the loss wobbles around its mean: Pearson far below 0.95
        return {**r, "loss": mean + 0.01 * (-1) ** r["iteration"]} if r["iteration"] < cut else r

    c = compare_runs(a, _derived(a, tmp_path / "wobble", wobble))
    assert c["b"]["diverged"] and c["loss_before_divergence"]["pearson"] < 0.95
    assert c["verdict"] == "inconsistent"  # compare's general question says no ...
    line = reproduction_verdict("lr-spike", c)
    assert line.startswith("verdict: the proxy reproduced the fault") and "missed" not in line  # ... E3 says yes
    assert "did NOT reproduce the healthy run" in reproduction_verdict("none", c)  # healthy pairs: Pearson counts
    silent = compare_runs(a, _derived(a, tmp_path / "silent", drop_alerts=True))
    assert reproduction_verdict("lr-spike", silent).endswith("missed: first alerts differ")
    calm = compare_runs(a, _derived(a, tmp_path / "calm", lambda r: {
        **r, "loss": mean + 0.01 * (-1) ** r["iteration"], "grad_norm": 1.0}))  # never diverges
    assert not calm["b"]["diverged"]
    line = reproduction_verdict("lr-spike", calm)
    assert line.startswith("verdict: the proxy did NOT reproduce") and "divergence outcome differs" in line
