"""The norm pass on more spellings of the statistics: a mean written as a sum over the last dim divided by its
size (``x.sum(-1, keepdim=True) / N``, ``* (1 / N)``, ``/ x.shape[-1]``), a mean reduced without keepdim and
unsqueezed back, and the mean / var / var_mean / sqrt spellings that the pass already took, pinned here.

Every positive case checks the exact rewrite count and that forward and gradients (inputs and parameters)
equal eager's on CPU fp32, in training and in eval, with residual + dropout variants. Every negative case
(a sum over another count: N - 1, N + 1, another dim's size; a detached statistic; eps after the square
root; E[x²] - E[x]²) checks that nothing is rewritten and, where the pass saw a candidate, the reason.
Helpers come from tests/test_norm_pass.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_norm_pass import EPS, Fn, N, _assert_same, _check_near_miss, _check_rewrite, _rewritten, _x
from torch._dynamo.utils import counters

from fx_passes import collecting

TOL = {"atol": 1e-4, "rtol": 1e-4}


def _check_untouched(model, args, decisions=False):
    """Nothing is rewritten, the model runs as eager (gradients too), and, unless decisions, the pass did
    not even see a candidate (no near miss)."""
    counters.clear()
    with collecting() as report:
        compiled, _ = _rewritten(model)
        _assert_same(model, compiled, args, **TOL)
    assert counters["flash"]["norm"] == 0, str(report)
    if not decisions:
        assert not report.decisions, str(report)
    return report


# --------------------------------------------------------------------------------------------------------
# Spellings of a mean over the last dim
# --------------------------------------------------------------------------------------------------------


MEANS = {
    "sum_div_n": lambda t: t.sum(-1, keepdim=True) / N,
    "sum_div_float_n": lambda t: t.sum(-1, keepdim=True) / float(N),
    "sum_div_shape": lambda t: t.sum(-1, keepdim=True) / t.shape[-1],
    "sum_div_size": lambda t: t.sum(-1, keepdim=True) / t.size(-1),
    "sum_div_size_list": lambda t: t.sum(-1, keepdim=True) / t.size()[-1],
    "sum_times_reciprocal": lambda t: t.sum(-1, keepdim=True) * (1.0 / N),
    "reciprocal_times_torch_sum": lambda t: (1 / N) * torch.sum(t, dim=-1, keepdim=True),
    "sum_dim_tuple": lambda t: t.sum(dim=(-1,), keepdim=True) / N,
    "torch_sum_positional_div_method": lambda t: torch.sum(t, -1, True).div(N),
    "sum_unsqueezed_then_divided": lambda t: t.sum(-1).unsqueeze(-1) / N,
    "sum_divided_then_indexed": lambda t: (t.sum(-1) / N)[..., None],
    "torch_mean_positional": lambda t: torch.mean(t, -1, True),
    "mean_dim_list": lambda t: t.mean(dim=[-1], keepdim=True),
    "mean_unsqueeze": lambda t: t.mean(-1).unsqueeze(-1),
    "mean_unsqueeze_positive": lambda t: t.mean(dim=-1).unsqueeze(t.dim() - 1),
    "mean_index_none": lambda t: t.mean(-1)[..., None],
}


def _ln(mean, var_form="cc", scale="rsqrt"):
    """A hand-written LayerNorm whose statistics are spelled by `mean` (both) and var_form."""

    def stats(x):
        mu = mean(x)
        c = x - mu
        if var_form == "cc":
            return mu, c, mean(c * c)
        if var_form == "pow":
            return mu, c, mean((x - mu) ** 2)
        if var_form == "var_correction_0":
            return mu, c, x.var(-1, keepdim=True, correction=0)
        raise AssertionError(var_form)

    def scaled(c, var):
        if scale == "rsqrt":
            return c * torch.rsqrt(var + EPS)
        if scale == "div_sqrt":
            return c / torch.sqrt(var + EPS)
        if scale == "one_over_sqrt":
            return c * (1 / torch.sqrt(var + EPS))
        raise AssertionError(scale)

    def fn(m, x):
        _, c, var = stats(x)
        return scaled(c, var) * m.weight + m.bias

    return fn


def _rms(mean, square="pow", scale="rsqrt"):
    def fn(m, x):
        sq = {"pow": lambda: x.pow(2), "mul": lambda: x * x, "square": lambda: torch.square(x)}[square]()
        ms = mean(sq)
        if scale == "rsqrt":
            return m.weight * (x * torch.rsqrt(ms + EPS))
        if scale == "div_sqrt":
            return x / torch.sqrt(ms + EPS) * m.weight
        if scale == "one_over_sqrt":
            return x * (1.0 / torch.sqrt(ms + EPS)) * m.weight
        raise AssertionError(scale)

    return fn


@pytest.mark.parametrize("mean", list(MEANS))
def test_layernorm_mean_and_variance_spellings(mean):
    # the same spelling for the mean and for the variance (the mean of the squared centred value)
    _check_rewrite(Fn(_ln(MEANS[mean])), (_x(2, 5, N),), text="hand-written LayerNorm + weight + bias", **TOL)


@pytest.mark.parametrize("mean", list(MEANS))
def test_rmsnorm_mean_square_spellings(mean):
    _check_rewrite(Fn(_rms(MEANS[mean]), bias=False), (_x(2, 5, N),), text="hand-written RMSNorm + weight",
                   **TOL)


@pytest.mark.parametrize("mean,var_form,scale", [
    ("sum_div_n", "pow", "div_sqrt"),        # ((x - mu) ** 2).sum(-1, keepdim=True) / N
    ("sum_div_shape", "cc", "one_over_sqrt"),
    ("sum_times_reciprocal", "var_correction_0", "rsqrt"),
    ("mean_unsqueeze", "pow", "div_sqrt"),
    ("sum_unsqueezed_then_divided", "cc", "div_sqrt"),
])
def test_layernorm_with_other_variance_and_scale_spellings(mean, var_form, scale):
    _check_rewrite(Fn(_ln(MEANS[mean], var_form, scale)), (_x(3, N),), text="hand-written LayerNorm", **TOL)


@pytest.mark.parametrize("square,scale", [("mul", "div_sqrt"), ("square", "one_over_sqrt"), ("pow", "rsqrt")])
def test_rmsnorm_sum_over_n_with_square_and_scale_spellings(square, scale):
    _check_rewrite(Fn(_rms(MEANS["sum_div_n"], square, scale), bias=False), (_x(3, N),),
                   text="hand-written RMSNorm + weight", **TOL)


def test_layernorm_and_rmsnorm_mixed_spellings_in_one_graph():
    # the mean as a sum / N, the variance as a mean; then an RMSNorm of the result with mean + unsqueeze
    def fn(m, x):
        mu = x.sum(-1, keepdim=True) / N
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        h = (x - mu) * torch.rsqrt(var + EPS) * m.weight + m.bias
        return h * torch.rsqrt(h.pow(2).mean(-1).unsqueeze(-1) + EPS)

    _check_rewrite(Fn(fn), (_x(2, 5, N),), rewrites=2, **TOL)


def test_llama_style_rmsnorm_with_upcast_and_sum_over_n():
    # Llama's RMSNorm in bf16 with the mean square spelled as a sum over the size: the upcast folds
    def fn(m, x):
        h = x.to(torch.float32)
        variance = h.pow(2).sum(-1, keepdim=True) / h.shape[-1]
        return m.weight * (h * torch.rsqrt(variance + EPS)).to(x.dtype)

    _check_rewrite(Fn(fn, bias=False, dtype=torch.bfloat16), (_x(3, N, dtype=torch.bfloat16),),
                   text="hand-written RMSNorm + weight", atol=2e-2, rtol=2e-2)


# --------------------------------------------------------------------------------------------------------
# Spellings the pass already took: pinned
# --------------------------------------------------------------------------------------------------------


def test_var_mean_with_correction_0_and_var_with_correction_0():
    def var_mean(m, x):
        var, mu = torch.var_mean(x, -1, correction=0, keepdim=True)
        return (x - mu) / torch.sqrt(var + EPS) * m.weight + m.bias

    def var(m, x):
        mu = x.mean(-1, keepdim=True)
        return (x - mu) * (1 / torch.sqrt(x.var(-1, keepdim=True, correction=0) + EPS)) * m.weight + m.bias

    _check_rewrite(Fn(var_mean), (_x(3, N),), text="hand-written LayerNorm + weight + bias", **TOL)
    _check_rewrite(Fn(var), (_x(3, N),), text="hand-written LayerNorm + weight + bias", **TOL)


# --------------------------------------------------------------------------------------------------------
# With dropout and a residual, in training and in eval
# --------------------------------------------------------------------------------------------------------


def _post_norm(mean, p, is_rms):
    def fn(m, x, r):
        h = r + F.dropout(x, p, m.training)
        return (_rms(mean) if is_rms else _ln(mean))(m, h)

    return fn


def _pre_norm(mean, p, is_rms):
    def fn(m, x, r):
        h = F.dropout(x, p, m.training) + r
        return (_rms(mean) if is_rms else _ln(mean))(m, h), h

    return fn


@pytest.mark.parametrize("mean", ["sum_div_n", "sum_div_shape", "reciprocal_times_torch_sum",
                                  "mean_unsqueeze", "sum_divided_then_indexed"])
@pytest.mark.parametrize("is_rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_post_and_pre_norm_with_dropout_train_and_eval(mean, is_rms):
    norm = "hand-written RMSNorm + weight" if is_rms else "hand-written LayerNorm + weight + bias"
    args = (_x(2, 5, N), _x(2, 5, N))
    # p = 0 in training (the op's mask and eager's agree); p = 0.3 in eval (dropout is the identity)
    for p, train in ((0.0, True), (0.3, False)):
        for block, text in ((_post_norm, "dropout + residual add + " + norm),
                            (_pre_norm, "(pre-norm, returns the residual)")):
            torch._dynamo.reset()
            m = Fn(block(MEANS[mean], p, is_rms), bias=not is_rms).train(train)
            _check_rewrite(m, args, text=text, **TOL)


@pytest.mark.parametrize("is_rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_pre_norm_dropout_p_positive_in_training(is_rms):
    # p > 0: the op draws its own mask, so compare through the residual it returns: dropped entries are zero
    # (else x / (1 - p)), the norm output is the eager norm of that residual, and x's gradient is zero exactly
    # where x was dropped.
    p = 0.25
    m = Fn(_pre_norm(MEANS["sum_div_n"], p, is_rms), bias=not is_rms)
    x, r = _x(64, N).requires_grad_(), _x(64, N)
    compiled, _ = _rewritten(m)
    out, h = compiled(x, r)
    assert counters["flash"]["norm"] == 1 and counters["flash"]["norm_skipped"] == 0
    delta = (h - r).detach()
    dropped = delta == 0
    assert abs(dropped.float().mean().item() - p) < 0.05
    torch.testing.assert_close(delta[~dropped], (x / (1 - p)).detach()[~dropped])
    reference = (_rms(MEANS["sum_div_n"]) if is_rms else _ln(MEANS["sum_div_n"]))(m, h.detach())
    torch.testing.assert_close(out, reference, **TOL)
    (out * torch.randn_like(out)).sum().backward()
    assert (x.grad[dropped] == 0).all() and (x.grad[~dropped] != 0).all()


# --------------------------------------------------------------------------------------------------------
# Dynamic shapes: a size divisor is symbolic too; a literal N is the size only for the example
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("divisor", ["shape", "size", "size_list"])
@pytest.mark.parametrize("is_rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_dynamic_size_divisor_is_rewritten_without_recompiles(divisor, is_rms):
    size = {"shape": lambda t: t.shape[-1], "size": lambda t: t.size(-1), "size_list": lambda t: t.size()[-1]}
    mean = lambda t: t.sum(-1, keepdim=True) / size[divisor](t)  # noqa: E731

    def fn(m, x):  # no weight: the last dim stays symbolic
        if is_rms:
            return x * torch.rsqrt(mean(x * x) + EPS)
        c = x - mean(x)
        return c / torch.sqrt(mean(c * c) + EPS)

    m = Fn(fn, bias=False)
    compiled, graphs = _rewritten(m, dynamic=True)
    for shape in ((2, 5, N), (3, 7, N), (2, 3, N + 6)):
        _assert_same(m, compiled, (_x(*shape),), **TOL)
    assert len(graphs) == 1
    assert counters["flash"]["norm"] == 1 and counters["flash"]["norm_skipped"] == 0


def test_dynamic_literal_n_over_a_symbolic_size_is_a_near_miss():
    def fn(m, x):
        return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) / N + EPS)

    m = Fn(fn, bias=False)
    with collecting() as report:
        compiled, graphs = _rewritten(m, dynamic=True)
        _assert_same(m, compiled, (_x(2, 5, N),), **TOL)
    assert counters["flash"]["norm"] == 0
    assert any("symbolic" in d.detail and "97" in d.detail for d in report.near_misses), str(report)


@pytest.mark.parametrize("scale", ["div", "reciprocal"])
def test_dynamic_literal_n_is_rewritten_where_the_weight_fixes_the_size(scale):
    # * weight of shape (N,) makes dynamo specialise the last dim to N: the literal is then proven
    def fn(m, x):
        s = x.pow(2).sum(-1, keepdim=True)
        return x * torch.rsqrt((s / N if scale == "div" else s * (1.0 / N)) + EPS) * m.weight

    m = Fn(fn, bias=False)
    compiled, graphs = _rewritten(m, dynamic=True)
    for shape in ((2, 5, N), (3, 7, N)):
        _assert_same(m, compiled, (_x(*shape),), **TOL)
    assert len(graphs) == 1
    assert counters["flash"]["norm"] == 1 and counters["flash"]["norm_skipped"] == 0


def test_e2e_flash_backend_dynamic_sum_over_size():
    # through Inductor: the size node the divisor read stays in the graph, unused, and compiles
    def fn(m, x):
        c = x - x.sum(-1, keepdim=True) / x.shape[-1]
        return c * torch.rsqrt((c * c).sum(-1, keepdim=True) / x.shape[-1] + EPS) * m.weight + m.bias

    m = Fn(fn)
    compiled = torch.compile(m, backend="flash", fullgraph=True, dynamic=True)
    for b, s in ((2, 5), (3, 8)):
        _assert_same(m, compiled, (_x(b, s, N),), **TOL)
    assert counters["stats"]["unique_graphs"] == 1
    assert counters["flash"]["norm"] == 1


# --------------------------------------------------------------------------------------------------------
# Other functions: left alone
# --------------------------------------------------------------------------------------------------------


def _ln_var_over_n_minus_1(m, x):
    mu = x.sum(-1, keepdim=True) / N
    c = x - mu
    return c * torch.rsqrt((c * c).sum(-1, keepdim=True) / (N - 1) + EPS)


def _ln_var_over_size_minus_1(m, x):
    c = x - x.mean(-1, keepdim=True)
    var = ((x - x.mean(-1, keepdim=True)) ** 2).sum(-1, keepdim=True) / (x.shape[-1] - 1)
    return c * torch.rsqrt(var + EPS)


def _ln_mean_over_n_plus_1(m, x):
    # (an RMSNorm of c would be one: RMSNorm of whatever c is; here c is scaled by x's variance)
    c = x - x.sum(-1, keepdim=True) / (N + 1)
    return c * torch.rsqrt(x.var(-1, keepdim=True, correction=0) + EPS)


def _rms_over_n_plus_1(m, x):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) / (N + 1) + EPS)


def _rms_over_another_dims_size(m, x):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) / x.shape[1] + EPS)


def _rms_times_reciprocal_of_n_minus_1(m, x):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) * (1.0 / (N - 1)) + EPS)


def _rms_times_rounded_reciprocal(m, x):
    # 0.0103 is not 1 / 97 (0.010309...): close, but another function
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) * 0.0103 + EPS)


def _rms_sum_without_division(m, x):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + EPS)


def _rms_mean_put_back_at_another_dim(m, x):
    # x is (N, N): the row mean square broadcast along columns is not a per-row RMSNorm
    return x * torch.rsqrt(x.pow(2).mean(-1).unsqueeze(0) + EPS)


def _rms_l1_sum_over_n(m, x):
    return x * torch.rsqrt(x.abs().sum(-1, keepdim=True) / N + EPS)


def _rms_sum_over_n_detached(m, x):
    # same forward, no gradient through the statistic: another backward
    return x * torch.rsqrt((x.pow(2).sum(-1, keepdim=True) / N).detach() + EPS)


def _ln_sum_mean_detached_var_via_var(m, x):
    mu = (x.sum(-1, keepdim=True) / N).detach()
    return (x - mu) / torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + EPS)


def _ln_ex2_minus_mean_squared(m, x):
    # E[x²] - E[x]²: the same value in exact arithmetic, not the same function in floating point
    mu = x.sum(-1, keepdim=True) / N
    var = x.pow(2).sum(-1, keepdim=True) / N - mu * mu
    return (x - mu) * torch.rsqrt(var + EPS)


LEFT_ALONE = [_ln_var_over_n_minus_1, _ln_var_over_size_minus_1, _ln_mean_over_n_plus_1, _rms_over_n_plus_1,
              _rms_over_another_dims_size, _rms_times_reciprocal_of_n_minus_1, _rms_times_rounded_reciprocal,
              _rms_sum_without_division, _rms_l1_sum_over_n, _rms_sum_over_n_detached,
              _ln_sum_mean_detached_var_via_var, _ln_ex2_minus_mean_squared]


@pytest.mark.parametrize("fn", LEFT_ALONE, ids=lambda f: f.__name__.strip("_"))
def test_other_functions_are_not_candidates(fn):
    _check_untouched(Fn(fn, bias=False), (_x(2, 5, N),))


def test_mean_put_back_at_another_dim_is_not_a_candidate():
    _check_untouched(Fn(_rms_mean_put_back_at_another_dim, bias=False), (_x(N, N),))


def test_near_miss_eps_after_the_square_root_of_a_sum_over_n():
    def fn(m, x):
        c = x - x.sum(-1, keepdim=True) / N
        return c / (torch.sqrt((c * c).sum(-1, keepdim=True) / N) + EPS)

    _check_near_miss(Fn(fn), (_x(3, N),), "eps is added after the square root")


def test_near_miss_sum_over_another_dim_divided_by_its_size():
    # a mean over dim 1, spelled as a sum: a candidate, over the wrong dim
    def fn(m, x):
        return x * torch.rsqrt(x.pow(2).sum(1, keepdim=True) / x.shape[1] + EPS)

    _check_near_miss(Fn(fn), (_x(2, 5, N),), "not only the last dim")


# A statistic reduced without keepdim whose dim is given back later, or on a var / std call itself: the same
# values as keepdim=True (the unsqueeze restores the reduced last dim), so rewritten.
GIVEN_BACK = {
    "rms_sum_over_n_rsqrt_index_none": (lambda m, x: x * torch.rsqrt(x.pow(2).sum(-1) / N + EPS)[..., None],
                                        "hand-written RMSNorm"),
    "rms_rsqrt_unsqueeze_last": (
        lambda m, x: m.weight * x * torch.rsqrt(x.pow(2).mean(-1) + EPS).unsqueeze(-1),
        "hand-written RMSNorm"),
    "rms_rsqrt_full_slices_none": (
        lambda m, x: x * torch.rsqrt(x.pow(2).mean(-1) + EPS)[:, :, None] * m.weight,
        "hand-written RMSNorm + weight"),
    "rms_one_over_sqrt_unsqueeze_positive": (
        lambda m, x: x * (1 / torch.sqrt(x.pow(2).mean(-1) + EPS)).unsqueeze(2), "hand-written RMSNorm"),
    "ln_var_index_none": (lambda m, x: (x - x.mean(-1)[..., None])
                          / torch.sqrt(x.var(-1, unbiased=False)[..., None] + EPS) * m.weight + m.bias,
                          "hand-written LayerNorm + weight + bias"),
    "ln_var_correction_0_unsqueeze": (lambda m, x: (x - x.mean(-1, keepdim=True))
                                      / torch.sqrt(x.var(-1, correction=0).unsqueeze(-1) + EPS),
                                      "hand-written LayerNorm"),
    "ln_rsqrt_var_then_index_none": (lambda m, x: (x - x.mean(-1, keepdim=True))
                                     * torch.rsqrt(x.var(-1, unbiased=False) + EPS)[..., None],
                                     "hand-written LayerNorm"),
    "ln_mean_square_rsqrt_then_index_none": (
        lambda m, x: (lambda c: c * torch.rsqrt(c.pow(2).mean(-1) + EPS)[..., None])(
            x - x.mean(-1, keepdim=True)), "hand-written LayerNorm"),
    "ln_std_then_index_none": (
        lambda m, x: (x - x.mean(-1, keepdim=True)) / x.std(-1, correction=0)[..., None],
        "hand-written LayerNorm"),
    "ln_var_mean_index_none": (
        lambda m, x: (lambda var, mean: (x - mean[..., None]) * torch.rsqrt(var[..., None] + EPS) * m.weight
                      + m.bias)(*torch.var_mean(x, -1, unbiased=False)),
        "hand-written LayerNorm + weight + bias"),
    "ln_var_mean_rsqrt_then_unsqueeze": (
        lambda m, x: (lambda var, mean: (x - mean.unsqueeze(-1)) * torch.rsqrt(var + EPS).unsqueeze(-1))(
            *torch.var_mean(x, dim=-1, correction=0)),
        "hand-written LayerNorm"),
    "ln_std_mean_index_none": (
        lambda m, x: (lambda std, mean: (x - mean[:, :, None]) / std[..., None])(
            *torch.std_mean(x, -1, unbiased=False)),
        "hand-written LayerNorm"),
}


@pytest.mark.parametrize("name", list(GIVEN_BACK))
def test_statistic_dim_given_back_later_is_rewritten(name):
    fn, text = GIVEN_BACK[name]
    _check_rewrite(Fn(fn), (_x(3, 5, N),), text=text, **TOL)


@pytest.mark.parametrize("fn,reason", [
    # given back at another dim: (3, 1, 5) scales x[:, :, :5] across rows, not per row
    (lambda m, x: x[:, :, :5] * torch.rsqrt(x.pow(2).mean(-1) + EPS).unsqueeze(1), "keepdim"),
    # an unbiased variance, given back: still another function
    (lambda m, x: (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1)[..., None] + EPS), "unbiased"),
    # eps added after the square root of a given-back standard deviation
    (lambda m, x: (x - x.mean(-1, keepdim=True)) / (x.std(-1, unbiased=False)[..., None] + EPS), "after the"),
], ids=["another_dim", "unbiased", "eps_after_sqrt"])
def test_near_miss_statistic_given_back_but_another_function(fn, reason):
    _check_near_miss(Fn(fn), (_x(3, 5, N),), reason)


@pytest.mark.parametrize("fn,reason", [
    # var_mean without keepdim, only the mean given back: on a square x the (N,) variance broadcasts along
    # the rows, scaling columns
    (lambda m, x: (lambda var, mean: (x - mean[..., None]) * torch.rsqrt(var + EPS))(
        *torch.var_mean(x, -1, unbiased=False)), "keepdim"),
    # both given back, but the variance unbiased
    (lambda m, x: (lambda var, mean: (x - mean[..., None]) * torch.rsqrt(var[..., None] + EPS))(
        *torch.var_mean(x, -1)), "unbiased"),
], ids=["var_not_given_back", "unbiased"])
def test_near_miss_var_mean_given_back_but_another_function(fn, reason):
    _check_near_miss(Fn(fn), (_x(N, N),), reason)


def test_near_miss_sum_intermediate_with_other_users():
    def fn(m, x):
        s = x.sum(-1, keepdim=True)
        c = x - s / N
        return c * torch.rsqrt((c * c).sum(-1, keepdim=True) / N + EPS), s

    _check_near_miss(Fn(fn), (_x(3, N),), "users outside the norm")
