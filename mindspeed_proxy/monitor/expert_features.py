"""Expert features collected during training, the converter's `outputs` pass without a separate model run.

At the sampled steps of the window (MonitorConfig.expert_features_*), on every training forward of every
MoE layer: the layer's input x (after the pre-MLP norm, exactly what the converter's `outputs` pass feeds
the experts) is all-gathered over expert-TP×EP, each rank applies each of its local experts to every
gathered token with probability 1 (`proxy.calibrate.forward.expert_sums`, the converter's own code) and adds the
float64 sums; the router's routing map of the same call counts the tokens routed to each expert (top-k).
At the end of the window the sums are reduced (reductions.reduce_expert_sums), divided by the tokens seen,
and rank 0 writes, atomically, into the monitor's output dir:
- `expert_features.npz`: {"<global layer>": [E, H] float64 mean expert outputs} (`--features FILE`);
- `expert_usage.json`: {"<global layer>": [tokens routed to each global expert]} (`--usage-file`).
Global layer = Megatron's layer_number − 1 (0-based over the whole model); global expert id = the MoE
layer's `local_expert_indices`. The result does not depend on the parallel layout.
"""
from __future__ import annotations

import json
import os

import torch

from mindspeed_proxy.monitor import reductions as R

FEATURES_FILE = "expert_features.npz"
USAGE_FILE = "expert_usage.json"


class ExpertFeatureCollector:
    """Per-layer float64 sums of this rank's local experts' outputs, routed-token counts and tokens seen."""

    def __init__(self, num_layers: int, num_experts: int, hidden_size: int, groups: R.MonitorGroups, device):
        self.num_layers, self.num_experts, self.hidden_size = num_layers, num_experts, hidden_size
        self.groups, self.device = groups, device
        self.sums: dict[int, torch.Tensor] = {}  # global layer -> [n_local, H] float64 (CPU)
        self.local_ids: dict[int, list] = {}  # global layer -> this rank's global expert ids
        self.counts = torch.zeros(num_layers, num_experts + 1, dtype=torch.float64)  # per expert, then tokens
        self.steps: list[int] = []  # sampled steps whose forwards were collected
        self.armed = None  # layer_number whose next router call is counted
        self.written = False

    def collect(self, module, hidden: torch.Tensor, step: int, failed: bool) -> None:
        """One MoE forward: gather the tokens (always, a collective), then add the local experts' sums."""
        x = hidden.detach().reshape(-1, hidden.shape[-1])
        gathered = R.gather_expert_tokens(x, self.groups)
        if not self.steps or self.steps[-1] != step:
            self.steps.append(step)  # before anything that can fail: the same list on every rank
        if failed:
            return
        from mindspeed_proxy.proxy.calibrate.forward import expert_sums

        layer = module.layer_number - 1
        ids = [int(i) for i in module.local_expert_indices]
        with torch.no_grad():
            sums = expert_sums(module.experts, gathered, len(ids))
        self.sums[layer] = sums if layer not in self.sums else self.sums[layer] + sums
        self.local_ids[layer] = ids
        self.counts[layer, -1] += x.shape[0]
        self.armed = module.layer_number

    def count_routed(self, layer_number: int, routing) -> None:
        """Add the tokens routed to each expert by the armed layer's router call (bool map [T, E] or ids [T, k])."""
        self.armed = None
        routing = routing.detach()
        if routing.dtype == torch.bool:
            counts = routing.reshape(-1, self.num_experts).sum(dim=0)
        else:
            counts = torch.bincount(routing.reshape(-1).long(), minlength=self.num_experts)
        self.counts[layer_number - 1, :-1] += counts.to(device="cpu", dtype=torch.float64)

    def reduce(self, fail) -> dict:
        """Reduce over the parallel groups (collectives on every rank, fixed shapes); {layer: (mean, counts, tokens)}."""
        counts = self.counts.to(self.device)
        R.reduce_router_tokens(counts, self.groups)
        counts = counts.cpu()
        out = {}
        for layer in (l for l in range(self.num_layers) if counts[l, -1] > 0):  # same list on every rank
            table = torch.zeros(self.num_experts, self.hidden_size, dtype=torch.float64)
            try:
                if layer in self.sums:
                    table[self.local_ids[layer]] = self.sums[layer]
            except Exception:
                fail()
            table = R.reduce_expert_sums(table.to(self.device), self.groups).cpu()
            tokens = float(counts[layer, -1])
            out[layer] = ((table / tokens).numpy(), [int(round(c)) for c in counts[layer, :-1].tolist()], tokens)
        return out

    def write(self, output_dir: str, reduced: dict) -> dict:
        """Write the two files (call on one rank); return the record for monitor.jsonl."""
        from mindspeed_proxy.proxy.io.features_file import write_features_file

        os.makedirs(output_dir, exist_ok=True)
        features = os.path.join(output_dir, FEATURES_FILE)
        usage = os.path.join(output_dir, USAGE_FILE)
        write_features_file(features, {layer: mean for layer, (mean, _, _) in reduced.items()})
        tmp = f"{usage}.tmp-{os.getpid()}"
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump({str(layer): c for layer, (_, c, _) in reduced.items()}, fh)
            os.replace(tmp, usage)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return {"type": "expert-features", "steps": list(self.steps), "features_file": features,
                "usage_file": usage, "tokens": {str(layer): t for layer, (_, _, t) in reduced.items()}}
