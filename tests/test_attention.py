"""flash::attention_* ops: reference vs fp64 math, op contract, errors, Triton kernels (interpreter, GPU)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import flash_backend  # noqa: F401
from flash_backend.ops.attention import (
    DROPOUT_PHILOX_ROUNDS,
    attention_backward_reference,
    attention_reference,
    attention_varlen_backward_reference,
    attention_varlen_reference,
    dropout_keep_mask,
    dropout_scale,
    dropout_threshold,
    flash_attention,
    flash_attention_varlen,
    philox_4x32,
)


def _qkv(B, Hq, Hkv, Sq, Sk, D, dtype=torch.float32, device="cpu", requires_grad=False):
    q = torch.randn(B, Hq, Sq, D, dtype=dtype, device=device)
    k = torch.randn(B, Hkv, Sk, D, dtype=dtype, device=device)
    v = torch.randn(B, Hkv, Sk, D, dtype=dtype, device=device)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def _math_fp64(q, k, v, mask=None, is_causal=False, scale=None, bottom_right=False, window=(-1, -1)):
    """Textbook attention in fp64 with explicit masks; fully masked rows -> 0 (our convention)."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    Sq, Sk = s.shape[-2:]
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask.double()
    i = torch.arange(Sq).view(-1, 1) + (Sk - Sq if bottom_right else 0)
    j = torch.arange(Sk).view(1, -1)
    left, right = window
    if is_causal:
        right = 0
    if left >= 0:
        s = s.masked_fill(j < i - left, -math.inf)
    if right >= 0:
        s = s.masked_fill(j > i + right, -math.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v


# ---------------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("is_causal,bottom_right,window", [
    (False, False, (-1, -1)), (True, False, (-1, -1)), (True, True, (-1, -1)), (False, True, (16, 8)),
    (True, False, (20, -1)),
])
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2)])
def test_reference_matches_fp64(is_causal, bottom_right, window, Hq, Hkv):
    q, k, v = _qkv(2, Hq, Hkv, 97, 113, 40, dtype=torch.float64)
    out = flash_attention(q, k, v, is_causal=is_causal, window_size=window,
                          causal_alignment="bottom_right" if bottom_right else "top_left")
    ref = _math_fp64(q, k, v, is_causal=is_causal, bottom_right=bottom_right, window=window)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


def test_reference_matches_sdpa_and_its_gradients():
    q, k, v = _qkv(2, 4, 2, 97, 113, 64, dtype=torch.float64, requires_grad=True)
    mask = torch.randn(1, 4, 97, 113, dtype=torch.float64, requires_grad=True)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    out = flash_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    g = torch.randn_like(ref)
    grads = torch.autograd.grad(out, (q, k, v, mask), g), torch.autograd.grad(ref, (q, k, v, mask), g)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_bool_mask_broadcast_and_fully_masked_rows():
    q, k, v = _qkv(2, 3, 3, 33, 45, 32, requires_grad=True)
    mask = torch.rand(2, 1, 33, 45) > 0.5
    mask[:, :, 5] = False  # fully masked rows
    out = flash_attention(q, k, v, attn_mask=mask)
    ref = _math_fp64(q, k, v, mask=mask)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert (out[:, :, 5] == 0).all()
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


def test_gradcheck_fp64_bias_gqa_window():
    q, k, v = _qkv(1, 2, 1, 9, 11, 8, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(1, 1, 9, 11, dtype=torch.float64, requires_grad=True)
    # lse is kept in fp32 by the op, so gradcheck runs on the fp64 reference through autograd instead.
    f = lambda q, k, v, b: attention_reference(q, k, v, b, window_left=3, window_right=1)[0]
    assert torch.autograd.gradcheck(f, (q, k, v, bias))
    out, lse = attention_reference(q, k, v, bias, window_left=3, window_right=1)
    g = torch.randn_like(out)
    ours = attention_backward_reference(g, q, k, v, out, lse, bias, window_left=3, window_right=1,
                                        compute_dbias=True)
    auto = torch.autograd.grad(out, (q, k, v, bias), g)
    for a, b in zip(ours, auto, strict=True):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def test_philox_matches_random123_known_answer():
    # Random123's kat_vectors, philox4x32 10 rounds, counter 0 and key 0: pins the word order too
    words = philox_4x32(torch.tensor([0]), torch.tensor([0]), torch.tensor([0]))
    assert [int(w) for w in words] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    # ...and philox4x32 7 rounds, the attention dropout's (DROPOUT_PHILOX_ROUNDS)
    words = philox_4x32(torch.tensor([0]), torch.tensor([0]), torch.tensor([0]), rounds=DROPOUT_PHILOX_ROUNDS)
    assert [int(w) for w in words] == [0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48]


def test_dropout_statistics_and_reproducibility():
    q, k, v = _qkv(2, 4, 4, 64, 64, 16)
    torch.manual_seed(5)
    a = flash_attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(5)
    b = flash_attention(q, k, v, dropout_p=0.3)
    assert torch.equal(a, b)
    keep = dropout_keep_mask(torch.randint(0, 2**62, (1,)), 0.3, 4, 8, 128, 128, "cpu")
    assert abs(keep.float().mean().item() - 0.7) < 0.005
    # each of the 8 halves one Philox call serves (key j % 8), and rows, are drawn alike
    by_half = keep.view(4, 8, 128, 16, 8).float().mean((0, 1, 2, 3))
    assert (by_half - 0.7).abs().max() < 0.01, by_half
    assert abs(keep[..., 0::2].float().mean() - keep[..., 1::2].float().mean()) < 0.005
    # neighbouring keys share a Philox call but not their bits: no correlation between halves
    pair = keep.view(-1, 2).float()
    assert abs((pair[:, 0] * pair[:, 1]).mean().item() - 0.49) < 0.005
    # unbiased: the mean over many seeds approaches the no-dropout output
    outs = torch.stack([flash_attention(q, k, v, dropout_p=0.3) for _ in range(200)]).mean(0)
    ref = flash_attention(q, k, v)
    assert (outs - ref).abs().mean() < 0.03


def test_dropout_gradients_match_autograd_of_reference():
    q, k, v = _qkv(1, 2, 2, 17, 23, 8, dtype=torch.float64, requires_grad=True)
    seed = torch.tensor([123456789012])
    out, lse = attention_reference(q, k, v, None, seed, 0.25)
    g = torch.randn_like(out)
    ours = attention_backward_reference(g, q, k, v, out, lse, None, seed, 0.25)[:3]
    for a, b in zip(ours, torch.autograd.grad(out, (q, k, v), g), strict=True):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("p", [0.1, 0.3, 0.1 + 0.49 / 65536, 1e-6, 0.999999])
def test_dropout_p_quantisation_keeps_output_unbiased(p):
    t = dropout_threshold(p)
    assert 0 <= t <= 65535 and (abs(t - p * 65536) <= 0.5 or t in (0, 65535))
    # exactly (65536 - t) of the 65536 equally likely 16-bit halves are kept: scale * P(keep) == 1
    kept = (torch.arange(65536) >= t).sum().item()
    assert kept == 65536 - t
    assert abs(dropout_scale(p) * kept / 65536 - 1.0) < 1e-15
    # the reference applies that scale, not 1 / (1 - p): kept probabilities are scaled exactly by it
    q, k, v = _qkv(1, 2, 2, 17, 23, 8, dtype=torch.float64)
    seed = torch.tensor([987654321])
    out, _ = attention_reference(q, k, v, None, seed, p)
    keep = dropout_keep_mask(seed, p, 1, 2, 17, 23, "cpu")
    probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), -1)
    torch.testing.assert_close(out, (probs * keep * dropout_scale(p)) @ v, atol=1e-12, rtol=1e-12)


