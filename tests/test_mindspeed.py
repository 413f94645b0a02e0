"""The monitor under MindSpeed's own patch manager and features manager, on real megatron-core training.

Needs a MindSpeed checkout named by env MINDSPEED_PATH (e.g. `git archive HEAD | tar -x -C /tmp/ms` of
https://gitcode.com/Ascend/MindSpeed and `MINDSPEED_PATH=/tmp/ms`). CI has none, so everything skips there.

MindSpeed modules exercised, unmodified, from the checkout: `mindspeed/patch_utils.py` (Patch,
MindSpeedPatchesManager: registration, decorator stacking, apply_patches, remove_patches),
`mindspeed/features_manager/feature.py` (MindSpeedFeature), `mindspeed/features_manager/features_manager.py`
(MindSpeedFeaturesManager), `mindspeed/args_utils.py` (get_mindspeed_args: MindSpeed's pre-parse of
sys.argv with every feature's register_args), `mindspeed/core/optimizer/fix_duplicate_allgather.py` (the
get_megatron_optimizer wrapper MindSpeed's MegatronBasicFeature registers) and
`mindspeed/core/megatron_basic/arguments_basic.py` (its TransformerConfig.__post_init__ wrapper, which runs
every feature's validate_args on each TransformerConfig), plus `log_config.py` / `deprecate.py` they import.

Not importable without torch_npu, so replaced by stand-ins named STANDIN_*: `mindspeed/features_manager/
__init__.py` (imports every feature; several import torch_npu) by a package shell exposing the two classes
it exports; `mindspeed/megatron_adaptor.py` (imports torch_npu.contrib.transfer_to_npu; here the CPU
platform layer plays that part) by its patch_features() sequence: get_mindspeed_args(),
apply_features_pre_patches, apply_features_patches; MindSpeed's default feature list (create_features_list()
needs the torch_npu features) by one feature carrying the two MegatronBasicFeature rows above and
RequirementsBasicFeature's --optimization-level flag.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from mindspeed_proxy.testing import run_distributed

MINDSPEED = os.environ.get("MINDSPEED_PATH", "")

pytestmark = pytest.mark.skipif(
    not MINDSPEED,
    reason="MINDSPEED_PATH is not set: these tests need a MindSpeed checkout (its pure-Python patch and feature "
           "managers), which CI does not have",
)

FAMILIES = ["attention-spectral", "router", "update-spectral"]
OPTIMIZER = "megatron.core.optimizer.get_megatron_optimizer"


def load_mindspeed(root: str):
    """Import MindSpeed's pure-Python modules from checkout `root`; return (features_manager module, args_utils)."""
    sys.path.insert(0, root)
    import mindspeed
    import mindspeed.patch_utils  # noqa: F401

    shell = types.ModuleType("mindspeed.features_manager")  # STANDIN_ package shell (see the module docstring)
    shell.__path__ = [os.path.join(root, "mindspeed", "features_manager")]
    sys.modules[shell.__name__] = shell
    mindspeed.features_manager = shell
    shell.MindSpeedFeature = importlib.import_module("mindspeed.features_manager.feature").MindSpeedFeature
    manager_module = importlib.import_module("mindspeed.features_manager.features_manager")
    shell.MindSpeedFeaturesManager = manager_module.MindSpeedFeaturesManager
    return manager_module, importlib.import_module("mindspeed.args_utils")


def standin_feature_list():
    """STANDIN_ for MindSpeed's default list: MegatronBasicFeature's rows that import without torch_npu."""
    from mindspeed.core.megatron_basic.arguments_basic import transformer_config_post_init_wrapper
    from mindspeed.core.optimizer.fix_duplicate_allgather import get_megatron_optimizer_wrapper
    from mindspeed.features_manager.feature import MindSpeedFeature

    class STANDIN_MegatronBasic(MindSpeedFeature):
        def __init__(self):
            super().__init__("standin-megatron-basic", optimization_level=0)

        def register_args(self, parser):
            parser.add_argument("--optimization-level", type=int, default=2)  # RequirementsBasicFeature's flag

        def register_patches(self, pm, args):
            pm.register_patch(OPTIMIZER, get_megatron_optimizer_wrapper)
            pm.register_patch("megatron.core.transformer.transformer_config.TransformerConfig.__post_init__",
                              transformer_config_post_init_wrapper)

    return [STANDIN_MegatronBasic()]


