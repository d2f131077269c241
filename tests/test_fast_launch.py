"""flash_backend/_fast_launch.py: a cached compiled kernel is launched again only where Triton itself would
launch that same compiled kernel, with the arguments in the order Triton passes them.

On the CPU there is no driver to launch anything, so Triton's `JITFunction.run` is replaced by a stand-in
that does what matters here exactly as Triton does: it binds the arguments and computes their
specialization with Triton's own binder (`create_function_from_signature`, the code `run` uses), and keeps
one fake compiled kernel per (specialization, options), as Triton's kernel cache does. The cuda test
launches real kernels both ways.
"""

import itertools
import random

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction, create_function_from_signature

from flash_backend import _fast_launch
from flash_backend._fast_launch import FastKernel, fast_kernel


def _kernel_fn(X, Y, n, stride, scale, flag, BLOCK: tl.constexpr, EVEN: tl.constexpr = True):
    pass


class _FakeCompiled:
    def __init__(self, spec, options):
        self.spec, self.options = spec, options
        self.function, self.packed_metadata = object(), object()
        self.launches = []

    def run(self, g0, g1, g2, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook,
            *values):
        assert function is self.function and packed_metadata is self.packed_metadata
        assert launch_metadata is None and enter_hook is None and exit_hook is None
        self.launches.append(((g0, g1, g2), stream, values))


class _TritonStandIn:
    """JITFunction.run's binding, specialization and kernel cache, without compiling or launching."""

    def __init__(self, kernel):
        self.binder = create_function_from_signature(kernel.signature, kernel.params, BaseBackend)
        self.cache = {}
        self.triton_launches = []  # (compiled, grid, bound values) of each launch through Triton's path

    def run(self, *args, grid, warmup, **kwargs):
        bound, spec, options = self.binder(*args, **kwargs)
        key = (str(spec), str(sorted(options.items())))
        compiled = self.cache.setdefault(key, _FakeCompiled(spec, options))
        self.triton_launches.append((compiled, grid, tuple(bound.values())))
        return compiled

    def expected(self, args, kwargs):
        """The compiled kernel and argument values Triton would launch for this call."""
        bound, spec, options = self.binder(*args, **kwargs)
        key = (str(spec), str(sorted(options.items())))
        return self.cache.get(key), tuple(bound.values())


class _FakeDriver:
    class active:
        @staticmethod
        def get_current_device():
            return 0

        @staticmethod
        def get_current_stream(device):
            return 1234


@pytest.fixture
def kernel(monkeypatch):
    kern = JITFunction(_kernel_fn)
    stand_in = _TritonStandIn(kern)
    monkeypatch.setattr(kern, "run", stand_in.run)
    monkeypatch.setattr(_fast_launch, "driver", _FakeDriver)
    return kern, stand_in


def _launch_all(fast, stand_in, calls):
    """Each call through FastKernel: (the compiled kernel it launched, the values it passed, and the pair
    Triton would have launched)."""
    seen = []
    for args, kwargs in calls:
        before_triton = len(stand_in.triton_launches)
        before = {id(c): len(c.launches) for c in stand_in.cache.values()}
        fast[(3, 2)](*args, **kwargs)
        if len(stand_in.triton_launches) > before_triton:  # went through Triton's path
            compiled, _, values = stand_in.triton_launches[-1]
        else:
            (compiled,) = [c for c in stand_in.cache.values() if len(c.launches) > before.get(id(c), 0)]
            grid, stream, values = compiled.launches[-1]
            assert (grid, stream) == ((3, 2, 1), 1234)
        seen.append((compiled, values, stand_in.expected(args, kwargs)))
    return seen


def _tensor(dtype, misaligned=False):
    base = torch.zeros(64, dtype=dtype)
    t = base[1:] if misaligned else base
    return t


def _check_launches(fast, stand_in, calls):
    for compiled, values, (expected_compiled, expected_values) in _launch_all(fast, stand_in, calls):
        assert compiled is expected_compiled
        assert len(values) == len(expected_values)
        for a, b in zip(values, expected_values, strict=True):
            assert a is b or (type(a) is type(b) and a == b)


def test_each_specialized_property_gets_its_own_kernel(kernel):
    """Calls that differ from a base call in one property Triton specializes on, in turn with it."""
    kern, stand_in = kernel
    fast = FastKernel(kern)
    x, y = _tensor(torch.float16), _tensor(torch.float16)
    base = (x, y, 32, 16, 1.5, True)
    variants = [
        (0, _tensor(torch.float16, misaligned=True)),  # pointer alignment
        (0, _tensor(torch.bfloat16)),  # dtype
        (2, 1),  # an int equal to 1
        (2, 17),  # not divisible by 16
        (2, 2**31),  # i64
        (2, 2**63),  # u64
        (5, 1),  # the int 1 where the bool True was
        (5, False),
        (4, 2),  # an int where a float was
    ]
    calls = []
    for i, value in variants:
        args = list(base)
        args[i] = value
        for _ in range(2):
            calls += [(base, {"BLOCK": 32}), (tuple(args), {"BLOCK": 32})]
    calls += [(base, {"BLOCK": 64}), (base, {"BLOCK": 32, "EVEN": False}), (base, {"BLOCK": 32, "EVEN": 1}),
              (base, {"BLOCK": 32, "num_warps": 8})]
    _check_launches(fast, stand_in, calls + calls)
    assert sum(len(c.launches) for c in stand_in.cache.values()) > len(calls)  # most were relaunches


