"""The train_rl.py loop of the RL fault matrix without a Megatron-LM checkout: its config, the SFT documents, the
reward series from Megatron-LM's rollout pickles, the commands it would launch, the run timeout and the driver's
refusal without a checkout. The runs themselves: tests/test_megatron_lm_rl_matrix.py (needs the checkout)."""
import json
import os
import pickle
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from mindspeed_proxy.experiments.matrix import TIMED_OUT, launch
from mindspeed_proxy.experiments.megatron_rl_matrix import MegatronRLMatrix, rollout_metrics, sft_text, write_sft_jsonl
from mindspeed_proxy.experiments.rl_matrix import load_rl_config
from mindspeed_proxy.experiments import rl_protocol
from mindspeed_proxy.monitor.config import MonitorConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "configs" / "megatron_rl_fault_matrix.yaml"


def test_shipped_config_holds_the_protocol_and_names_only_known_flags():
    cfg = load_rl_config(CONFIG)
    assert cfg["loop"] == "train_rl" and cfg["megatron"]["seq_length"] == 16
    assert cfg["megatron"]["sft_data_seed_offset"] == 1000  # a default of the schema the file leaves out
    stats = rl_protocol.tested_statistics(MonitorConfig.from_file(str(CONFIG.parent / cfg["calibrate_config"])))
    assert stats == ["rl/topk_match", "update-spectral/linear_qkv/frobenius"]
    check = rl_protocol.protocol_check(cfg, len(stats))
    assert check["unmet"] == [] and check["k"] >= 1 and check["heldout_steps_per_model"] >= 1000
    assert check["promise_per_1000_steps"] <= cfg["false_alarms_per_1000_steps"]
    arch = cfg["megatron"]["arch_args"]
    assert "--num-experts" not in arch and arch[arch.index("--seq-length") + 1] == "16"
    grpo = load_rl_config(CONFIG.parent / "rl_fault_matrix.yaml")
    assert grpo["loop"] == "grpo" and grpo["megatron"] is None and grpo["setup"] is None


@pytest.mark.parametrize("change, message", [({"loop": "verl"}, "loop 'verl': expected one of grpo, train_rl"),
                                             ({"megatron": None}, "loop train_rl needs the 'megatron' settings")])
def test_bad_loop_settings_are_refused_naming_the_key(tmp_path, change, message):
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg.update(change)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_rl_config(path)


def test_sft_documents_are_exactly_seq_tokens_with_the_right_answer(tmp_path):
    """Each document tokenises to `seq` ids: prompt, the task's answer, EOD, PADs (character tokenizer)."""
    from mindspeed_proxy.rl.tasks import build_task
    from mindspeed_proxy.rl.tokenizer_dir import EOD, PAD, write_tokenizer
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    write_sft_jsonl(tmp_path / "sft.jsonl", "reverse", 1011, 50, 16)
    texts = [json.loads(line)["text"] for line in open(tmp_path / "sft.jsonl", encoding="utf-8")]
    assert len(texts) == 50 and len(set(texts)) > 40
    task = build_task("reverse")
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == 16
        body = text.split(EOD)[0]
        prompt = body[:body.index("=") + 1]
        assert body == prompt + task.answer(prompt) and text.endswith(PAD) and text.count(EOD) == 1
    with pytest.raises(ValueError, match="longer than 5 tokens"):
        sft_text("12+34=", "4321", 5)


def test_rollout_metrics_write_the_mean_reward_per_iteration_and_drop_the_pickles(tmp_path):
    """rollouts_rank0_iteration{N}_*.pkl (N 0-based, groups of rollouts with .reward) -> step N+1, mean reward;
    other ranks' files are not read; the pickles are removed."""
    rng = random.Random(0)
    langrl = tmp_path / "langrl"
    langrl.mkdir()
    expected = {}
    for n in (0, 1, 2, 5):
        groups = [[SimpleNamespace(reward=rng.random()) for _ in range(4)] for _ in range(3)]
        expected[n + 1] = sum(r.reward for g in groups for r in g) / 12
        (langrl / f"rollouts_rank0_iteration{n}_cfg.pkl").write_bytes(pickle.dumps(groups))
    (langrl / "rollouts_rank1_iteration0_cfg.pkl").write_bytes(pickle.dumps([[SimpleNamespace(reward=99.0)]]))
    assert rollout_metrics(tmp_path, langrl) == 4
    steps = [json.loads(line) for line in open(tmp_path / "metrics.jsonl", encoding="utf-8")]
    assert [s["iteration"] for s in steps] == [1, 2, 3, 6]
    assert all(s["type"] == "step" and abs(s["reward_mean"] - expected[s["iteration"]]) < 1e-12 for s in steps)
    assert not langrl.exists()


