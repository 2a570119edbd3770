from setuptools import find_packages, setup

setup(
    name="megatron_tree",
    version="0.2.0",
    description="Tree training for Megatron-LM: pack sequences with shared prefixes into prefix trees, "
    "compute every shared token once, return exact per-sequence log-probs and gradients.",
    # megatron_tree/patches is a link to the top-level patches/ folder: installed as megatron_tree.compat only.
    packages=find_packages(include=["megatron_tree", "megatron_tree.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "numpy", "pyyaml"],
    extras_require={
        "megatron": [
            "megatron-core>=0.16,<0.20",
            "mbridge",
            "transformers",
            "safetensors",
            "einops",
            "psutil",  # megatron-core's dist checkpoint writer needs it (hangs without)
            "pyarrow",  # Parquet rollouts
            "tensorboard",
            "tqdm",
        ],
        "test": ["pytest", "hypothesis", "wandb"],
        # The "fa4" tree attention backend (Hopper / Blackwell GPUs): FlashAttention-4's CuTe kernels.
        "fa4": ["flash-attn-4==4.0.0b36"],
        # The "cudnn_flex" tree attention backend (Hopper / Blackwell GPUs): cuDNN frontend's interval-mask kernels.
        "cudnn_flex": ["nvidia-cudnn-frontend==1.32.0"],
        "bench": ["matplotlib", "tqdm"],
    },
    entry_points={"console_scripts": ["megatron-tree-train=megatron_tree.train.__main__:main"]},
)
