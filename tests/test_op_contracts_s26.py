"""The public fused ops against their contract (review s26, CPU): zero-size dims, malformed varlen offsets,
fp64 gradients, odd layouts, partial requires_grad, grad modes, and the errors bad input must get.

Found here (each fixed in flash_backend/ops/, each test below fails without its fix):
- flash_attention with no keys (Sk = 0) raised IndexError from amax(); the backward of an empty batch
  (B = 0) raised from a view(..., -1) of an empty tensor; varlen with no keys likewise.
- flash_attention_varlen took cu_seqlens that do not start at 0, decrease, or end short of / past the packed
  tokens (a wrong result, an IndexError, or kernels reading past q/k/v); a v of another head dim failed inside
  the op after the work; a list for cu_seqlens raised AttributeError.
- flash_attention_varlen computed fp64 inputs in fp32 (its reference cast with .float(), and its backward used
  the fp32 logsumexp): gradcheck failed.
- linear_bias_gelu / linear_bias with K = 0 or N = 0, and linear_cross_entropy with K = 0, raised in a
  reshape(-1, 0) (the dense ones in the backward, after the forward had run).
- linear_cross_entropy took an integer loss_dtype (the loss silently truncated); non-tensor arguments to the
  dense, cross-entropy and norm ops raised AttributeError instead of naming the argument.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import flash_backend  # noqa: F401  (registers torch.ops.flash.*)
from flash_backend.ops.add_dropout_norm import add_dropout_norm
from flash_backend.ops.attention import flash_attention, flash_attention_varlen
from flash_backend.ops.cross_entropy import linear_cross_entropy
from flash_backend.ops.dense import linear_bias, linear_bias_gelu

OPS = torch.ops.flash


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, gen, dtype=torch.float32, requires_grad=False):
    return torch.randn(shape, generator=gen).to(dtype).requires_grad_(requires_grad)


def _sdpa_fp64(q, k, v, mask=None, scale=None, is_causal=False):
    """SDPA's math path in fp64 with GQA repeated out; a fully masked row gives 0 (the flash convention)."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    mask = mask.double() if mask is not None and mask.is_floating_point() else mask
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=is_causal)
    return out.nan_to_num(0.0)


def _grads(out, leaves, g):
    return torch.autograd.grad(out, leaves, g, allow_unused=True)


# --------------------------------------------------------------------------------------------------------
# flash_attention: zero-size dims
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk",
                         [(0, 4, 2, 5, 6), (2, 4, 2, 0, 6), (2, 4, 2, 5, 0), (0, 2, 2, 0, 0)],
                         ids=["batch0", "seq_q0", "seq_k0", "all0"])
def test_attention_zero_size_dims(B, Hq, Hkv, Sq, Sk, dtype):
    """SDPA gives zeros for rows with no keys and empty results for empty dims; so must the op, with
    gradients of the inputs' shapes (zeros: nothing flows). Sk = 0 raised IndexError from amax() and the
    backward of B = 0 from a view(..., -1) of an empty tensor."""
    gen = _gen()
    q = _randn(B, Hq, Sq, 16, gen=gen, dtype=dtype, requires_grad=True)
    k = _randn(B, Hkv, Sk, 16, gen=gen, dtype=dtype, requires_grad=True)
    v = _randn(B, Hkv, Sk, 24, gen=gen, dtype=dtype, requires_grad=True)
    out = flash_attention(q, k, v)
    assert out.shape == (B, Hq, Sq, 24) and out.dtype == dtype
    torch.testing.assert_close(out, torch.zeros_like(out) if Sk == 0 else _sdpa_fp64(q, k, v).to(dtype))
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    for g, t in zip(grads, (q, k, v), strict=True):
        assert g.shape == t.shape and g.dtype == t.dtype
        assert torch.count_nonzero(g) == 0  # an empty dim on either side: nothing to attend, no gradient


