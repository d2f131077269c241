"""Review of the cross-entropy pass (fx_passes/cross_entropy.py), session 28: row selections and LM heads
that training code writes and the pass missed.

Now rewritten, with eager's losses, logits and gradients (hidden states, weight, bias) in training and eval:

- rows of the logits selected by ``narrow`` / ``torch.narrow`` and ``select`` of a dimension before the class
  one, an item of ``unbind`` of such a dimension, and a boolean mask of leading dimensions
  (``logits[labels != -100]``, with dynamo's capture_dynamic_output_shape_ops on; off, dynamo breaks the
  graph there), also between a log_softmax and an nll_loss: each picks every row at most once, in row-major
  order, so the loss over them is the op's loss over every row with the other rows' targets ignored. The
  masked rows' count dynamo asserts on is read from the masked row numbers, not from masked logits;
- LM heads ``torch.addmm(b, h, w.t())`` (beta = alpha = 1, b of shape (V,) or (1, V)), and einsums that are
  a Linear (``"btd,vd->btv"``, ``"nd,vd->nv"``, ``"...d,vd->...v"``, either operand first, the operands as a
  list, ``"btd,dv->btv"`` of ``w.t()``), also plus a class bias.

Already rewritten, checked here: the causal-LM shift ``logits[..., :-1, :].contiguous().view(-1, V)``, rows of
the hidden states selected before the head (any selection, a mask too), ``h @ w.t() + b``, F.linear with
an nn.Embedding's (tied) weight.

Left alone, eager's values: selections along the class dimension (narrow, select, unbind), a selection after
a reshape that regrouped the rows, an integer tensor index (it may pick a row twice), a mask computed from
the logits; heads that are not a Linear's: addmm with beta != 1 or a per-row (M, V) bias, an einsum with a
per-batch weight or rows in another order, an einsum or addmm of a (K, V) weight that is not a transpose.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_norm_pass import _rewritten  # (compiled through the passes only, its graphs)
from test_pass_review_s26 import Fn, N, V, _check

from fx_passes._match import is_op

B, T = 3, 11  # 33 rows, V = 37 classes


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def _labels(*shape):
    y = torch.randint(0, V, shape)
    y.view(-1)[::4] = -100
    return y


def _seq():
    return torch.randn(B, T, N), _labels(B, T)


def _rows():
    return torch.randn(B * T, N), _labels(B * T)


def _ce(m, h, y, loss):
    """loss(logits, labels) over the head's logits; returns the loss and the logits (used elsewhere too)."""
    lg = m.head(h)
    return loss(lg, y), lg


def _masked(lg, y, **kwargs):
    keep = y != -100
    return F.cross_entropy(lg[keep], y[keep], **kwargs)


# ========================================================================================================
# row selections of the logits: rewritten
# ========================================================================================================

