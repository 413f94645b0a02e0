"""Real legacy checkpoints written by the real trainer, shared by the proxy tests (built once per session)."""
import hashlib
import os

import pytest

from mindspeed_proxy.testing import run_distributed
from mindspeed_proxy.testing.shared import built_once, shared_dir
from mindspeed_proxy.training.loop import train

from helpers import CONFIGS, TINY, legacy_grouped_gemm  # noqa: E402  (tests/proxy is on sys.path under pytest)


class Checkpoints:
    """Builds each named checkpoint on first use, once per test run (shared by pytest-xdist workers), in `fmt`."""

    def __init__(self, root, fmt="torch"):
        self.root = root
        self.fmt = fmt

    def __call__(self, name: str) -> str:
        world, flags = CONFIGS[name]
        if "--moe-grouped-gemm" in flags and not legacy_grouped_gemm():
            pytest.skip("this megatron-core has no legacy GroupedMLP (gone from 0.17; its grouped GEMM needs "
                        "Transformer Engine): the GroupedMLP layout is tested on the 0.12-0.16 line")
        path = os.path.join(self.root, name)
        build = lambda: run_distributed(  # noqa: E731
            train, world, TINY + flags + ["--ckpt-format", self.fmt, "--save", path,
                                          "--log-dir", os.path.join(self.root, name + "-logs")], timeout=300)
        return built_once(path, build)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """checkpoints(name) -> path of a real legacy checkpoint from CONFIGS."""
    return Checkpoints(shared_dir(tmp_path_factory, "proxy-ckpts"))


@pytest.fixture(scope="session")
def dist_checkpoints(tmp_path_factory):
    """dist_checkpoints(name) -> path of a real torch_dist checkpoint from CONFIGS."""
    return Checkpoints(shared_dir(tmp_path_factory, "proxy-dist-ckpts"), "torch_dist")


def folder_hash(root: str) -> str:
    """SHA-256 over every file's relative path, mode and content under `root`."""
    digest = hashlib.sha256()
    for base, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(base, name)
            digest.update(os.path.relpath(path, root).encode())
            digest.update(str(os.stat(path).st_mode).encode())
            with open(path, "rb") as fh:
                digest.update(fh.read())
    return digest.hexdigest()


@pytest.fixture(scope="session")
def hash_folder():
    """The folder_hash function."""
    return folder_hash
