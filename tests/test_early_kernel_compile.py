"""flash_backend/_early_kernel_compile.py: our kernels are handed to Inductor's compile pool at codegen.

CPU: the (name, source) read back from an emitted definition is exactly what the generated module passes to
async_compile.triton when it runs (checked by running the module text), and the codegen wrapper submits our
kernels only, once, and leaves the codegen untouched. CUDA: a compiled graph's module load finds every early
submission already in AsyncCompile's cache.
"""

import multiprocessing

import pytest
import torch

from flash_backend import _early_kernel_compile as early
from flash_backend import config as flash_config
from flash_backend.kernels.add_dropout_norm_kernels import _add_dropout_norm_fwd_kernel

# What Inductor's wrapper emits for a user-defined kernel (wrapper.py, define_user_defined_triton_kernel):
# a backslash doubled, a whitespace-only line, an indented body, a quote of the other kind.
_SOURCE_LINES = [
    "import triton",
    "@triton.jit",
    "def _k_0(X, N: tl.constexpr):",
    "    # a comment with \\\\n and a \"quote\"",
    "    ",
    "    pass",
]
_DEFINITION = ("\n\n# Original path: flash_backend/kernels/k.py:1\n_k_0 = async_compile.triton('_k_0', '''\n"
               + "\n".join(_SOURCE_LINES) + "\n''', device_str='cuda')")


def _run_module_text(definition: str) -> list:
    """What the generated module's own call passes: the definition spliced into a header as Inductor does,
    then executed against a recording async_compile."""
    from torch._inductor.utils import IndentedBuffer

    header = IndentedBuffer()
    header.splice(definition)
    calls = []

    class _Recorder:
        def triton(self, name, source, device_str="cuda"):
            calls.append((name, source, device_str))

    exec(compile(header.getvalue(), "<module>", "exec"), {"async_compile": _Recorder()})
    return calls


def test_emitted_call_is_what_the_module_passes_at_load():
    got = early.emitted_compile_call(_DEFINITION)
    assert got is not None
    assert [got] == _run_module_text(_DEFINITION)
    name, source, device = got
    assert name == "_k_0" and device == "cuda"
    assert "\n\n    pass" in source  # the whitespace-only line arrives empty, as the module has it
    assert "\\n" in source  # the doubled backslash arrives single


@pytest.mark.parametrize("definition", [
    "x = 1",
    "a = async_compile.triton('a', '''x''')\nb = async_compile.triton('b', '''y''')",  # two calls
    "a = async_compile.triton(name, '''x''')",  # not a literal
    "a = async_compile.triton('a', '''x''', device_str='cuda', other=1)",  # an unknown keyword
    "a = async_compile.triton('a', '''x'''",  # not Python
])
def test_anything_but_one_literal_call_is_left_to_the_load(definition):
    assert early.emitted_compile_call(definition) is None


class _FakeWrapper:
    """Stands in for Inductor's PythonWrapperCodegen: defines a kernel the first time it sees it."""

    def __init__(self):
        self.defined = []

    def define_kernel(self, name, body, metadata=None):
        self.defined.append((name, body, metadata))

    def define_user_defined_triton_kernel(self, kernel, configs, kwargs):
        if any(name == kernel.__name__ for name, *_ in self.defined):
            return "cached"
        self.define_kernel(kernel.__name__, _DEFINITION.replace("_k_0", kernel.__name__), "meta")
        return "defined"


class _NotOurs:
    __name__ = "other_kernel"
    fn = None


@pytest.fixture
def pool(monkeypatch):
    """AsyncCompile with a ready pool whose triton() records its calls."""
    from torch._inductor.async_compile import AsyncCompile

    calls = []
    monkeypatch.setattr(AsyncCompile, "use_process_pool", classmethod(lambda cls: True))
    monkeypatch.setattr(AsyncCompile, "triton", lambda self, name, source, device_str="cuda":
                        calls.append((name, source, device_str)))
    return calls


def test_codegen_submits_our_kernel_once_and_is_otherwise_unchanged(pool):
    define = early._early(_FakeWrapper.define_user_defined_triton_kernel)
    wrapper = _FakeWrapper()
    assert define(wrapper, _add_dropout_norm_fwd_kernel, [], {}) == "defined"
    name = _add_dropout_norm_fwd_kernel.__name__
    assert [c[0] for c in pool] == [name]
    assert pool == _run_module_text(wrapper.defined[0][1])  # the very call the module will make
    assert wrapper.defined[0][2] == "meta"  # the definition itself went through as emitted
    assert "define_kernel" not in vars(wrapper)  # the method is no longer shadowed
    assert define(wrapper, _add_dropout_norm_fwd_kernel, [], {}) == "cached"
    assert len(pool) == 1  # an already defined specialisation emits nothing, submits nothing
    assert define(wrapper, _NotOurs(), [], {}) == "defined"
    assert len(pool) == 1  # a user's own kernel is left to Inductor