def test_dropout_tiny_p_keeps_everything():
    # p below 2**-17 quantises to 0: no element dropped, scale 1, the output is the no-dropout one
    q, k, v = _qkv(1, 2, 2, 17, 23, 8, dtype=torch.float64)
    out, _ = attention_reference(q, k, v, None, torch.tensor([3]), 1e-6)
    torch.testing.assert_close(out, attention_reference(q, k, v)[0], atol=0, rtol=0)


def test_transposed_layout_kept_without_copies():
    q = torch.randn(2, 33, 4, 64).transpose(1, 2)
    k = torch.randn(2, 40, 4, 64).transpose(1, 2)
    v = torch.randn(2, 40, 4, 64).transpose(1, 2)
    out = flash_attention(q, k, v)
    assert out.stride() == q.stride()
    torch.testing.assert_close(out.double(), _math_fp64(q, k, v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bottom_right", [False, True])
def test_varlen_matches_per_sequence(bottom_right):
    lens_q, lens_k = [30, 1, 66], [50, 7, 56]
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32)
    q = torch.randn(sum(lens_q), 4, 32, requires_grad=True)
    k = torch.randn(sum(lens_k), 2, 32, requires_grad=True)
    v = torch.randn(sum(lens_k), 2, 32, requires_grad=True)
    align = "bottom_right" if bottom_right else "top_left"
    out = flash_attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), is_causal=True,
                                 causal_alignment=align)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    for b in range(3):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        qs, ks, vs = (t[s].detach().transpose(0, 1)[None].requires_grad_()
                      for t, s in ((q, sq), (k, sk), (v, sk)))
        ref = flash_attention(qs, ks, vs, is_causal=True, causal_alignment=align)
        torch.testing.assert_close(out[sq], ref[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
        rg = torch.autograd.grad(ref, (qs, ks, vs), g[sq].transpose(0, 1)[None])
        for got, want, s in zip(grads, rg, (sq, sk, sk), strict=True):
            torch.testing.assert_close(got[s], want[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_cpu(dtype):
    q, k, v = _qkv(2, 4, 2, 37, 29, 16, dtype=dtype)
    mask = torch.randn(1, 4, 37, 29, dtype=dtype)
    seed = torch.tensor([77])
    qt = torch.randn(2, 37, 4, 16, dtype=dtype).transpose(1, 2)
    cases = [(q, k, v, mask, seed, 0.2, 0.125, -1, 0, True), (qt, k, v, None, None, 0.0, 0.3, 4, 2, False)]
    for args in cases:
        opcheck(torch.ops.flash.attention_forward, args)
        opcheck(torch.ops.flash.attention_forward, tuple(a.requires_grad_() if isinstance(a, torch.Tensor)
                                                         and a.is_floating_point() else a for a in args))
        args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        out, lse = torch.ops.flash.attention_forward(*args)
        mask_arg = args[3]
        opcheck(torch.ops.flash.attention_backward,
                (torch.randn_like(out), *args[:3], out, lse, *args[3:], mask_arg is not None, False))
    cu = torch.tensor([0, 10, 37], dtype=torch.int32)
    qv = torch.randn(2, 37, 4, 16, dtype=dtype)[1]
    kv, vv = torch.randn(2, 37, 2, 16, dtype=dtype).unbind(0)
    varlen_args = (cu, cu, 27, 27, seed, 0.1, 0.25, -1, 0, True)
    opcheck(torch.ops.flash.attention_varlen_forward, (qv, kv, vv, *varlen_args))
    out, lse = torch.ops.flash.attention_varlen_forward(qv, kv, vv, *varlen_args)
    opcheck(torch.ops.flash.attention_varlen_backward,
            (torch.randn_like(out), qv, kv, vv, out, lse, *varlen_args))


def test_compile_fullgraph_matches_eager():
    q, k, v = _qkv(2, 4, 2, 33, 47, 32, requires_grad=True)
    mask = torch.randn(2, 1, 33, 47, requires_grad=True)
    f = lambda q, k, v, m: flash_attention(q, k, v, attn_mask=m)
    out = torch.compile(f, fullgraph=True, dynamic=False)(q, k, v, mask)
    ref = f(q, k, v, mask)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, mask), g), torch.autograd.grad(ref, (q, k, v, mask), g)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("call,match", [
    (lambda q, k, v: flash_attention(q.half(), k, v), "share a dtype"),
    (lambda q, k, v: flash_attention(q.int(), k.int(), v.int()), "q.dtype"),
    (lambda q, k, v: flash_attention(q[..., :12], k[..., :12], v[..., :12]), "multiple of 8"),
    (lambda q, k, v: flash_attention(*(torch.randn(1, 2, 4, 264),) * 3), "at most 256"),
    (lambda q, k, v: flash_attention(q[:, :3], k[:, :2], v[:, :2]), "divisible"),
    (lambda q, k, v: flash_attention(q, k, v, attn_mask=torch.ones(3, 5, dtype=torch.bool)), "broadcastable"),
    (lambda q, k, v: flash_attention(q, k, v, dropout_p=1.0), "dropout_p"),
    (lambda q, k, v: flash_attention(q, k, v, causal_alignment="center"), "causal_alignment"),
    (lambda q, k, v: flash_attention(q, k, v, window_size=(-2, 0)), "window_size"),
    (lambda q, k, v: flash_attention(q, k, v[:, :, :5]), "sequence lengths"),
    (lambda q, k, v: flash_attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.int64)), "attn_mask"),
    (lambda q, k, v: flash_attention(q, k.to("meta"), v), "one device"),
])
def test_errors_name_the_argument(call, match):
    q, k, v = _qkv(1, 4, 4, 8, 8, 16)
    with pytest.raises((ValueError, TypeError), match=match):
        call(q, k, v)


