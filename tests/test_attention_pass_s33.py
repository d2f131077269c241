"""fx_passes/attention, session 33 (tests/findings/codebase_review_s33.md): two forms the code-base review
found left alone.

- Z1: ESPnet's / wenet's ``torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)``, the probabilities
  zeroed after the softmax by the mask the scores were filled with (every Conformer / Transformer attention
  of both toolkits, FunASR's). Was a near miss ("the probabilities go to 'attn' (masked_fill), not to a
  matmul with v"). Where a row keeps a key the zeroing changes nothing (the masked keys are 0 already);
  where a row keeps none it gives 0, the op's own value there. Rewritten now; a zeroing by another mask,
  another value or a zeroing the scores were not masked with stays a near miss.
- T1: timm's MaxViT / CoAtNet Attention2d keeps q, k, v channels-first, (B, H, D, N):
  ``attn = q.transpose(-2, -1) @ k`` (k already kᵀ, no transpose node) and ``x = v @ attn.transpose(-2,
  -1)`` (the probabilities swapped, the right operand). Was no candidate at all (not even a near miss); both
  sides are taken now: any right operand of q·kᵀ is kᵀ (k = its last two dims swapped), and v' @ pᵀ is
  (p @ v'ᵀ)ᵀ (the op's v = v'ᵀ, its output swapped back).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flash_backend.backend import rewrite_only_backend
from fx_passes import collecting
from fx_passes._compat import counters

TOL = dict(atol=2e-5, rtol=2e-5)
B, H, S, D = 2, 3, 7, 8


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _check(fn, args, rewrites, words=(), near=None, dynamic=None, argsets=None):
    """fn compiled (rewrite-only) equals eager on outputs and the float inputs' gradients; `rewrites`
    attention rewrites; the report holds words; near: words of the one near miss expected."""
    torch._dynamo.reset()
    counters.clear()
    with collecting() as report:
        compiled = torch.compile(fn, backend=rewrite_only_backend, fullgraph=True, dynamic=dynamic)
        for a in argsets or [args]:
            outs = []
            for f in (compiled, fn):
                leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in a]
                out = f(*leaves)
                g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
                grads = torch.autograd.grad(out, [t for t in leaves if t.requires_grad], g)
                outs.append((out, grads))
            (got, got_g), (want, want_g) = outs
            torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{m}\n{report}")
            for x, y in zip(got_g, want_g, strict=True):
                torch.testing.assert_close(x, y, **TOL, msg=lambda m: f"{m}\n{report}")
    assert counters["flash"]["attention"] == rewrites, str(report)
    for w in words:
        assert w in str(report), str(report)
    if near is not None:
        assert len(report.near_misses) == 1 and near in report.near_misses[0].detail, str(report)
    else:
        assert not report.near_misses, str(report)
    return report


def _qkv(*shape):
    return tuple(torch.randn(*shape) for _ in range(3))


# ========================================================================================================
# Z1: probabilities zeroed at the masked keys after the softmax
# ========================================================================================================


def _espnet_attention(fill):
    """ESPnet / wenet's MultiHeadedAttention.forward_attention after q·kᵀ / √d_k; mask (B, 1, T) is the
    keep mask (True = real frame), inverted with eq(0) as they do."""

    def f(q, k, v, mask):
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        mask = mask.unsqueeze(1).eq(0)
        value = torch.finfo(scores.dtype).min if fill is None else fill
        scores = scores.masked_fill(mask, value)
        attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        attn = F.dropout(attn, p=0.0, training=True)
        return torch.matmul(attn, v)

    return f


def _keep(lens, t=S):
    return (torch.arange(t)[None, :] < torch.tensor(lens)[:, None]).unsqueeze(1)  # (B, 1, T)


@pytest.mark.parametrize("fill", [float("-inf"), None, -1e9], ids=["-inf", "finfo.min", "-1e9"])
def test_probabilities_zeroed_at_the_mask_after_the_softmax(fill):
    _check(_espnet_attention(fill), (*_qkv(B, H, S, D), _keep([7, 4])), 1,
           words=["probabilities zeroed at the masked keys after the softmax", "mask [2, 1, 1, 7]"])


@pytest.mark.parametrize("fill", [float("-inf"), None], ids=["-inf", "finfo.min"])
def test_rows_with_no_key_are_zero_in_eager_too(fill):
    """A decoder source mask (B, T, T) with whole rows masked (and one sequence of length 0): eager's NaN
    (-inf) or uniform (finfo.min) rows are zeroed by the second masked_fill, the op gives 0 there, and the
    gradients are 0 in both. No policy note in the report: the results are eager's."""

    def f(q, k, v, mask):
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        mask = mask.unsqueeze(1).eq(0)  # (B, 1, T, T)
        value = torch.finfo(scores.dtype).min if fill is None else fill
        scores = scores.masked_fill(mask, value)
        attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        return torch.matmul(attn, v)

    keep = torch.rand(B, S, S) > 0.3
    keep[0, 2] = False  # a row with no key
    keep[1] = False  # a sequence with none at all
    report = _check(f, (*_qkv(B, H, S, D), keep), 1)
    assert "every key masked" not in str(report), str(report)


