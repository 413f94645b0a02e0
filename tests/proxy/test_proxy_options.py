"""Options resolves its own defaults: the Python API `convert(Options(...))` selects what the CLI selects."""
import dataclasses

import pytest

from mindspeed_proxy.proxy.cli import build_parser, options_from_args
from mindspeed_proxy.proxy.core.errors import ConversionError
from mindspeed_proxy.proxy.core.options import Options

BASE = ["--load", "x", "--target-expert-parallel-size", "2", "--target-num-experts", "4"]

# (CLI flags, the same request through the API)
CASES = [
    ([], {}),
    (["--calibration-data", "c.npy"], dict(calibration_data="c.npy")),
    (["--usage-weighted"], dict(usage_weighted=True)),
    (["--calibration-data", "c.npy", "--usage-weighted"], dict(calibration_data="c.npy", usage_weighted=True)),
    (["--calibration-data", "c.npy", "--features", "outputs"], dict(calibration_data="c.npy", features="outputs")),
    (["--calibration-data", "c.npy", "--representative", "saliency"],
     dict(calibration_data="c.npy", representative="saliency")),
    (["--calibration-data", "c.npy", "--cluster", "kmeans"], dict(calibration_data="c.npy", cluster="kmeans")),
    (["--selection", "random", "--seed", "3"], dict(selection="random", seed=3)),
    (["--features", "feats.npz", "--usage-file", "u.json"], dict(features="feats.npz", usage_file="u.json")),
    (["--non-finite-experts", "exclude", "--reconstruction-inputs", "original", "--calibration-data", "c.npy"],
     dict(non_finite_experts="exclude", reconstruction_inputs="original", calibration_data="c.npy")),
]


@pytest.mark.parametrize("flags, api", CASES, ids=[" ".join(f) or "defaults" for f, _ in CASES])
def test_api_and_cli_resolve_every_default_alike(flags, api):
    cli = options_from_args(build_parser().parse_args(BASE + flags))
    assert dataclasses.asdict(Options(target_ep=2, target_k=4, **api)) == dataclasses.asdict(cli)


def test_the_resolved_defaults_are_the_documented_ones():
    plain = Options(target_ep=1, target_k=4)
    assert (plain.selection, plain.features, plain.cluster, plain.representative) == \
        ("cluster", "weights", "agglomerative", "medoid")
    assert Options(target_ep=1, target_k=4, calibration_data="c.npy").selection == "reconstruction"
    assert Options(target_ep=1, target_k=4, usage_weighted=True).cluster == "kmeans"
    # explicit values are kept as given, never re-derived
    assert Options(target_ep=1, target_k=4, calibration_data="c.npy", selection="usage").selection == "usage"


@pytest.mark.parametrize("field, value, message", [
    ("selection", "clusters", "--selection 'clusters': expected one of cluster, random, usage, reconstruction"),
    ("cluster", "ward", "--cluster 'ward'"),
    ("representative", "best", "--representative 'best'"),
    ("non_finite_experts", "drop", "--non-finite-experts 'drop'"),
    ("target_k", 0, "target_k must be a positive integer, got 0"),
    ("calibration_sequences", -1, "calibration_sequences must be a positive integer"),
])
def test_bad_values_are_refused_when_options_are_built(field, value, message):
    kwargs = dict(target_ep=1, target_k=4)
    kwargs[field] = value
    with pytest.raises(ConversionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Options(**kwargs)
