"""The cross-entropy pass on F.nll_loss(F.log_softmax(z, -1), target): the same function as
F.cross_entropy(z, target), spelled as PyTorch's own cross_entropy computes it.

Every spelling (F / torch / Tensor / torch.special log_softmax, nn.NLLLoss and nn.LogSoftmax modules, dim 1
of a 2-D z, dtype=torch.float32, log-probabilities reshaped after the log_softmax) is checked through the
rewrite-only backend against eager, in training, for each reduction and ignore_index, at odd sizes; then
the look-alikes that are left alone, each with its reason. The helpers are tests/test_cross_entropy_pass.py's.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_cross_entropy_pass import (
    Head,
    K,
    V,
    _check,
    _labels,
    _not_rewritten,
    _run,
    check_end_to_end_through_inductor,
)
from torch._dynamo.utils import counters

from flash_backend.backend import rewrite_only_backend
from fx_passes import collecting


def _flat(lg):
    return lg.view(-1, lg.shape[-1])


# name: loss_fn(logits, labels, **nll_loss kwargs); the logits are (B, S, C), the labels (B, S)
SPELLINGS = {
    "F.log_softmax(dim=-1)":
        lambda lg, y, **kw: F.nll_loss(F.log_softmax(_flat(lg), dim=-1), y.view(-1), **kw),
    "torch.log_softmax(z, -1)":
        lambda lg, y, **kw: F.nll_loss(torch.log_softmax(lg.reshape(-1, lg.shape[-1]), -1), y.reshape(-1),
                                       **kw),
    "z.log_softmax(-1)":
        lambda lg, y, **kw: F.nll_loss(lg.flatten(0, 1).log_softmax(-1), y.flatten(), **kw),
    "F.log_softmax(dim=1) of 2-D":
        lambda lg, y, **kw: F.nll_loss(F.log_softmax(_flat(lg), 1), y.view(-1), **kw),
    "nn.NLLLoss(nn.LogSoftmax(dim=-1))":
        lambda lg, y, **kw: nn.NLLLoss(**kw)(nn.LogSoftmax(dim=-1)(_flat(lg)), y.view(-1)),
    "log_softmax(dtype=float32)":
        lambda lg, y, **kw: F.nll_loss(F.log_softmax(_flat(lg), -1, dtype=torch.float32), y.view(-1), **kw),
    "torch.special.log_softmax":
        lambda lg, y, **kw: F.nll_loss(torch.special.log_softmax(_flat(lg), -1), y.view(-1), **kw),
    # fairseq's order: log-probabilities of the (B, S, C) logits, flattened for the loss
    "log_softmax then view":
        lambda lg, y, **kw: F.nll_loss(F.log_softmax(lg, -1).view(-1, lg.shape[-1]), y.view(-1), **kw),
    "upcast then log_softmax":
        lambda lg, y, **kw: F.nll_loss(F.log_softmax(_flat(lg.float()), -1), y.view(-1), **kw),
}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [None, 3], ids=["default_ignore", "ignore_3"])
@pytest.mark.parametrize("name", list(SPELLINGS))
def test_nll_loss_of_log_softmax_is_rewritten(name, ignore_index, reduction):
    torch.manual_seed(0)
    kwargs = {"reduction": reduction}
    if ignore_index is not None:
        kwargs["ignore_index"] = ignore_index
    loss_fn = SPELLINGS[name]
    shape, classes = (5, 3), 13  # odd sizes: 15 rows, 13 classes
    labels = _labels(shape, classes, ignore=-100 if ignore_index is None else ignore_index)
    report = _check(Head(lambda lg, y: loss_fn(lg, y, **kwargs), classes=classes),
                    (torch.randn(*shape, K), labels))
    assert "log_softmax -> F.nll_loss" in str(report) or "log_softmax -> view -> F.nll_loss" in str(report), \
        str(report)


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("shape,classes", [((1, 3), 2), ((3, 7), V), ((2, 9), 101)])
def test_odd_sizes(shape, classes, train):
    torch.manual_seed(0)
    _check(Head(SPELLINGS["nn.NLLLoss(nn.LogSoftmax(dim=-1))"], classes=classes, bias=classes != 2),
           (torch.randn(*shape, K), _labels(shape, classes)), train=train)


def test_implicit_dim_of_2d_input_is_the_last():
    # F.log_softmax without dim picks dim 1 for a 2-D input (deprecated, with a warning): the class dim.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        _check(Head(lambda lg, y: F.nll_loss(F.log_softmax(_flat(lg)), y.view(-1))),
               (torch.randn(3, 7, K), _labels((3, 7))))


@pytest.mark.parametrize("form", ["torch", "method", "special"])
def test_log_softmax_with_numpy_style_axis(form):
    # torch's log_softmax (not F.log_softmax, a Python function) takes NumPy's axis= for dim
    def loss(lg, y):
        z = _flat(lg)
        if form == "torch":
            logp = torch.log_softmax(z, axis=-1)
        elif form == "method":
            logp = z.log_softmax(axis=-1)
        else:
            logp = torch.special.log_softmax(z, axis=1)
        return F.nll_loss(logp, y.view(-1))

    _check(Head(loss), (torch.randn(3, 7, K), _labels((3, 7))))


def test_log_softmax_with_numpy_style_axis_over_another_dim_is_left_alone():
    reason = "is over dim 0 of its 2-D input"  # not on the loss's line, which the report quotes
    _not_rewritten(lambda lg, y: F.nll_loss(torch.log_softmax(_flat(lg), axis=0), y.view(-1)), reason)


def test_variant_names_the_chain():
    report = _check(Head(SPELLINGS["upcast then log_softmax"]), (torch.randn(3, 7, K), _labels((3, 7))))
    assert "F.linear -> float -> view -> log_softmax -> F.nll_loss" in str(report), str(report)


def test_ignore_index_masks_rows_exactly_like_cross_entropy():
    # The rewritten nll_loss form and the rewritten cross_entropy form are one fused call: equal results.
    torch.manual_seed(0)
    x, labels = torch.randn(4, 5, K), _labels((4, 5), ignore=7)
    nll = Head(lambda lg, y: F.nll_loss(F.log_softmax(_flat(lg), -1), y.view(-1), ignore_index=7))
    ce = Head(lambda lg, y: F.cross_entropy(_flat(lg), y.view(-1), ignore_index=7))
    ce.load_state_dict(nll.state_dict())
    got = _run(torch.compile(nll, backend=rewrite_only_backend, fullgraph=True), (x, labels), True)
    want = _run(torch.compile(ce, backend=rewrite_only_backend, fullgraph=True), (x, labels), True)
    assert counters["flash"]["cross_entropy"] == 2
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_log_softmax_dtype_float32_is_the_upcast_first(dtype, reduction):
    """What the pass assumes of log_softmax(z, dtype=torch.float32): z.float().log_softmax(), which is what
    F.cross_entropy(z.float()) computes, loss and gradient, bit for bit (eager, CPU)."""
    torch.manual_seed(0)
    z = (torch.randn(21, 37) * 3).to(dtype).requires_grad_()
    y = _labels((21,))
    a = F.nll_loss(F.log_softmax(z, -1, dtype=torch.float32), y, reduction=reduction)
    b = F.cross_entropy(z.float(), y, reduction=reduction)
    g = torch.randn(a.shape)
    assert a.dtype == b.dtype == torch.float32
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    (grad_a,), (grad_b,) = torch.autograd.grad(a, z, g), torch.autograd.grad(b, z, g)
    torch.testing.assert_close(grad_a, grad_b, atol=0, rtol=0)


def test_low_precision_logits_with_dtype_float32_are_the_upcast_variant():
    torch.manual_seed(0)
    model = Head(SPELLINGS["log_softmax(dtype=float32)"]).to(torch.bfloat16)
    x, labels = torch.randn(3, 7, K, dtype=torch.bfloat16), _labels((3, 7))
    with torch.no_grad():
        expected, _ = model(x, labels)
        with collecting() as report:
            got, logits = torch.compile(model, backend=rewrite_only_backend, fullgraph=True)(x, labels)
    assert counters["flash"]["cross_entropy"] == 1, str(report)
    assert "(logits upcast to fp32)" in str(report), str(report)
    assert got.dtype == torch.float32 and logits.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)


def test_dynamic_batch_does_not_recompile():
    model = Head(SPELLINGS["nn.NLLLoss(nn.LogSoftmax(dim=-1))"])
    compiled = torch.compile(model, backend=rewrite_only_backend, dynamic=True)
    for batch in (2, 5):
        x, labels = torch.randn(batch, 7, K), _labels((batch, 7))
        torch.testing.assert_close(compiled(x, labels)[0], model(x, labels)[0])
    assert counters["flash"]["cross_entropy"] == 1


def test_dynamic_with_loss_modules_stored_on_the_model():
    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(K, V)
            self.log_softmax = nn.LogSoftmax(dim=-1)
            self.loss = nn.NLLLoss(ignore_index=0, reduction="sum")

        def forward(self, x, labels):
            logits = self.proj(x)
            return self.loss(self.log_softmax(logits.view(-1, V)), labels.view(-1)), logits

    model = Tagger()
    compiled = torch.compile(model, backend=rewrite_only_backend, dynamic=True)
    for batch in (2, 5):
        x, labels = torch.randn(batch, 7, K), _labels((batch, 7), ignore=0)
        for g, e in zip(_run(compiled, (x, labels), True), _run(model, (x, labels), True), strict=True):
            torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    assert counters["flash"]["cross_entropy"] == 1


def test_end_to_end_through_inductor():
    check_end_to_end_through_inductor(SPELLINGS["z.log_softmax(-1)"])


# ------------------------------------------------------------------------------------------ near misses


def test_log_softmax_over_dim_0_is_left_alone():
    # A softmax over the rows of a 2-D z: another function (nll_loss then reads a column-normalised matrix).
    _not_rewritten(lambda lg, y: F.nll_loss(F.log_softmax(_flat(lg), dim=0), y.view(-1)),
                   "is over dim 0 of its 2-D input, not over the class dimension")


class _ReturnsLogProbs(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(K, V)

    def forward(self, x, labels):
        log_probs = F.log_softmax(self.proj(x).view(-1, V), dim=-1)
        return F.nll_loss(log_probs, labels.view(-1)), log_probs


def test_log_probs_also_returned_are_left_alone():
    report = _check(_ReturnsLogProbs(), (torch.randn(3, 7, K), _labels((3, 7))), rewrites=0, skipped=1)
    assert "are also used by output: the fused op does not compute them" in str(report), str(report)


def test_log_probs_also_used_by_a_regulariser_are_left_alone():
    def with_entropy(lg, y):
        log_probs = F.log_softmax(_flat(lg), -1)
        return F.nll_loss(log_probs, y.view(-1)) - 0.1 * (log_probs.exp() * log_probs).sum(-1).mean()

    _not_rewritten(with_entropy, "are also used by exp")


def test_nll_loss_with_class_weights_is_left_alone():
    weights = torch.rand(V)
    _not_rewritten(lambda lg, y: F.nll_loss(F.log_softmax(_flat(lg), -1), y.view(-1), weight=weights),
                   "class weights")
    _not_rewritten(lambda lg, y: nn.NLLLoss(weight=weights)(nn.LogSoftmax(-1)(_flat(lg)), y.view(-1)),
                   "class weights")


def test_log_softmax_of_logits_not_from_a_linear_is_left_alone():
    _not_rewritten(lambda lg, y: F.nll_loss(F.log_softmax((lg * 0.5).view(-1, V), -1), y.view(-1)), "mul")


def test_log_softmax_of_a_graph_input_is_left_alone():
    def forward(logits, labels):
        return F.nll_loss(F.log_softmax(logits, -1), labels)

    with collecting() as report:
        torch.compile(forward, backend=rewrite_only_backend, fullgraph=True)(torch.randn(6, V), _labels((6,)))
    assert counters["flash"]["cross_entropy"] == 0, str(report)
    assert "an input of this graph" in str(report), str(report)


def test_log_softmax_in_float64_is_left_alone():
    _not_rewritten(lambda lg, y: F.nll_loss(F.log_softmax(_flat(lg), -1, dtype=torch.float64), y.view(-1)),
                   "dtype=torch.float64")


def test_log_probs_cast_before_the_loss_are_left_alone():
    # Rounding the log-probabilities is not cross-entropy of the logits.
    _not_rewritten(lambda lg, y: F.nll_loss(F.log_softmax(_flat(lg), -1).half().float(), y.view(-1)),
                   "between the log_softmax and the nll_loss")


def test_class_dim_other_than_last_is_left_alone():
    # (N, C, d) log-probabilities: the nll_loss's class dimension is 1. The vocabulary moved there by
    # transpose(1, 2) is fused (tests/test_ce_dense_forms_s31.py); moved to dim 0 it is another function.
    _not_rewritten(lambda lg, y: F.nll_loss(F.log_softmax(lg, -1).transpose(0, 2), y),
                   "permutes the logits' dimensions", labels=torch.randint(0, 7, (V, 3)))


def test_nll_loss_of_other_log_probs_is_not_a_candidate():
    # Log-probabilities that come from no log_softmax here (a log of probabilities): nothing to prove.
    report = _check(Head(lambda lg, y: F.nll_loss(torch.log(F.softmax(_flat(lg), -1)), y.view(-1))),
                    (torch.randn(3, 7, K), _labels((3, 7))), rewrites=0, skipped=0)
    assert "nll_loss" not in str(report), str(report)