# ------------------------------------------------------------------------- Triton kernels, interpreter


INTERPRET_CASES = {
    "gqa_odd": dict(Hq=2, Hkv=1, Sq=37, Sk=45, D=40),
    "causal": dict(Sq=37, Sk=45, wr=0),
    "causal_bottom_right": dict(Sq=45, Sk=37, wr=0, br=True),
    "window": dict(Sq=64, Sk=64, wl=10, wr=3),
    "bias_grad": dict(Sq=37, Sk=45, bias=True),
    "bool_mask_empty_rows": dict(Sq=37, Sk=45, bool_mask=True),
    "padding_bias_grad": dict(Sq=37, Sk=45, bias=True, bias_shape=(1, 1, 1, 45)),
    "dropout_causal_gqa": dict(Hq=4, Hkv=2, Sq=37, Sk=45, wr=0, p=0.3),
    # query-broadcast (B, 1, 1, Sk) masks: key blocks of 32 dead for every query are skipped (see
    # _padding_mask); with dropout the dK/dV tile is queries-major with the mask row applied
    "padding_bool_dropout": dict(Hq=4, Hkv=2, Sq=37, Sk=100, p=0.3, padding="bool"),
    "padding_additive_dropout": dict(Sq=37, Sk=100, p=0.3, padding="additive"),
    "padding_additive_zero_dropout": dict(Sq=37, Sk=100, p=0.3, padding="additive_zero"),
    "padding_bool_causal": dict(Sq=100, Sk=100, wr=0, padding="bool"),
}


def _padding_mask(kind: str, B: int, Sk: int, dtype=torch.float16) -> torch.Tensor:
    """(B, 1, 1, Sk) masks whose dead keys fill whole 32-key blocks in some rows: right padding (keys
    65..99), left padding (0..62), a dead block in the middle (32..63, live keys on both sides), and a row
    with no live key: zeros for a bool mask. Additive masks carry -inf on dead keys and random finite
    values ("additive") or zeros ("additive_zero") on live ones, and their last row is one finite value
    everywhere, as transformers' finfo.min rows: a plain softmax, never skipped (-30 here: at finfo.min,
    fp32 keeps too few bits of score + mask for the kernel and the reference to round alike)."""
    live = torch.zeros(B, Sk, dtype=torch.bool)
    live[0, :65] = True  # the last live key opens a block, the first live key ends one:
    live[1, 63:] = True  # a range off by one key loses a whole block
    live[2, 10:20] = True
    live[2, 80:90] = True
    if kind == "bool":
        return live.view(B, 1, 1, Sk)
    mask = torch.randn(B, Sk) if kind == "additive" else torch.zeros(B, Sk)
    mask = mask.masked_fill(~live, float("-inf"))
    mask[3] = -30.0
    return mask.to(dtype).view(B, 1, 1, Sk)


# backward variants: the dK/dV config, atomic dQ. A pair of dK/dV configs splits the work in a dV-only and
# a dK-only launch (the head_dim 256 default, SPLIT_DKDV_CONFIGS).
JOINT_DKDV, SPLIT_DKDV = (16, 32, 4, 2), ((16, 32, 4, 2), (32, 32, 4, 2))
BWD_VARIANTS = {
    "dq_kernel": (JOINT_DKDV, False),
    "atomic_dq": (JOINT_DKDV, True),
    "split_dkdv": (SPLIT_DKDV, False),
}


@pytest.mark.interpret
@pytest.mark.parametrize("variant", list(BWD_VARIANTS))
@pytest.mark.parametrize("case", list(INTERPRET_CASES))
def test_kernels_under_interpreter(interpreter, case, variant):
    from flash_backend.kernels.attention_bwd import attention_backward_launch
    from flash_backend.kernels.attention_fwd import attention_forward_launch

    c = dict(B=1, Hq=2, Hkv=2, D=32, wl=-1, wr=-1, br=False, p=0.0, bias=False, bool_mask=False,
             bias_shape=None, padding=None)
    c.update(INTERPRET_CASES[case])
    if c["padding"]:
        c["B"] = 4
    q, k, v = _qkv(c["B"], c["Hq"], c["Hkv"], c["Sq"], c["Sk"], c["D"], dtype=torch.float16)
    mask = _padding_mask(c["padding"], c["B"], c["Sk"]) if c["padding"] else None
    if c["bias"]:
        mask = torch.randn(c["bias_shape"] or (1, c["Hq"], c["Sq"], c["Sk"]), dtype=torch.float16)
    if c["bool_mask"]:
        mask = torch.rand(1, 1, c["Sq"], c["Sk"]) > 0.5
        mask[..., 3, :] = False
    seed = torch.randint(0, 2**62, (1,)) if c["p"] else None
    args = (mask, seed, c["p"], 0.3, c["wl"], c["wr"], c["br"])
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3])
    attention_forward_launch(q, k, v, *args, out, lse, config=(32, 32, 4, 2))
    ref_out, ref_lse = attention_reference(q, k, v, *args)
    torch.testing.assert_close(out, ref_out, atol=2e-3, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=0)
    dout = torch.randn_like(q)
    grads = [torch.empty_like(t) for t in (q, k, v)] + [torch.empty_like(mask) if c["bias"] else None]
    dkdv_config, atomic_dq = BWD_VARIANTS[variant]
    attention_backward_launch(dout, q, k, v, ref_out, ref_lse, *args, *grads,
                              config=(dkdv_config, (32, 32, 4, 2)), atomic_dq=atomic_dq)
    ref = attention_backward_reference(dout, q, k, v, ref_out, ref_lse, *args, compute_dbias=c["bias"])
    for got, want in zip(grads, ref, strict=True):
        if want is not None:
            torch.testing.assert_close(got.float(), want.float(), atol=5e-3, rtol=2e-3)


