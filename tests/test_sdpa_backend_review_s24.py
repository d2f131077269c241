"""flash_backend.sdpa against SDPA's argument semantics (review s24): what a routed call computes must be what
PyTorch's kernel for that aten op computes, and what the flash op cannot take must stay with PyTorch.

CPU tests call the overrides and the routing predicate directly (the flash op runs its reference on CPU);
the CUDA tests compare F.scaled_dot_product_attention with the backend active against PyTorch's kernels."""

import contextlib
import math

import pytest
import torch
import torch.nn.attention as attention
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

import flash_backend.sdpa as sdpa

_KEYSET = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)


def _qkv(B, H, Sq, Sk, D, Hkv=None, dtype=torch.bfloat16, device="cpu"):
    Hkv = H if Hkv is None else Hkv
    q = torch.randn(B, H, Sq, D, dtype=dtype, device=device)
    k, v = (torch.randn(B, Hkv, Sk, D, dtype=dtype, device=device) for _ in range(2))
    return q, k, v


def _band(Sq, Sk, bottom_right):
    off = Sk - Sq if bottom_right else 0
    return torch.arange(Sk)[None, :] <= torch.arange(Sq)[:, None] + off


def _reference(q, k, v, mask, scale=None):
    """fp32 SDPA (math), with fully masked rows 0 as SDPA's math path and the flash op give them."""
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=scale)
    return out, (qf, kf, vf)


# --------------------------------------------------------------------------------------------------------
# is_causal with Sq != Sk: each aten op's own alignment
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sq,sk", [(8, 24), (24, 8)])
def test_flash_op_causal_is_bottom_right_like_flash_attention_2(sq, sk):
    """aten::_scaled_dot_product_flash_attention's is_causal is FlashAttention-2's bottom-right diagonal:
    torch.nn.attention.bias.causal_lower_right calls it directly with Sq != Sk and relies on that (SDPA
    itself only sends square causal calls). The override ran it top-left."""
    q, k, v = _qkv(2, 4, sq, sk, 32)
    out, lse, *_ = sdpa._flash_fwd(_KEYSET, q, k, v, 0.0, True, False)
    ref, leaves = _reference(q, k, v, _band(sq, sk, bottom_right=True))
    torch.testing.assert_close(out.float(), ref.detach(), atol=2e-2, rtol=2e-2)
    go = torch.randn_like(out)
    grads = sdpa._flash_bwd(_KEYSET, go, q, k, v, out, lse, None, None, sq, sk, 0.0, True, None, None)
    ref.backward(go.float())
    for g, r in zip(grads, leaves, strict=True):
        torch.testing.assert_close(g.float(), r.grad, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("sq,sk", [(8, 24), (24, 8)])
def test_efficient_and_cudnn_ops_causal_stay_top_left(sq, sk):
    """SDPA's is_causal (top-left) reaches the efficient and cuDNN ops with Sq != Sk: those stay top-left."""
    q, k, v = _qkv(2, 4, sq, sk, 32)
    ref, _ = _reference(q, k, v, _band(sq, sk, bottom_right=False))
    eff = sdpa._efficient_fwd(_KEYSET, q, k, v, None, True, 0.0, True)[0]
    cudnn = sdpa._cudnn_fwd(_KEYSET, q, k, v, None, True, 0.0, True, False)[0]
    for out in (eff, cudnn):
        torch.testing.assert_close(out.float(), ref.detach(), atol=2e-2, rtol=2e-2)


def test_flash_op_square_causal_unchanged():
    q, k, v = _qkv(1, 2, 40, 40, 16)
    out = sdpa._flash_fwd(_KEYSET, q, k, v, 0.0, True, False)[0]
    ref, _ = _reference(q, k, v, _band(40, 40, bottom_right=False))
    torch.testing.assert_close(out.float(), ref.detach(), atol=2e-2, rtol=2e-2)


# --------------------------------------------------------------------------------------------------------
# Scale: explicit values (0, negative) are used as given, None is 1/sqrt(head_dim of q)
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [None, 0.0, -0.7, 3.0])
def test_scale_semantics(scale):
    q, k, v = _qkv(1, 2, 20, 28, 16)
    bias = torch.randn(1, 2, 20, 28, dtype=torch.bfloat16)
    ref, _ = _reference(q, k, v, bias.float(), scale=scale)
    out = sdpa._efficient_fwd(_KEYSET, q, k, v, bias, False, 0.0, False, scale=scale)[0]
    torch.testing.assert_close(out.float(), ref.detach(), atol=3e-2, rtol=3e-2)
    ref, _ = _reference(q, k, v, None, scale=scale)
    out = sdpa._flash_fwd(_KEYSET, q, k, v, 0.0, False, False, scale=scale)[0]
    torch.testing.assert_close(out.float(), ref.detach(), atol=3e-2, rtol=3e-2)