def test_zeroing_with_a_causal_band_too_keeps_the_policy_note():
    """Causal and padding masks filled separately, the zeroing by the padding one only: a row that the two
    mask together is not zeroed whole by eager, so the fill's policy note stays."""

    def f(q, k, v, keep):
        scores = torch.matmul(q, k.transpose(-2, -1)) * D ** -0.5
        causal = torch.ones(S, S, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(causal, float("-inf"))
        pad = keep.unsqueeze(1).eq(0)
        scores = scores.masked_fill(pad, float("-inf"))
        attn = torch.softmax(scores, dim=-1).masked_fill(pad, 0.0)
        return torch.matmul(attn, v)

    _check(f, (*_qkv(B, H, S, D), _keep([7, 5])), 1,
           words=["probabilities zeroed", "-inf fill: a row with every key masked gives 0"])


def test_zeroing_by_another_mask_is_refused():
    def f(q, k, v, mask, other):
        scores = torch.matmul(q, k.transpose(-2, -1))
        scores = scores.masked_fill(mask, float("-inf"))
        attn = torch.softmax(scores, dim=-1).masked_fill(other, 0.0)
        return torch.matmul(attn, v)

    mask = ~_keep([7, 4]).unsqueeze(1)
    other = ~_keep([6, 4]).unsqueeze(1)  # zeroes a key the scores kept: another function
    _check(f, (*_qkv(B, H, S, D), mask, other), 0, near="(masked_fill), not to a matmul with v")


def test_zeroing_with_a_nonzero_value_or_no_prior_fill_is_refused():
    def nonzero(q, k, v, mask):
        scores = torch.matmul(q, k.transpose(-2, -1)).masked_fill(mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1).masked_fill(mask, 0.5), v)

    def no_prior_fill(q, k, v, mask):
        scores = torch.matmul(q, k.transpose(-2, -1))  # masked keys keep their probability: renormalised?
        return torch.matmul(torch.softmax(scores, dim=-1).masked_fill(mask, 0.0), v)  # no: rows sum < 1

    mask = ~_keep([7, 4]).unsqueeze(1)
    for fn in (nonzero, no_prior_fill):
        _check(fn, (*_qkv(B, H, S, D), mask), 0, near="(masked_fill), not to a matmul with v")


def test_zeroing_under_dynamic_shapes():
    argsets = [(*_qkv(B, H, s, D), _keep([s, s - 2], s)) for s in (5, 7, 9)]
    _check(_espnet_attention(float("-inf")), argsets[0], 1, dynamic=True, argsets=argsets)


# ========================================================================================================
# T1: channels-first attention, k given as kᵀ and the output as v @ pᵀ
# ========================================================================================================


def _attention2d(q, k, v):
    """timm maxxvit.Attention2d's manual path on (B, H, D, N) q / k / v (the scale on q first)."""
    q = q * D ** -0.5
    attn = q.transpose(-2, -1) @ k
    attn = attn.softmax(dim=-1)
    attn = F.dropout(attn, 0.0, True)
    return v @ attn.transpose(-2, -1)


def test_channels_first_attention_is_rewritten():
    _check(_attention2d, _qkv(B, H, D, S), 1)


@pytest.mark.parametrize("swap", ["transpose", "mT", "permute", "swapaxes"])
def test_probabilities_swapped_as_the_right_operand(swap):
    spell = {
        "transpose": lambda p: p.transpose(-1, -2),
        "mT": lambda p: p.mT,
        "permute": lambda p: p.permute(0, 1, 3, 2),
        "swapaxes": lambda p: p.swapaxes(2, 3),
    }[swap]

    def f(q, k, v, bias):
        attn = (q @ k.transpose(-2, -1)) * D ** -0.5 + bias
        return v.transpose(-2, -1) @ spell(attn.softmax(-1))  # (B, H, D, Sq)

    _check(f, (*_qkv(B, H, S, D), torch.randn(1, H, S, S)), 1, words=["mask [1, 3, 7, 7]"])


def test_k_given_transposed_with_bmm_and_cross_lengths():
    """(B·H, D, Sk) keys straight from a projection, Sq != Sk, bmm on both sides."""

    def f(q, kt, vt):
        attn = torch.bmm(q, kt).softmax(-1)  # (BH, Sq, Sk)
        return torch.bmm(vt, attn.transpose(1, 2))  # (BH, D, Sq)

    _check(f, (torch.randn(6, 5, D), torch.randn(6, D, 9), torch.randn(6, 16, 9)), 1)


def test_channels_first_attention_under_dynamic_shapes():
    argsets = [_qkv(B, H, D, s) for s in (5, 7, 9)]
    _check(_attention2d, argsets[0], 1, dynamic=True, argsets=argsets)


def test_swapped_probabilities_as_the_left_operand_are_not_attention():
    """pᵀ @ v contracts over the queries: another function, never rewritten (not even a candidate the
    report names: the walk looks for v' @ pᵀ only)."""

    def f(q, k, v):
        attn = (q @ k.transpose(-2, -1)).softmax(-1)
        return attn.transpose(-2, -1) @ v

    torch._dynamo.reset()
    counters.clear()
    q, k, v = _qkv(B, H, S, D)
    with collecting():
        got = torch.compile(f, backend=rewrite_only_backend, fullgraph=True)(q, k, v)
    torch.testing.assert_close(got, f(q, k, v), **TOL)
    assert counters["flash"]["attention"] == 0


def test_swapped_probabilities_also_read_elsewhere_are_refused():
    def f(q, k, v):
        attn = (q @ k.transpose(-2, -1)).softmax(-1)
        pt = attn.transpose(-2, -1)
        return v.transpose(-2, -1) @ pt + pt.sum()

    torch._dynamo.reset()
    counters.clear()
    q, k, v = _qkv(B, H, S, D)
    with collecting():
        got = torch.compile(f, backend=rewrite_only_backend, fullgraph=True)(q, k, v)
    torch.testing.assert_close(got, f(q, k, v), **TOL)
    assert counters["flash"]["attention"] == 0
