"""Review of the norm pass (fx_passes/norm.py): regressions for what the review found.

- A cast in the norm's tail that rounds (fp32 -> bf16 / fp16) was folded into the op even when a later step
  widened the value again (``F.layer_norm(x).bfloat16() * w_fp32``, ``.half().float()``): eager's fp32
  result then has bf16 / fp16 precision, the op's (rounding once, to fp32) does not. Such a cast now stays
  after the op, with what follows it.
- The same rounding on the numerator, ``(w_bf16 * x_bf16) * rsqrt(x.float().pow(2).mean(..) + eps)``: the
  product is rounded to bf16 and widened by the fp32 scaling; the op multiplies by the weight in fp32. Left
  alone, reported.
- ``F.layer_norm(h, (N,), weight=f(h))`` with h a residual sum: folding the sum made the op read a weight
  computed from its own residual output, a cycle, and the compile failed (stable_topological_sort). Now a
  near miss.
- ``x / (x.norm(2, -1, keepdim=True) * -N ** -0.5)``: the 2-norm's scale was checked through its square
  only, so the RMSNorm with its sign flipped was rewritten as the RMSNorm. Now not a candidate.

Helpers come from tests/test_norm_pass.py; every positive case checks forward and gradients against eager.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_norm_pass import EPS, Fn, N, _assert_same, _check_near_miss, _check_rewrite, _rewritten, _x
from test_norm_pass_styles import _check_untouched
from torch._dynamo.utils import counters

from fx_passes import collecting

BF16_TOL = {"atol": 2e-2, "rtol": 2e-2}


@pytest.fixture(autouse=True)
def _seeded():
    # low-precision comparisons: fixed inputs, so that a value on a rounding boundary cannot come and go
    torch.manual_seed(0)


def _rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


# --------------------------------------------------------------------------------------------------------
# A rounding cast in the tail, widened again after it
# --------------------------------------------------------------------------------------------------------


ROUNDED_THEN_WIDENED = {
    # fp32 norm rounded to bf16, times an fp32 weight: an fp32 result of bf16 precision
    "layer_norm_bf16_times_fp32_weight": lambda m, x: F.layer_norm(x, (N,)).to(torch.bfloat16) * m.weight,
    "layer_norm_half_then_float": lambda m, x: F.layer_norm(x, (N,), m.weight, m.bias).half().float(),
    "rms_bf16_times_fp32_weight": lambda m, x: _rms(x).bfloat16() * m.weight,
    "layer_norm_half_plus_fp32_bias": lambda m, x: F.layer_norm(x, (N,), m.weight).half() + m.bias,
}


@pytest.mark.parametrize("name", sorted(ROUNDED_THEN_WIDENED))
def test_rounding_cast_widened_after_stays_after_the_op(name):
    # the norm is still rewritten; the rounding cast reads the op's result and runs after it, with what
    # follows it, as eager ran them (folded, the bf16 / fp16 rounding was missing from the fp32 result). The
    # values match up to one bf16 / fp16 step, where the op's fp32 value and F.layer_norm's round apart.
    model, args = Fn(ROUNDED_THEN_WIDENED[name]), (_x(2, 5, N),)
    counters.clear()
    with collecting() as report:
        compiled, graphs = _rewritten(model)
        _assert_same(model, compiled, args, atol=2e-2, rtol=1e-2)
    assert counters["flash"]["norm"] == 1 and counters["flash"]["norm_skipped"] == 0, str(report)
    casts = [n for n in graphs[0].graph.nodes
             if n.op == "call_method" and n.target in ("to", "half", "bfloat16")
             and getattr(n.args[0].target, "__name__", None) == "add_dropout_norm"]
    assert len(casts) == 1, str(graphs[0].graph)


def _llama_bf16_weight(m, x):
    h = x.float()
    return m.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def _chatglm(m, x):
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return (m.weight * (x * torch.rsqrt(variance + EPS))).to(x.dtype)


@pytest.mark.parametrize("fn", [_llama_bf16_weight, _chatglm], ids=["llama", "chatglm"])
def test_rounding_cast_to_the_result_dtype_is_still_folded(fn):
    # a bf16 input upcast, normalised, rounded back to bf16 with the bf16 weight: the rounding is the op's
    # own rounding of its bf16 result, and the weight is folded
    model = Fn(fn, bias=False, dtype=torch.bfloat16)
    _check_rewrite(model, (_x(2, 5, N, dtype=torch.bfloat16),), text="+ weight", **BF16_TOL)


# --------------------------------------------------------------------------------------------------------
# The weight times the value, rounded then widened by the scaling
# --------------------------------------------------------------------------------------------------------


def test_near_miss_weight_product_rounded_to_bf16_then_scaled_in_fp32():
    def fn(m, x):
        return (m.weight * x) * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS)

    _check_near_miss(Fn(fn, bias=False, dtype=torch.bfloat16), (_x(2, 5, N, dtype=torch.bfloat16),),
                     "is rounded to torch.bfloat16 and widened")


def test_weight_product_of_the_result_dtype_is_still_rewritten():
    # all in bf16 (the statistics too, which the pass takes): the product is not widened after
    def fn(m, x):
        return (m.weight * x) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)

    _check_rewrite(Fn(fn, bias=False, dtype=torch.bfloat16), (_x(2, 5, N, dtype=torch.bfloat16),),
                   text="+ weight", atol=5e-2, rtol=5e-2)


# --------------------------------------------------------------------------------------------------------
# A norm call's weight computed from the residual sum
# --------------------------------------------------------------------------------------------------------


def _layer_norm_weight_from_sum(m, x, r):
    h = x + r
    return F.layer_norm(h, (N,), h[0, 0], m.bias)


def _rms_norm_weight_from_sum(m, x, r):
    h = x + r
    return F.rms_norm(h, (N,), h.mean((0, 1)), EPS)


@pytest.mark.parametrize("fn", [_layer_norm_weight_from_sum, _rms_norm_weight_from_sum], ids=["ln", "rms"])
def test_near_miss_norm_call_weight_computed_from_the_residual_sum(fn):
    args = (_x(2, 5, N), _x(2, 5, N))
    _check_near_miss(Fn(fn), args, "is computed from the normalised tensor")
    _check_untouched(Fn(fn), args)


def test_norm_call_weight_from_a_separate_sum_is_still_rewritten():
    # (x + r) computed twice: the weight reads its own sum, not the one the op folds
    def fn(m, x, r):
        return F.layer_norm(x + r, (N,), (x + r)[0, 0], m.bias)

    _check_rewrite(Fn(fn), (_x(2, 5, N), _x(2, 5, N)), text="residual add")


# --------------------------------------------------------------------------------------------------------
# The 2-norm scaled by a negative factor
# --------------------------------------------------------------------------------------------------------


NEGATIVE_SCALES = {
    "times_minus_reciprocal_sqrt_n": lambda m, x: x / (x.norm(2, -1, keepdim=True) * -(N ** -0.5)),
    "over_minus_sqrt_n": lambda m, x: x / (torch.linalg.vector_norm(x, dim=-1, keepdim=True) / -(N ** 0.5)),
}


@pytest.mark.parametrize("name", sorted(NEGATIVE_SCALES))
def test_two_norm_scaled_by_a_negative_factor_is_not_rmsnorm(name):
    _check_untouched(Fn(NEGATIVE_SCALES[name]), (_x(2, 5, N),))


def test_two_norm_scaled_by_the_positive_factor_is_still_rewritten():
    _check_rewrite(Fn(lambda m, x: x / (x.norm(2, -1, keepdim=True) / N ** 0.5)), (_x(2, 5, N),))