def standin_adaptor(features_manager, args_utils):
    """STANDIN_ `mindspeed.megatron_adaptor`: its patch_features() at import, without torch_npu."""
    adaptor = types.ModuleType("mindspeed.megatron_adaptor")
    adaptor._IS_FEATURES_PATCHED = True
    manager = features_manager.MindSpeedFeaturesManager
    args = args_utils.get_mindspeed_args()
    manager.apply_features_pre_patches(args)
    manager.apply_features_patches(args)
    sys.modules[adaptor.__name__] = adaptor
    return adaptor


def train_under_mindspeed(root, route, config_path, steps=6, extra_rows=()):
    """Set up MindSpeed and our patches by `route`, train the tiny MoE `steps` steps; report what happened.

    route: "mindspeed-first" (MindSpeed's adaptor, then ours, as MindSpeed documents), "ours-first",
    "feature-list" (our features in MindSpeed's list, no import of ours), "never-applied" (ours only: MindSpeed's
    adaptor is never imported), "removed" (ours, then MindSpeedPatchesManager.remove_patches() and MindSpeed's
    adaptor, as MindSpeed-LLM's adaptor does).
    """
    features_manager, args_utils = load_mindspeed(root)
    from mindspeed.patch_utils import MindSpeedPatchesManager as pm

    from mindspeed_proxy.patches.registry import Patch, register

    sys.argv = ["pretrain_gpt.py", "--enable-mechanism-monitor", "--mechanism-monitor-config", config_path,
                "--inject-fault", "lr-spike:start=1000,x=10"]  # armed, never reached: the run's numbers stay plain
    for row in extra_rows:
        register(Patch(**row))
    features_manager.MindSpeedFeaturesManager.set_features_list(standin_feature_list())
    if route == "mindspeed-first":
        standin_adaptor(features_manager, args_utils)
        import mindspeed_proxy.megatron_adaptor  # noqa: F401
    elif route in ("ours-first", "removed"):
        import mindspeed_proxy.megatron_adaptor  # noqa: F401
        if route == "removed":
            pm.remove_patches()
        standin_adaptor(features_manager, args_utils)
    elif route == "feature-list":
        from mindspeed_proxy.patches.mindspeed_feature import proxy_features

        features_manager.MindSpeedFeaturesManager.FEATURES_LIST.extend(proxy_features())
        standin_adaptor(features_manager, args_utils)
    else:
        import mindspeed_proxy.megatron_adaptor  # noqa: F401
    return _train(pm, steps)


def _train(pm, steps):
    from mindspeed_proxy import patches
    from mindspeed_proxy.patches.runtime import RUNTIME
    from mindspeed_proxy.testing.batches import synthetic_microbatches
    from mindspeed_proxy.testing.parallel import init_parallel
    from mindspeed_proxy.tiny_moe import TinyMoEConfig
    from mindspeed_proxy.training.engine import TrainConfig, Trainer, microbatch_sample_ids

    init_parallel()
    model_cfg = TinyMoEConfig(num_layers=2)
    train_cfg = TrainConfig(micro_batch_size=2, global_batch_size=4)
    trainer = Trainer(model_cfg, train_cfg)
    for it in range(steps):
        trainer.train_step(synthetic_microbatches(microbatch_sample_ids(train_cfg, it), 64, model_cfg.vocab_size))
    monitor = patches.active_monitor()
    inner = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
    result = {
        "sampled": None if monitor is None else sorted(monitor.last),
        "wrappers": {name: [f"{w.__module__}.{w.__name__}" for w in info.wrappers]
                     for name, info in pm.patches_info.items()},
        "applied": sorted(name for name, info in pm.patches_info.items() if info.is_applied),
        "mindspeed_wrapper_ran": all(hasattr(o, "is_moe_param") for o in inner),
        "faults": [f.name for f in RUNTIME.faults],
    }
    if monitor is not None:
        monitor.close()
    return result