@pytest.mark.interpret
@pytest.mark.parametrize("atomic_dq", [False, True])
def test_causal_launch_groups_under_interpreter(interpreter, monkeypatch, atomic_dq):
    """Causal launches in groups of (batch, head) pairs (attention_fwd._grid_ids with GROUP_CTAS, which the
    GPU's launches take from causal_group_ctas): every block of every pair computed once, against the
    reference. 4 query / key blocks a pair and groups of 5 programs: 2 pairs a group, the dK / dV launch's
    3 (batch, kv head) pairs end in a group of one."""
    from flash_backend.kernels import attention_bwd, attention_fwd

    groups = []

    def group_ctas(device, causal, bh_on_x):
        groups.append(causal and not bh_on_x)
        return 5 if causal and not bh_on_x else 0

    monkeypatch.setattr(attention_fwd, "causal_group_ctas", group_ctas)
    monkeypatch.setattr(attention_bwd, "causal_group_ctas", group_ctas)
    q, k, v = _qkv(3, 2, 1, 100, 100, 32, dtype=torch.float16)
    args = (None, None, 0.0, 0.3, -1, 0, False)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3])
    attention_fwd.attention_forward_launch(q, k, v, *args, out, lse, config=(32, 32, 4, 2))
    ref_out, ref_lse = attention_reference(q, k, v, *args)
    torch.testing.assert_close(out, ref_out, atol=2e-3, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=0)
    dout = torch.randn_like(q)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    attention_bwd.attention_backward_launch(dout, q, k, v, ref_out, ref_lse, *args, *grads, None,
                                            config=(JOINT_DKDV, (32, 32, 4, 2)), atomic_dq=atomic_dq)
    ref = attention_backward_reference(dout, q, k, v, ref_out, ref_lse, *args, compute_dbias=False)
    for got, want in zip(grads, ref[:3], strict=True):  # ref[3]: no bias gradient
        torch.testing.assert_close(got.float(), want.float(), atol=5e-3, rtol=2e-3)
    assert groups == [True] * (2 if atomic_dq else 3)  # the forward, dK / dV (and dQ) launches


def test_causal_group_ctas(monkeypatch):
    """GROUP_CTAS: CAUSAL_GROUP_WAVES waves of the GPU's SMs for a causal launch; 0 (the plain order)
    otherwise, on the CPU (the interpreter) and for a swapped grid (bh_grid)."""
    from flash_backend.kernels import attention_fwd

    monkeypatch.setattr(attention_fwd, "sm_count", lambda device: 132)
    cuda = torch.device("cuda", 0)
    assert attention_fwd.causal_group_ctas(cuda, True, False) == attention_fwd.CAUSAL_GROUP_WAVES * 132
    assert attention_fwd.causal_group_ctas(cuda, False, False) == 0
    assert attention_fwd.causal_group_ctas(cuda, True, True) == 0
    assert attention_fwd.causal_group_ctas(torch.device("cpu"), True, False) == 0


