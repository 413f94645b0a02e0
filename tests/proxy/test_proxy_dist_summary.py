"""The converter's per-layer-type summary of a torch_dist conversion (decoder MoE layers, the MTP layer, the rest):
parameters and bytes before/after against the two checkpoints' own metadata, and the experts kept and dropped."""
import json
import math
import os

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mindspeed_proxy.proxy.cli import main


def _sizes(folder):
    """{key: (params, bytes)} of every model tensor of a torch_dist iteration folder (optimizer state excluded)."""
    meta = FileSystemReader(folder).read_metadata().state_dict_metadata
    out = {}
    for key, m in meta.items():
        if isinstance(m, TensorStorageMetadata) and not key.startswith(("optimizer.", "rng_state")):
            n = math.prod(m.size)
            out[key] = (n, n * m.properties.dtype.itemsize)
    return out


def test_layer_type_summary_of_an_mtp_checkpoint(dist_checkpoints, tmp_path, capsys):
    src, out = dist_checkpoints("mtp"), str(tmp_path / "proxy")
    assert main(["--load", src, "--save", out, "--target-expert-parallel-size", "1", "--target-num-experts", "4"]) == 0
    printed = capsys.readouterr().out
    summary = json.load(open(os.path.join(out, "proxy_manifest.json")))["layer_types"]
    before, after = _sizes(os.path.join(src, "iter_0000002")), _sizes(os.path.join(out, "iter_0000002"))
    assert summary["total"] == {"params": [sum(v[0] for v in before.values()), sum(v[0] for v in after.values())],
                                "bytes": [sum(v[1] for v in before.values()), sum(v[1] for v in after.values())]}
    assert summary["layers"] == {"dense": [], "moe": [0, 1], "mtp": ["mtp.0"], "other": []}
    parts = {(r["type"], r["part"]): r for r in summary["parts"]}
    for kind in ("moe", "mtp"):
        for part in ("routed experts", "router weight", "router expert_bias"):  # E = 8 -> K = 4: half of each
            assert parts[kind, part]["params"][1] * 2 == parts[kind, part]["params"][0] > 0, (kind, part)
        for part in ("shared expert", "attention, norms"):
            assert parts[kind, part]["params"][0] == parts[kind, part]["params"][1] > 0, (kind, part)
    mtp_router = [k for k in before if k.startswith("mtp.layers.0.transformer_layer.mlp.router.weight")]
    assert parts["mtp", "router weight"]["params"] == [before[mtp_router[0]][0], after[mtp_router[0]][0]]
    assert parts["mtp", "MTP eh_proj, enorm, hnorm, final norm"]["params"][0] > 0
    assert parts["other", "embedding, output layer, final norm"]["params"][0] > 0
    manifest = json.load(open(os.path.join(out, "proxy_manifest.json")))
    kept = {e["layer"]: e["kept_global_ids_in_new_order"] for e in manifest["layers"]}
    for entry in summary["experts"]:
        assert entry["kept"] == kept[entry["layer"]] and sorted(entry["kept"] + entry["dropped"]) == list(range(8))
    assert "per layer type (params, bytes: source -> proxy):" in printed and "mtp.0: routed experts kept" in printed
