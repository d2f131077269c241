"""Two forms real code writes that the cross-entropy and dense passes used to miss.

- cross entropy: the causal-LM shift that slices the logits before the loss, as older transformers models
  and much training code write it, ``logits[..., :-1, :].contiguous().view(-1, V)`` against
  ``labels[..., 1:]``. A selection of rows (not along the class dimension) is rewritten: the op computes
  every row's logits, with the dropped rows' targets set to ignore_index, and still returns the full logits
  (which these heads also return). A slice, step or index along the class dimension, or a selection after
  a reshape that regrouped the rows, is left alone.
- dense: ``F.gelu(lin(x).float()).to(x.dtype)`` on a bf16/fp16 Linear is the op's function (GELU in fp32,
  rounded once to the Linear's dtype) and is rewritten; ``F.gelu(lin(x).float())`` used in fp32 is not
  (the op would round it) and is reported.
"""

from __future__ import annotations

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
from test_norm_dense_ce_review_s23 import Fn, _compile
from torch._dynamo.utils import counters

from flash_backend.backend import rewrite_only_backend
from fx_passes import collecting

# --------------------------------------------------------------------------------------------------------
# cross entropy: row selections of the logits
# --------------------------------------------------------------------------------------------------------


def shift_view(logits, labels):  # older transformers' GPT-2 / Llama heads
    shift_logits = logits[..., :-1, :].contiguous()
    shift_labels = labels[..., 1:].contiguous()
    return F.cross_entropy(shift_logits.view(-1, V), shift_labels.view(-1))


def shift_float_reshape(logits, labels):
    shift_logits = logits[..., :-1, :].contiguous().float()
    return F.cross_entropy(shift_logits.reshape(-1, V), labels[..., 1:].reshape(-1), ignore_index=3)


