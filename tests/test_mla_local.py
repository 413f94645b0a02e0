"""MLA on megatron-core's local spec without an accelerator (patches/mla_local.py), each case in its own process
(run_python: forked from the launcher's fork server, nothing activated or patched before the case's code).

- YaRN: on the CPU platform `YarnRotaryEmbedding` builds (it opened `with torch.device(current_device())`) and its
  embedding equals a float64 YaRN reference (DeepSeek-V2's formula, written out here).
- Core attention: megatron-core's own local spec with `multi_latent_attention=True` builds `MLASelfAttention`
  (it died on `k_channels`), with MLADotProductAttention in the core-attention slot only, and its forward equals
  a float64 recomputation of MLA from the module's weights.
"""
import subprocess
import textwrap

from mindspeed_proxy.patches import mla_local, registry
from mindspeed_proxy.testing import run_python


def run_py(code: str) -> subprocess.CompletedProcess:
    return run_python(["-c", textwrap.dedent(code)], env={"MINDSPEED_PROXY_DEVICE": "cpu", "OMP_NUM_THREADS": "1"},
                      timeout=240)


YARN = """
import math
import torch
from mindspeed_proxy import platform
platform.activate("cpu")
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

DIM, BASE, S, ORIG, FAST, SLOW, M, MALL, SEQ = 8, 10000.0, 40.0, 16, 32.0, 1.0, 1.0, 0.707, 12
rope = YarnRotaryEmbedding(DIM, rotary_base=BASE, scaling_factor=S, original_max_position_embeddings=ORIG,
                           beta_fast=FAST, beta_slow=SLOW, mscale=M, mscale_all_dim=MALL)
emb, mscale = rope(SEQ)

def corr(rot):  # dimension index whose wavelength makes `rot` turns over ORIG positions
    return DIM * math.log(ORIG / (rot * 2 * math.pi)) / (2 * math.log(BASE))
low, high = max(math.floor(corr(FAST)), 0), min(math.ceil(corr(SLOW)), DIM - 1)
i = torch.arange(DIM // 2, dtype=torch.float64)
extra = 1.0 / BASE ** (2 * i / DIM)
keep = 1.0 - ((i - low) / (high - low)).clamp(0, 1)  # 1: extrapolate (high frequency), 0: interpolate
inv = extra / S * (1 - keep) + extra * keep
ref = torch.outer(torch.arange(SEQ, dtype=torch.float64), inv)
ref = torch.cat([ref, ref], -1)[:, None, None, :]
g = lambda m: 0.1 * m * math.log(S) + 1.0
print("device", emb.device.type)
print("shape", tuple(emb.shape))
print("emb_err", ((emb.double() - ref).abs().max() / ref.abs().max()).item())
print("mscale_err", abs(mscale - g(M) / g(MALL)))
"""