SELECTIONS = {
    "narrow_dim0_rows": (_rows, lambda lg, y: F.cross_entropy(lg.narrow(0, 2, 29), y[2:31])),
    "narrow_shift": (_seq, lambda lg, y: F.cross_entropy(lg.narrow(1, 0, T - 1).reshape(-1, V),
                                                         y[:, 1:].reshape(-1), label_smoothing=0.2)),
    "torch_narrow_negative_dim_none": (_seq, lambda lg, y: F.cross_entropy(
        torch.narrow(lg, -2, 1, T - 1).flatten(0, 1), y[:, :-1].flatten(), reduction="none")),
    "narrow_negative_start_sum": (_seq, lambda lg, y: F.cross_entropy(
        lg.narrow(1, -5, 4).reshape(-1, V), y[:, 6:10].reshape(-1), reduction="sum")),
    "narrow_batch_then_shift": (_seq, lambda lg, y: F.cross_entropy(
        lg.narrow(0, 1, 2)[:, :-1].reshape(-1, V), y[1:, 1:].reshape(-1))),
    "select_position": (_seq, lambda lg, y: F.cross_entropy(lg.select(1, 3), y[:, 3])),
    "torch_select_last_row_none": (_seq, lambda lg, y: F.cross_entropy(torch.select(lg, 0, -1), y[-1],
                                                                       reduction="none")),
    "select_one_row_viewed": (_rows, lambda lg, y: F.cross_entropy(lg.select(0, 5).view(1, V), y[6:7])),
    "unbind_position": (_seq, lambda lg, y: F.cross_entropy(lg.unbind(1)[2], y[:, 2], reduction="none")),
    "unbind_last_negative_dim_sum": (_seq, lambda lg, y: F.cross_entropy(lg.unbind(dim=-2)[-1], y[:, -1],
                                                                         reduction="sum")),
    "torch_unbind_batch_smoothed": (_seq, lambda lg, y: F.cross_entropy(torch.unbind(lg)[1], y[1],
                                                                        label_smoothing=0.1)),
    "mask_of_labels": (_seq, _masked),
    "mask_of_labels_none": (_seq, lambda lg, y: _masked(lg, y, reduction="none")),
    "mask_of_labels_smoothed_sum": (_seq, lambda lg, y: _masked(lg, y, reduction="sum", label_smoothing=0.3)),
    "mask_of_flat_rows": (_rows, lambda lg, y: F.cross_entropy(lg[y % 3 != 0], y[y % 3 != 0])),
    "mask_of_batch": (_seq, lambda lg, y: F.cross_entropy(lg[y[:, 0] != -100].reshape(-1, V),
                                                          y[y[:, 0] != -100].reshape(-1))),
    "nll_narrow": (_seq, lambda lg, y: F.nll_loss(F.log_softmax(lg, -1).narrow(1, 1, T - 1).reshape(-1, V),
                                                  y[:, :-1].reshape(-1))),
    "nll_unbind": (_seq, lambda lg, y: F.nll_loss(torch.log_softmax(lg, dim=-1).unbind(0)[2], y[2],
                                                  reduction="sum")),
    "nll_mask": (_seq, lambda lg, y: F.nll_loss(F.log_softmax(lg, -1)[y != -100], y[y != -100])),
    # already rewritten before this review: the causal-LM shift as older transformers models write it
    "causal_shift": (_seq, lambda lg, y: F.cross_entropy(lg[..., :-1, :].contiguous().view(-1, V),
                                                         y[..., 1:].contiguous().view(-1))),
}


@pytest.mark.parametrize("name", list(SELECTIONS))
def test_row_selection_of_the_logits_is_rewritten(name):
    inputs, loss = SELECTIONS[name]
    # a boolean index has a data-dependent row count: dynamo breaks the graph there unless told to capture it
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        _check(Fn(lambda m, h, y: _ce(m, h, y, loss)), inputs(), "cross_entropy", rewrites=1)


@pytest.mark.parametrize("log_softmax", [False, True])
def test_masked_rows_are_not_kept_for_their_count(log_softmax):
    # dynamo reads a mask's data-dependent row count (range assertions) from the masked logits or
    # log-probabilities: the count is read from the masked row numbers instead, so the op's logits and the
    # log_softmax are not computed again for it
    def loss(lg, y):
        keep = y != -100
        return F.nll_loss(F.log_softmax(lg, -1)[keep], y[keep]) if log_softmax else \
            F.cross_entropy(lg[keep], y[keep])

    model = Fn(lambda m, h, y: loss(m.head(h), y))
    h, y = _seq()
    compiled, graphs = _rewritten(model)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        got = compiled(h, y)
    torch.testing.assert_close(got, model(h, y), atol=1e-5, rtol=1e-5)
    (graph,) = [gm.graph for gm in graphs]
    fused = [n for n in graph.nodes if n.op == "call_function" and "cross_entropy" in str(n.target)]
    logits_read = [u for u in fused[0].users if u.args[1] == 1 and u.users] if len(fused) == 1 else fused
    assert len(fused) == 1 and not logits_read, graph.python_code("")
    assert not any(is_op(n, "log_softmax") for n in graph.nodes), graph.python_code("")


def test_losses_over_every_unbound_item_rewrite_the_first():
    # after the first rewrite the other items are rows of the op's logits, not of a Linear: each further
    # loss is left alone (a GEMM per loss would compute the same logits again)
    def loss(lg, y):
        return sum(F.cross_entropy(lg_b, y_b) for lg_b, y_b in zip(lg.unbind(0), y.unbind(0), strict=True))

    _check(Fn(lambda m, h, y: _ce(m, h, y, loss)), _seq(), "cross_entropy", rewrites=1, skipped=B - 1)


