"""Shared pytest setup.

Without a GPU, Triton kernels are exercised through Triton's interpreter (TRITON_INTERPRET=1), which
must be set before any kernel is decorated, i.e. before flash_backend is imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch._functorch.config  # noqa: E402
import torch._inductor.config  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)


@pytest.fixture(scope="session", autouse=True)
def _flash_backend_name():
    """backend="flash" in a source tree that pip has not installed (the GPU machine runs the tests from a
    copy of the tree, where the package's entry points are not visible): register the name by hand.
    Installed, torch finds it through the entry point, as users' code does; test_backend.py checks that in a
    fresh interpreter, which this registration cannot reach."""
    from importlib.metadata import entry_points

    if not any(ep.name == "flash" for ep in entry_points(group="torch_dynamo_backends")):
        from torch._dynamo.backends.registry import register_backend

        from flash_backend.backend import flash_backend

        register_backend(flash_backend, name="flash")


@pytest.fixture(autouse=True)
def _fresh_dynamo_and_counters(monkeypatch):
    """Each test starts with empty dynamo caches and counters.

    The compile caches are off: a cache hit reuses an already-rewritten graph without running the
    pre-grad passes again, so the rewrite counters the tests assert on would stay at zero.
    """
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False, raising=False)
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False, raising=False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield


def _triton_language_namespaces():
    """The module and class namespaces Triton's interpreter patches while it runs a kernel."""
    import triton.language as tl

    return [tl, tl.core, tl.math, tl.tensor, tl.dtype, tl.core.tensor_descriptor_base]


_LANGUAGE_SNAPSHOT = [(ns, dict(vars(ns))) for ns in _triton_language_namespaces()]


@pytest.fixture(autouse=True)
def _undo_leaked_interpreter_patches():
    """Put triton.language back as it was imported, after every test.

    Triton 3.6's interpreter patches triton.language builtins with interpreted versions for each kernel it
    runs and restores them afterwards, except for the nested @triton.jit functions a kernel calls
    (InterpretedFunction.__call__ of a device function drops its patch scope). Triton's own tl.random
    helpers (our dropout's Philox) import tl.core, so tl.core.program_id, to_tensor, arange, ... stay
    interpreted. A Gluon kernel compiled for sm_90 later in the same process (the *_hopper compile tests)
    then failed with "'ir.value' object has no attribute 'dtype'", depending on the order the tests ran.
    """
    yield
    for ns, snapshot in _LANGUAGE_SNAPSHOT:
        current = vars(ns)
        for name in [n for n in current if n not in snapshot]:
            delattr(ns, name)
        for name, value in snapshot.items():
            if current.get(name, snapshot) is not value:
                setattr(ns, name, value)


@pytest.fixture
def interpreter():
    """Run the kernels under TRITON_INTERPRET=1 on CPU (conftest sets it when there is no GPU)."""
    import os

    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreter runs are for CPU-only machines; with a GPU the cuda tests run these kernels")
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        # NumPy >= 2.4 refuses int() of the interpreter's 1-element scalar arrays (loop bounds).
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched
    yield
    interp._patch_lang_tensor = original