def _convert_log(work: Path, proxy: Path) -> None:
    (work / "convert_cluster.log").write_text(
        "proxy written to X\nlaunch flags: --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 "
        f"--expert-model-parallel-size 1 --num-experts 4 --ckpt-format torch --load {proxy} --finetune "
        "--no-load-optim --no-load-rng\naccelerators: 2 -> 1 (TP=1 x PP=1 x DP=1, EP=1)\n")


def test_a_conversion_log_without_its_launch_lines_is_named(tmp_path):
    """The proxy's runs need the converter's printed launch flags and accelerators: a log without them (a conversion
    that stopped early) is one error naming that log, before anything is launched."""
    m = MegatronRLMatrix(load_rl_config(CONFIG), tmp_path / "seed12", ROOT, tmp_path / "mlm", seed=12)
    m.work.mkdir(parents=True)
    (m.work / "convert_cluster.log").write_text("planning...\nlaunch flags: --num-experts 4\n")
    with pytest.raises(ValueError, match=re.escape(f"{m.work / 'convert_cluster.log'}: no 'launch flags:'")):
        m.launch_flags("proxy")
    _convert_log(m.work, m.work / "proxy_cluster")
    ranks, flags = m.launch_flags("proxy")
    assert ranks == 1 and flags[flags.index("--load") + 1] == str(m.work / "proxy_cluster") and len(flags) == 15


def test_run_commands_are_train_rl_with_the_run_seed_layout_fault_and_monitor(tmp_path):
    """The original loads the SFT checkpoint on 2 ranks at EP=2; the proxy takes the converter's printed flags and
    rank count; an RL seed sets --seed, the agent's prompt stream and the rollout noise's seed; the run's
    rollouts go to its LANGRL_LOG_DIR and it is killed past run_timeout_s."""
    cfg = load_rl_config(CONFIG)
    mlm = tmp_path / "mlm"
    mlm.mkdir()
    m = MegatronRLMatrix(cfg, tmp_path / "seed12", ROOT, mlm, seed=12)
    m.work.mkdir(parents=True)
    _convert_log(m.work, m.work / "proxy_cluster")
    calls = []
    m._stage = lambda *a, **k: calls.append((a, k)) or SimpleNamespace(cpu_s=1.0, wall_s=1.0)
    m.run("rollout-router-noise", "proxy", rl_seed=1401)
    m.run("lr-spike", "original")
    (proxy_args, proxy_kw), (orig_args, orig_kw) = calls
    name, model, fault, spec, ranks, cmd = proxy_args[:6]
    assert (name, model, ranks) == ("proxy_rollout-router-noise_s1401", "proxy", 1)
    assert spec == "rollout-router-noise:start=20,std=0.5,seed=1401"
    assert cmd[cmd.index("--nproc-per-node") + 1] == "1" and cmd[cmd.index("-m", 3) + 1] == "mindspeed_proxy.run"
    assert cmd[cmd.index("mindspeed_proxy.run") + 1] == str(mlm / "train_rl.py")
    assert cmd[cmd.index("--seed") + 1] == "1401" and cmd[cmd.index("--inject-fault") + 1] == spec
    printed = (m.work / "convert_cluster.log").read_text().split("launch flags: ")[1].split("\n")[0].split()
    assert len(printed) == 15 and cmd[-15:] == printed  # the converter's flags, last
    assert cmd[cmd.index("--load") + 1] == str(m.work / "proxy_cluster") and "--enable-mechanism-monitor" in cmd
    assert cmd[cmd.index("--num-experts") + 1] == "4" and cmd.count("--num-experts") == 1
    agent = yaml.safe_load(Path(cmd[cmd.index("--langrl-env-config") + 1]).read_text())[0]["agent_args"]
    assert agent["seed"] == 1401 and agent["partial_credit"] == 0.5 and agent["task"] == "reverse"
    run_dir = m.work / "runs" / name
    assert cmd[cmd.index("--mechanism-monitor-output") + 1] == str(run_dir / "mechanism_monitor")
    langrl = Path(proxy_kw["env"]["LANGRL_LOG_DIR"])
    assert langrl.parent == run_dir.parent and proxy_kw["timeout"] == 900 and proxy_kw["check"] is False
    assert proxy_kw["env"]["PYTHONPATH"].split(os.pathsep)[0] == str(mlm.resolve())  # its optional rows need it
    assert not langrl.exists()  # made before the launch (Megatron-LM opens its log there at import), then removed
    (run_dir).mkdir(parents=True)
    langrl.mkdir()
    (langrl / "rollouts_rank0_iteration0_c.pkl").write_bytes(pickle.dumps([[SimpleNamespace(reward=0.25)]]))
    proxy_kw["after"](run_dir)  # the hook reads that folder into the run's metrics.jsonl
    assert json.loads((run_dir / "metrics.jsonl").read_text())["reward_mean"] == 0.25 and not langrl.exists()
    name, model, fault, spec, ranks, cmd = orig_args[:6]
    assert (name, ranks, spec) == ("original_lr-spike", 2, "lr-spike:start=20,x=50")
    assert cmd[cmd.index("--seed") + 1] == "12" and cmd[cmd.index("--load") + 1] == str(m.sft)
    assert cmd[cmd.index("--expert-model-parallel-size") + 1] == "2" and cmd[cmd.index("--num-experts") + 1] == "8"
    assert "--bf16" in cmd and cmd[cmd.index("--train-iters") + 1] == "100"