def test_yarn_builds_on_the_cpu_platform_and_matches_float64():
    proc = run_py(YARN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert out["device"] == "cpu" and out["shape"] == "(12, 1, 1, 8)", proc.stdout
    assert float(out["emb_err"]) <= 1e-6, proc.stdout  # float32 cache vs float64 formula
    assert float(out["mscale_err"]) <= 1e-12, proc.stdout


MLA = """
import math
import torch
from mindspeed_proxy import platform, patches
platform.activate("cpu")
patches.apply(enable_monitor=False)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import MLATransformerConfig
from mindspeed_proxy.mla_attention import MLADotProductAttention
from mindspeed_proxy.testing.parallel import init_parallel

import tempfile
torch.distributed.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
init_parallel(tp=1)
D, H, QK, R, V, QL, KVL, T = 32, 4, 8, 4, 8, 16, 12, 6
cfg = MLATransformerConfig(num_layers=1, hidden_size=D, num_attention_heads=H, q_lora_rank=QL, kv_lora_rank=KVL,
                           qk_head_dim=QK, qk_pos_emb_head_dim=R, v_head_dim=V, rope_type="rope",
                           normalization="RMSNorm", add_bias_linear=False, use_cpu_initialization=True,
                           attention_dropout=0.0, hidden_dropout=0.0, apply_rope_fusion=False,
                           masked_softmax_fusion=False, multi_latent_attention=True, qk_layernorm=True)
spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
attn_spec = spec.submodules.self_attention
assert attn_spec.submodules.core_attention is DotProductAttention  # megatron-core's spec is left as it is
torch.manual_seed(0)
attn = build_module(attn_spec, config=cfg, layer_number=1)  # the spec sets the causal mask
print("core", type(attn.core_attention).__name__)
with torch.no_grad():
    for p in attn.parameters():
        p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
x = torch.randn(T, 1, D)
with torch.no_grad():
    out, _ = attn(x, attention_mask=None)

# float64 MLA: low-rank q, compressed kv + shared rope key, RoPE on the last R dims, causal softmax
w = {n: p.detach().double() for n, p in attn.named_parameters()}
xd = x.double()[:, 0]
rms = lambda t, g: t * (t.square().mean(-1, keepdim=True) + cfg.layernorm_epsilon).rsqrt() * g
q = (rms(xd @ w["linear_q_down_proj.weight"].T, w["q_layernorm.weight"]) @ w["linear_q_up_proj.weight"].T)
q = q.view(T, H, QK + R)
kv_all = xd @ w["linear_kv_down_proj.weight"].T
kv = (rms(kv_all[:, :KVL], w["kv_layernorm.weight"]) @ w["linear_kv_up_proj.weight"].T).view(T, H, QK + V)
inv = 1.0 / cfg.rotary_base ** (torch.arange(0, R, 2, dtype=torch.float64) / R)
ang = torch.outer(torch.arange(T, dtype=torch.float64), inv)
ang = torch.cat([ang, ang], -1)
def rot(t):  # [T, ..., R]; megatron's MLA de-interleaves the rope dims (DeepSeek's layout) before rotate-half
    t = torch.cat([t[..., 0::2], t[..., 1::2]], -1)
    c, s = ang.cos().view(T, *([1] * (t.dim() - 2)), R), ang.sin().view(T, *([1] * (t.dim() - 2)), R)
    half = torch.cat([-t[..., R // 2:], t[..., :R // 2]], -1)
    return t * c + half * s
q = torch.cat([q[..., :QK], rot(q[..., QK:])], -1)
k_rope = rot(kv_all[:, KVL:])
k = torch.cat([kv[..., :QK], k_rope[:, None, :].expand(T, H, R)], -1)
scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(QK + R)
scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
ctx = torch.einsum("hts,shd->thd", scores.softmax(-1), kv[..., QK:]).reshape(T, H * V)
ref = ctx @ w["linear_proj.weight"].T
print("err", ((out[:, 0].double() - ref).abs().max() / ref.abs().max()).item())
"""


def test_megatron_local_spec_builds_mla_with_our_core_attention_and_matches_float64():
    proc = run_py(MLA)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert out["core"] == "MLADotProductAttention", proc.stdout
    assert float(out["err"]) <= 1e-5, proc.stdout


def test_rows_are_gated_where_their_targets_are():
    """The core-attention row covers every supported line; YaRN's only those with the `torch.device` block."""
    mla_local.register_all()
    rows = [p for p in registry.table() if p.feature == mla_local.FEATURE]
    assert [p.target for p in rows] == [
        "megatron.core.transformer.multi_latent_attention:MultiLatentAttention.__init__"]
    assert rows[0].versions == registry.MEGATRON_CORE_SUPPORTED and not rows[0].optional
    (target, _, optional, gate), = mla_local.cpu_rows()
    assert target.endswith("yarn_rotary_pos_embedding:YarnRotaryEmbedding.__init__") and not optional
    from packaging.version import Version

    assert [registry.within(Version(v), gate) for v in ("0.14.0", "0.15.0", "0.16.1", "0.19.1", "0.20.0")] == [
        False, True, True, True, False]


def test_list_shows_both_rows_applying_here(capsys):
    """`python -m mindspeed_proxy.patches --list` names both rows, each applying to the imported megatron-core."""
    from mindspeed_proxy.patches.__main__ import main  # in this process: listing applies nothing

    assert main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for feature, target in (("mla-local-attention", "MultiLatentAttention.__init__"),
                            ("cpu-platform", "YarnRotaryEmbedding.__init__")):
        row = [line for line in lines if line.startswith(feature) and target in line]
        assert len(row) == 1 and row[0].endswith("applies"), lines