def shift_flatten_module(logits, labels):
    return nn.CrossEntropyLoss(ignore_index=-100)(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def shift_sum(logits, labels):
    return F.cross_entropy(logits.float()[:, 1:, :].contiguous().view(-1, V), labels[:, :-1].reshape(-1),
                           reduction="sum", label_smoothing=0.1)


def shift_per_token(logits, labels):
    return F.cross_entropy(logits[..., :-1, :].reshape(-1, V), labels[..., 1:].reshape(-1), reduction="none")


def strided_rows(logits, labels):  # a step along a row dimension still selects rows
    return F.cross_entropy(logits[:, ::2].reshape(-1, V), labels[:, ::2].reshape(-1), reduction="none")


def last_token(logits, labels):  # an index along a row dimension too
    return F.cross_entropy(logits[:, -1], labels[:, -1])


def twice_sliced_nll(logits, labels):
    z = logits[1:][:, :-1]
    return F.nll_loss(F.log_softmax(z.float(), -1).reshape(-1, V), labels[1:, 1:].reshape(-1))


SELECTIONS = [shift_view, shift_float_reshape, shift_flatten_module, shift_sum, shift_per_token, strided_rows,
              last_token, twice_sliced_nll]


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("loss_fn", SELECTIONS)
def test_row_selection_of_logits_is_rewritten(loss_fn, train):
    # Head returns the full logits too: the op returns them (their gradient flows in training, _run)
    torch.manual_seed(0)
    labels = _labels((3, 7), ignore=3 if loss_fn is shift_float_reshape else -100)
    report = _check(Head(loss_fn), (torch.randn(3, 7, K), labels), train=train)
    assert "getitem" in str(report), str(report)


class LossOnly(nn.Module):
    def __init__(self, loss_fn, dtype=torch.float32):
        super().__init__()
        self.proj = nn.Linear(K, V).to(dtype)
        self.loss_fn = loss_fn

    def forward(self, x, labels):
        return self.loss_fn(self.proj(x), labels)


def _loss_and_grads(model, x, labels):
    x = x.detach().clone().requires_grad_()
    loss = model(x, labels)
    grads = torch.autograd.grad(loss.float().sum(), [x, *model.parameters()])
    return [loss, *grads]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shift_with_loss_only_matches_eager(dtype):
    torch.manual_seed(0)
    model = LossOnly(shift_float_reshape, dtype)
    x, labels = torch.randn(2, 6, K, dtype=dtype), _labels((2, 6), ignore=3)
    expected = _loss_and_grads(model, x, labels)
    counters.clear()
    with collecting() as report:
        got = _loss_and_grads(torch.compile(model, backend=rewrite_only_backend, fullgraph=True), x, labels)
    assert counters["flash"]["cross_entropy"] == 1, str(report)
    assert "(logits upcast to fp32)" in str(report) or dtype == torch.float32, str(report)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for e, g in zip(expected, got, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        torch.testing.assert_close(g, e, atol=tol, rtol=tol)


def test_shift_bfloat16_head_returning_logits():
    torch.manual_seed(0)
    model = Head(shift_float_reshape).bfloat16()
    x, labels = torch.randn(2, 5, K, dtype=torch.bfloat16), _labels((2, 5), ignore=3)
    expected = _run(model, (x, labels), True)
    counters.clear()
    got = _run(torch.compile(model, backend=rewrite_only_backend, fullgraph=True), (x, labels), True)
    assert counters["flash"]["cross_entropy"] == 1
    for e, g in zip(expected, got, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        torch.testing.assert_close(g, e, atol=2e-2, rtol=2e-2)


def test_shift_dynamic_shapes_do_not_recompile():
    torch.manual_seed(0)
    model = Head(shift_per_token)
    compiled = torch.compile(model, backend=rewrite_only_backend, dynamic=True)
    counters.clear()
    for batch, seq in ((2, 5), (3, 8), (4, 6)):
        x, labels = torch.randn(batch, seq, K), _labels((batch, seq))
        expected = _run(model, (x, labels), True)
        got = _run(compiled, (x, labels), True)
        for e, g in zip(expected, got, strict=True):
            torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    assert counters["flash"]["cross_entropy"] == 1
    assert counters["stats"]["unique_graphs"] == 1


def test_shift_end_to_end_through_inductor():
    check_end_to_end_through_inductor(shift_view)


def test_every_selected_row_ignored_gives_nan_as_eager():
    # every selected row ignored: 'mean' is 0 / 0 as in eager, the padded rows (ignored) not counted either
    labels = torch.full((2, 4), -100)
    labels[:, 0] = 5  # never read: the shift pairs logits row t with label t + 1
    x = torch.randn(2, 4, K)
    model = Head(shift_view)
    counters.clear()
    got = torch.compile(model, backend=rewrite_only_backend, fullgraph=True)(x, labels)
    assert counters["flash"]["cross_entropy"] == 1
    torch.testing.assert_close(got, model(x, labels), equal_nan=True)
    assert got[0].isnan()


@pytest.mark.parametrize("loss_fn, classes", [
    # a slice along the class dimension: the loss over fewer classes, not the Linear's
    (lambda lg, y: F.cross_entropy(lg[..., :-1, :V - 1].reshape(-1, V - 1), y[..., 1:].reshape(-1)), V),
    # a step along it
    (lambda lg, y: F.cross_entropy(lg[..., ::2].reshape(-1, (V + 1) // 2), y.reshape(-1)), V),
    # a selection after a reshape that regrouped the rows
    (lambda lg, y: F.cross_entropy(lg.view(-1, V)[:-1], y.view(-1)[1:]), V),
])
def test_selection_not_of_rows_only_is_left_alone(loss_fn, classes):
    labels = torch.randint(0, (V - 1) // 2, (3, 7))
    report = _check(Head(loss_fn, classes=classes), (torch.randn(3, 7, K), labels), rewrites=0, skipped=1)
    assert "getitem" in str(report), str(report)


def test_index_along_class_dimension_is_left_alone():
    # lg[..., 0, :] selects rows; lg[:, :, 0] the first class: the loss input is then not (M, V) logits
    _not_rewritten(lambda lg, y: F.cross_entropy(lg[:, :, :4].reshape(-1, 4), y.reshape(-1) % 4), "getitem")


# --------------------------------------------------------------------------------------------------------
# dense: F.gelu(lin(x).float()) on a bf16 / fp16 Linear
# --------------------------------------------------------------------------------------------------------

N = 8


def _dense(fn, dtype):
    torch.manual_seed(0)
    lin = nn.Linear(K, N).to(dtype)
    return Fn(lambda x: fn(lin, x)), lin


def _same_with_params(model, compiled, lin, x, tol):
    outs, grads = [], []
    for m in (model, compiled):
        xi = x.detach().clone().requires_grad_()
        y = m(xi)
        weights = torch.linspace(0.5, 1.5, y.numel()).view(y.shape)
        outs.append(y)
        grads.append(torch.autograd.grad((y.float() * weights).sum(), [xi, *lin.parameters()]))
    assert outs[1].dtype == outs[0].dtype
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)
    for e, g in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(g, e, atol=5 * tol, rtol=5 * tol)


CAST_BACK = {
    "to_x_dtype": lambda lin, x: F.gelu(lin(x).float()).to(x.dtype),
    "tanh_type": lambda lin, x: F.gelu(lin(x).to(torch.float32), approximate="tanh").type(x.dtype),
    "module_gelu": lambda lin, x: nn.GELU()(lin(x).float()).to(dtype=x.dtype),
    "written_out_tanh": lambda lin, x: (lambda h: 0.5 * h * (1.0 + torch.tanh(
        0.7978845608028654 * (h + 0.044715 * h * h * h))))(lin(x).float()).to(x.dtype),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", list(CAST_BACK))
def test_gelu_in_fp32_cast_back_is_rewritten(form, dtype):
    model, lin = _dense(CAST_BACK[form], dtype)
    x = torch.randn(2, 3, K, dtype=dtype)
    with collecting() as report:
        _same_with_params(model, _compile(model), lin, x, tol=2e-2)
    assert counters["flash"]["dense"] == 1, report
    name = str(dtype).removeprefix("torch.")
    assert f"(in fp32, cast back to {name})" in report.rewrites[0].variant, report


def test_gelu_in_fp32_cast_back_is_bitwise_eager_forward_on_cpu():
    # ATen's bf16 GELU on CPU computes in fp32 and rounds once, as the op's reference does
    model, _ = _dense(CAST_BACK["to_x_dtype"], torch.bfloat16)
    x = torch.randn(4, 5, K, dtype=torch.bfloat16) * 3
    with collecting(), torch.no_grad():
        assert torch.equal(_compile(model)(x), model(x))
    assert counters["flash"]["dense"] == 1


def test_gelu_in_fp32_cast_back_dynamic():
    model, lin = _dense(CAST_BACK["to_x_dtype"], torch.bfloat16)
    compiled = _compile(model, dynamic=True)
    with collecting() as report:
        for shape in [(2, 3, K), (4, 5, K)]:
            _same_with_params(model, compiled, lin, torch.randn(*shape, dtype=torch.bfloat16), tol=2e-2)
    assert counters["flash"]["dense"] == 1, report


def test_fp32_linear_float_is_the_identity_and_rewritten():
    model, lin = _dense(lambda lin, x: F.gelu(lin(x).float()), torch.float32)
    with collecting() as report:
        _same_with_params(model, _compile(model), lin, torch.randn(2, 3, K), tol=1e-5)
    assert counters["flash"]["dense"] == 1, report


@pytest.mark.parametrize("fn", [
    lambda lin, x: F.gelu(lin(x).float()),  # an fp32 GELU: the op would round it to bf16
    lambda lin, x: (lambda g: g.to(x.dtype) + g.sum())(F.gelu(lin(x).float())),  # the fp32 GELU read too
])
def test_gelu_in_fp32_used_in_fp32_is_left_alone(fn):
    model, lin = _dense(fn, torch.bfloat16)
    with collecting() as report:
        _same_with_params(model, _compile(model), lin, torch.randn(2, 3, K, dtype=torch.bfloat16), tol=2e-2)
    assert counters["flash"]["dense"] == 0, report
    assert any(d.family == "dense" and "used in fp32" in d.detail for d in report.near_misses), report


def test_pre_activation_cast_up_and_read_elsewhere_is_left_alone():
    def fn(lin, x):
        h = lin(x).float()
        return F.gelu(h).to(x.dtype) + h.sum().to(x.dtype)

    model, lin = _dense(fn, torch.bfloat16)
    with collecting() as report:
        _same_with_params(model, _compile(model), lin, torch.randn(2, 3, K, dtype=torch.bfloat16), tol=2e-2)
    assert counters["flash"]["dense"] == 0, report
