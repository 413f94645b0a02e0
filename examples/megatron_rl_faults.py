"""Faults inside Megatron-LM's own `train_rl.py`, original vs proxy, with routing replay R3 as the control.

One command, every output under --work-dir (seeds pinned; a finished stage or run is kept and skipped when the
command is run again on the same folder):

1. SFT start checkpoint with Megatron-LM's own tools: a jsonl of digit-reversal prompt+answer texts, tokenised
   by `tools/preprocess_data.py` with the tokenizer folder of `mindspeed-proxy write-tokenizer`, then
   `pretrain_gpt.py` (8 experts, EP=2, 2 ranks, legacy `torch` checkpoint);
2. `convert_to_proxy.py` of it with the README's plain command (4 experts, EP=1);
3. `train_rl.py` runs from the SFT checkpoint (`--finetune`) with `--enable-mechanism-monitor`: healthy, then
   each fault on the original (2 ranks, EP=2) and on the proxy (its printed flags and ranks), without and with
   `--mechanism-routing-replay r3`;
4. the table (mindspeed_proxy.experiments.megatron_rl_faults): first alert, any-layer expert mismatch, reward
   from the pickled rollouts and its collapse, per run; printed and written to WORK/table.md.

    MEGATRON_LM_PATH=$MLM PYTHONPATH=.:$MLM:$MLM_DEPS:$RL_DEPS OMP_NUM_THREADS=1 \\
      python examples/megatron_rl_faults.py --work-dir runs/megatron_rl_faults
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from mindspeed_proxy.experiments.matrix import TIMED_OUT, launch as launch_command, torchrun  # noqa: E402
from mindspeed_proxy.experiments.megatron_rl_faults import FaultRun, rollout_rewards, summarize, table  # noqa: E402
from mindspeed_proxy.experiments.rl_matrix import read_jsonl  # noqa: E402
from mindspeed_proxy.proxy.printed_launch import read_launch  # noqa: E402

SEQ = 16  # train_rl.py: prompt + response (the digit task's longest is 14 tokens with EOD)
ARCH = ["--num-layers", "4", "--hidden-size", "128", "--ffn-hidden-size", "256", "--num-attention-heads", "4",
        "--group-query-attention", "--num-query-groups", "2", "--seq-length", str(SEQ), "--max-position-embeddings",
        str(SEQ), "--num-experts", "8", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
        "--transformer-impl", "local", "--tokenizer-type", "HuggingFaceTokenizer",
        "--no-gradient-accumulation-fusion", "--no-bias-swiglu-fusion", "--no-masked-softmax-fusion",
        "--no-rope-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm", "--disable-bias-linear",
        "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--distributed-backend",
        "gloo", "--eval-iters", "0", "--eval-interval", "100000", "--ckpt-format", "torch"]
# SFT in fp32 (the checkpoint loads into train_rl.py's bf16 model), loss on every token of the packed texts
SFT = ["--micro-batch-size", "32", "--global-batch-size", "64", "--lr", "3e-3", "--min-lr", "3e-4",
       "--lr-decay-style", "cosine", "--lr-warmup-iters", "20", "--split", "100,0,0", "--log-interval", "50"]
# GRPO (bf16: train_rl.py's get_logprobs needs the Float16Module): 4 prompts x 4 samples per iteration, one update
# per collection; the dynamic engine's GPU-sized defaults shrunk; the monitor samples every iteration
RL = ["--bf16", "--micro-batch-size", "4", "--global-batch-size", "16", "--lr", "2e-4", "--min-lr", "2e-4",
      "--lr-decay-style", "constant", "--log-interval", "1", "--perform-rl-step",
      "--langrl-inference-server-type", "inplace_megatron", "--grpo-prompts-per-step", "4", "--grpo-group-size",
      "4", "--grpo-iterations", "1", "--rl-parallel-generation-tasks", "4", "--inference-max-seq-length", str(SEQ),
      "--inference-dynamic-batching-buffer-size-gb", "0.02", "--inference-dynamic-batching-max-requests", "16",
      "--inference-dynamic-batching-max-tokens", "512", "--enable-mechanism-monitor",
      "--mechanism-monitor-interval", "1", "--mechanism-monitor-delta", "1"]
RUN_NAMES = ("healthy", "healthy-proxy", "noise-original", "noise-proxy", "noise-original-r3", "noise-proxy-r3",
             "lr-original", "lr-proxy", "lr-original-r3", "lr-proxy-r3")


def fault_runs(noise: str, lr: str) -> dict[str, FaultRun]:
    """The table's runs by name."""
    runs = {"healthy": FaultRun("healthy", "original"), "healthy-proxy": FaultRun("healthy-proxy", "proxy")}
    for short, spec in (("noise", noise), ("lr", lr)):
        for model in ("original", "proxy"):
            for r3 in (False, True):
                name = f"{short}-{model}" + ("-r3" if r3 else "")
                runs[name] = FaultRun(name, model, spec, r3)
    return runs


