"""Adversarial cases for the widened norm statistics (a mean spelled ``sum / N``, unsqueezed back) and the
``F.nll_loss(F.log_softmax(z, -1), y)`` form of the cross-entropy pass: look-alikes that are other functions
(they must be left alone), and same-function spellings whose rewrite could go wrong on shapes where a
wrong match would still broadcast (square inputs). Helpers come from the suites of the two passes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_cross_entropy_pass import Head, K, V, _check, _labels, _not_rewritten
from test_norm_pass import EPS, Fn, _assert_same, _check_near_miss, _check_rewrite, _rewritten, _x
from test_norm_pass_more_forms import _check_untouched
from torch._dynamo.utils import counters

from flash_backend.backend import rewrite_only_backend
from fx_passes import collecting

S = 8  # square (S, S) inputs: a reduction or an unsqueeze at the wrong dim still broadcasts


def _rms(mean_square):
    return lambda m, x: x * torch.rsqrt(mean_square(x * x) + EPS)


# --------------------------------------------------------------------------------------------------------
# Norm: sum / N
# --------------------------------------------------------------------------------------------------------


def test_float16_sum_over_n_overflows_where_the_mean_does_not():
    # Eager rounds the fp16 sum of squares to fp16: 4096 * 36 > 65504 is inf, and the output is 0. A mean
    # (and the fused op) accumulates in fp32. Not the same function: reported, not rewritten.
    x = torch.full((2, 4096), 6.0, dtype=torch.float16)
    model = Fn(_rms(lambda t: t.sum(-1, keepdim=True) / t.shape[-1]), weight_shape=(4096,), bias=False,
               dtype=torch.float16)
    assert (model(x) == 0).all()
    _check_near_miss(model, (x,), "overflows past 65504")


@pytest.mark.parametrize("dtype,upcast", [(torch.bfloat16, False), (torch.float16, True)],
                         ids=["bf16", "fp16_upcast_first"])
def test_low_precision_sum_over_n_with_float32_range_is_rewritten(dtype, upcast):
    def fn(m, x):
        h = x.float() if upcast else x
        return (h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) / S + EPS)).to(x.dtype) * m.weight

    _check_rewrite(Fn(fn, weight_shape=(S,), bias=False, dtype=dtype), (_x(3, S, dtype=dtype) * 4,),
                   atol=2e-2, rtol=2e-2)


def test_square_input_with_the_first_dims_size_as_divisor():
    # Static shapes: x.shape[0] is the number S, the reduced size, and dynamo guards on the shape.
    def ln(m, x):
        mu = x.sum(-1, keepdim=True) / x.shape[0]
        c = x - mu
        return c * torch.rsqrt((c * c).sum(-1, keepdim=True) / x.shape[0] + EPS) * m.weight + m.bias

    _check_rewrite(Fn(ln, weight_shape=(S,)), (_x(S, S),), atol=1e-4, rtol=1e-4)


def test_dynamic_square_input_with_the_first_dims_size_recompiles_for_other_shapes():
    # dynamic=True gives both equal sizes one symbol (duck shaping), guarded: (4, 8) compiles again.
    def fn(x):
        return _rms(lambda t: t.sum(-1, keepdim=True) / x.shape[0])(None, x)

    counters.clear()
    compiled, graphs = _rewritten(fn, dynamic=True)
    for shape in [(S, S), (6, 6), (4, S), (S, 4)]:
        x = _x(*shape)
        torch.testing.assert_close(compiled(x), fn(x))
    assert len(graphs) == 2 and counters["flash"]["norm"] == 1


NOT_CANDIDATES = {
    "sum_unsqueezed_at_-2": lambda t: t.sum(-1).unsqueeze(-2) / S,
    "sum_indexed_None_first": lambda t: t.sum(-1)[None] / S,
    "mean_indexed_None_first": lambda t: t.mean(-1)[None],
    "sum_div_floor": lambda t: t.sum(-1, keepdim=True).div(S, rounding_mode="floor"),
    "sum_div_tensor": lambda t: t.sum(-1, keepdim=True) / torch.tensor(S),
    "nested_sums": lambda t: t.sum(-1, keepdim=True).sum(-1, keepdim=True) / S,
    "n_over_sum": lambda t: S / t.sum(-1, keepdim=True),
}


@pytest.mark.parametrize("name", list(NOT_CANDIDATES))
def test_square_look_alikes_are_not_candidates(name):
    _check_untouched(Fn(_rms(NOT_CANDIDATES[name]), weight_shape=(S,), bias=False), (_x(S, S).abs() + 1,))


@pytest.mark.parametrize("mean_square,shape,reason", [
    (lambda t: t.sum(0, keepdim=True) / S, (S, S), "not only the last dim"),
    (lambda t: t.sum(-1, keepdim=True, dtype=torch.float64) / S, (3, S), "dtype="),
    (lambda t: t.sum((-2, -1), keepdim=True) / (t.shape[-2] * t.shape[-1]), (2, 3, S),
     "not only the last dim"),
], ids=["sum_over_dim_0", "sum_dtype", "sum_over_two_dims"])
def test_near_miss_sums_over_the_right_count_of_the_wrong_thing(mean_square, shape, reason):
    _check_near_miss(Fn(_rms(mean_square), weight_shape=(S,), bias=False), (_x(*shape),), reason)


# --------------------------------------------------------------------------------------------------------
# Cross-entropy: nll_loss of log_softmax
# --------------------------------------------------------------------------------------------------------


class HalfHead(nn.Module):
    def __init__(self, loss_fn):
        super().__init__()
        self.proj = nn.Linear(K, V, dtype=torch.float16)
        self.loss_fn = loss_fn

    def forward(self, x, labels):
        return self.loss_fn(self.proj(x).view(-1, V), labels.view(-1))


@pytest.mark.parametrize("loss_fn", [
    lambda lg, y: F.nll_loss(F.log_softmax(lg, -1).view(torch.bfloat16), y),
    lambda lg, y: F.cross_entropy(lg.view(torch.bfloat16), y),
], ids=["log_probs", "logits"])
def test_view_as_another_dtype_reinterprets_the_bits_and_is_left_alone(loss_fn):
    # fp16 -> bf16 keeps the shape (same item size) but not the values: no reshape of the chain.
    torch.manual_seed(0)
    model, args = HalfHead(loss_fn), (torch.randn(3, 7, K, dtype=torch.float16), _labels((3, 7)))
    counters.clear()
    with torch.no_grad(), collecting() as report:
        got = torch.compile(model, backend=rewrite_only_backend, fullgraph=True)(*args)
    assert counters["flash"]["cross_entropy"] == 0, str(report)
    assert "view" in str(report), str(report)
    torch.testing.assert_close(got, model(*args), atol=0, rtol=0)


def _flat(lg):
    return lg.view(-1, lg.shape[-1])


@pytest.mark.parametrize("loss_fn,reason,classes", [
    (lambda lg, y: F.nll_loss(F.log_softmax(lg, -1).view(3, -1).view(-1, V), y.view(-1)),
     "not a reshape keeping the class dimension last", V),
    (lambda lg, y: F.nll_loss(F.log_softmax(lg, 1).reshape(-1, 7), y.view(-1)), "over dim 1 of its 3-D", 7),
    (lambda lg, y: F.nll_loss(F.log_softmax(_flat(lg), -1, dtype=torch.float16), y.view(-1)),
     "dtype=torch.float16", V),
    (lambda lg, y: F.nll_loss(F.log_softmax(_flat(lg) / 2.0, -1), y.view(-1)), "div", V),
    (lambda lg, y: F.nll_loss(F.log_softmax(_flat(lg), -1), y.view(-1), ignore_index=torch.tensor(3)),
     "not a constant int", V),
], ids=["merged_class_dim", "dim_1_of_square_3d", "downcast_dtype", "temperature", "tensor_ignore_index"])
def test_nll_look_alikes_are_left_alone(loss_fn, reason, classes):
    # (3, 7, 7) logits for dim 1: a softmax over the sequence that a wrong match would still reshape
    _not_rewritten(loss_fn, reason, classes=classes, labels=_labels((3, 7), classes, ignore=3))


def test_one_log_softmax_read_by_two_losses_is_left_alone_twice():
    def two(lg, y):
        lp = F.log_softmax(_flat(lg), -1)
        return F.nll_loss(lp, y.view(-1)) + F.nll_loss(lp, y.view(-1), reduction="sum")

    _check(Head(two), (torch.randn(3, 7, K), _labels((3, 7))), rewrites=0, skipped=2)


@pytest.mark.parametrize("loss_fn,dynamic", [
    (lambda lg, y: F.nll_loss(F.log_softmax(_flat(lg), -1), y.view(-1), None, None, 3, None, "sum"), False),
    (lambda lg, y: F.nll_loss(F.log_softmax(_flat(lg), -1), y.view(-1), ignore_index=3, reduction="none"),
     True),
], ids=["positional_ignore_and_reduction", "dynamic_per_token"])
def test_nll_same_function_edge_cases_are_rewritten(loss_fn, dynamic):
    torch.manual_seed(0)
    model, args = Head(loss_fn), (torch.randn(3, 7, K), _labels((3, 7), ignore=3))
    counters.clear()
    with collecting() as report:
        compiled = torch.compile(model, backend=rewrite_only_backend, fullgraph=True, dynamic=dynamic)
        _assert_same(model, compiled, args, atol=1e-5, rtol=1e-5)
    assert counters["flash"]["cross_entropy"] == 1, str(report)


def test_nll_every_label_ignored_is_nan_as_in_eager():
    model, args = Head(lambda lg, y: F.nll_loss(F.log_softmax(_flat(lg), -1), y.view(-1))), \
        (torch.randn(3, 7, K), torch.full((3, 7), -100))
    counters.clear()
    with torch.no_grad():
        loss, logits = torch.compile(model, backend=rewrite_only_backend)(*args)
        want, want_logits = model(*args)
    assert counters["flash"]["cross_entropy"] == 1
    assert loss.isnan() and want.isnan()
    torch.testing.assert_close(logits, want_logits)
