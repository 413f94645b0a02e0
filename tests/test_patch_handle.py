"""The registry's one row selection and its handle, in this process (no subprocess): `patches.apply` returns an
Applied handle that puts every original back; optional rows skip an absent target; torch rows are gated; the
MindSpeed manager route selects the same rows as the direct route."""
import json

import pytest
from packaging.version import Version

from mindspeed_proxy import patches
from mindspeed_proxy.patches import cpu_transfer, fault_patches, mla_local, monitor_patches, registry
from mindspeed_proxy.patches.mindspeed_manager import register_with_mindspeed
from mindspeed_proxy.patches.runtime import RUNTIME


@pytest.fixture()
def rows():
    """Register test rows; remove them (and anything they left applied) afterwards."""
    added = []

    def add(**kwargs):
        patch = registry.Patch(**{"versions": "", **kwargs})
        registry.register(patch)
        added.append(patch)
        return patch

    yield add
    for patch in added:
        registry.revert_feature(patch.feature)
        registry._REGISTRY.remove(patch)


def _current(target):
    return registry.resolve(target)[2]


def test_apply_returns_a_handle_that_reverts_every_attribute():
    monitor_patches.register_all()
    fault_patches.register_all()
    mla_local.register_all()
    features = (monitor_patches.FEATURE, fault_patches.FEATURE, mla_local.FEATURE)  # what patches.apply applies
    targets = [p.target for f in features for p in registry.rows_for(f)]
    before = {}
    for target in targets:
        try:
            before[target] = _current(target)
        except (ImportError, AttributeError):
            continue  # optional rows for Megatron-LM modules this install lacks
    handle = patches.apply({"sinks": []}, faults=["lr-spike:start=3,x=10"])
    assert isinstance(handle, list) and set(handle) == set(registry.applied()) and len(handle) >= 5
    assert set(handle) <= set(before)
    assert all(_current(t) is not before[t] for t in handle)  # every applied row replaced its target
    assert RUNTIME.config is not None and RUNTIME.faults
    assert sorted(handle.revert()) == sorted(handle)
    assert registry.applied() == []
    assert all(_current(t) is before[t] for t in before)  # every original is back, the untouched ones too
    assert RUNTIME.config is None and RUNTIME.faults == [] and handle.revert() == []  # once


def test_the_handle_is_a_context_manager():
    target = "megatron.core.optimizer:get_megatron_optimizer"
    original = _current(target)
    with patches.apply(enable_monitor=False) as handle:
        assert target in handle and _current(target) is not original
    assert _current(target) is original and registry.applied() == []


def test_an_optional_row_skips_an_absent_attribute_instead_of_creating_it(rows):
    rows(target="json:no_such_attribute", build=lambda original: "made", feature="t-optional", optional=True)
    assert registry.apply_feature("t-optional") == []
    assert not hasattr(json, "no_such_attribute")
    rows(target="json:no_such_attribute_b", build=lambda original: "made", feature="t-required")  # one owner a target
    with pytest.raises(AttributeError, match="patch target json:no_such_attribute_b does not exist"):
        registry.apply_feature("t-required")
    assert not hasattr(json, "no_such_attribute_b")
    rows(target="json:no_such_attribute_c", build=lambda original: original, feature="t-create", create=True)
    with registry.apply_feature("t-create"):
        assert json.no_such_attribute_c is None  # a create row defines it (as build(None))
    assert not hasattr(json, "no_such_attribute_c")  # and its revert removes it


def test_torch_rows_are_gated_by_the_torch_version(monkeypatch):
    cpu_transfer._register_all()
    torch_rows = [p for p in registry.rows_for(cpu_transfer.FEATURE) if p.package == "torch"]
    assert len(torch_rows) > 30 and all(p.versions == registry.TORCH_SUPPORTED for p in torch_rows)
    assert not registry.applies(torch_rows[0], torch=Version("2.3.1"))
    assert registry.applies(torch_rows[0], torch=Version("2.13.0"))
    monkeypatch.setattr(registry, "torch_version", lambda: Version("2.3.1"))
    with pytest.raises(registry.UnsupportedVersionError, match=r"^mindspeed-proxy: torch 2.3.1 is not supported; "
                                                               r"supported: torch >=2.4$"):
        registry.rows_for(cpu_transfer.FEATURE)


class RecordingManager:
    """The one method of MindSpeed's patch manager our route calls."""

    def __init__(self):
        self.registered = []

    def register_patch(self, path, build):
        self.registered.append(path)


def test_the_mindspeed_route_applies_the_same_gates_as_the_direct_route(rows):
    rows(target="json:dumps", build=lambda original: original, feature="t-route", versions=">=0.12")
    rows(target="json:loads", build=lambda original: original, feature="t-route", versions="<0.1")  # another line
    rows(target="json:no_such_attribute", build=lambda o: o, feature="t-route", versions=">=0.12", optional=True)
    rows(target="no_such_module_here:thing", build=lambda o: o, feature="t-route", versions=">=0.12", optional=True)
    manager = RecordingManager()
    assert register_with_mindspeed(manager, "t-route") == ["json.dumps"]
    assert manager.registered == ["json.dumps"]
    with registry.apply_feature("t-route") as direct:
        assert list(direct) == ["json:dumps"]
    rows(target="json:JSONEncoder", build=lambda original: original, feature="t-too-new", versions="<0.1")
    for route in (lambda: register_with_mindspeed(manager, "t-too-new"),
                  lambda: registry.apply_feature("t-too-new")):
        with pytest.raises(registry.UnsupportedVersionError, match="json:JSONEncoder written for megatron-core <0.1"):
            route()