@pytest.mark.parametrize("B,Sq,Sk", [(0, 3, 5), (2, 3, 0), (2, 0, 5)], ids=["batch0", "seq_k0", "seq_q0"])
def test_attention_opcheck_zero_size(B, Sq, Sk):
    gen = _gen(1)
    q, k = _randn(B, 2, Sq, 8, gen=gen), _randn(B, 1, Sk, 8, gen=gen)
    v = _randn(B, 1, Sk, 16, gen=gen)
    args = (q, k, v, None, None, 0.0, 0.5, -1, -1, False)
    opcheck(OPS.attention_forward, tuple(a.detach().requires_grad_() if isinstance(a, torch.Tensor) else a
                                         for a in args))
    out, lse = OPS.attention_forward(*args)
    if Sk == 0:
        assert torch.isposinf(lse).all()  # every row is fully masked: lse = +inf, out = 0
    opcheck(OPS.attention_backward, (torch.randn_like(out), q, k, v, out, lse, None, None, 0.0, 0.5, -1, -1,
                                     False, False, False))


# --------------------------------------------------------------------------------------------------------
# flash_attention: values and gradients on odd sizes, scales, masks, layouts, partial requires_grad
# --------------------------------------------------------------------------------------------------------


def test_attention_gradcheck_fp64_mask_gqa_negative_scale():
    gen = _gen(2)
    q = _randn(1, 4, 3, 8, gen=gen, dtype=torch.float64, requires_grad=True)
    k = _randn(1, 2, 5, 8, gen=gen, dtype=torch.float64, requires_grad=True)
    v = _randn(1, 2, 5, 16, gen=gen, dtype=torch.float64, requires_grad=True)
    mask = _randn(3, 1, gen=gen, dtype=torch.float64, requires_grad=True)  # broadcast over keys and heads
    assert torch.autograd.gradcheck(lambda q, k, v, m: flash_attention(q, k, v, attn_mask=m, scale=-0.4),
                                    (q, k, v, mask))
    assert torch.autograd.gradcheck(
        lambda q, k, v: flash_attention(q, k, v, is_causal=True, causal_alignment="bottom_right",
                                        window_size=(1, -1)), (q, k, v))


@pytest.mark.parametrize("case", ["single_key", "single_query", "scale0", "scale_neg", "big_v", "tiny_qk"])
def test_attention_edge_values_and_grads_against_fp64(case):
    gen = _gen(3)
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 7, 11, 24
    Sk = 1 if case == "single_key" else Sk
    Sq = 1 if case == "single_query" else Sq
    q, k, v = (_randn(B, h, s, D, gen=gen) for h, s in ((Hq, Sq), (Hkv, Sk), (Hkv, Sk)))
    scale = {"scale0": 0.0, "scale_neg": -0.7}.get(case)
    if case == "big_v":
        v = v * 1e30
    if case == "tiny_qk":
        q, k = q * 1e-20, k * 1e-20
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = flash_attention(*leaves, scale=scale)
    ref = _sdpa_fp64(*leaves, scale=scale)
    err = lambda a, b: (a.double() - b).abs().max().item()
    assert err(out, ref) <= 1e-6 * v.abs().max().item()
    g = torch.randn(out.shape, generator=gen)
    # fp32 rounding bounds each gradient relative to the size of its terms (the exact dq, dk of a single key
    # are 0, and of scale 0 too: there the op must give 0 or rounding of that size, never more)
    size = g.abs().max().item() * v.abs().max().item() * abs(scale if scale is not None else D ** -0.5)
    terms = [size * k.abs().max().item(), size * q.abs().max().item(), g.abs().max().item()]
    for got, want, t in zip(_grads(out, leaves, g), _grads(ref, leaves, g.double()), terms, strict=True):
        assert err(got, want) <= 1e-5 * max(want.abs().max().item(), t), case