HIDDEN_SELECTIONS = {  # already rewritten: the head's input is any tensor
    "hidden_shift": lambda m, h, y: F.cross_entropy(m.head(h[:, :-1]).reshape(-1, V), y[:, 1:].reshape(-1)),
    "hidden_narrow": lambda m, h, y: F.cross_entropy(m.head(h.narrow(1, 2, 7)).flatten(0, 1),
                                                     y[:, 2:9].flatten()),
    "hidden_unbind": lambda m, h, y: F.cross_entropy(m.head(h.unbind(1)[4]), y[:, 4]),
    "hidden_mask": lambda m, h, y: F.cross_entropy(m.head(h[y != -100]), y[y != -100], label_smoothing=0.1),
}


@pytest.mark.parametrize("name", list(HIDDEN_SELECTIONS))
def test_row_selection_of_the_hidden_states_is_rewritten(name):
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        _check(Fn(HIDDEN_SELECTIONS[name]), _seq(), "cross_entropy", rewrites=1)


# ========================================================================================================
# row selections: left alone
# ========================================================================================================

CLASSES = 11  # the sequence dimension read as classes once the class dimension is selected away

NOT_ROWS = {
    # the class dimension narrowed or selected: a loss over other classes than the Linear's
    "narrow_classes": (lambda lg, y: F.cross_entropy(lg.narrow(-1, 0, V - 1).reshape(-1, V - 1),
                                                     y.reshape(-1) % (V - 1)), "narrow"),
    "narrow_classes_positive_dim": (lambda lg, y: F.cross_entropy(lg.narrow(2, 1, V - 1).reshape(-1, V - 1),
                                                                  y.reshape(-1) % (V - 1)), "narrow"),
    "select_class": (lambda lg, y: F.cross_entropy(lg.select(-1, 0), y[:, 0] % CLASSES), "select"),
    "unbind_classes": (lambda lg, y: F.cross_entropy(lg.unbind(2)[1], y[:, 1] % CLASSES), "getitem"),
    # rows selected after a reshape regrouped them (the index means rows of another shape than h's)
    "narrow_after_regroup": (lambda lg, y: F.cross_entropy(lg.view(-1, V).narrow(0, 1, 30), y.view(-1)[1:31]),
                             "regrouped"),
    "select_after_regroup": (lambda lg, y: F.cross_entropy(lg.reshape(-1, V).select(0, 4).view(1, V),
                                                           y.view(-1)[4:5]), "regrouped"),
    # an integer tensor index picks a row twice: eager's loss counts it twice, a target per row once
    "tensor_index_repeats_a_row": (lambda lg, y: F.cross_entropy(
        lg[:, torch.tensor([0, 0, 5, 2])].reshape(-1, V), y[:, torch.tensor([0, 0, 5, 2])].reshape(-1)),
        "getitem"),
    # an integer index that looks like a mask (0 / 1) picks rows 0 and 1 over and over
    "long_mask": (lambda lg, y: F.cross_entropy(lg[(y[:, 0] != -100).long()].reshape(-1, V),
                                                y[(y[:, 0] != -100).long()].reshape(-1)), "getitem"),
}


@pytest.mark.parametrize("name", list(NOT_ROWS))
def test_selection_that_is_not_of_rows_is_left_alone(name):
    loss, reason = NOT_ROWS[name]
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        _check(Fn(lambda m, h, y: _ce(m, h, y, loss)), _seq(), "cross_entropy", rewrites=0, skipped=1,
               reason=reason)


def test_mask_computed_from_the_logits_is_left_alone():
    # the rows the loss reads are chosen by the logits (hard-example mining): the op would need its target,
    # built from the mask, before it computes the logits
    def loss(lg, y):
        hard = lg.detach().argmax(-1) != y
        return F.cross_entropy(lg[hard], y[hard])

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        _check(Fn(lambda m, h, y: _ce(m, h, y, loss)), _seq(), "cross_entropy", rewrites=0, skipped=1,
               reason="computed from the logits")


# ========================================================================================================
# LM heads written out
# ========================================================================================================


class Tied(nn.Module):
    """An embedding whose weight is also the LM head's (GPT-2's wte), and a class bias."""

    def __init__(self, head):
        super().__init__()
        self.emb = nn.Embedding(V, N)
        self.b = nn.Parameter(0.1 * torch.randn(V))
        self.head = head

    def forward(self, ids, y):
        h = torch.tanh(self.emb(ids))
        lg = self.head(self, h)
        loss = F.cross_entropy(lg, y.reshape(-1)[: lg.shape[0]]) if lg.dim() == 2 else \
            F.cross_entropy(lg[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1))
        return loss, lg