# --------------------------------------------------------------------------------------------------------
# Masks of every broadcastable rank (the cuDNN op gets SDPA's mask unexpanded), fully masked rows
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(20, 28), (1, 28), (2, 20, 28), (1, 1, 28), (3, 1, 20, 28), (3, 2, 1, 1)])
def test_cudnn_override_masks_of_every_rank(shape):
    q, k, v = _qkv(3, 2, 20, 28, 16)
    bias = torch.randn(shape, dtype=torch.bfloat16)
    assert sdpa.unsupported_reason(q, k, v, bias) is None
    out = sdpa._cudnn_fwd(_KEYSET, q, k, v, bias, True, 0.0, False, False)[0]
    ref, _ = _reference(q, k, v, bias.float())
    torch.testing.assert_close(out.float(), ref.detach(), atol=2e-2, rtol=2e-2)


def test_fully_masked_rows_give_zero_like_sdpa_math():
    q, k, v = _qkv(1, 2, 6, 16, 16)
    bias = torch.zeros(1, 2, 6, 16, dtype=torch.bfloat16)
    bias[..., 2, :] = float("-inf")
    out = sdpa._efficient_fwd(_KEYSET, q, k, v, bias, True, 0.0, False)[0]
    ref, _ = _reference(q, k, v, bias.float())
    assert torch.isfinite(out).all() and (out[..., 2, :] == 0).all()
    torch.testing.assert_close(out.float(), ref.detach(), atol=2e-2, rtol=2e-2)


def test_efficient_backward_without_forward_logsumexp():
    """Only attn_mask requires grad: SDPA's forward asks for no logsumexp (compute_log_sumexp=False, an empty
    one comes back), yet the efficient backward runs for the mask's gradient (pytorch#148476). The override
    indexed the empty logsumexp; it must give the mask the exact gradient."""
    q, k, v = _qkv(2, 2, 20, 28, 16)
    bias = torch.randn(2, 2, 20, 28, dtype=torch.bfloat16)
    out, lse, seed, offset = sdpa._efficient_fwd(_KEYSET, q, k, v, bias, False, 0.0, False)
    assert lse.shape[-1] == 0
    go = torch.randn_like(out)
    mask = [False, False, False, True]
    grads = sdpa._efficient_bwd(_KEYSET, go, q, k, v, bias, out, lse, seed, offset, 0.0, mask, False)
    bias_ref = bias.float().requires_grad_()
    F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=bias_ref).backward(go.float())
    torch.testing.assert_close(grads[3].float(), bias_ref.grad, atol=2e-2, rtol=2e-2)


# --------------------------------------------------------------------------------------------------------
# What the routing predicate must leave to PyTorch
# --------------------------------------------------------------------------------------------------------


def test_zero_head_dim_stays_with_pytorch():
    """head_dim 0 passes `d % 8 == 0`, but the flash op takes head dims 8..256 (flash_attention rejects 0)."""
    q, k, v = _qkv(1, 2, 4, 4, 0)
    assert "head_dim" in sdpa.unsupported_reason(q, k, v)


@pytest.mark.parametrize("shape", [(0, 2, 8, 8), (2, 2, 0, 8), (2, 2, 8, 0)])
def test_empty_inputs_stay_with_pytorch(shape):
    """B = 0, Sq = 0 or Sk = 0: whatever PyTorch's kernel gives (or raises) is SDPA's answer, not a launch of
    ours over an empty grid."""
    B, H, Sq, Sk = shape
    assert "empty" in sdpa.unsupported_reason(*_qkv(B, H, Sq, Sk, 16))