def child_env() -> dict:
    """This process's environment with the repo first on PYTHONPATH, the interpreter's folders on PATH, the pins."""
    from mindspeed_proxy.determinism import PINNED_ENV

    path = os.pathsep.join([os.path.dirname(sys.executable), os.path.join(sys.base_prefix, "bin"),
                            os.environ.get("PATH", "")])
    pythonpath = os.pathsep.join(p for p in [ROOT, os.environ.get("PYTHONPATH", "")] if p)
    return {**os.environ, **PINNED_ENV, "PATH": path, "PYTHONPATH": pythonpath}


def run(cmd: list[str], log: str, cwd: str, env: dict, check: bool = True,
        timeout: float | None = None) -> tuple[float, int]:
    """Run `cmd` in `cwd` with its output in `log` (experiments.matrix.launch: past `timeout` seconds the whole
    process group is killed and rc is TIMED_OUT); with `check`, exits naming the log on failure; (wall s, rc)."""
    rc, _, wall = launch_command(cmd, Path(log), env=env, timeout=timeout, cwd=cwd)
    if rc and check:
        sys.exit(f"megatron_rl_faults: {os.path.basename(log)[:-4]} failed (exit {rc}); see {log}")
    return wall, rc


def first_error(log: str) -> str:
    """The first exception line a rank printed in `log` (e.g. "[rank1]: RuntimeError: ...")."""
    with open(log, encoding="utf-8", errors="replace") as fh:
        lines = [line.strip() for line in fh if re.match(r"(\[rank\d+\]: )?\w+(Error|Exception): ", line.strip())]
    return lines[0] if lines else "no exception line in the log"


def last_line(log: str) -> str:
    """The last non-empty line a run wrote before our timeout note."""
    with open(log, encoding="utf-8", errors="replace") as fh:
        lines = [line.strip() for line in fh if line.strip() and not line.startswith("TimeoutError: no exit")]
    return lines[-1] if lines else ""


def prepare_sft(a, work: str, mlm: str, env: dict, say) -> str:
    """Tokenizer folder, SFT jsonl -> preprocess_data.py -> pretrain_gpt.py; returns the checkpoint folder."""
    from mindspeed_proxy.experiments.megatron_rl_matrix import write_sft_jsonl
    from mindspeed_proxy.rl.tokenizer_dir import write_tokenizer

    ckpt = os.path.join(work, "sft_ckpt")
    write_tokenizer(os.path.join(work, "tokenizer"))
    if os.path.isfile(os.path.join(ckpt, "latest_checkpointed_iteration.txt")):
        return ckpt
    # the training stream of another seed than the RL agent's prompts, each document SEQ tokens
    write_sft_jsonl(os.path.join(work, "sft.jsonl"), "reverse", a.sft_seed, a.sft_docs, SEQ)
    seconds, _ = run([sys.executable, os.path.join(mlm, "tools", "preprocess_data.py"), "--input", "sft.jsonl",
                   "--output-prefix", "sft", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                   "tokenizer", "--workers", "1"], os.path.join(work, "preprocess.log"), work, env)
    say(f"preprocess_data.py: {a.sft_docs} documents ({seconds:.0f} s)")
    flags = [*ARCH, *SFT, "--expert-model-parallel-size", "2", "--tokenizer-model", "tokenizer", "--seed",
             str(a.seed), "--data-path", "sft_text_document", "--train-iters", str(a.sft_iters), "--save", ckpt,
             "--save-interval", str(a.sft_iters)]
    seconds, _ = run(torchrun(2, os.path.join(mlm, "pretrain_gpt.py"), flags), os.path.join(work, "sft.log"), work, env)
    say(f"pretrain_gpt.py SFT: {a.sft_iters} iterations, 2 ranks, EP=2 ({seconds:.0f} s)")
    return ckpt


