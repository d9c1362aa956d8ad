"""dmd2-mega: Megatron-style DMD2 distillation of flow-matching diffusion transformers."""
from setuptools import find_packages, setup

setup(
    name="dmd2-mega",
    version="0.1.0",
    description="Tensor/data-parallel DMD2 distillation of flow-matching DiTs on megatron-core",
    # The Triton kernels' folder is kernels/ (the repository's layout); their import name is dmd2_kernels, the
    # package in kernels/dmd2_kernels/. The name `kernels` is Hugging Face's (transformers >= 5.25 requires and imports
    # it): kernels/ itself has no __init__.py, so even from the repository root `import kernels` finds theirs.
    packages=find_packages(include=["dmd2_mega", "dmd2_mega.*"]) + ["dmd2_kernels"],
    package_dir={"dmd2_kernels": "kernels/dmd2_kernels"},
    python_requires=">=3.10",
    install_requires=[
        # 2.13.0 is the CPU build on local disk; keep the range so it satisfies without a download.
        "torch>=2.4,<2.15",
        "triton>=3.4",  # kernels/dmd2_kernels/_utils.py reads triton.knobs (3.4+)
        "megatron-core>=0.16.1,<0.17",  # 0.17+ needs Python 3.12
        "psutil",
        "numpy",
        "scikit-learn",  # the embedded 8x8 digits data
        "safetensors",
        "pillow",
        "tqdm",
        "tensorboard",
        "matplotlib",  # the training curves' PNG (<save>/curves.png, launch/plot_curves.py), Agg only
        "imageio>=2.30",  # decoded media: GIF / PNG, and MP4 through imageio-ffmpeg's pip-installed ffmpeg
        "imageio-ffmpeg",
        # the ecosystem's formats: diffusers checkpoints in and out, VAEs and text encoders for prepare_data.py and
        # decoded media; accelerate is what diffusers' from_pretrained needs to load a folder
        "diffusers>=0.35",
        "transformers",
        "accelerate",
        "ftfy",  # diffusers' WanImageToVideoPipeline cleans prompts with it unconditionally (WanPipeline if present)
    ],
    extras_require={
        "gpu": ["transformer-engine[pytorch]", "flash-attn"],
        # diffusers / transformers (installed above) are also the oracles of the tests: tiny random models built
        # in the test, nothing downloaded
        # peft: diffusers' LoRA loader (WanPipeline.load_lora_weights) that reads the LoRA exports
        "test": ["pytest>=7", "pytest-timeout", "pytest-xdist>=3.5", "import-linter>=2.1", "peft>=0.15"],
    },
)