def test_key_value_lengths_differ_stays_with_pytorch():
    q, k, _ = _qkv(1, 2, 8, 8, 16)
    v = torch.randn(1, 2, 9, 16, dtype=torch.bfloat16)
    assert "sequence lengths" in sdpa.unsupported_reason(q, k, v)


def test_mask_on_another_device_stays_with_pytorch():
    q, k, v = (t.to("meta") for t in _qkv(1, 2, 8, 8, 16))
    assert "device" in sdpa.unsupported_reason(q, k, v, torch.zeros(8, 8, dtype=torch.bfloat16))


def test_routed_inputs_the_predicate_accepts():
    q, k, v = _qkv(2, 8, 8, 12, 64, Hkv=2)  # GQA: k/v heads divide q's
    assert sdpa.unsupported_reason(q, k, v) is None
    assert "heads" in sdpa.unsupported_reason(*_qkv(2, 6, 8, 12, 64, Hkv=4))
    qv = torch.randn(2, 8, 8, 32, dtype=torch.bfloat16)
    assert "head dims" in sdpa.unsupported_reason(q, k, torch.randn(2, 2, 12, 32, dtype=torch.bfloat16))
    assert "dtype" in sdpa.unsupported_reason(qv, qv.half(), qv)
    assert "3-d" in sdpa.unsupported_reason(qv[0], qv[0], qv[0])
    assert "5-d" in sdpa.unsupported_reason(qv[None], qv[None], qv[None])
    assert "attn_bias" in sdpa.unsupported_reason(qv, qv, qv, torch.zeros(1, 1, 1, 8, 8, dtype=torch.bool))


# --------------------------------------------------------------------------------------------------------
# CUDA: SDPA with the backend active against PyTorch's kernels, case by case
# --------------------------------------------------------------------------------------------------------


@pytest.fixture
def restored():
    yield
    sdpa.deactivate()


def _run(args, kwargs, grad_mask):
    leaves = [a.detach().requires_grad_() for a in args]  # no clone: keeps expanded / strided layouts
    kw = dict(kwargs)
    if grad_mask:
        kw["attn_mask"] = kw["attn_mask"].detach().clone().requires_grad_()
    out = F.scaled_dot_product_attention(*leaves, **kw)
    if out is None:  # PyTorch 2.11's CUDA SDPA returns None for B = 0 or head_dim 0 (seen on the H200)
        return None, []
    # The upstream gradient by logical index: randn_like fills memory in order, so two runs whose outputs
    # differ in layout (ours follows the op's meta, PyTorch's cuDNN kernel returns contiguous) would be
    # given different gradients (session 25, the `expanded` case).
    gen = torch.Generator().manual_seed(1)
    out.backward(torch.randn(out.shape, generator=gen).to(out.device, out.dtype))
    grads = [t.grad for t in leaves] + ([kw["attn_mask"].grad] if grad_mask else [])
    return out.detach(), grads


def _reference_kwargs(args, kwargs):
    """SDPA's function in fp32 for the math path: a CausalBias materialised, is_causal folded into a mask
    given with it (the math path refuses the pair, a fused choice may take it)."""
    kw = dict(kwargs)
    mask = kw.get("attn_mask")
    if isinstance(mask, torch.Tensor) and not mask.is_floating_point() and mask.dtype != torch.bool:
        mask = mask._materialize(args[0].device)  # torch.nn.attention.bias.CausalBias
    if isinstance(mask, torch.Tensor) and mask.is_floating_point():
        mask = mask.float()
    if mask is not None and kw.pop("is_causal", False):
        band = _band(args[0].shape[2], args[1].shape[2], bottom_right=False).to(args[0].device)
        mask = mask.masked_fill(~band, -math.inf) if mask.is_floating_point() else mask & band
    if mask is not None:
        kw["attn_mask"] = mask
    return kw