def test_short_keys_tile_rule():
    """The short-keys tile only where it was measured faster (short keys, head_dim <= 64, no causal mask, mask
    or dropout), and never from a symbolic length that would need a guard (no recompile for it)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from flash_backend.kernels.attention_fwd import SHORT_KEYS_MAX, short_keys_tile

    assert short_keys_tile(64, False, False, False, 197)
    assert short_keys_tile(32, False, False, False, SHORT_KEYS_MAX)
    assert not short_keys_tile(64, False, False, False, SHORT_KEYS_MAX + 1)
    assert not short_keys_tile(64, False, False, False, 256)  # whole 64-key blocks: measured 0.99x
    assert short_keys_tile(64, False, False, False, 257) and short_keys_tile(64, False, False, False, 288)
    assert not short_keys_tile(64, False, False, False, 289)
    assert not short_keys_tile(128, False, False, False, 197)
    assert not short_keys_tile(64, True, False, False, 197)
    assert not short_keys_tile(64, False, True, False, 197)
    assert not short_keys_tile(64, False, False, True, 197)
    env = ShapeEnv()
    seq_k = env.create_symintnode(env.create_symbol(197, source=ConstantSource("seq_k")), hint=197)
    assert not short_keys_tile(64, False, False, False, seq_k)
    assert not env.guards


@pytest.mark.interpret
@pytest.mark.parametrize("Sq, Sk", [(37, 45), (130, 70)])
def test_short_keys_tile_under_interpreter(interpreter, Sq, Sk):
    from flash_backend.kernels.attention_fwd import SHORT_KEYS_FWD_CONFIG, attention_forward_launch

    q, k, v = _qkv(1, 2, 2, Sq, Sk, 32, dtype=torch.float16)
    args = (None, None, 0.0, 0.3, -1, -1, False)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3])
    attention_forward_launch(q, k, v, *args, out, lse, config=SHORT_KEYS_FWD_CONFIG)
    ref_out, ref_lse = attention_reference(q, k, v, *args)
    torch.testing.assert_close(out, ref_out, atol=2e-3, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=0)


@pytest.mark.interpret
def test_mask_key_ranges_under_interpreter(interpreter):
    """The live key range of each mask row: first live key, last live key + 1; (0, 0) for a row with none.
    A key is dead when the kernels' _apply_mask makes its score -inf: False, -inf, or a finfo.min that
    overflows once scaled to base 2 in fp32 (bf16's, fp32's); fp16's finfo.min and other finite values
    stay live (a row of them is a plain softmax)."""
    from torch.library import wrap_triton

    from flash_backend.kernels.attention_fwd import _mask_args, mask_key_ranges

    Sk = 70
    live = torch.zeros(4, Sk, dtype=torch.bool)
    live[0, :33] = True
    live[1, 40:] = True
    live[2, 5] = True
    live[2, 64] = True  # a hole of dead keys inside the range does not narrow it
    expected = torch.tensor([[0, 33], [40, Sk], [5, 65], [0, 0]], dtype=torch.int32)
    masks = [live]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for dead in (float("-inf"), torch.finfo(dtype).min):
            masks.append(torch.randn(4, Sk).to(dtype).masked_fill(~live, dead))
    for mask in masks:
        mask4 = mask.view(4, 1, 1, Sk)
        _, strides, _, is_bool = _mask_args(mask4, None)
        ranges, range_strides = mask_key_ranges(mask4, strides, Sk, is_bool, wrap_triton)
        assert range_strides == (2, 0)
        fp16_min = mask.dtype == torch.float16 and mask.min() == torch.finfo(torch.float16).min
        if fp16_min:  # finite in base 2: every key live
            assert ranges.tolist() == [[0, Sk]] * 4
        else:
            assert torch.equal(ranges, expected), (mask.dtype, ranges)
    # broadcast over batch, one row per head
    mask = torch.zeros(1, 3, 1, Sk).masked_fill(~live[:3].view(1, 3, 1, Sk), float("-inf"))
    ranges, range_strides = mask_key_ranges(mask, _mask_args(mask, None)[1], Sk, False, wrap_triton)
    assert range_strides == (0, 2) and torch.equal(ranges, expected[:3])


@pytest.mark.interpret
@pytest.mark.parametrize("layout", ["padding", "tile"])
def test_mask_speed_switches_change_nothing_under_interpreter(interpreter, monkeypatch, layout):
    """Key-range narrowing and mask prefetch (attention_fwd's switches) give bitwise the same forward and
    gradients as neither, with padding rows (whole dead key blocks at either end) and full mask tiles."""
    from flash_backend.kernels import attention_fwd
    from flash_backend.kernels.attention_bwd import attention_backward_launch

    B, H, Sq, Sk, D = 4, 2, 37, 100, 32
    q, k, v = _qkv(B, H, H, Sq, Sk, D, dtype=torch.float16)
    mask = _padding_mask("additive", B, Sk)
    if layout == "tile":
        mask = mask.expand(B, 1, Sq, Sk).clone()
        mask[:, :, 5, 40:] = float("-inf")
    dout = torch.randn_like(q)
    results = []
    for combo in [(False, False, False), (True, True, True), (True, False, False), (False, True, True)]:
        switches = ("NARROW_PADDING_KEYS", "PREFETCH_MASK_ROWS", "PREFETCH_MASK_TILES")
        for name, value in zip(switches, combo, strict=True):
            monkeypatch.setattr(attention_fwd, name, value)
        args = (mask, None, 0.0, 0.3, -1, -1, False)
        out, lse = torch.empty_like(q), torch.empty(q.shape[:3])
        attention_fwd.attention_forward_launch(q, k, v, *args, out, lse, config=(32, 32, 4, 2))
        grads = [torch.empty_like(t) for t in (q, k, v)]
        attention_backward_launch(dout, q, k, v, out, lse, *args, *grads, None,
                                  config=((16, 32, 4, 2), (32, 32, 4, 2)), atomic_dq=False)
        results.append([out, lse, *grads])
    ref_out, _ = attention_reference(q, k, v, mask, None, 0.0, 0.3)
    torch.testing.assert_close(results[0][0], ref_out, atol=2e-3, rtol=0)
    for got in results[1:]:
        for a, b in zip(got, results[0], strict=True):
            assert torch.equal(a, b)


def _kernel_dropout_masks(B, Hq, Hkv, Sq, Sk, D, p, device, fwd_config=None, bwd_config=None,
                          atomic_dq=False):
    """The keep-masks the three kernels apply (forward, dK/dV, dQ), read back through probe inputs, and the
    reference's mask for the same seed; all (B, Hq, Sq, Sk) bool.

    q = 0 makes every probability 1 / Sk, k = v = I puts key j on column j (D >= Sq, Sk), so
    out[i, j] = keep_ij * scale / Sk. With dO_i = 2**g * e_i for the g-th q head of a kv group,
    dV[j, i] = scale / Sk * sum_g 2**g keep^g_ij. With dO = 1, dQ[i, j] = sm_scale / Sk * (keep_ij * scale
    - delta_i), delta_i = scale * (kept in row i) / Sk: > 0 exactly on kept elements.
    """
    from flash_backend.kernels.attention_bwd import attention_backward_launch
    from flash_backend.kernels.attention_fwd import attention_forward_launch

    G = Hq // Hkv
    q = torch.zeros(B, Hq, Sq, D, dtype=torch.float16, device=device)
    k = torch.eye(Sk, D, dtype=torch.float16, device=device).expand(B, Hkv, Sk, D).contiguous()
    v = k.clone()
    seed = torch.randint(0, 2**62, (1,), device=device)
    args = (None, seed, p, 0.5, -1, -1, False)
    out, lse = torch.empty_like(q), torch.empty(B, Hq, Sq, device=device)
    attention_forward_launch(q, k, v, *args, out, lse, config=fwd_config)
    unit = dropout_scale(p) / Sk
    fwd = out[..., :Sk].float() > unit / 2
    weights = 2.0 ** (torch.arange(Hq, device=device) % G).view(1, Hq, 1, 1)
    dout = (torch.eye(Sq, D, device=device) * weights).expand(B, Hq, Sq, D).half().contiguous()
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    attention_backward_launch(dout, q, k, v, out, lse, *args, dq, dk, dv, None, config=bwd_config,
                              atomic_dq=atomic_dq)
    n = (dv[..., :Sq].float() / unit).round().long()  # (B, Hkv, Sk, Sq): sum_g 2**g keep^g
    assert ((n >= 0) & (n < 2**G)).all()
    dkdv = torch.stack([(n >> g) & 1 for g in range(G)], 2).view(B, Hq, Sk, Sq).transpose(-1, -2).bool()
    dout = torch.ones_like(q)
    attention_backward_launch(dout, q, k, v, out, lse, *args, dq, dk, dv, None, config=bwd_config,
                              atomic_dq=atomic_dq)
    return dropout_keep_mask(seed, p, B, Hq, Sq, Sk, device), fwd, dkdv, dq[..., :Sk] > 0


@pytest.mark.interpret
@pytest.mark.parametrize("variant", list(BWD_VARIANTS))
def test_kernels_drop_the_reference_elements_under_interpreter(interpreter, variant):
    # Sk = 45: 4 * ceil(Sk / 32) = 8 Philox calls per query row, keys 32..44 a partial 32-key span; key
    # blocks of 32 in all three kernels, the second one partial; GQA: the dK/dV kernel walks both q heads.
    dkdv_config, atomic_dq = BWD_VARIANTS[variant]
    want, *got = _kernel_dropout_masks(2, 2, 1, 37, 45, 48, 0.3, "cpu", fwd_config=(32, 32, 4, 2),
                                       bwd_config=(dkdv_config, (32, 32, 4, 2)), atomic_dq=atomic_dq)
    assert abs(want.float().mean().item() - 0.7) < 0.05
    for name, mask in zip(("forward", "dK/dV", "dQ"), got, strict=True):
        assert torch.equal(mask, want), f"{name}: {(mask != want).sum().item()} elements differ"


@pytest.mark.interpret
@pytest.mark.parametrize("atomic_dq", [False, True], ids=["dq_kernel", "atomic_dq"])
def test_varlen_kernels_dropout_under_interpreter(interpreter, atomic_dq):
    # Positions and lengths inside each sequence key the RNG; probe inputs as in _kernel_dropout_masks
    # make one differing element move out or a gradient by >= scale / len_k (~0.03).
    from flash_backend.kernels.attention_bwd import attention_varlen_backward_launch
    from flash_backend.kernels.attention_fwd import attention_varlen_forward_launch

    lens_q, lens_k = [37, 5, 20], [45, 13, 20]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32)
    pos_k = torch.cat([torch.arange(n) for n in lens_k])
    q = torch.zeros(sum(lens_q), 2, 48, dtype=torch.float16)
    k = torch.nn.functional.one_hot(pos_k, 48).half()[:, None].contiguous()
    v = k.clone()
    seed = torch.randint(0, 2**62, (1,))
    args = (cu_q, cu_k, max(lens_q), max(lens_k), seed, 0.3, 0.5, -1, -1, False)
    out, lse = torch.empty_like(q), torch.empty(2, sum(lens_q))
    attention_varlen_forward_launch(q, k, v, *args, out, lse, config=(32, 32, 4, 2))
    ref_out, ref_lse = attention_varlen_reference(q, k, v, *args[:2], *args[4:])
    torch.testing.assert_close(out.float(), ref_out.float(), atol=1e-3, rtol=0)
    dout = (1 + torch.rand_like(q, dtype=torch.float32)).half()
    grads = [torch.empty_like(t) for t in (q, k, v)]
    attention_varlen_backward_launch(dout, q, k, v, ref_out, ref_lse, *args, *grads,
                                     config=((16, 32, 4, 2), (32, 32, 4, 2)), atomic_dq=atomic_dq)
    ref = attention_varlen_backward_reference(dout, q, k, v, ref_out, ref_lse, *args[:2], *args[4:])
    for got, want in zip(grads, ref, strict=True):
        torch.testing.assert_close(got.float(), want.float(), atol=5e-3, rtol=2e-3)


# ------------------------------------------------------------------------------------------- GPU

CUDA_CASES = {
    "plain_d64": dict(D=64),
    "causal_d128": dict(D=128, is_causal=True),
    "causal_bottom_right": dict(D=64, Sq=300, Sk=1000, is_causal=True, align="bottom_right"),
    "causal_top_left_long_q": dict(D=64, Sq=1000, Sk=300, is_causal=True),
    "window": dict(D=64, window=(100, 20)),
    "window_causal_bottom_right": dict(D=128, Sq=777, Sk=1000, is_causal=True, window=(64, -1),
                                       align="bottom_right"),
    "gqa_d128": dict(D=128, Hq=8, Hkv=2, is_causal=True),
    "d256": dict(D=256, Sq=513, Sk=513),  # dK and dV in two launches (SPLIT_DKDV_CONFIGS)
    "d256_causal_gqa": dict(D=256, Hq=8, Hkv=2, Sq=300, Sk=701, is_causal=True, align="bottom_right"),
    "d256_bias_grad": dict(D=256, Sq=200, Sk=333, mask="bias"),
    "d72_odd": dict(D=72, Sq=97, Sk=113),
    "d8": dict(D=8, Sq=97, Sk=1000),
    "bias_grad": dict(D=64, mask="bias"),
    "bias_broadcast_grad": dict(D=64, mask="bias_b1"),
    "bool_mask": dict(D=128, mask="bool"),
    "padding_bool": dict(D=64, mask="padding"),
    "transposed_layout": dict(D=128, bshd=True, is_causal=True),
    # keys up to SHORT_KEYS_MAX: the forward's short-keys tile (attention_fwd.short_keys_tile)
    "short_keys_vit": dict(D=64, Sq=197, Sk=197),
    "short_keys_gqa_odd": dict(D=40, Hq=4, Hkv=2, Sq=77, Sk=224),
    "short_keys_transposed": dict(D=64, Sq=33, Sk=31, bshd=True),
}


def _lowp_error(fn_lowp, fn_ref, got):
    return (fn_lowp - fn_ref).abs().max().item(), (got.float() - fn_ref).abs().max().item()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(CUDA_CASES))
def test_cuda_forward_and_gradients(case, dtype):
    c = dict(B=2, Hq=4, Hkv=4, Sq=1000, Sk=1000, is_causal=False, align="top_left", window=(-1, -1),
             mask=None, bshd=False)
    c.update(CUDA_CASES[case])
    dev = "cuda"
    if c["bshd"]:
        q = torch.randn(c["B"], c["Sq"], c["Hq"], c["D"], device=dev, dtype=dtype).transpose(1, 2)
        k = torch.randn(c["B"], c["Sk"], c["Hkv"], c["D"], device=dev, dtype=dtype).transpose(1, 2)
        v = torch.randn(c["B"], c["Sk"], c["Hkv"], c["D"], device=dev, dtype=dtype).transpose(1, 2)
    else:
        q, k, v = _qkv(c["B"], c["Hq"], c["Hkv"], c["Sq"], c["Sk"], c["D"], dtype=dtype, device=dev)
    mask = None
    if c["mask"] == "bias":
        mask = torch.randn(c["B"], c["Hq"], c["Sq"], c["Sk"], device=dev, dtype=dtype)
    elif c["mask"] == "bias_b1":
        mask = torch.randn(1, c["Hq"], 1, c["Sk"], device=dev, dtype=dtype)
    elif c["mask"] == "bool":
        mask = torch.rand(c["B"], 1, c["Sq"], c["Sk"], device=dev) > 0.3
        mask[:, :, 7] = False
    elif c["mask"] == "padding":  # right padding, then left padding: whole key blocks are skipped
        mask = torch.ones(c["B"], 1, 1, c["Sk"], device=dev, dtype=torch.bool)
        mask[0, ..., 377:] = False
        mask[1, ..., :600] = False
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    if mask is not None and mask.is_floating_point():
        leaves.append(mask.detach().requires_grad_())
    kw = dict(is_causal=c["is_causal"], causal_alignment=c["align"], window_size=c["window"])
    out = flash_attention(*leaves[:3], attn_mask=leaves[3] if len(leaves) > 3 else mask, **kw)
    if c["bshd"]:
        assert out.stride() == q.stride()
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)

    right = 0 if c["is_causal"] else c["window"][1]
    ref_args = (None, 0.0, None, c["window"][0], right, c["align"] == "bottom_right")

    def ref(upcast):
        xs = [t.detach().requires_grad_() for t in leaves]
        m = xs[3] if len(xs) > 3 else mask
        o, _ = attention_reference(*(x.float() if upcast else x for x in xs[:3]),
                                   m.float() if (upcast and m is not None and m.is_floating_point()) else m,
                                   *ref_args, upcast=upcast)
        return o, torch.autograd.grad(o, xs, dout.float() if upcast else dout)

    ref_out, ref_grads = ref(True)
    low_out, low_grads = ref(False)
    names = ["out", "dq", "dk", "dv", "dbias"][: len(grads) + 1]
    floor = 2e-3 if dtype == torch.float16 else 1e-2
    for name, got, want, low in zip(names, (out, *grads), (ref_out, *ref_grads), (low_out, *low_grads),
                                    strict=True):
        err_low, err = _lowp_error(low.float(), want.float(), got)
        assert torch.isfinite(got).all(), name
        assert err <= 2 * err_low + floor, f"{name}: err {err:.3g} vs torch low-precision {err_low:.3g}"


@pytest.mark.cuda
def test_cuda_causal_launch_groups_change_nothing(monkeypatch):
    """The Triton kernels' causal launch in groups of (batch, head) pairs (attention_fwd._grid_ids; here 128
    pairs of 16 blocks: two groups on a GPU of more than 63 SMs, the second short) against the plain order
    (CAUSAL_GROUP_WAVES 0): out, lse, dq, dk, dv bitwise the same (each program computes the same tile; the dQ
    kernel, no atomics)."""
    from flash_backend.kernels import attention_fwd
    from flash_backend.kernels.attention_bwd import attention_backward_launch

    q, k, v = _qkv(8, 16, 16, 1024, 1024, 64, dtype=torch.bfloat16, device="cuda")
    dout = torch.randn_like(q)
    args = (None, None, 0.0, 0.125, -1, 0, False)
    results = []
    for waves in (0, attention_fwd.CAUSAL_GROUP_WAVES):
        monkeypatch.setattr(attention_fwd, "CAUSAL_GROUP_WAVES", waves)
        out, lse = torch.empty_like(q), torch.empty(q.shape[:3], device="cuda")
        attention_fwd.attention_forward_launch(q, k, v, *args, out, lse)
        grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
        attention_backward_launch(dout, q, k, v, out, lse, *args, *grads, None)
        results.append([out, lse, *grads])
    assert attention_fwd.causal_group_ctas(q.device, True, False) > 0
    for name, plain, grouped in zip(("out", "lse", "dq", "dk", "dv"), *results, strict=True):
        assert torch.isfinite(grouped).all() and torch.equal(grouped, plain), name


@pytest.mark.cuda
def test_cuda_varlen_matches_reference():
    lens_q, lens_k = [300, 1, 700, 129], [400, 17, 700, 64]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(sum(lens_k), 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(sum(lens_k), 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = flash_attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), is_causal=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    xs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = flash_backend.ops.attention.attention_varlen_reference(*xs, cu_q, cu_k, window_right=0,
                                                                   bottom_right=True)[0]
    ref_grads = torch.autograd.grad(ref, xs, dout.float())
    for got, want in zip((out, *grads), (ref, *ref_grads), strict=True):
        assert (got.float() - want).abs().max().item() <= 0.02 * want.abs().max().item() + 1e-2


@pytest.mark.cuda
@pytest.mark.parametrize("padding", [False, True], ids=["no_mask", "padding_mask"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dq", "dq_kernel"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_dropout_matches_reference_mask(dtype, deterministic, padding):
    q, k, v = _qkv(2, 4, 2, 333, 517, 64, dtype=dtype, device="cuda")
    mask = None
    if padding:  # a (B, 1, 1, Sk) bool mask: right padding; left padding, so causal rows < 130 are empty
        mask = torch.ones(2, 1, 1, 517, device="cuda", dtype=torch.bool)
        mask[0, ..., 300:] = False
        mask[1, ..., :130] = False
    seed = torch.randint(0, 2**62, (1,), device="cuda")
    out, lse = torch.ops.flash.attention_forward(q, k, v, mask, seed, 0.2, 0.125, -1, 0, False)
    ref_out, ref_lse = attention_reference(q, k, v, mask, seed, 0.2, 0.125, -1, 0, False)
    low_out, _ = attention_reference(q, k, v, mask, seed, 0.2, 0.125, -1, 0, False, upcast=False)
    err_low = (low_out.float() - ref_out.float()).abs().max()
    assert (out.float() - ref_out.float()).abs().max() <= 2 * err_low + 1e-2
    dout = torch.randn_like(out)
    grads = torch.ops.flash.attention_backward(dout, q, k, v, out, lse, mask, seed, 0.2, 0.125, -1, 0, False,
                                               False, deterministic)[:3]
    ref = attention_backward_reference(dout, q, k, v, out, lse, mask, seed, 0.2, 0.125, -1, 0, False)[:3]
    for got, want in zip(grads, ref, strict=True):
        assert (got.float() - want.float()).abs().max().item() <= 0.02 * want.abs().max().item() + 1e-2
    keep = torch.stack([flash_attention(q, k, v, dropout_p=0.3) for _ in range(50)]).float().mean(0)
    assert (keep - flash_attention(q, k, v).float()).abs().mean() < 0.02


@pytest.mark.cuda
@pytest.mark.parametrize("Sq,Sk,D,atomic_dq", [(60, 61, 64, False), (60, 61, 64, True),
                                               (100, 125, 128, False), (200, 250, 256, False)])
def test_cuda_kernels_drop_the_reference_elements(Sq, Sk, D, atomic_dq):
    # the default configs of each head-dim bucket (key blocks of 32 to 128); Sq, Sk <= D for the probes
    want, *got = _kernel_dropout_masks(2, 4, 2, Sq, Sk, D, 0.2, "cuda", atomic_dq=atomic_dq)
    for name, mask in zip(("forward", "dK/dV", "dQ"), got, strict=True):
        assert torch.equal(mask, want), f"{name}: {(mask != want).sum().item()} elements differ"


def test_atomic_dq_only_where_measured_faster_and_never_when_deterministic():
    from flash_backend.kernels.attention_bwd import use_atomic_dq

    assert use_atomic_dq(64, 0.1, False, False)
    assert use_atomic_dq(40, 0.1, False, False)  # the 64 bucket
    assert not use_atomic_dq(64, 0.1, False, True)  # torch.use_deterministic_algorithms(True)
    assert not use_atomic_dq(64, 0.0, False, False)
    assert not use_atomic_dq(64, 0.1, True, False)  # mask tiles (or dS stores) keep the dQ kernel
    assert not use_atomic_dq(128, 0.1, False, False)


def test_backward_default_configs_split_head_dim_256_only():
    from flash_backend.kernels import attention_bwd as bwd

    assert bwd.default_configs(64, 0.1, True) == (bwd.ATOMIC_DKDV_CONFIGS[64], bwd.DQ_CONFIGS[64])
    assert bwd.default_configs(128, 0.1, False) == (bwd.DKDV_CONFIGS[128], bwd.DQ_CONFIGS[128])
    assert bwd.default_configs(200, 0.0, False) == (bwd.SPLIT_DKDV_CONFIGS[256], bwd.DQ_CONFIGS[256])
    assert bwd.default_configs(256, 0.1, False) == (bwd.SPLIT_DKDV_DROPOUT_CONFIGS[256], bwd.DQ_CONFIGS[256])
    assert all(isinstance(cfg[0], tuple) for cfg in (bwd.SPLIT_DKDV_CONFIGS[256],
                                                     bwd.SPLIT_DKDV_DROPOUT_CONFIGS[256]))


@pytest.mark.cuda
@pytest.mark.parametrize("deterministic", [False, True])
def test_cuda_dropout_backward_repeats_under_deterministic_mode(deterministic):
    # D=64 with dropout and no mask: the atomic dQ path unless deterministic algorithms are on, then the
    # dQ kernel, whose gradients repeat bit for bit (the accuracy of both: test_cuda_dropout_matches_...)
    q, k, v = _qkv(3, 6, 2, 301, 517, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dout = torch.randn_like(q)
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        runs = []
        for _ in range(2):
            torch.manual_seed(7)
            out = flash_attention(q, k, v, dropout_p=0.15, is_causal=True)
            runs.append(torch.autograd.grad(out, (q, k, v), dout))
    finally:
        torch.use_deterministic_algorithms(prev)
    for a, b in zip(*runs, strict=True):
        assert torch.isfinite(a).all()
        if deterministic:
            assert torch.equal(a, b)
        else:  # atomics may reorder the fp32 adds of dQ: equal up to rounding
            assert (a.float() - b.float()).abs().max().item() <= 1e-2 * b.float().abs().max().item()


@pytest.mark.cuda
def test_cuda_fully_masked_rows_and_determinism():
    q, k, v = _qkv(2, 4, 4, 257, 300, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    mask = torch.rand(2, 4, 257, 300, device="cuda") > 0.5
    mask[:, :, 100:140] = False
    out = flash_attention(q, k, v, attn_mask=mask)
    assert (out[:, :, 100:140] == 0).all()
    dout = torch.randn_like(out)
    g1 = torch.autograd.grad(out, (q, k, v), dout)
    g2 = torch.autograd.grad(flash_attention(q, k, v, attn_mask=mask), (q, k, v), dout)
    for a, b in zip(g1, g2, strict=True):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize(("B", "H", "Hkv", "S"), [(2, 4, 2, 300), (8, 16, 8, 2048)])
def test_cuda_fully_masked_rows_mean(B, H, Hkv, S):
    """fully_masked_rows="mean" (what the pass asks for where eager's one finite fill masks a whole row)
    selects the rows by the kernels' logsumexp, +inf where no key is visible: those rows are the mean of v
    (GQA grouping), the others the op's. A small case (Triton kernels) and a padding mask with one sequence
    that has no live key at a size the Gluon kernels take (2**28 scores and more)."""
    q, k, v = _qkv(B, H, Hkv, S, S, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    if S < 2048:
        mask = torch.rand(B, H, S, S, device="cuda") > 0.5
        mask[:, :, 100:140] = False
        dead = torch.zeros(B, H, S, dtype=torch.bool, device="cuda")
        dead[:, :, 100:140] = True
    else:
        mask = torch.ones(B, 1, 1, S, dtype=torch.bool, device="cuda")
        mask[1] = False  # batch 1 has no live key: every one of its rows is dead
        mask[0, ..., S // 2:] = False
        dead = torch.zeros(B, H, S, dtype=torch.bool, device="cuda")
        dead[1] = True
    zero = flash_attention(q, k, v, attn_mask=mask)
    mean = flash_attention(q, k, v, attn_mask=mask, fully_masked_rows="mean")
    want = v.float().mean(2, keepdim=True).repeat_interleave(H // Hkv, 1).expand(B, H, S, 64)
    assert (zero[dead] == 0).all()
    assert (mean[~dead] == zero[~dead]).all()
    assert (mean.float()[dead] - want[dead]).abs().max().item() < 1e-2
    dv = torch.autograd.grad(mean, v, torch.ones_like(mean))[0]
    dv_zero = torch.autograd.grad(zero, v, torch.ones_like(zero))[0]
    # each dead row adds 1 / S to every key of its k/v head
    extra = dead.float().sum(2).view(B, Hkv, H // Hkv).sum(2)[..., None, None] / S
    # (bf16 sums: the op's dv plus the mean's, rounded once)
    err = (dv.float() - dv_zero.float() - extra).abs().max().item()
    assert err < 1e-2 * dv.float().abs().max().item() + 1e-2


@pytest.mark.cuda
def test_cuda_long_sequence_memory():
    S = 32768
    q, k, v = _qkv(1, 4, 4, S, S, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = flash_attention(q, k, v, is_causal=True)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < 20 * q.numel() * q.element_size(), f"peak {peak / 2**20:.0f} MiB: something is O(S^2)"
    assert torch.isfinite(q.grad).all()


@pytest.mark.cuda
def test_cuda_opcheck_and_compile():
    q, k, v = _qkv(2, 4, 2, 197, 213, 64, dtype=torch.bfloat16, device="cuda")
    mask = torch.randn(1, 4, 197, 213, device="cuda", dtype=torch.bfloat16)
    seed = torch.randint(0, 2**62, (1,), device="cuda")
    args = (q, k, v, mask, seed, 0.1, 0.125, -1, 0, True)
    opcheck(torch.ops.flash.attention_forward, args)
    out, lse = torch.ops.flash.attention_forward(*args)
    opcheck(torch.ops.flash.attention_backward,
            (torch.randn_like(out), q, k, v, out, lse, *args[3:], True, True))
    # the atomic dQ path (dropout, D=64, no mask, not deterministic)
    out, lse = torch.ops.flash.attention_forward(q, k, v, None, *args[4:])
    opcheck(torch.ops.flash.attention_backward,
            (torch.randn_like(out), q, k, v, out, lse, None, *args[4:], False, False))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    f = lambda q, k, v: flash_attention(q, k, v, is_causal=True)
    got = torch.compile(f, fullgraph=True)(*leaves)
    want = f(*leaves)
    torch.testing.assert_close(got, want)
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, leaves, g), torch.autograd.grad(want, leaves, g), strict=True):
        torch.testing.assert_close(a, b)