def test_relaunch_uses_the_kernel_and_argument_order_triton_would(kernel):
    """Random calls over a small space, so that keys repeat with every neighbour."""
    kern, stand_in = kernel
    fast = FastKernel(kern)
    random.seed(0)
    tensors = [(torch.float16, False), (torch.float16, True), (torch.bfloat16, False)]
    calls = []
    for _ in range(400):
        x = _tensor(*random.choice(tensors))
        y = _tensor(*random.choice(tensors[:2]))
        n, stride = random.choice([1, 17, 2**31]), 16
        scale = random.choice([0.5, 2])  # the int 2 is not the float 0.5's kind
        flag = random.choice([True, 1])  # a bool and the int of the same value must not meet
        kwargs = {"BLOCK": 32}
        if random.random() < 0.5:
            kwargs["EVEN"] = False
        calls.append(((x, y, n, stride, scale, flag), kwargs))
    _check_launches(fast, stand_in, calls)
    relaunches = sum(len(c.launches) for c in stand_in.cache.values())
    assert relaunches >= 200 and len(stand_in.triton_launches) + relaunches == len(calls)


def test_keyword_order_and_defaults(kernel):
    """Positional constexprs, keyword tensors and defaults bind to the parameter order."""
    kern, stand_in = kernel
    fast = FastKernel(kern)
    x, y = _tensor(torch.float16), _tensor(torch.float16)
    forms = [((x, y, 5, 16, 1.5, True, 32), {}),
             ((x,), dict(Y=y, n=5, stride=16, scale=1.5, flag=True, BLOCK=32)),
             ((x, y, 5, 16, 1.5, True), dict(EVEN=True, BLOCK=32))]
    for args, kwargs in itertools.chain(forms, forms):
        fast[(3, 2)](*args, **kwargs)
    expected = stand_in.expected(*forms[0])[1]
    for c in stand_in.cache.values():
        for _, _, values in c.launches:
            assert values == expected
    assert sum(len(c.launches) for c in stand_in.cache.values()) == 3


def test_what_it_cannot_key_takes_tritons_path_every_time(kernel, monkeypatch):
    kern, stand_in = kernel
    fast = FastKernel(kern)
    x, y = _tensor(torch.float16), _tensor(torch.float16)
    args = (x, y, 5, 16, 1.5, True)

    class Opaque:  # an argument type the key does not know
        dtype = torch.float16

        def data_ptr(self):
            return 0

    for _ in range(2):
        fast[(3, 2)](x, Opaque(), 5, 16, 1.5, True, BLOCK=32)
        fast[lambda meta: (3, 2)](*args, BLOCK=32)  # a callable grid
    assert len(stand_in.triton_launches) == 4
    assert not any(c.launches for c in stand_in.cache.values())

    from triton import knobs

    hook_calls = []
    knobs.runtime.launch_enter_hook.add(hook_calls.append)
    try:
        for _ in range(2):
            fast[(3, 2)](*args, BLOCK=32)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook_calls.append)
    assert len(stand_in.triton_launches) == 6  # a profiler's hook sees every launch
    fast[(3, 2)](*args, BLOCK=32)
    fast[(3, 2)](*args, BLOCK=32)
    assert len(stand_in.triton_launches) == 7  # without it, compiled once more, then relaunched


def test_cache_is_bounded(kernel, monkeypatch):
    kern, stand_in = kernel
    monkeypatch.setattr(_fast_launch, "MAX_ENTRIES", 4)
    fast = FastKernel(kern)
    x, y = _tensor(torch.float16), _tensor(torch.float16)
    for n in range(10):
        fast[(3, 2)](x, y, 100 + n, 16, 1.5, True, BLOCK=32)
        assert len(fast._compiled) <= 4


def test_interpreted_kernels_are_returned_as_they_are():
    interpreted = triton.runtime.interpreter.InterpretedFunction(_kernel_fn)
    assert fast_kernel(interpreted) is interpreted
    jitted = JITFunction(_kernel_fn)
    assert isinstance(fast_kernel(jitted), FastKernel) and fast_kernel(jitted) is fast_kernel(jitted)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_relaunched_kernel_computes_what_tritons_launch_computes_cuda():
    @triton.jit
    def axpy(X, Y, OUT, n, a, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(OUT + offs, a * tl.load(X + offs, mask=m) + tl.load(Y + offs, mask=m), mask=m)

    fast = fast_kernel(axpy)
    for n, dtype, offset in [(1000, torch.float32, 0), (1000, torch.float32, 0), (999, torch.float16, 1),
                             (4096, torch.bfloat16, 0), (999, torch.float16, 1), (1000, torch.float32, 0)]:
        x = torch.randn(n + offset, device="cuda", dtype=dtype)[offset:]
        y = torch.randn(n + offset, device="cuda", dtype=dtype)[offset:]
        a = 0.5 + n / 1000
        out_fast, out_triton = torch.empty_like(x), torch.empty_like(x)
        grid = (triton.cdiv(n, 256),)
        fast[grid](x, y, out_fast, n, a, BLOCK=256)
        axpy[grid](x, y, out_triton, n, a, BLOCK=256)
        torch.testing.assert_close(out_fast, out_triton, rtol=0, atol=0)
        torch.testing.assert_close(out_fast.float(), (a * x.float() + y.float()).to(dtype).float(),
                                   rtol=1e-2, atol=1e-2)
    assert len(fast._compiled) == 3