@pytest.fixture()
def config_path(tmp_path):
    path = tmp_path / "monitor.json"
    path.write_text(json.dumps({"interval": 2, "delta": 1, "router_interval": 1, "sinks": [],
                                "output_dir": str(tmp_path / "out")}))
    return str(path)


@pytest.mark.parametrize("route", ["mindspeed-first", "ours-first", "feature-list"])
def test_monitor_samples_the_three_families_under_mindspeeds_manager(route, config_path):
    out = run_distributed(train_under_mindspeed, 1, MINDSPEED, route, config_path)[0]
    assert out["sampled"] == FAMILIES
    ours = "mindspeed_proxy.patches.monitor_patches"
    mindspeed_wrapper = "mindspeed.core.optimizer.fix_duplicate_allgather.get_megatron_optimizer_wrapper"
    stacked = out["wrappers"][OPTIMIZER]
    assert mindspeed_wrapper in stacked and f"{ours}.get_megatron_optimizer_wrapper" in stacked
    assert out["mindspeed_wrapper_ran"]  # MindSpeed's wrapper still runs under (or over) ours
    # MindSpeed's TransformerConfig wrapper ran every feature's validate_args on the model's config
    for target in (OPTIMIZER, "megatron.core.transformer.moe.router.TopKRouter.routing",
                   "megatron.core.transformer.moe.moe_layer.MoELayer.forward",
                   "megatron.core.transformer.transformer_config.TransformerConfig.__post_init__"):
        assert target in out["applied"]
    # megatron-core-only install: the optional megatron.training rows are not registered
    assert not any(name.startswith("megatron.training") for name in out["wrappers"])
    assert out["faults"] == ["lr-spike"]  # the fault injectors' rows went through the manager too
    assert "megatron.core.optimizer_param_scheduler.OptimizerParamScheduler.get_lr" in out["applied"]
    if route == "feature-list":  # the parser rows are left to register_args there
        assert not any("parse_args" in name for name in out["wrappers"])


@pytest.mark.parametrize("route,why", [
    ("never-applied", "registered with MindSpeed's patch manager, which has not applied them"),
    ("removed", "removed since (MindSpeedPatchesManager.remove_patches()"),
])
def test_monitor_that_mindspeed_never_applies_says_so_once(route, why, config_path, capfd):
    out = run_distributed(train_under_mindspeed, 1, MINDSPEED, route, config_path, steps=3)[0]
    assert out["sampled"] is None
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("mindspeed-proxy:")]
    assert len(lines) == 1, lines
    assert "no monitor hook ran by the first optimizer step" in lines[0] and why in lines[0]


def missing_rows(root, config_path):
    """A row for an absent module under the real manager: our route skips it; MindSpeed's own apply would raise."""
    out = {}
    try:
        import megatron.training  # noqa: F401
        out["megatron_training"] = True
    except ModuleNotFoundError:
        out["megatron_training"] = False
    rows = [dict(target="megatron.no_such_module:thing", build=_identity_wrapper, feature="mechanism-monitor",
                 versions="", optional=True)]
    out.update(train_under_mindspeed(root, "mindspeed-first", config_path, steps=2, extra_rows=rows))
    from mindspeed.patch_utils import MindSpeedPatchesManager as pm

    from mindspeed_proxy.patches.mindspeed_manager import register_with_mindspeed
    from mindspeed_proxy.patches.registry import Patch, UnsupportedVersionError, register

    pm.apply_patches()  # again, with every row we registered: nothing to raise
    # a target no feature of ours patches (a target has one owning feature)
    register(Patch("megatron.core.optimizer:get_standard_config_overrides", _identity_wrapper, "too-new",
                   versions="<0.1"))
    try:
        register_with_mindspeed(pm, "too-new")
    except UnsupportedVersionError as exc:
        out["gate"] = str(exc)
    pm.register_patch("megatron.training.training.get_megatron_optimizer", _identity_wrapper)
    try:
        pm.apply_patches()
    except ModuleNotFoundError as exc:
        out["unfiltered"] = str(exc)
    return out


def _identity_wrapper(original):
    return original


