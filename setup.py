"""flash_backend: fused training kernels for PyTorch, delivered through torch.compile(backend="flash")."""

from setuptools import find_packages, setup

setup(
    name="flash_backend",
    version="0.1.0",
    description="A torch.compile backend rewriting attention, norm and dense subgraphs into fused kernels",
    packages=find_packages(include=["flash_backend", "flash_backend.*", "fx_passes", "fx_passes.*"]),
    python_requires=">=3.10",
    # torch 2.11 (the GPU machine) and 2.13 (CPU/CI) are both supported; triton 3.6 is what the
    # GPU machine ships and what CI uses for TRITON_INTERPRET runs.
    install_requires=[
        "torch>=2.11",
        "triton>=3.6,<3.7; platform_system=='Linux'",
        "ninja",
    ],
    # transformers builds the small random-initialised GPT-2 / BERT / ViT models the attention
    # rewrite is tested on (no downloads); it does not pull torch or torchvision.
    extras_require={"test": ["pytest", "expecttest", "transformers>=5.17,<6"]},
    entry_points={
        # torch.compile(model, backend="flash") finds the backend here: no import needed.
        "torch_dynamo_backends": ["flash = flash_backend.backend:flash_backend"],
    },
)
