"""Review of the cross-entropy pass (fx_passes/cross_entropy.py), session 27: adversarial models in styles the
earlier reviews did not cover.

Wrong rewrite found, now left alone with its reason:

- an in-place write spelled as an explicit dunder call, ``logits.__iadd__(b)``,
  ``logits.view(-1, V).__imul__(3)``, ``torch.Tensor.__iadd__(logits, b)``, the Linear's input
  ``h.__itruediv__(2)`` after the Linear, all before the loss: dynamo records these as call_method /
  call_function nodes named ``__iadd__`` & co., which _match.is_in_place did not count (its rule was "one
  trailing underscore", plus operator.iadd & co.). The pass fused anyway: the op, computing the logits itself,
  gave the loss of the logits unwritten (in inference a silently different loss; a written input even changed
  the returned logits), and a ``logits.__imul__(2)`` after the loss failed the compiled backward (a
  version-counter error) where eager's runs. The same miss made flash_backend/returned_linear.py give wrong
  gradients for a returned Linear output written by ``__iadd__``. Fixed in _match.is_in_place (every pass).

Same-function forms checked rewritten with eager's values and gradients: label smoothing with ignore_index
and the causal shift under each reduction, ignore_index outside the class range (a pad id equal to V) or
negative, a class bias added before the Linear's output (``b + lin(h)``), a 1-d hidden state viewed to (1, V),
two Linears sharing a weight with two losses, distillation on a teacher's argmax, transformers'
ForCausalLMLoss with num_items_in_batch and fp16 logits. Look-alikes left alone: pseudo-labels taken from each
other's logits by two heads (the second loss), a logit column over the sequence (a QA head's
``logits[..., 0]``), ``chunk`` of the classes, ``lin(h) - b``. Row selections by ``narrow`` / ``select`` /
``unbind`` and ``addmm`` / ``einsum`` heads were left alone here too until session 28, which rewrites them
(tests/test_cross_entropy_review_s28.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_cross_entropy_pass import Head, K, V, _check, _labels, _not_rewritten, _run
from torch._dynamo.utils import counters
from transformers.loss.loss_utils import ForCausalLMLoss

from flash_backend.backend import rewrite_only_backend
from fx_passes import collecting


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# --------------------------------------------------------------------------------------------------------
# in-place writes spelled as explicit dunder calls
# --------------------------------------------------------------------------------------------------------


class DunderWrite(nn.Module):
    """A head whose logits (or the Linear's input) are written by an explicit in-place dunder call."""

    def __init__(self, write):
        super().__init__()
        self.proj = nn.Linear(K, V)
        self.shift = nn.Parameter(torch.linspace(-2.0, 2.0, V))
        self.write = write

    def forward(self, x, labels):
        h = x + self.shift[:K]  # (every parameter used, whatever the write)
        logits = self.proj(h)
        if self.write == "logits_iadd":
            logits.__iadd__(self.shift)
        elif self.write == "view_imul":
            logits.view(-1, V).__imul__(3.0)
        elif self.write == "tensor_iadd_function":
            torch.Tensor.__iadd__(logits, self.shift)
        elif self.write == "x_itruediv":
            h.__itruediv__(2.0)  # after the Linear read h: the op, placed after its inputs, would read h / 2
        elif self.write == "logits_imul_after":
            loss = F.cross_entropy(logits.view(-1, V), labels.view(-1))
            logits.__imul__(2.0)  # the caller's logits; eager's backward reads its log-probabilities
            return loss, logits
        return F.cross_entropy(logits.view(-1, V), labels.view(-1), label_smoothing=0.1), logits


@pytest.mark.parametrize("write", ["logits_iadd", "view_imul", "tensor_iadd_function", "x_itruediv"])
def test_dunder_write_before_the_loss_is_left_alone(write):
    torch.manual_seed(0)
    model, x, labels = DunderWrite(write), torch.randn(3, 7, K), _labels((3, 7))
    with torch.no_grad():
        expected = model(x.clone(), labels)
        counters.clear()
        with collecting() as report:
            got = torch.compile(model, backend=rewrite_only_backend, fullgraph=True)(x.clone(), labels)
    assert counters["flash"]["cross_entropy"] == 0, str(report)
    assert "written in place" in str(report), str(report)
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


class LossOnly(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, labels):
        return self.inner(x, labels)[0]


def _loss_and_grads(model, x, labels):
    loss = model(x, labels)
    return [loss, *torch.autograd.grad(loss, list(model.parameters()))]


def _left_alone_as_written_in_place(write):
    """LossOnly(DunderWrite(write)) compiled: no loss rewritten, the reason "written in place", and eager's
    loss and parameter gradients."""
    torch.manual_seed(0)
    model, x, labels = LossOnly(DunderWrite(write)), torch.randn(3, 7, K), _labels((3, 7))
    expected = _loss_and_grads(model, x, labels)
    counters.clear()
    with collecting() as report:
        got = _loss_and_grads(torch.compile(model, backend=rewrite_only_backend, fullgraph=True), x, labels)
    assert counters["flash"]["cross_entropy"] == 0 and "written in place" in str(report), str(report)
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("write", ["logits_iadd", "view_imul"])
def test_dunder_write_before_the_loss_in_training_matches_eager(write):
    # fused, the op's saved logits were written after it ran: the backward failed (a version-counter error)
    _left_alone_as_written_in_place(write)


def test_dunder_write_to_returned_logits_in_training_matches_eager():
    # flash_backend/returned_linear.py gave wrong parameter gradients here (up to 1.08 off) with no loss
    # rewritten: the same is_in_place gap
    torch.manual_seed(0)
    _check(DunderWrite("logits_iadd"), (torch.randn(3, 7, K), _labels((3, 7))), rewrites=0, skipped=1)


def test_dunder_write_to_the_logits_after_the_loss_is_left_alone():
    # the op keeps the logits it returns for its backward: written after the loss, that backward failed
    _left_alone_as_written_in_place("logits_imul_after")


# --------------------------------------------------------------------------------------------------------
# same functions: rewritten, eager's values and gradients
# --------------------------------------------------------------------------------------------------------


def _pad_is_v(lg, y):  # a pad id equal to the vocabulary size, outside the class range
    return F.cross_entropy(lg.reshape(-1, V), torch.where(y == -100, V, y).view(-1), ignore_index=V,
                           label_smoothing=0.2)


def _negative_ignore(lg, y):
    return F.cross_entropy(lg.flatten(0, -2), torch.where(y == -100, -1, y).flatten(), ignore_index=-1,
                           reduction="sum")


def _shift_smoothing(reduction):
    def loss(lg, y):
        y = torch.where(y == -100, 4, y)
        return F.cross_entropy(lg[:, 1:].reshape(-1, V), y[:, :-1].reshape(-1), ignore_index=4,
                               label_smoothing=0.3, reduction=reduction)
    return loss


def _nll_rows_of_batch_sum(lg, y):  # a whole batch row dropped, the log-softmax upcast by dtype=
    return F.nll_loss(F.log_softmax(lg[1:], dim=-1, dtype=torch.float32).reshape(-1, V), y[1:].reshape(-1),
                      reduction="sum")


SAME = {
    "pad_id_is_V_smoothed": _pad_is_v,
    "negative_ignore_index_sum": _negative_ignore,
    "shift_smoothing_ignore_mean": _shift_smoothing("mean"),
    "shift_smoothing_ignore_sum": _shift_smoothing("sum"),
    "shift_smoothing_ignore_none": _shift_smoothing("none"),
    "nll_rows_of_batch_sum": _nll_rows_of_batch_sum,
    "scaled_plus_z_loss": lambda lg, y: 0.5 * F.cross_entropy(lg.view(-1, V), y.view(-1))
    + 1e-2 * torch.logsumexp(lg, -1).square().mean(),
}


@pytest.mark.parametrize("name", list(SAME))
def test_same_function_forms_are_rewritten(name):
    torch.manual_seed(0)
    _check(Head(SAME[name]), (torch.randn(3, 7, K), _labels((3, 7))))


class Params(nn.Module):
    """Parameters for heads written out: forward = fn(self, x, labels) -> (loss, logits)."""

    def __init__(self, fn, second=False):
        super().__init__()
        self.w = nn.Parameter(torch.randn(V, K) * 0.3)
        self.w2 = nn.Parameter(torch.randn(V, K) * 0.3) if second else None
        self.b = nn.Parameter(torch.randn(V))
        self.fn = fn

    def forward(self, x, labels):
        return self.fn(self, x, labels)


def _bias_first(m, x, y):  # b + lin(h), the class bias on the left
    lg = m.b + F.linear(x, m.w)
    return F.cross_entropy(lg.view(-1, V), y.view(-1), label_smoothing=0.1), lg


def _one_hidden_state(m, x, y):  # a 1-d hidden state: (V,) logits viewed to (1, V)
    lg = F.linear(x[0, 0], m.w, m.b)
    return F.cross_entropy(lg.view(1, V), y[0, 1:2], label_smoothing=0.2, reduction="none"), lg


def _shared_weight_two_losses(m, x, y):
    a, b = F.linear(x, m.w, m.b), F.linear(x * 2.0, m.w)
    loss = F.cross_entropy(a.view(-1, V), y.view(-1)) + F.cross_entropy(b.view(-1, V), y.flip(1).view(-1),
                                                                          reduction="sum")
    return loss, a


def _distillation(m, x, y):  # the target from another Linear's logits: no cycle
    student, teacher = F.linear(x, m.w, m.b), F.linear(x, m.w.flip(0))
    return F.cross_entropy(student.view(-1, V), teacher.detach().argmax(-1).view(-1)), student


def _hf_causal_num_items(m, x, y):
    lg = F.linear(x, m.w, m.b)
    return ForCausalLMLoss(lg, y, V, num_items_in_batch=(y != -100).sum() + 3), lg


@pytest.mark.parametrize("fn,rewrites", [
    (_bias_first, 1), (_one_hidden_state, 1), (_shared_weight_two_losses, 2), (_distillation, 1),
    (_hf_causal_num_items, 1),
], ids=["bias_first", "one_hidden_state", "shared_weight_two_losses", "distillation", "hf_causal_num_items"])
def test_written_out_heads_are_rewritten(fn, rewrites):
    torch.manual_seed(0)
    _check(Params(fn), (torch.randn(3, 7, K), _labels((3, 7))), rewrites=rewrites)


def test_fp16_upcast_shift_smoothing_matches_eager():
    torch.manual_seed(0)
    model = Head(lambda lg, y: F.cross_entropy(lg.float()[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1),
                                               label_smoothing=0.1)).half()
    x, labels = torch.randn(3, 7, K, dtype=torch.float16), _labels((3, 7))
    expected = _run(model, (x, labels), True)
    counters.clear()
    with collecting() as report:
        got = _run(torch.compile(model, backend=rewrite_only_backend, fullgraph=True), (x, labels), True)
    assert counters["flash"]["cross_entropy"] == 1 and "(logits upcast to fp32)" in str(report), str(report)
    for e, g in zip(expected, got, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        torch.testing.assert_close(g, e, atol=2e-3, rtol=2e-3)


# --------------------------------------------------------------------------------------------------------
# look-alikes: left alone, eager's values
# --------------------------------------------------------------------------------------------------------


def _mutual_pseudo_labels(m, x, y):
    a, b = F.linear(x, m.w, m.b), F.linear(x, m.w2)
    loss = F.cross_entropy(a.view(-1, V), b.detach().argmax(-1).view(-1)) + \
        F.cross_entropy(b.view(-1, V), a.detach().argmax(-1).view(-1))
    return loss, a + b


def test_pseudo_labels_from_each_others_logits_rewrite_one_loss_only():
    # after the first rewrite the op's logits depend on the other head's: the second loss's target is then
    # computed from its own Linear through the op, a cycle if fused
    torch.manual_seed(0)
    report = _check(Params(_mutual_pseudo_labels, second=True), (torch.randn(3, 7, K), _labels((3, 7))),
                    rewrites=1, skipped=1)
    assert "computed from the logits" in str(report), str(report)


QA_LABELS = torch.tensor([[0, 6, 3, 2, 5, 1, 4], [2, 2, 0, 1, 6, 5, 3], [6, 0, 1, 4, 4, 3, 2]])


@pytest.mark.parametrize("loss_fn,reason", [
    # a QA head: one logit column over the sequence, the sequence the classes
    (lambda lg, y: F.cross_entropy(lg[..., 0], y[:, 0]), "getitem"),
    (lambda lg, y: F.cross_entropy(lg[:, :, 1], y[:, 1], ignore_index=7), "getitem"),
    (lambda lg, y: F.cross_entropy(lg.chunk(2, dim=-1)[0].reshape(-1, (V + 1) // 2),
                                   y.reshape(-1) % ((V + 1) // 2)), "getitem"),
], ids=["qa_ellipsis_column", "qa_column", "chunk_classes"])
def test_selections_the_pass_does_not_read_are_left_alone(loss_fn, reason):
    torch.manual_seed(0)
    _not_rewritten(loss_fn, reason, labels=QA_LABELS)


@pytest.mark.parametrize("loss_fn", [
    # rows selected before the class dim (session 28, fx_passes/cross_entropy._row_selection): the loss over
    # every row with the others' targets ignored
    lambda lg, y: F.cross_entropy(lg.narrow(1, 0, 6).reshape(-1, V), y[:, 1:].reshape(-1)),
    lambda lg, y: F.cross_entropy(lg.select(1, 3), y[:, 3]),
    lambda lg, y: F.cross_entropy(lg.unbind(1)[2], y[:, 2]),
], ids=["narrow_rows", "select_row", "unbind_row"])
def test_row_selections_are_rewritten(loss_fn):
    torch.manual_seed(0)
    _check(Head(loss_fn), (torch.randn(3, 7, K), QA_LABELS))


@pytest.mark.parametrize("fn,reason", [
    (lambda m, x, y: (lambda lg: (F.cross_entropy(lg.view(-1, V), y.view(-1)), lg))(F.linear(x, m.w) - m.b),
     "sub"),
    (lambda m, x, y: (lambda lg: (F.cross_entropy(lg.view(-1, V), y.view(-1)), lg))(
        F.linear(x, m.w) + m.b[:1]), "add"),
], ids=["bias_subtracted", "one_element_bias"])
def test_heads_not_read_as_a_linear_are_left_alone(fn, reason):
    torch.manual_seed(0)
    report = _check(Params(fn), (torch.randn(3, 7, K), _labels((3, 7))), rewrites=0, skipped=1)
    assert reason in str(report), str(report)


@pytest.mark.parametrize("fn", [
    # Linears written as addmm / einsum (session 28, fx_passes/cross_entropy._addmm_linear, _einsum_linear)
    lambda m, x, y: (lambda lg: (F.cross_entropy(lg, y.view(-1)), lg))(
        torch.addmm(m.b, x.reshape(-1, K), m.w.t())),
    lambda m, x, y: (lambda lg: (F.cross_entropy(lg.view(-1, V), y.view(-1)), lg))(
        torch.einsum("bsk,vk->bsv", x + m.b[:K], m.w)),
], ids=["addmm_head", "einsum_head"])
def test_heads_written_as_addmm_or_einsum_are_rewritten(fn):
    torch.manual_seed(0)
    _check(Params(fn), (torch.randn(3, 7, K), _labels((3, 7))))