def convert(work: str, ckpt: str, env: dict, say) -> tuple[list[str], int]:
    """The README's plain converter command; returns the printed launch flags and accelerators."""
    proxy, log = os.path.join(work, "proxy_ckpt"), os.path.join(work, "convert.log")
    if not os.path.isfile(os.path.join(proxy, "latest_checkpointed_iteration.txt")):
        seconds, _ = run([sys.executable, os.path.join(ROOT, "convert_to_proxy.py"), "--load", ckpt, "--save", proxy,
                       "--target-expert-parallel-size", "1", "--target-num-experts", "4"], log, work, env)
        say(f"convert_to_proxy.py: 8 experts EP=2 -> 4 experts EP=1 ({seconds:.0f} s)")
    world, flags = read_launch(open(log, encoding="utf-8").read(), log)
    return flags, world


def launch(a, work: str, mlm: str, env: dict, spec: FaultRun, proxy: tuple, say) -> dict:
    """One train_rl.py run (skipped when its done.json exists); returns done.json's content."""
    folder = os.path.join(work, spec.name)
    done = os.path.join(folder, "done.json")
    if os.path.isfile(done):
        return json.load(open(done, encoding="utf-8"))
    os.makedirs(os.path.join(folder, "langrl"), exist_ok=True)
    if spec.model == "original":
        ranks, layout = 2, ["--expert-model-parallel-size", "2", "--load", os.path.join(work, "sft_ckpt"),
                            "--finetune", "--no-load-optim", "--no-load-rng"]
    else:
        ranks, layout = proxy[1], proxy[0]
    flags = [*ARCH, *RL, "--seed", str(a.seed), "--train-iters", str(a.rl_iters), "--tokenizer-model",
             os.path.join(work, "tokenizer"), "--langrl-env-config", os.path.join(work, "digits.yaml"),
             "--mechanism-monitor-output", os.path.join(folder, "monitor")]
    flags += ["--inject-fault", spec.fault] if spec.fault else []
    flags += ["--mechanism-routing-replay", "r3"] if spec.r3 else []
    log = os.path.join(folder, "train_rl.log")
    seconds, rc = run(torchrun(ranks, os.path.join(mlm, "train_rl.py"), flags + layout), log, folder,
                      {**env, "LANGRL_LOG_DIR": os.path.join(folder, "langrl")}, check=False, timeout=a.run_timeout)
    error = (f"TimeoutError: no exit after {a.run_timeout:.0f} s (--run-timeout), killed; last line before: "
             f"{last_line(log)}" if rc == TIMED_OUT else first_error(log) if rc else None)
    record = {"ranks": ranks, "wall_s": seconds, "error": error}
    with open(done, "w", encoding="utf-8") as fh:
        json.dump(record, fh)
    say(f"{spec.name}: {a.rl_iters} train_rl.py iterations on {ranks} rank(s) ({seconds:.0f} s)"
        + (f"; FAILED (exit {rc}): {record['error']}" if rc else ""))
    return record