def _compare_with_default(args, kwargs, grad_mask=False, expect_routed=True, dead_rows=()):
    """Our run against PyTorch's kernels: an error in one must be an error in the other, NaN where it is
    NaN, else errors against fp32 (the math path) at most ~2x PyTorch's own plus a floor. dead_rows: query
    rows left out of the output comparison (fully masked; the caller checks them)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        default = _run(args, kwargs, grad_mask)
    except RuntimeError as e:
        attention.activate_flash_attention_impl("flash_backend")
        with pytest.raises(RuntimeError):
            _run(args, kwargs, grad_mask)
        return f"both raise: {e}"
    attention.activate_flash_attention_impl("flash_backend")
    ours = _run(args, kwargs, grad_mask)
    routed = sdpa.calls["flash"]
    sdpa.deactivate()
    if expect_routed:
        assert routed >= 2, sdpa.calls
    if default[0] is None:  # PyTorch's answer for an empty call, and ours: the call stayed with PyTorch
        assert ours[0] is None and not routed, sdpa.calls
        return "both return None"
    with sdpa_kernel(SDPBackend.MATH):
        ref = _run([a.float() for a in args], _reference_kwargs(args, kwargs), grad_mask)
    pairs = zip([default[0], *default[1]], [ref[0], *ref[1]], strict=True)
    if not dead_rows and any(d is not None and (d.isnan() & ~r.isnan()).any() for d, r in pairs):
        # PyTorch's fused kernel is wrong here (NaN where the fp32 math path is finite: its cuDNN and FLASH
        # kernels for a causal call with scale <= 0, -inf * 0 and -inf * -0.3, seen on the H200): PyTorch's
        # error in this dtype is taken from its math path instead.
        with sdpa_kernel(SDPBackend.MATH):
            default = _run(args, _reference_kwargs(args, kwargs), grad_mask)
    live = torch.ones(ours[0].shape[2], dtype=torch.bool, device=ours[0].device)
    live[list(dead_rows)] = False
    for i, (o, d, r) in enumerate(
        zip([ours[0], *ours[1]], [default[0], *default[1]], [ref[0], *ref[1]], strict=True)
    ):
        if d is None:
            assert o is None
            continue
        if i == 0 and dead_rows:
            o, d, r = o[..., live, :], d[..., live, :], r[..., live, :]
        elif dead_rows:  # a kernel's NaN on a dead row reaches dK / dV: compare where PyTorch's is finite
            finite = d.isfinite()
            o, d, r = o[finite], d[finite], r[finite]
        assert torch.equal(o.isnan(), r.isnan()), f"NaN positions differ from the fp32 math path, result {i}"
        if o.numel() == 0:
            continue
        o, d, r = (t.float().nan_to_num(0.0) for t in (o, d, r))
        err_ours, err_default = (o - r).abs().max().item(), (d - r).abs().max().item()
        assert err_ours <= 2 * err_default + 2e-2, (i, err_ours, err_default)
    return {"ours": ours, "default": default}


def _cuda(*ts):
    return [t.cuda() for t in ts]


@pytest.mark.cuda
@pytest.mark.parametrize("sq,sk", [(128, 320), (320, 128)])
def test_cuda_causal_lower_right_bias(sq, sk, restored):
    args = _cuda(*_qkv(2, 4, sq, sk, 64))
    _compare_with_default(args, {"attn_mask": causal_lower_right(sq, sk)})


@pytest.mark.cuda
@pytest.mark.parametrize("backend", [None, "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"])
@pytest.mark.parametrize("sq,sk", [(128, 320), (320, 128)])
def test_cuda_is_causal_non_square(sq, sk, backend, restored):
    """SDPA's causal is top-left whichever fused op it picks (it refuses flash for Sq != Sk)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    args = _cuda(*_qkv(2, 4, sq, sk, 64))
    with (
        sdpa_kernel(getattr(SDPBackend, backend or "CUDNN_ATTENTION"))
        if backend
        else contextlib.nullcontext()
    ):
        print(_compare_with_default(args, {"is_causal": True}, expect_routed=backend != "FLASH_ATTENTION"))


@pytest.mark.cuda
@pytest.mark.parametrize("scale", [0.0, -0.3, 2.0])
def test_cuda_explicit_scale(scale, restored):
    args = _cuda(*_qkv(2, 4, 200, 200, 64))
    _compare_with_default(args, {"scale": scale, "is_causal": True})


@pytest.mark.cuda
@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((200, 200), torch.bool),
        ((2, 1, 1, 200), torch.bool),
        ((4, 200, 200), torch.bfloat16),
        ((2, 4, 200, 200), torch.bfloat16),
        ((1, 1, 200, 200), torch.bfloat16),
    ],
)
def test_cuda_mask_ranks(shape, dtype, restored):
    args = _cuda(*_qkv(2, 4, 200, 200, 64))
    mask = (
        torch.rand(shape, device="cuda") > 0.3 if dtype == torch.bool else torch.randn(shape, device="cuda")
    )
    _compare_with_default(args, {"attn_mask": mask.to(dtype)}, grad_mask=dtype != torch.bool)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["bool", "neginf"])
