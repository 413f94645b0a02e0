"""--selection usage --usage-file: the K most-used experts per layer (the fidelity baseline)."""
import hashlib
import json
import os

import numpy as np

from mindspeed_proxy.proxy.select import clustering
from mindspeed_proxy.proxy.cli import main


def test_usage_selection_top_k_ties_and_groups():
    sim = np.eye(8)
    usage = [5, 9, 1, 9, 0, 7, 2, 3]
    assert clustering.usage_selection(sim, 3, usage)["kept"] == [1, 3, 5]
    assert clustering.usage_selection(sim, 2, usage)["kept"] == [1, 3]  # tie 9/9 -> both, lower ids first
    assert clustering.usage_selection(sim, 2, [1] * 8)["kept"] == [0, 1]  # all tied -> lowest ids
    # two groups of 4: the top one of each group
    assert clustering.usage_selection(sim, 2, usage, num_groups=2)["kept"] == [1, 5]


def test_usage_cli_keeps_most_used(checkpoints, tmp_path, capsys):
    src = checkpoints("ep2_bias")  # 2 MoE layers, 8 experts, EP=2
    usage = {"0": [0, 10, 0, 0, 30, 0, 20, 5], "1": [9, 8, 7, 6, 5, 4, 3, 100]}
    usage_file = tmp_path / "usage.json"
    usage_file.write_text(json.dumps(usage))
    out = str(tmp_path / "proxy")
    assert main(["--load", src, "--save", out, "--target-expert-parallel-size", "1", "--target-num-experts", "4",
                 "--selection", "usage", "--usage-file", str(usage_file)]) == 0
    manifest = json.load(open(os.path.join(out, "proxy_manifest.json")))
    kept = {layer["layer"]: layer["kept_global_ids_in_new_order"] for layer in manifest["layers"]}
    assert kept == {0: [1, 4, 6, 7], 1: [0, 1, 2, 7]}
    digest = hashlib.sha256(usage_file.read_bytes()).hexdigest()
    assert manifest["selection"] == "usage" and manifest["usage_source"] == "usage-file"
    assert manifest["inputs"]["usage_file"] == {"path": str(usage_file), "sha256": digest}
    assert manifest["calibration_fingerprint"] == digest and manifest["calibration_tokens"] is None
    assert manifest["feature_type"] == "weights" and manifest["inputs"]["calibration_data"] is None


def test_usage_cli_refusals(checkpoints, tmp_path, capsys):
    src = checkpoints("ep2_bias")
    base = ["--load", src, "--target-expert-parallel-size", "1", "--target-num-experts", "4"]
    out = str(tmp_path / "proxy")
    assert main(base + ["--save", out, "--selection", "usage"]) == 2
    err = capsys.readouterr().err
    assert "--usage-file" in err and "--calibration-data" in err and not os.path.exists(out)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"0": [1, 2, 3]}))
    assert main(base + ["--save", out, "--selection", "usage", "--usage-file", str(bad)]) == 2
    assert "layer 0 needs a list of 8" in capsys.readouterr().err and not os.path.exists(out)
