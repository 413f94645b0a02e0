"""Packaging for mindspeed-proxy (the library `mindspeed_proxy/` plus `patches/` as `mindspeed_proxy.patches`)."""
from setuptools import find_packages, setup

library = find_packages(include=["mindspeed_proxy", "mindspeed_proxy.*"])
patch_packages = ["mindspeed_proxy.patches"] + [
    "mindspeed_proxy.patches." + p for p in find_packages(where="patches")
]

setup(
    name="mindspeed-proxy",
    version="0.1.0",
    description="Mechanism-driven monitors and MoE proxy models for Megatron-core / MindSpeed RL post-training",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=library + patch_packages,
    package_dir={"mindspeed_proxy.patches": "patches"},
    install_requires=[
        "torch>=2.4",
        "numpy",
        # Tested on 0.16.1 (Python 3.11) and 0.19.2 (Python 3.12, `make test-latest`); rows cover 0.12-0.19.
        "megatron-core>=0.12,<0.20",
        "packaging",
        "psutil",  # megatron dist_checkpointing imports it
        "threadpoolctl",  # the monitor limits numpy's BLAS pool around its small calls (monitor/threads.py)
    ],
    extras_require={
        # pytest-xdist spreads `make test` over the cores (its workers share built checkpoints through
        # mindspeed_proxy/locking.py); tensorboard: the tests read the monitor's tags back from the event files
        # deepspeed: the DeepSpeed host's 2-rank ZeRO tests (CPU accelerator on gloo, no comm op compiled)
        "test": ["pytest>=7", "pytest-timeout", "pytest-xdist", "pyyaml", "scipy", "scikit-learn", "tensorboard",
                 "import-linter", "deepspeed==0.19.8"],
        "tensorboard": ["tensorboard"],  # --tensorboard-dir of the trainer and the RL loop
        # matplotlib draws the plots; markdown-it-py renders the summary's markdown as HTML
        # scipy: `compare`'s Pearson/Spearman
        "report": ["matplotlib", "markdown-it-py", "scipy"],
        "npu": ["torch_npu"],
        "yaml": ["pyyaml"],  # YAML monitor configs and `calibrate --out X.yaml` (JSON needs nothing)
        # xxhash: XXH3-128 digests of the source and the written proxy (SHA-256 fallback without it)
        "proxy": ["scipy", "scikit-learn", "tqdm", "xxhash"],
        # Hugging Face checkpoints for the converter: safetensors reads/verifies the shards (memory-mapped);
        # transformers (tested on 5.23.0, which needs no newer torch) builds the tiny models of the tests
        "hf": ["safetensors>=0.8", "transformers==5.23.0"],
        # the DeepSpeed host (mindspeed_proxy.hosts.deepspeed); its CPU accelerator needs no compiler once
        # hosts.deepspeed.skip_shm_comm_build() declines the shared-memory comm op
        "deepspeed": ["deepspeed==0.19.8", "transformers==5.23.0"],
        # Megatron-LM's train_rl.py (a checkout, not the megatron-core wheel) imports these at start: fastapi,
        # uvicorn, httpx (its inference server), datasets (its HF agents), wandb (its logger), pyzmq (megatron-core's
        # InferenceCoordinator), triton; transformers loads the tokenizer folder `write-tokenizer` writes
        "rl": ["fastapi", "uvicorn", "httpx", "datasets", "wandb", "pyzmq", "triton", "transformers==5.23.0",
               "pyyaml"],
    },
    entry_points={"console_scripts": ["mindspeed-proxy=mindspeed_proxy.cli:main"]},
)
