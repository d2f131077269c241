"""flash_attention on the layouts real callers hand it, forward and every gradient against fp32.

Strided inputs are where a kernel that takes strides goes silently wrong: a broadcast (stride-0) batch or head
dim from expand(), a head_dim whose stride is not 1, a slice of a wider tensor, (B, S, H, D) memory seen as
(B, H, S, D), and the upstream gradients autograd really passes (out.sum() gives an all-stride-0 dout). Each
case runs at a small size (the Triton kernels) and, on CUDA, at a size the Hopper (Gluon) kernels take when
the layout allows them. Found by the SDPA review's `expanded` case on the H200 (session 25)."""

from __future__ import annotations

import pytest
import torch

from flash_backend.ops.attention import flash_attention

LAYOUTS = ["contiguous", "bshd", "expanded_batch", "expanded_kv_heads", "sliced_head_dim", "head_dim_strided"]
DOUTS = ["random", "random_bshd", "sum", "expanded_batch"]


def _layout(shape, layout, dtype, device, gen):
    """A (B, H, S, D) tensor of random values in the named memory layout."""
    B, H, S, D = shape
    if layout == "contiguous":
        return torch.randn(B, H, S, D, generator=gen).to(device, dtype)
    if layout == "bshd":
        return torch.randn(B, S, H, D, generator=gen).to(device, dtype).transpose(1, 2)
    if layout == "expanded_batch":
        return torch.randn(1, H, S, D, generator=gen).to(device, dtype).expand(B, -1, -1, -1)
    if layout == "expanded_kv_heads":  # a k/v head repeated with expand (GQA written as a broadcast)
        return torch.randn(B, 1, S, D, generator=gen).to(device, dtype).expand(-1, H, -1, -1)
    if layout == "sliced_head_dim":  # the first D of 2D columns: rows 2D apart, a 16-byte aligned start
        return torch.randn(B, H, S, 2 * D, generator=gen).to(device, dtype)[..., :D]
    if layout == "head_dim_strided":  # head_dim not unit-stride: (B, H, D, S) memory transposed
        return torch.randn(B, H, D, S, generator=gen).to(device, dtype).transpose(-1, -2)
    raise ValueError(layout)


def _dout(out, kind, gen):
    if kind == "random":
        return torch.randn(out.shape, generator=gen).to(out.device, out.dtype)
    if kind == "random_bshd":
        B, H, S, D = out.shape
        return torch.randn(B, S, H, D, generator=gen).to(out.device, out.dtype).transpose(1, 2)
    if kind == "sum":  # what out.sum().backward() passes: one value, every stride 0
        return torch.ones((), device=out.device, dtype=out.dtype).expand(out.shape)
    if kind == "expanded_batch":
        return torch.randn((1, *out.shape[1:]), generator=gen).to(out.device, out.dtype).expand(out.shape)
    raise ValueError(kind)


def _check(shape, q_layout, kv_layout, dout_kind, causal, device, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    B, H, S, D = shape
    q = _layout(shape, q_layout, dtype, device, gen)
    k = _layout(shape, kv_layout, dtype, device, gen)
    v = _layout(shape, kv_layout, dtype, device, gen)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]  # no clone: keeps the layout
    out = flash_attention(*leaves, is_causal=causal)
    dout = _dout(out, dout_kind, gen)
    grads = torch.autograd.grad(out, leaves, dout)

    # fp32 reference, and PyTorch's own error in this dtype (math path on the rounded inputs), per result
    ref_leaves = [t.detach().float().contiguous().requires_grad_() for t in (q, k, v)]
    ref_out = torch.nn.functional.scaled_dot_product_attention(*ref_leaves, is_causal=causal)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, dout.float())
    low_leaves = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        low_out = torch.nn.functional.scaled_dot_product_attention(*low_leaves, is_causal=causal)
        low_grads = torch.autograd.grad(low_out, low_leaves, dout)
    names = ["out", "dq", "dk", "dv"]
    for name, got, want, low in zip(names, [out, *grads], [ref_out, *ref_grads], [low_out, *low_grads],
                                    strict=True):
        assert got.shape == want.shape, name
        err = (got.float() - want).abs().max().item()
        err_torch = (low.float() - want).abs().max().item()
        scale = want.abs().max().item()
        assert err <= 2 * err_torch + 1e-2 * max(scale, 1.0), (name, err, err_torch, scale)


CPU_CASES = [  # the reference path (plain PyTorch) takes every layout too
    ("expanded_batch", "contiguous", "random", False),
    ("bshd", "expanded_kv_heads", "sum", True),
    ("head_dim_strided", "sliced_head_dim", "random_bshd", False),
]


@pytest.mark.parametrize("q_layout,kv_layout,dout_kind,causal", CPU_CASES)
def test_layouts_reference_path(q_layout, kv_layout, dout_kind, causal):
    _check((3, 4, 37, 32), q_layout, kv_layout, dout_kind, causal, "cpu", dtype=torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dout_kind", DOUTS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_small_cuda(layout, dout_kind, causal):
    """q, k, v all in the layout (Triton kernels at this size)."""
    _check((3, 4, 200, 64), layout, layout, dout_kind, causal, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("q_layout,kv_layout", [("expanded_batch", "contiguous"), ("contiguous", "bshd"),
                                                 ("bshd", "expanded_kv_heads"),
                                                 ("sliced_head_dim", "head_dim_strided")])
def test_layouts_mixed_small_cuda(q_layout, kv_layout):
    _check((3, 4, 200, 64), q_layout, kv_layout, "random", False, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("dout_kind", DOUTS)
@pytest.mark.parametrize("layout", ["contiguous", "bshd", "expanded_batch", "sliced_head_dim"])
@pytest.mark.parametrize("head_dim,causal", [(64, False), (64, True), (128, True)])
def test_layouts_large_cuda(layout, dout_kind, head_dim, causal):
    """2**29 scores: the Gluon forward and backward on sm_90 where the layout is TMA-compatible, the Triton
    kernels elsewhere."""
    _check((2, 16, 4096, head_dim), layout, layout, dout_kind, causal, "cuda")
