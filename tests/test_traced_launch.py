"""flash_backend/_traced_launch.py: one traced kernel object per (kernel, launch options).

CPU: the launch goes to wrap_triton with the options moved into a shared single-config Autotuner, exactly
the one torch would build. CUDA: compiling a graph with many call sites of our kernels adds one row per
kernel and launch shape to torch's kernel side table, however many call sites and tracing phases there are.
"""

import pytest
import torch
import triton
from triton.runtime.autotuner import Autotuner

from flash_backend import _traced_launch
from flash_backend.kernels.add_dropout_norm_kernels import _add_dropout_norm_fwd_kernel
from flash_backend.kernels.partial_sums import _sum_partials_kernel


@pytest.fixture
def launched(monkeypatch):
    """wrap_triton replaced by a recorder of (kernel, grid, args, kwargs)."""
    calls = []

    def wrap_triton(kernel):
        class _Grid:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: calls.append((kernel, grid, args, kwargs))

        return _Grid()

    monkeypatch.setattr(_traced_launch, "wrap_triton", wrap_triton)
    return calls


def test_options_go_into_one_shared_single_config_autotuner(launched):
    launch = _traced_launch.traced_launch
    launch(_add_dropout_norm_fwd_kernel)[(3,)](1, 2, BLOCK=4, num_warps=8, num_stages=2)
    launch(_add_dropout_norm_fwd_kernel)[(5,)](6, BLOCK=7, num_stages=2, num_warps=8)  # another call site
    (first, grid, args, kwargs), (second, *_) = launched
    assert first is second  # one object for both call sites: one side-table row when traced
    assert isinstance(first, Autotuner) and first.fn is _add_dropout_norm_fwd_kernel
    (config,) = first.configs
    assert (config.kwargs, config.num_warps, config.num_stages) == ({}, 8, 2)
    assert (grid, args, kwargs) == ((3,), (1, 2), {"BLOCK": 4})  # the options left the kernel's kwargs
    # what torch builds for a launch with options (triton_kernel_wrap: SPECIAL_CONFIG_NAMES)
    torchs = triton.autotune(configs=[triton.Config({}, num_warps=8, num_stages=2)], key=[])(
        _add_dropout_norm_fwd_kernel)
    assert vars(torchs.configs[0]) == vars(config) and torchs.keys == first.keys


def test_other_options_or_kernels_get_their_own_object_and_no_options_the_kernel_itself(launched):
    launch = _traced_launch.traced_launch
    launch(_add_dropout_norm_fwd_kernel)[(1,)](num_warps=8)
    launch(_add_dropout_norm_fwd_kernel)[(1,)](num_warps=4)
    launch(_sum_partials_kernel)[(1,)](num_warps=8)
    launch(_sum_partials_kernel)[(1,)](BLOCK=2)
    kernels = [call[0] for call in launched]
    assert len({id(k) for k in kernels[:3]}) == 3
    assert kernels[3] is _sum_partials_kernel


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_call_sites_share_side_table_rows():
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    from flash_backend.backend import flash_backend

    def blocks(x, residual, weight, bias):
        for _ in range(4):  # four norms, each one call site of the same kernels and launch shapes
            h = torch.nn.functional.dropout(x, 0.1, training=True) + residual
            x = torch.nn.functional.layer_norm(h, (x.shape[-1],), weight, bias, 1e-5)
            residual = h
        return x, h

    args = [torch.randn(67, 200, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    args += [torch.randn(200, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    torch._dynamo.reset()
    _traced_launch.single_config_kernel.cache_clear()  # fresh objects: rows that this compile must add
    before = set(kernel_side_table.id_to_kernel.values())
    out, h = torch.compile(blocks, backend=flash_backend)(*args)
    torch.autograd.grad((out, h), args, (torch.randn_like(out), torch.randn_like(h)))
    new = [k for k in kernel_side_table.id_to_kernel.values() if k not in before]
    # forward, backward, partial sums: one row each (before, one per call site and tracing phase)
    assert 1 <= len(new) <= 3, [getattr(getattr(k, "fn", k), "__name__", k) for k in new]
