"""`make_report`: plots and a one-page summary (markdown + JSON) of one recorded run."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from mindspeed_proxy.report.divergence import DivergenceRule, divergence_step
from mindspeed_proxy.report.runs import (FAMILIES, Run, family_aggregate, family_matrix, headline_metric,
                                         layer_label, load_run)


def _plt():
    """matplotlib.pyplot on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def baseline_band(run: Run, family: str, steps: list[int], agg: list[float]) -> tuple[float, float, str] | None:
    """(low, high, source) of the family's baseline: the detector warm-up's median ± z·MAD·1.4826, else its range."""
    cfg = run.config or {}
    det = cfg.get("router_detector" if family == "router" else "detector") or {}
    warmup = int(det.get("warmup", 8))
    start = int(cfg.get("detect_start", 0) or 0)
    vals = [v for s, v in zip(steps, agg) if s >= start and math.isfinite(v)][:warmup]
    if len(vals) < 2:
        return None
    med = statistics.median(vals)
    mad = statistics.median(abs(v - med) for v in vals) * 1.4826
    z = float(det.get("z_threshold", 0) or 0)
    if mad > 0 and z > 0:
        return med - z * mad, med + z * mad, f"warm-up median ± {z:g}·MAD (first {len(vals)} samples from step {start})"
    return min(vals), max(vals), f"warm-up range (first {len(vals)} samples from step {start})"