def _ids():
    return torch.randint(0, V, (B, T)), _labels(B, T)


def _w(m):
    return m.emb.weight


HEADS = {
    "addmm": lambda m, h: torch.addmm(m.b, h.reshape(-1, N), _w(m).t()),
    "addmm_row_bias_alpha_beta_one": lambda m, h: torch.addmm(m.b.view(1, V), h.view(-1, N), _w(m).T, beta=1,
                                                              alpha=1),
    "addmm_method": lambda m, h: m.b.addmm(h.flatten(0, 1), _w(m).transpose(0, 1)),
    "einsum_btd": lambda m, h: torch.einsum("btd,vd->btv", h, _w(m)),
    "einsum_nd": lambda m, h: torch.einsum("nd,vd->nv", h.reshape(-1, N), _w(m)),
    "einsum_ellipsis_spaces": lambda m, h: torch.einsum("...d, vd -> ...v", h, _w(m)),
    "einsum_weight_first": lambda m, h: torch.einsum("vd,btd->btv", _w(m), h),
    "einsum_operand_list": lambda m, h: torch.einsum("btd,vd->btv", [h, _w(m)]),
    "einsum_transposed_weight": lambda m, h: torch.einsum("btd,dv->btv", h, _w(m).t()),
    "einsum_plus_bias": lambda m, h: torch.einsum("btd,vd->btv", h, _w(m)) + m.b,
    # already rewritten before this review
    "matmul_plus_bias": lambda m, h: h @ _w(m).t() + m.b,
    "tied_linear": lambda m, h: F.linear(h, _w(m)),
}


@pytest.mark.parametrize("name", list(HEADS))
def test_lm_head_written_out_is_rewritten(name):
    _check(Tied(HEADS[name]), _ids(), "cross_entropy", rewrites=1)


def test_addmm_head_with_row_selection_is_rewritten():
    def head(m, h):
        return torch.addmm(m.b, h.reshape(-1, N), _w(m).t()).narrow(0, 0, B * T - 1)

    _check(Tied(head), _ids(), "cross_entropy", rewrites=1)


_NOT_LINEAR = "not from an F.linear"
NOT_HEADS = {
    # addmm scaling, or a bias per row: not b + x @ w.t() with a class bias
    "addmm_beta": (lambda m, h: torch.addmm(m.b, h.reshape(-1, N), _w(m).t(), beta=0.5), "addmm"),
    "addmm_alpha": (lambda m, h: torch.addmm(m.b, h.reshape(-1, N), _w(m).t(), alpha=2.0), "addmm"),
    "addmm_bias_per_row": (lambda m, h: torch.addmm(m.b * h.reshape(-1, N)[:, :1], h.reshape(-1, N),
                                                    _w(m).t()), "addmm"),
    "addmm_weight_not_transposed": (lambda m, h: torch.addmm(m.b, h.reshape(-1, N), _w(m).t().contiguous()),
                                    "addmm"),
    # a weight per batch row (not row-wise), rows in another order, a (K, V) weight that is no transpose
    "einsum_batched_weight": (lambda m, h: torch.einsum("btd,bvd->btv", h, _w(m).expand(B, V, N) * 1.5),
                              _NOT_LINEAR),
    # (T, B, V) read back as (B, T, V): rows paired with other rows' targets, were the einsum a Linear
    "einsum_rows_reordered": (lambda m, h: torch.einsum("btd,vd->tbv", h, _w(m)).reshape(B, T, V),
                              _NOT_LINEAR),
    "einsum_plain_kv_weight": (lambda m, h: torch.einsum("btd,dv->btv", h, _w(m).t().contiguous()),
                               _NOT_LINEAR),
    "einsum_sums_a_row_dim": (lambda m, h: torch.einsum("btd,vd->bv", h, _w(m)), _NOT_LINEAR),
}


@pytest.mark.parametrize("name", list(NOT_HEADS))
def test_head_that_is_not_a_linear_is_left_alone(name):
    head, reason = NOT_HEADS[name]
    _check(Tied(head), _ids(), "cross_entropy", rewrites=0, skipped=1, reason=reason)
