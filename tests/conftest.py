"""Shared pytest setup.

Without a GPU, Triton kernels are exercised through Triton's interpreter (TRITON_INTERPRET=1), which
must be set before any kernel is decorated, i.e. before flash_backend is imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)


@pytest.fixture(autouse=True)
def _fresh_dynamo_and_seed():
    """Each test starts with empty dynamo caches and counters, and a seed of its own."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