def test_rows_for_absent_modules_do_not_crash_apply_patches(config_path):
    out = run_distributed(missing_rows, 1, MINDSPEED, config_path)[0]
    assert out["megatron_training"] is False  # megatron-core only: the optional megatron.training rows are absent
    assert not any(name.startswith(("megatron.training", "megatron.no_such_module")) for name in out["wrappers"])
    assert out["sampled"] is not None  # trained with the monitor on
    assert "\n" not in out["gate"] and "megatron.core.optimizer:get_standard_config_overrides" in out["gate"]
    assert "written for megatron-core <0.1" in out["gate"]
    assert "megatron.training" in out["unfiltered"]  # what registering it anyway does to MindSpeed's apply_patches


def gated_rows(root):
    """Our rows under MindSpeed's real manager go through the registry's one selection: a row gated off this
    megatron-core and an optional row whose attribute is absent are left out, and apply_patches() then runs."""
    load_mindspeed(root)
    import megatron.core.optimizer  # noqa: F401  (imported: its missing attribute is seen without importing)
    from mindspeed.patch_utils import MindSpeedPatchesManager as pm

    from mindspeed_proxy.patches.mindspeed_manager import register_with_mindspeed
    from mindspeed_proxy.patches.registry import Patch, register

    register(Patch("megatron.core.optimizer:get_standard_config_overrides", _identity_wrapper, "t-gates"))
    register(Patch("megatron.core.optimizer:OptimizerConfig", _identity_wrapper, "t-gates", versions="<0.1"))
    register(Patch("megatron.core.optimizer:no_such_attribute", _identity_wrapper, "t-gates", optional=True))
    out = {"paths": register_with_mindspeed(pm, "t-gates")}
    pm.apply_patches()
    out["registered"] = sorted(k for k in pm.patches_info if k.startswith("megatron.core.optimizer"))
    return out


def test_the_mindspeed_route_applies_the_version_gates_and_skips_absent_optional_rows():
    out = run_distributed(gated_rows, 1, MINDSPEED)[0]
    assert out["paths"] == out["registered"] == ["megatron.core.optimizer.get_standard_config_overrides"]


def validation_errors(root):
    """MindSpeedFeaturesManager.validate_features_args over our features: bad flags raise, a config passes."""
    from argparse import Namespace

    features_manager, _ = load_mindspeed(root)
    from mindspeed_proxy.patches.mindspeed_feature import proxy_features

    manager = features_manager.MindSpeedFeaturesManager
    manager.set_features_list(proxy_features())
    out = {}
    for name, args in [("interval", Namespace(enable_mechanism_monitor=True, mechanism_monitor_interval="x")),
                       ("fault", Namespace(inject_fault=["no-such-fault"]))]:
        try:
            manager.validate_features_args(args)
        except ValueError as exc:
            out[name] = str(exc)
    manager.validate_features_args(Namespace(enable_mechanism_monitor=True, mechanism_monitor_interval="4"))
    return out


def test_validate_args_names_the_bad_flag():
    out = run_distributed(validation_errors, 1, MINDSPEED)[0]
    assert out["interval"] == "--mechanism-monitor-interval 'x': expected int"
    assert out["fault"].startswith("--inject-fault 'no-such-fault': unknown fault 'no-such-fault'; known: ")


def test_our_adaptor_first_leaves_megatron_unimported():
    """MindSpeed applies its pre-patches before megatron is imported; ours must not import it ahead of them."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"from test_mindspeed import load_mindspeed; load_mindspeed({MINDSPEED!r}); "
            "sys.argv = ['train.py', '--enable-mechanism-monitor']; import mindspeed_proxy.megatron_adaptor; "
            "from mindspeed.patch_utils import MindSpeedPatchesManager as pm; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'), *sorted(pm.patches_info))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    waiting = ["megatron.core.inference.contexts.dynamic_context.DynamicInferenceContext.current_input_and_position_ids",
               "megatron.core.inference.text_generation_controllers.text_generation_controller."
               "TextGenerationController.__init__",
               "megatron.core.optimizer.get_megatron_optimizer",
               "megatron.core.transformer.moe.moe_layer.MoELayer.forward",
               "megatron.core.transformer.moe.router.TopKRouter.routing",
               "megatron.core.transformer.multi_latent_attention.MultiLatentAttention.__init__"]
    assert proc.stdout.split() == ["[]"] + waiting  # the rows wait in the manager, no megatron module loaded