def main(argv=None) -> int:
    """Build the start checkpoint and the proxy, run the selected train_rl.py runs, print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work-dir", required=True)
    p.add_argument("--megatron-lm", default=os.environ.get("MEGATRON_LM_PATH"), help="the checkout (core_v0.16)")
    p.add_argument("--runs", default=",".join(RUN_NAMES),
                   help=f"comma-separated subset of {', '.join(RUN_NAMES)}, in order (the alerts of a faulted run "
                        "listed after its model's healthy run that the healthy run also raised are not counted)")
    p.add_argument("--sft-iters", type=int, default=800)  # the defaults are the docs table's settings
    p.add_argument("--sft-docs", type=int, default=20000)
    p.add_argument("--sft-seed", type=int, default=7)
    p.add_argument("--rl-iters", type=int, default=22)
    p.add_argument("--onset", type=int, default=12, help="first train_rl.py iteration of every fault")
    p.add_argument("--noise-std", type=float, default=0.5)
    p.add_argument("--lr-x", type=float, default=50.0)
    p.add_argument("--partial-credit", type=float, default=0.5, help="the agent's credit per right digit")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--run-timeout", type=float, default=1800.0, metavar="S",
                   help="seconds a train_rl.py run may take before it is killed and recorded as a miss (a launch "
                        "has been seen waiting forever on Megatron-LM's inference coordinator)")
    a = p.parse_args(argv)
    if not a.run_timeout > 0:
        p.error(f"--run-timeout {a.run_timeout:g}: must be a positive number of seconds")
    names = [n.strip() for n in a.runs.split(",") if n.strip()]
    bad = [n for n in names if n not in RUN_NAMES]
    if bad or not names:
        p.error(f"--runs {a.runs!r}: unknown run(s) {bad}; known: {', '.join(RUN_NAMES)}")
    if not a.megatron_lm or not os.path.isfile(os.path.join(a.megatron_lm, "train_rl.py")):
        p.error(f"--megatron-lm {a.megatron_lm!r}: not a Megatron-LM checkout with train_rl.py "
                "(set MEGATRON_LM_PATH or pass --megatron-lm)")
    if not 1 <= a.onset <= a.rl_iters:
        p.error(f"--onset {a.onset}: must be within 1..--rl-iters ({a.rl_iters})")
    work, mlm = os.path.abspath(a.work_dir), os.path.abspath(a.megatron_lm)
    os.makedirs(work, exist_ok=True)
    env = child_env()
    t0 = time.perf_counter()

    def say(message: str) -> None:
        print(f"[{time.perf_counter() - t0:6.0f} s] {message}", flush=True)

    import yaml

    from mindspeed_proxy.rl.megatron_agents import env_config

    noise = f"rollout-router-noise:start={a.onset},std={a.noise_std},seed={a.seed}"
    lr = f"lr-spike:start={a.onset},x={a.lr_x:g}"
    runs = fault_runs(noise, lr)
    say(f"outputs in {work}; runs: {', '.join(names)}")
    ckpt = prepare_sft(a, work, mlm, env, say)
    with open(os.path.join(work, "digits.yaml"), "w", encoding="utf-8") as fh:
        yaml.safe_dump(env_config("reverse", a.partial_credit, a.seed), fh)
    proxy = convert(work, ckpt, env, say) if any(runs[n].model == "proxy" for n in names) else None
    rows, healthy = [], {}
    for name in names:
        spec = runs[name]
        extra = launch(a, work, mlm, env, spec, proxy, say)
        folder = os.path.join(work, name)
        summary = summarize(os.path.join(folder, "monitor", "monitor.jsonl"),
                            rollout_rewards(os.path.join(folder, "langrl")), a.onset, healthy.get(spec.model))
        if spec.fault is None:  # the same model's faulted runs' alerts are compared with its alerts
            healthy[spec.model] = [r for r in read_jsonl(os.path.join(folder, "monitor", "monitor.jsonl"))
                                   if r.get("type") == "alert"]
        summary["error"] = extra.get("error")
        rows.append((runs[name], summary, extra))
    text = table(rows, a.onset)
    with open(os.path.join(work, "table.md"), "w", encoding="utf-8") as fh:
        fh.write(text + "\n")
    with open(os.path.join(work, "results.json"), "w", encoding="utf-8") as fh:
        json.dump({r.name: {"fault": r.fault, "r3": r.r3, "model": r.model, **s, **x} for r, s, x in rows}, fh,
                  indent=1)
    print("\n" + text, flush=True)
    say("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