def test_launch_kills_the_whole_process_group_at_its_timeout(tmp_path):
    """A command whose child outlives it (a rank hung on a collective) is killed with all its children at the
    timeout; the code is 124 and the log says so after what the command wrote."""
    pid_file = tmp_path / "child.pid"
    script = f"import subprocess, time; p = subprocess.Popen(['sleep', '60']); open({str(pid_file)!r}, 'w')" \
             ".write(str(p.pid)); print('started', flush=True); time.sleep(60)"
    t0 = time.time()
    rc, cpu, wall = launch([sys.executable, "-c", script], tmp_path / "log.txt", timeout=3)
    assert rc == TIMED_OUT and wall < 30 and time.time() - t0 < 30
    log = (tmp_path / "log.txt").read_text()
    assert log.startswith("started\n") and "TimeoutError: no exit after 3 s" in log
    child = int(pid_file.read_text())
    for _ in range(50):  # the killed sleep is reaped by init; gone within moments
        if not os.path.exists(f"/proc/{child}") or "Z" in open(f"/proc/{child}/stat").read().split()[2]:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the command's child {child} survived the timeout")
    rc, _, _ = launch([sys.executable, "-c", "import os; print('quick', os.getcwd())"], tmp_path / "quick.txt",
                      timeout=60, cwd=tmp_path)  # examples/megatron_rl_faults.py runs its stages in its work dir
    assert rc == 0 and (tmp_path / "quick.txt").read_text() == f"quick {tmp_path}\n"


def test_driver_refuses_a_train_rl_config_without_a_checkout(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_LM_PATH"}
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "experiments" / "rl_fault_matrix.py"), "--config",
                          str(CONFIG), "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "p.md")],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and out.stderr.count("error:") == 1 and "not a Megatron-LM checkout" in out.stderr
    assert not (tmp_path / "work").exists() and not (tmp_path / "p.md").exists()


def test_a_partial_matrix_says_how_many_planned_runs_its_tables_cover():
    """The page's protocol names the recorded share of the planned runs and the missing ones; nothing when whole."""
    from mindspeed_proxy.experiments.rl_matrix import planned_names
    from mindspeed_proxy.experiments.rl_page import recorded_text

    cfg = load_rl_config(CONFIG)
    stages = {(11, "proxy_none"): None, (11, "proxy_none_s1101"): None}
    assert recorded_text(cfg, stages) == (
        "- **Recorded so far: 2 of 38 planned runs** (the tables below cover only these; missing: seed 11: 4 "
        "(original_none, original_none_s1101, original_none_s1102, proxy_none_s1102); seed 12: 6 (all); seed 13: 6 "
        "(all); seed 14: 20 (all)).\n")
    whole = {(s, n): None for s in (11, 12, 13, 14) for n in planned_names(cfg, s, cfg["faults"])}
    assert len(whole) == 38 and recorded_text(cfg, whole) == ""


def test_cost_rows_keep_the_preprocess_stage_out_of_the_runs():
    from mindspeed_proxy.experiments.rl_page import cost_rows

    def stage(name, model, iters, cpu):
        return SimpleNamespace(name=name, model=model, iters=iters, wall_s=cpu, cpu_s=cpu)

    rows = {r["stage"]: r for r in cost_rows([
        stage("preprocess", "original", 0, 10.0), stage("sft", "original", 800, 500.0),
        stage("original_none", "original", 100, 300.0), stage("proxy_none", "proxy", 100, 200.0)])}
    assert rows["preprocess"]["count"] == 1 and rows["run (original)"]["count"] == 1
    assert rows["run (original)"]["wall_s_per_step"] == 3.0 and rows["total"]["cpu_s"] == 1010.0


def test_the_page_names_thresholds_of_zero_and_only_those():
    from mindspeed_proxy.experiments.rl_page import zero_threshold_text

    cals = {"all": {"thresholds": {"update-spectral/linear_qkv/frobenius": {"threshold": 0.0},
                                   "rl/topk_match": {"threshold": 0.672}}},
            "original": {"thresholds": {"rl/any_layer_mismatch": {"threshold": 0.0}}}, "proxy": {"error": "none"}}
    text = zero_threshold_text({"calibrations": cals})
    assert text.startswith("A threshold of 0 (rl/any_layer_mismatch, update-spectral/linear_qkv/frobenius): ")
    assert "topk_match" not in text
    assert zero_threshold_text({"calibrations": {"all": {"thresholds": {"a/b": {"threshold": 1e-9}}}}}) == ""