@pytest.mark.parametrize("mask_shape", [(11,), (7, 1), (), (2, 1, 1, 11), (1, 4, 1, 1)])
@pytest.mark.parametrize("grads_of", ["all", "mask_only", "v_and_mask"])
def test_attention_broadcast_mask_gradients(mask_shape, grads_of):
    """The gradient of a broadcast additive mask is summed back to the mask's own shape; inputs that do not
    require grad get none, and the rest are unchanged by that."""
    gen = _gen(4)
    q, k, v = _randn(2, 4, 7, 16, gen=gen), _randn(2, 2, 11, 16, gen=gen), _randn(2, 2, 11, 16, gen=gen)
    mask = _randn(*mask_shape, gen=gen, dtype=torch.float64)  # mask in fp64, q/k/v fp32: its dtype is kept
    wanted = {"all": (q, k, v, mask), "mask_only": (mask,), "v_and_mask": (v, mask)}[grads_of]
    for t in wanted:
        t.requires_grad_()
    out = flash_attention(q, k, v, attn_mask=mask)
    ref = _sdpa_fp64(q, k, v, mask)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    g = torch.randn(out.shape, generator=gen)
    got, want = _grads(out, wanted, g), _grads(ref, wanted, g.double())
    assert got[-1].shape == mask.shape and got[-1].dtype == torch.float64
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-5, rtol=1e-5)


def _layout(kind, B, H, S, D, gen):
    if kind == "offset_view":  # a view into a bigger buffer, at a storage offset
        base = _randn(3 * B * H * S * D + 5, gen=gen)
        return base[5 + B * H * S * D:].view(2, B, H, S, D)[1]
    if kind == "expanded_batch":
        return _randn(1, H, S, D, gen=gen).expand(B, -1, -1, -1)
    if kind == "bshd":
        return _randn(B, S, H, D, gen=gen).transpose(1, 2)
    if kind == "head_dim_strided":
        return _randn(B, H, D, S, gen=gen).transpose(-1, -2)
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["offset_view", "expanded_batch", "bshd", "head_dim_strided"])
def test_attention_strided_inputs_with_mask(kind):
    gen = _gen(5)
    q, k, v = (_layout(kind, 3, 2, s, 16, gen) for s in (9, 13, 13))
    assert not q.is_contiguous() or q.storage_offset() > 0
    keep = torch.rand(3, 1, 9, 13, generator=gen) > 0.3
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]  # detach keeps the layout
    out = flash_attention(*leaves, attn_mask=keep)
    ref = _sdpa_fp64(*leaves, keep)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    g = torch.randn(out.shape, generator=gen)
    for a, b in zip(_grads(out, leaves, g), _grads(ref, leaves, g.double()), strict=True):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("how", ["bool", "neg_inf_fp16_mask_grad", "dropout", "window"])