def _plot_loss(run: Run, div: int | None, out: Path, dpi: int = 90) -> Path:
    """Loss and grad norm against step, divergence and first alert marked."""
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax1.plot(run.steps, run.loss, lw=1)
    ax1.set_ylabel("loss")
    ax2.plot(run.steps, run.grad_norm, lw=1, color="tab:orange")
    ax2.set_ylabel("grad norm")
    ax2.set_xlabel("step")
    first = run.first_alert()
    for ax in (ax1, ax2):
        if div is not None:
            ax.axvline(div, color="red", ls="--", label=f"divergence @ {div}")
        if first:
            ax.axvline(first["step"], color="purple", ls=":", label=f"first alert @ {first['step']}")
        for f in run.faults:
            if "start" in f:
                ax.axvline(f["start"], color="gray", ls="-.", label=f"fault {f.get('name')} @ {f['start']}")
    if ax1.get_legend_handles_labels()[0]:
        ax1.legend(fontsize=8)
    ax1.set_title(f"{run.path.name}: loss and grad norm")
    fig.tight_layout()
    path = out / "loss_grad_norm.png"
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def _plot_family(run: Run, family: str, out: Path, heatmap: bool = True, dpi: int = 90) -> tuple[list[Path], dict]:
    """Aggregate curve with band and alert markers, plus (if `heatmap`) the layer×step heatmap, of one family."""
    plt = _plt()
    metric = headline_metric(run, family)
    steps, agg = family_aggregate(run, family, metric)
    band = baseline_band(run, family, steps, agg)
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(steps, agg, marker=".", lw=1, label=f"mean over layers of {metric}")
    if band:
        ax.axhspan(band[0], band[1], color="green", alpha=0.15, label=band[2])
    alerts = [a for a in run.alerts if a.get("family") == family]
    if alerts:
        by_step = dict(zip(steps, agg))
        xs = sorted({a["step"] for a in alerts})
        ax.scatter(xs, [by_step.get(s, math.nan) for s in xs], color="red", zorder=3, label=f"alerts ({len(alerts)})")
        for s in xs:
            ax.axvline(s, color="red", alpha=0.2, lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(f"{family}: aggregate")
    ax.legend(fontsize=8)
    fig.tight_layout()
    slug = family.replace("-", "_")
    p1 = out / f"{slug}_aggregate.png"
    fig.savefig(p1, dpi=dpi)
    plt.close(fig)
    steps, layers, values = family_matrix(run, family, metric)
    info = {"metric": metric, "samples": len(steps), "layers": layers,
            "band": None if band is None else {"low": band[0], "high": band[1], "source": band[2]}}
    if not heatmap:
        return [p1], info
    fig, ax = plt.subplots(figsize=(8, 1.5 + 0.4 * max(len(layers), 1)))
    im = ax.imshow(values, aspect="auto", interpolation="nearest", cmap="viridis",
                   extent=(min(steps) - 0.5, max(steps) + 0.5, len(layers) - 0.5, -0.5))
    ax.set_yticks(range(len(layers)), [str(layer) for layer in layers])
    ax.set_xlabel("step")
    ax.set_ylabel("layer")
    ax.set_title(f"{family}: {metric} per layer")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    p2 = out / f"{slug}_heatmap.png"
    fig.savefig(p2, dpi=dpi)
    plt.close(fig)
    return [p1, p2], info


def summarize(run: Run, rule: DivergenceRule = DivergenceRule()) -> dict:
    """The report's numbers for `run` (no files written)."""
    div, reason = divergence_step(run.steps, run.loss, run.grad_norm, rule)
    first = run.first_alert()
    per_family = {}
    for fam in sorted(set(FAMILIES) | {a["family"] for a in run.alerts}):
        a = run.first_alert(fam)
        per_family[fam] = None if a is None else {k: a.get(k) for k in (
            "step", "metric", "layer", "head_or_expert", "value", "baseline", "z", "kind", "mechanism", "mitigation")}
    return {
        "run_dir": str(run.path),
        "steps": len(run.steps),
        "loss_source": run.loss_source,
        "last_step": run.steps[-1] if run.steps else None,
        "faults": run.faults,
        "divergence_rule": rule.as_dict(),
        "divergence_step": div,
        "divergence_reason": reason,
        "alerts": len(run.alerts),
        "first_alert": None if first is None else {"step": first["step"], "family": first.get("family"),
                                                   "metric": first.get("metric"), "layer": first.get("layer")},
        "first_alert_per_family": per_family,
        "lead_time": None if (div is None or first is None) else div - first["step"],
        "mechanism": None if first is None else first.get("mechanism"),
        "hint": None if first is None else first.get("mitigation"),
        "monitor_errors": len(run.errors),
    }


def _markdown(s: dict, plots: list[str]) -> str:
    """The summary as one markdown page."""
    div, fa = s["divergence_step"], s["first_alert"]
    first = "no alerts" if fa is None else f"step {fa['step']} ({fa['family']}: {fa['metric']}, {layer_label(fa['layer'])})"
    lines = [f"# Run report: `{s['run_dir']}`", "",
             f"- steps: {s['steps']} (last {s['last_step']}; loss from {s['loss_source']})",
             f"- faults: {', '.join(f.get('name', '?') + ' @ ' + str(f.get('start')) for f in s['faults']) or 'none'}",
             "- divergence: " + ("no divergence" if div is None else f"step {div} ({s['divergence_reason']})"),
             f"- first alert: {first}",
             f"- lead time (divergence step − first alert step): {'n/a' if s['lead_time'] is None else s['lead_time']}",
             f"- mechanism: {s['mechanism'] or 'n/a'}", f"- hint: {s['hint'] or 'n/a'}",
             f"- monitor errors: {s['monitor_errors']}", "", "## First alert per family", "",
             "| family | step | metric | layer | z | kind | mechanism |", "|---|---|---|---|---|---|---|"]
    for fam, a in s["first_alert_per_family"].items():
        if a is None:
            lines.append(f"| {fam} | no alerts | | | | | |")
        else:
            z = "" if a["z"] is None else f"{a['z']:.3g}"
            lines.append(f"| {fam} | {a['step']} | {a['metric']} | {layer_label(a['layer'])} | {z} | {a['kind']} | {a['mechanism']} |")
    r = s["divergence_rule"]
    lines += ["", "## Divergence rule", "", f"{r['definition']}; warmup={r['warmup']}, "
              f"loss_factor={r['loss_factor']}, grad_factor={r['grad_factor']}.", "", "## Plots", ""]
    lines += [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def markdown_to_html(md: str, title: str) -> str:
    """The summary's markdown (CommonMark with pipe tables, by markdown-it-py) as one self-contained page."""
    import html

    from markdown_it import MarkdownIt

    body = MarkdownIt("commonmark").enable("table").render(md)
    style = ("body{font-family:sans-serif;max-width:60em;margin:2em auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:2px 6px}code{background:#f4f4f4}img{max-width:100%}")
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body>\n" + body + "</body></html>\n")


def make_report(run_dir, out_dir=None, rule: DivergenceRule = DivergenceRule(), heatmaps: bool = True,
                dpi: int = 90) -> dict:
    """Write PNG plots, summary.md/.html/.json for `run_dir` into `out_dir` (default RUN_DIR/report)."""
    run = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else run.path / "report"
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(run, rule)
    plots = [_plot_loss(run, summary["divergence_step"], out, dpi)] if run.steps else []
    families = {}
    for fam in FAMILIES:
        if run.samples.get(fam):
            paths, families[fam] = _plot_family(run, fam, out, heatmaps, dpi)
            plots += paths
    summary["families"] = families
    summary["plots"] = [p.name for p in plots]
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    (out / "summary.md").write_text(_markdown(summary, summary["plots"]))
    (out / "summary.html").write_text(markdown_to_html(_markdown(summary, summary["plots"]), summary["run_dir"]))
    summary["out_dir"] = str(out)
    return summary