def test_cuda_fully_masked_rows(kind, restored):
    """A query row with every key masked: SDPA's math path gives 0 there, the flash op 0 (and +inf
    logsumexp); PyTorch's fused kernels may differ on that row (cuDNN gets bool masks as a finite fill, so a
    uniform average), so the row is printed and checked for ours only, the rest compared as usual."""
    args = _cuda(*_qkv(2, 4, 200, 200, 64))
    keep = torch.rand(2, 1, 200, 200, device="cuda") > 0.3
    keep[:, :, 5] = False
    mask = keep
    if kind == "neginf":
        mask = torch.zeros_like(keep, dtype=torch.bfloat16).masked_fill(~keep, -math.inf)
    res = _compare_with_default(args, {"attn_mask": mask}, dead_rows=(5,))
    ours, default = res["ours"][0][..., 5, :], res["default"][0][..., 5, :]
    print(kind, "default on the dead row:", default.float().abs().max().item(), default.isnan().any().item())
    assert all(torch.isfinite(g).all() for g in res["ours"][1])
    if sdpa.calls["flash"] and default.isnan().any():  # routed, and PyTorch's kernel gave NaN: ours 0
        assert (ours == 0).all()
    else:
        torch.testing.assert_close(ours, default, atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "case", ["mask_and_causal", "gqa", "head_dim_12", "dv_differs", "b0", "d0", "expanded"]
)
def test_cuda_argument_cases(case, restored):
    routed = True
    kwargs = {}
    if case == "mask_and_causal":
        args = _cuda(*_qkv(2, 4, 200, 200, 64))
        kwargs = {"attn_mask": torch.randn(2, 4, 200, 200, device="cuda").bfloat16(), "is_causal": True}
    elif case == "gqa":
        args = _cuda(*_qkv(2, 8, 200, 260, 64, Hkv=2))
        kwargs = {"enable_gqa": True}
    elif case == "head_dim_12":
        args = _cuda(*_qkv(2, 4, 200, 200, 12))
    elif case == "dv_differs":
        q, k, _ = _qkv(2, 4, 200, 200, 64)
        args, routed = _cuda(q, k, torch.randn(2, 4, 200, 32).bfloat16()), False
    elif case == "b0":
        args, routed = _cuda(*_qkv(0, 4, 200, 200, 64)), False  # stays with PyTorch: same result or error
    elif case == "d0":
        args, routed = _cuda(*_qkv(2, 4, 200, 200, 0)), False
    else:
        q, k, _ = _cuda(*_qkv(1, 4, 200, 200, 64))  # batch stride 0, v in (B, S, H, D) memory
        v = torch.randn(3, 200, 4, 64, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
        args = [q.expand(3, -1, -1, -1), k.expand(3, -1, -1, -1), v]
    print(case, _compare_with_default(args, kwargs, expect_routed=routed))


@pytest.mark.cuda
def test_cuda_mask_only_requires_grad(restored):
    """q, k, v without grad, an additive mask with: SDPA's forward returns no logsumexp, the backward must
    still give the mask its gradient. PyTorch's own kernel is not run here: without pytorch#148476's fix it
    reads past the empty logsumexp, which would poison this process's CUDA context."""
    q, k, v = _cuda(*_qkv(2, 4, 200, 200, 64))
    bias = torch.randn(2, 4, 200, 200, device="cuda", dtype=torch.bfloat16)
    attention.activate_flash_attention_impl("flash_backend")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaf = bias.clone().requires_grad_()
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=leaf)
    go = torch.randn_like(out)
    out.backward(go)
    assert sdpa.calls["flash"] == 2, sdpa.calls
    sdpa.deactivate()
    ref_leaf = bias.float().requires_grad_()
    with sdpa_kernel(SDPBackend.MATH):
        F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=ref_leaf).backward(
            go.float()
        )
    torch.testing.assert_close(leaf.grad.float(), ref_leaf.grad, atol=2e-2, rtol=2e-2)