def test_switch_off_and_no_pool_submit_nothing(pool, monkeypatch):
    from torch._inductor.async_compile import AsyncCompile

    define = early._early(_FakeWrapper.define_user_defined_triton_kernel)
    monkeypatch.setattr(flash_config, "early_kernel_compile", False)
    assert define(_FakeWrapper(), _add_dropout_norm_fwd_kernel, [], {}) == "defined"
    monkeypatch.setattr(flash_config, "early_kernel_compile", True)
    monkeypatch.setattr(AsyncCompile, "use_process_pool", classmethod(lambda cls: False))
    assert define(_FakeWrapper(), _add_dropout_norm_fwd_kernel, [], {}) == "defined"
    assert pool == []


def test_a_failed_submission_leaves_the_codegen_result(monkeypatch):
    from torch._inductor.async_compile import AsyncCompile

    def broken(self, *args, **kwargs):
        raise RuntimeError("pool gone")

    monkeypatch.setattr(AsyncCompile, "use_process_pool", classmethod(lambda cls: True))
    monkeypatch.setattr(AsyncCompile, "triton", broken)
    define = early._early(_FakeWrapper.define_user_defined_triton_kernel)
    assert define(_FakeWrapper(), _add_dropout_norm_fwd_kernel, [], {}) == "defined"


def test_install_wraps_inductors_codegen_once():
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen

    assert early.install()
    wrapped = PythonWrapperCodegen.define_user_defined_triton_kernel
    assert getattr(wrapped, "_flash_early", False)
    assert early.install()
    assert PythonWrapperCodegen.define_user_defined_triton_kernel is wrapped


@pytest.mark.cuda
def test_compiled_graph_loads_our_kernels_from_the_early_compiles(monkeypatch, tmp_path):
    from torch._dynamo.utils import counters
    from torch._inductor.async_compile import AsyncCompile

    from flash_backend.backend import flash_backend

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    inductor_config = torch._inductor.config
    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)
    # Early submission needs Inductor's worker pool. Python forbids a multiprocessing daemon to have child
    # processes, so there (unless workers start by subprocess, torch's _process_pool_allowed) Inductor has
    # no pool and compiles in-process, and so do we: nothing to test.
    if (multiprocessing.current_process().daemon
            and getattr(inductor_config, "worker_start_method", None) != "subprocess"):
        pytest.skip("Python forbids a multiprocessing daemon child processes, so Inductor runs no compile "
                    "worker pool here: no pool to submit early compiles to")
    # Ask for a pool even on a small machine, and wait until it is up (as Inductor's own early compiles do).
    threads = inductor_config.compile_threads or inductor_config.decide_compile_threads()
    monkeypatch.setattr(inductor_config, "compile_threads", max(2, threads))
    if not AsyncCompile.use_process_pool():
        AsyncCompile.process_pool()
        if AsyncCompile._ready_future is not None:
            AsyncCompile._ready_future.result(timeout=120)
    assert AsyncCompile.use_process_pool(), "Inductor's compile worker pool did not come up"

    def block(x, residual, weight, bias):
        h = torch.nn.functional.dropout(x, 0.1, training=True) + residual
        return torch.nn.functional.layer_norm(h, (x.shape[-1],), weight, bias, 1e-5), h

    args = [torch.randn(67, 200, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    args += [torch.randn(200, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    torch._dynamo.reset()
    early.submitted.clear()
    hits_before = counters["inductor"]["async_compile_cache_hit"]
    out, h = torch.compile(block, backend=flash_backend)(*args)
    torch.autograd.grad((out, h), args, (torch.randn_like(out), torch.randn_like(h)))
    submitted = sum(early.submitted.values())
    assert submitted >= 3, early.submitted  # forward, backward and the partial sums at least
    assert counters["inductor"]["async_compile_cache_hit"] - hits_before >= submitted
    # and the results are the kernels' (the op's own cuda tests check the values): finite, right shape
    assert out.shape == args[0].shape and torch.isfinite(out.float()).all()