def test_attention_fully_masked_rows_zero_and_finite_gradients(how):
    gen = _gen(6)
    dtype = torch.float16 if how == "neg_inf_fp16_mask_grad" else torch.float32
    q, k, v = (_randn(1, 2, 6, 8, gen=gen, dtype=dtype, requires_grad=True) for _ in range(3))
    keep = torch.ones(6, 6, dtype=torch.bool)
    keep[2] = False
    kwargs, leaves, dead = {}, [q, k, v], [2]
    if how in ("bool", "dropout"):
        kwargs["attn_mask"] = keep
    if how == "dropout":
        kwargs["dropout_p"] = 0.5
    if how == "neg_inf_fp16_mask_grad":
        mask = torch.zeros(6, 6, dtype=dtype).masked_fill(~keep, float("-inf")).requires_grad_()
        kwargs["attn_mask"] = mask
        leaves.append(mask)
    if how == "window":  # bottom-right window (0, 0) with Sq > Sk: the first Sq - Sk rows see no key
        k2, v2 = (_randn(1, 2, 4, 8, gen=gen, requires_grad=True) for _ in range(2))
        leaves, dead = [q, k2, v2], [0, 1]
        kwargs.update(window_size=(0, 0), causal_alignment="bottom_right")
    out = flash_attention(*leaves[:3], **kwargs)
    assert torch.count_nonzero(out[:, :, dead]) == 0
    grads = torch.autograd.grad(out.float().sum(), leaves)
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.count_nonzero(grads[0][:, :, dead]) == 0  # a dead row's query gets no gradient
    if how == "neg_inf_fp16_mask_grad":
        assert torch.count_nonzero(grads[3][2]) == 0
        live = [0, 1, 3, 4, 5]
        ref = _sdpa_fp64(q, k, v, mask)
        torch.testing.assert_close(out[:, :, live].double(), ref[:, :, live], atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_attention_and_norm_under_grad_modes(mode):
    gen = _gen(7)
    q, k, v = (_randn(1, 2, 5, 8, gen=gen, requires_grad=True) for _ in range(3))
    x = _randn(3, 5, gen=gen, requires_grad=True)
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with ctx:
        out = flash_attention(q, k, v, is_causal=True)
        norm = add_dropout_norm(x, x, is_rms_norm=True)
        dense = linear_bias_gelu(x, x[:2], None)
    assert not out.requires_grad and not norm.requires_grad and not dense.requires_grad
    torch.testing.assert_close(out, flash_attention(q, k, v, is_causal=True).detach())
    torch.testing.assert_close(norm, F.rms_norm(2 * x, (5,), eps=1e-5).detach())
    torch.testing.assert_close(dense, F.gelu(F.linear(x, x[:2])).detach())


def test_attention_double_backward_is_an_error_not_zero():
    """Only a first-order backward is defined: a second one must raise, never return zeros."""
    q, k, v = (_randn(1, 1, 3, 8, gen=_gen(8), dtype=torch.float64, requires_grad=True) for _ in range(3))
    (dq,) = torch.autograd.grad(flash_attention(q, k, v).sum(), (q,), create_graph=True)
    with pytest.raises(RuntimeError, match="attention_backward"):
        torch.autograd.grad(dq.sum(), (q,))


# --------------------------------------------------------------------------------------------------------
# flash_attention_varlen
# --------------------------------------------------------------------------------------------------------


def _cu(*offsets):
    return torch.tensor(offsets, dtype=torch.int32)


def test_varlen_gradcheck_fp64():
    """fp64 in, fp64 math: the reference cast to fp32 and its backward used the fp32 logsumexp."""
    gen = _gen(9)
    cu_q, cu_k = _cu(0, 2, 2, 5), _cu(0, 3, 4, 6)
    q = _randn(5, 2, 8, gen=gen, dtype=torch.float64, requires_grad=True)
    k, v = (_randn(6, 1, 8, gen=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    for kwargs in (dict(is_causal=True), dict(window_size=(1, 0), causal_alignment="top_left", scale=-0.6)):
        assert torch.autograd.gradcheck(
            lambda q, k, v, kw=kwargs: flash_attention_varlen(q, k, v, cu_q, cu_k, 3, 3, **kw), (q, k, v))


@pytest.mark.parametrize("case", ["no_keys_at_all", "one_sequence_without_keys", "no_queries"])
def test_varlen_empty_sequences(case):
    """Sequences without keys give 0 (as flash_attention with Sk = 0), with finite zero gradients; Tk = 0
    raised from a view(..., -1) of an empty tensor in the backward."""
    gen = _gen(10)
    cu_q, cu_k = {"no_keys_at_all": (_cu(0, 3, 5), _cu(0, 0, 0)),
                  "one_sequence_without_keys": (_cu(0, 3, 5), _cu(0, 0, 4)),
                  "no_queries": (_cu(0, 0, 0), _cu(0, 2, 4))}[case]
    Tq, Tk = int(cu_q[-1]), int(cu_k[-1])
    q = _randn(Tq, 4, 8, gen=gen, requires_grad=True)
    k, v = (_randn(Tk, 2, 8, gen=gen, requires_grad=True) for _ in range(2))
    out = flash_attention_varlen(q, k, v, cu_q, cu_k, 3, 4)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn(out.shape, generator=gen))
    assert all(g.shape == t.shape and torch.isfinite(g).all() for g, t in zip(grads, (q, k, v), strict=True))
    for b in range(2):
        sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if sk.stop == sk.start:
            assert torch.count_nonzero(out[sq]) == 0 and torch.count_nonzero(grads[0][sq]) == 0
        elif sq.stop > sq.start:
            ref = _sdpa_fp64(*(t[s].detach().transpose(0, 1)[None] for t, s in ((q, sq), (k, sk), (v, sk))))
            torch.testing.assert_close(out[sq].double(), ref[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


_BAD_OFFSETS = {
    "not_from_zero": (_cu(1, 3, 10), _cu(0, 3, 10)),
    "decreasing": (_cu(0, 6, 3, 10), _cu(0, 3, 3, 10)),
    "ends_short": (_cu(0, 3, 8), _cu(0, 3, 10)),
    "ends_past": (_cu(0, 3, 10), _cu(0, 3, 12)),
}


@pytest.mark.parametrize("case", list(_BAD_OFFSETS))
def test_varlen_malformed_cu_seqlens_raise(case):
    """Offsets into the packed tokens start at 0, never decrease and end at the token count. Such offsets
    were taken silently (a wrong result), or raised an IndexError from inside the reference."""
    cu_q, cu_k = _BAD_OFFSETS[case]
    which = "q" if case in ("not_from_zero", "decreasing", "ends_short") else "k"
    q = torch.randn(10, 2, 8)
    with pytest.raises(RuntimeError, match=f"cu_seqlens_{which} must start at 0, never decrease"):
        flash_attention_varlen(q, q, q, cu_q, cu_k, 10, 10)


def test_varlen_malformed_cu_seqlens_raise_compiled():
    """The offsets check is a device-side assert (no sync): traced into a graph, it still raises."""
    q = torch.randn(10, 2, 8)
    compiled = torch.compile(flash_attention_varlen, backend="eager", fullgraph=True, dynamic=True)
    with pytest.raises(RuntimeError, match="cu_seqlens_k must start at 0, never decrease"):
        compiled(q, q, q, _cu(0, 4, 10), _cu(0, 4, 9), 6, 6)
    torch.testing.assert_close(compiled(q, q, q, _cu(0, 4, 10), _cu(0, 4, 10), 6, 6),
                               flash_attention_varlen(q, q, q, _cu(0, 4, 10), _cu(0, 4, 10), 6, 6))


@pytest.mark.parametrize("call,exc,match", [
    (lambda q, cu: flash_attention_varlen(q, q, torch.randn(10, 2, 16), cu, cu, 10, 10), ValueError,
     r"head_dim of v \(16\) must equal that of q \(8\)"),
    (lambda q, cu: flash_attention_varlen(q, q, q, [0, 10], cu, 10, 10), TypeError, "cu_seqlens_q must be"),
    (lambda q, cu: flash_attention_varlen(q, q, q, cu, cu[:0], 10, 10), ValueError, "cu_seqlens_k must be a "
     "non-empty"),
    (lambda q, cu: flash_attention_varlen(q, q, q, cu.long(), cu, 10, 10), ValueError,
     "cu_seqlens_q must be"),
])
def test_varlen_bad_arguments_are_named(call, exc, match):
    with pytest.raises(exc, match=match):
        call(torch.randn(10, 2, 8), _cu(0, 10))


def test_varlen_opcheck_fp64_with_an_empty_sequence():
    gen = _gen(11)
    q = _randn(3, 2, 8, gen=gen, dtype=torch.float64)
    k, v = (_randn(4, 1, 8, gen=gen, dtype=torch.float64) for _ in range(2))
    args = (_cu(0, 0, 3), _cu(0, 4, 4), 3, 4, None, 0.0, -0.3, -1, 0, True)
    opcheck(OPS.attention_varlen_forward, (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), *args))
    q, k, v = q.detach(), k.detach(), v.detach()
    out, lse = OPS.attention_varlen_forward(q, k, v, *args)
    opcheck(OPS.attention_varlen_backward, (torch.randn_like(out), q, k, v, out, lse, *args))


# --------------------------------------------------------------------------------------------------------
# Dense: zero-size K / N, layouts, partial requires_grad
# --------------------------------------------------------------------------------------------------------


def _dense_eager(fn, x, w, b):
    if fn is linear_bias:
        return F.linear(x, w, b)
    return F.gelu(F.linear(x, w, b), approximate="tanh")


@pytest.mark.parametrize("fn", [linear_bias, linear_bias_gelu], ids=["linear_bias", "linear_bias_gelu"])
@pytest.mark.parametrize("K,N", [(0, 5), (6, 0), (0, 0)])
def test_dense_zero_k_or_n(fn, K, N):
    """F.linear works (forward and backward) with K or N = 0; the op's backward raised in reshape(-1, 0)."""
    gen = _gen(12)
    x, w, b = _randn(2, 3, K, gen=gen, requires_grad=True), _randn(N, K, gen=gen, requires_grad=True), \
        _randn(N, gen=gen, requires_grad=True)
    call = (lambda x, w, b: fn(x, w, b, "tanh")) if fn is linear_bias_gelu else fn
    out, ref = call(x, w, b), _dense_eager(fn, x, w, b)
    torch.testing.assert_close(out, ref)
    g = torch.randn(out.shape, generator=gen)
    for a, e in zip(_grads(out, (x, w, b), g), _grads(ref, (x, w, b), g), strict=True):
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("K,N", [(0, 5), (6, 0)])
def test_dense_opcheck_zero_k_or_n(K, N):
    gen = _gen(13)
    x, w, b, pre, gy = (_randn(2, 3, K, gen=gen), _randn(N, K, gen=gen), _randn(N, gen=gen),
                        _randn(2, 3, N, gen=gen), _randn(2, 3, N, gen=gen))
    rg = lambda *ts: tuple(t.detach().requires_grad_() for t in ts)
    opcheck(OPS.dense_gelu_fwd, (*rg(x, w, b), "none"))
    opcheck(OPS.dense_bias_fwd, rg(x, w, b))
    opcheck(OPS.dense_gelu_inference, (x, w, b, "tanh"))
    opcheck(OPS.dense_gelu_bwd, (gy, x, w, pre, "none"))
    opcheck(OPS.dense_bias_bwd, (gy, x, w))


@pytest.mark.parametrize("layout", ["x_transposed", "w_transposed", "x_expanded", "offset_views"])
@pytest.mark.parametrize("grads_of", ["all", "bias_only", "weight_only"])
def test_dense_layouts_and_partial_grads_fp64(layout, grads_of):
    gen = _gen(14)
    f64 = dict(gen=gen, dtype=torch.float64)
    x, w, b = _randn(3, 5, 24, **f64), _randn(40, 24, **f64), _randn(40, **f64)
    if layout == "x_transposed":
        x = _randn(5, 3, 24, **f64).transpose(0, 1)
    if layout == "w_transposed":
        w = _randn(24, 40, **f64).t()
    if layout == "x_expanded":
        x = _randn(1, 5, 24, **f64).expand(3, 5, 24)
    if layout == "offset_views":
        base = _randn(3 * 5 * 24 + 40 * 24 + 40 + 7, **f64)
        x, w, b = base[7:367].view(3, 5, 24), base[367:1327].view(40, 24), base[1327:]
    leaves = {"all": (x, w, b), "bias_only": (b,), "weight_only": (w,)}[grads_of]
    leaves = [t.requires_grad_() for t in leaves]
    for fn in (linear_bias, linear_bias_gelu):
        out, ref = fn(x, w, b), (F.linear(x, w, b) if fn is linear_bias else F.gelu(F.linear(x, w, b)))
        torch.testing.assert_close(out, ref)
        g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        for a, e in zip(_grads(out, leaves, g), _grads(ref, leaves, g), strict=True):
            torch.testing.assert_close(a, e)


def test_dense_gradcheck_fp64_no_bias_tanh():
    gen = _gen(15)
    x = _randn(2, 3, 5, gen=gen, dtype=torch.float64, requires_grad=True)
    w = _randn(4, 5, gen=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: linear_bias_gelu(x, w, None, "tanh"), (x, w))
    assert torch.autograd.gradcheck(lambda x, w: linear_bias(x, w, None), (x, w))


# --------------------------------------------------------------------------------------------------------
# Linear + cross-entropy
# --------------------------------------------------------------------------------------------------------


def _ce_check(x, w, b, target, leaves, **kwargs):
    """Loss and logits (and the gradient of a loss using both) against F.linear + F.cross_entropy in fp64."""
    loss, logits = linear_cross_entropy(x, w, b, target, **kwargs)
    kwargs.pop("loss_dtype", None)
    ref_logits = F.linear(x.double(), w.double(), b.double() if b is not None else None)
    ref = F.cross_entropy(ref_logits.reshape(-1, w.shape[0]), target.reshape(-1), **kwargs)
    torch.testing.assert_close(loss.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits.double(), ref_logits, atol=1e-5, rtol=1e-5)
    gen = _gen(16)
    gl, gz = torch.randn(loss.shape, generator=gen), torch.randn(logits.shape, generator=gen)
    got = _grads((loss * gl).sum() + (logits * gz).sum(), leaves, None)
    want = _grads((ref * gl.double()).sum() + (ref_logits * gz.double()).sum(), leaves, None)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), e.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_zero_hidden_size(reduction):
    """K = 0: the logits are the bias; the op raised in x.reshape(-1, 0)."""
    gen = _gen(17)
    x, w, b = _randn(7, 0, gen=gen, requires_grad=True), _randn(9, 0, gen=gen, requires_grad=True), \
        _randn(9, gen=gen, requires_grad=True)
    target = torch.randint(0, 9, (7,), generator=gen)
    _ce_check(x, w, b, target, (x, w, b), reduction=reduction)
    opcheck(OPS.linear_cross_entropy_fwd, (x, w, b, target, -100, 0.1))


@pytest.mark.parametrize("case",
                         ["weight_transposed", "x_expanded_3d", "only_bias", "one_class", "smooth_ignore"])
def test_cross_entropy_layouts_and_partial_grads(case):
    gen = _gen(18)
    M, K, V = 6, 5, 11
    x, w, b = _randn(M, K, gen=gen), _randn(V, K, gen=gen), _randn(V, gen=gen)
    target = torch.randint(0, V, (M,), generator=gen)
    kwargs = {}
    if case == "weight_transposed":
        w = _randn(K, V, gen=gen).t()
    if case == "x_expanded_3d":  # x (B, S, K) with target (B, S)
        x, target = _randn(1, 3, K, gen=gen).expand(2, 3, K), target.view(2, 3)
    if case == "one_class":
        w, b, target = w[:1], b[:1], torch.zeros(M, dtype=torch.long)
    if case == "smooth_ignore":
        target[1] = 3
        kwargs = dict(ignore_index=3, label_smoothing=0.3, reduction="sum")
    leaves = (b,) if case == "only_bias" else (x, w, b)
    leaves = [t.detach().requires_grad_() for t in leaves]  # detach keeps expanded / transposed layouts
    if case == "only_bias":
        b = leaves[0]
    else:
        x, w, b = leaves
    _ce_check(x, w, b, target, leaves, **kwargs)


def test_cross_entropy_integer_loss_dtype_is_refused():
    x, w, target = torch.randn(4, 8), torch.randn(5, 8), torch.tensor([0, 1, 2, 3])
    with pytest.raises(TypeError, match="loss_dtype must be a floating-point dtype"):
        linear_cross_entropy(x, w, None, target, loss_dtype=torch.int64)


# --------------------------------------------------------------------------------------------------------
# add_dropout_norm
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("layout", ["x_transposed", "offset_views", "expanded", "n1"])
def test_norm_layouts_and_partial_grads(layout, rms):
    gen = _gen(19)
    M, N = 6, 37
    x, r, w, b = _randn(M, N, gen=gen), _randn(M, N, gen=gen), _randn(N, gen=gen), _randn(N, gen=gen)
    if layout == "x_transposed":
        x = _randn(N, M, gen=gen).t()
    if layout == "offset_views":
        base = _randn(2 * M * N + 2 * N + 3, gen=gen)
        x, r = base[3:3 + M * N].view(M, N), base[3 + M * N:3 + 2 * M * N].view(M, N)
        w, b = base[3 + 2 * M * N:3 + 2 * M * N + N], base[3 + 2 * M * N + N:]
    if layout == "expanded":
        x, w = _randn(1, N, gen=gen).expand(M, N), _randn(1, gen=gen).expand(N)
    if layout == "n1":
        x, r, w, b = x[:, :1], r[:, :1], w[:1], b[:1]
    b = None if rms else b
    leaves = [t.detach().requires_grad_() for t in (r, w)]  # x and bias without gradients
    r, w = leaves
    out = add_dropout_norm(x, r, w, b, is_rms_norm=rms)
    h = x.double() + r.double()
    n = h.shape[-1]
    if rms:
        ref = F.rms_norm(h, (n,), w.double(), 1e-5)
    else:
        ref = F.layer_norm(h, (n,), w.double(), b.double(), 1e-5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    g = torch.randn(out.shape, generator=gen)
    for a, e in zip(_grads(out, leaves, g), _grads(ref, leaves, g.double()), strict=True):
        torch.testing.assert_close(a.double(), e.double(), atol=1e-5, rtol=1e-5)


def test_norm_opcheck_backward_of_no_rows():
    x, r, w, b = torch.randn(0, 9), torch.randn(0, 9), torch.randn(9), torch.randn(9)
    seed = torch.tensor([3])
    fwd = (x, r, w, b, seed, 1e-5, 0.2, False, True, True)
    opcheck(OPS.add_dropout_norm_fwd, tuple(t.requires_grad_() if isinstance(t, torch.Tensor)
                                            and t.is_floating_point() else t for t in fwd))
    with torch.no_grad():
        _, h, mean, rstd = OPS.add_dropout_norm_fwd(*fwd)
    bwd = (torch.randn(0, 9), torch.randn(0, 9), h, w.detach(), b.detach(), mean, rstd, seed, 0.2, False,
           True, torch.float32, torch.float32)
    opcheck(OPS.add_dropout_norm_bwd, bwd)
    _, _, dw, db = OPS.add_dropout_norm_bwd(*bwd)
    assert torch.count_nonzero(dw) == 0 and torch.count_nonzero(db) == 0


# --------------------------------------------------------------------------------------------------------
# Non-tensor arguments are named, not an AttributeError
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("call,match", [
    (lambda x, w: linear_bias_gelu([1.0], w, None), "x must be a tensor"),
    (lambda x, w: linear_bias(x, w.tolist(), None), "weight must be a tensor"),
    (lambda x, w: linear_bias_gelu(x, w, [0.0] * 5), "bias must be a tensor"),
    (lambda x, w: linear_cross_entropy(x, w, None, [0, 1, 2]), "target must be a tensor"),
    (lambda x, w: linear_cross_entropy(x, w, (0.0,) * 5, torch.tensor([0, 1, 2])), "bias must be a tensor"),
    (lambda x, w: add_dropout_norm(x, x.tolist()), "residual must be a tensor"),
    (lambda x, w: add_dropout_norm(x, None, [1.0] * 8), "weight must be a tensor"),
])
def test_non_tensor_arguments_are_named(call, match):
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    with pytest.raises(TypeError, match=match):
        call(x, w)

