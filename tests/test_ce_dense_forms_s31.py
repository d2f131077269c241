"""Cross-entropy with the classes at dim 1, and a GELU cast back with ``.to(h)`` (session 31).

Every case goes through the passes without Inductor (tests/test_norm_dense_ce_review_s25.py's harness:
dynamo + fx_passes, the graph run as plain PyTorch, the flash ops on their CPU reference) in training (outputs
and the gradients of the inputs and parameters) and in eval, at odd sizes (B=3, S=7, V=37, K=40), on fresh
random inputs, and is compared with eager.

- cross-entropy, GAP fixed (fx_passes/cross_entropy.py, _classes_moved_to_dim_1): ``F.cross_entropy(
  logits.transpose(1, 2), y)`` with logits (B, S, V) from a Linear and y (B, S), as seq2seq,
  token-classification and torchtune-style recipes feed (B, V, S) to the loss, was a near miss ("the input is
  3-D"). It is the loss of the logits' rows with the targets flattened row-major: rewritten now for every
  spelling of that transpose (``permute(0, 2, 1)``, ``transpose(-1, -2)``, ``.mT``, ``movedim(-1, 1)``,
  ``swapaxes``), followed by ``contiguous()`` or a cast up, for each reduction (the per-row loss reshaped as
  the target), ignore_index and label smoothing, after the causal-LM shift, on (B, H, W, V) logits moved by
  ``permute(0, 3, 1, 2)``, under dynamic shapes; and for ``F.nll_loss`` of a ``log_softmax`` over dim 1 of the
  moved logits or of log-probabilities moved there; since session 33 also sequence-first logits moved in one
  step by ``permute(1, 2, 0)`` (a row permutation, then the class move). Left alone, reported: a permutation
  that puts another dimension at 1 (``transpose(0, 2)``, ``.mT`` of 4-D logits; ``transpose(1, 3)`` of square
  4-D logits, the spatial dims swapped, is fused since session 33), classes at dim 1 that come from no
  transpose (a Conv1d, an einsum writing them there), a row selection after the transpose, probability
  targets, a log_softmax over another dim, log-probabilities cast or also returned.
- dense, GAP fixed (fx_passes/dense.py, _dtype_references / _cast_back_by_reference): ``F.gelu(h.float())
  .to(h)`` was no candidate at all (``.to(h)`` reads the pre-activation for its dtype, like fairseq's
  ``.type_as(h)``), and ``F.gelu(h).to(h)`` / ``.type_as(h)`` (the identity cast) were near misses; both are
  rewritten now, fp32 and bf16, also under autocast where h is bf16 and the Linear's input fp32. Pinned:
  ``.to(h.dtype)``, ``.to(dtype=h.dtype)``, ``.to(x)``; a cast to a third tensor's dtype after a GELU in h's
  dtype (kept after the op). Left alone, reported: the fp32 GELU cast to another tensor's dtype that is not
  h's (fp16 for bf16 h, fp32 for autocast's bf16 h: eager rounds the GELU there, the op to h's dtype), and a
  pre-activation also read for its values.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_cross_entropy_pass import _labels, check_end_to_end_through_inductor
from test_dense_review_s28 import _autocast
from test_norm_dense_ce_review_s25 import Fn, K, _check, _x

B, S, V = 3, 7, 37


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def _ce_head(loss_fn, returns_logits=False):
    """A Linear K -> V over (B, S, K) and loss_fn(logits, labels)."""
    def forward(m, x, y):
        logits = m.lin(x)
        loss = loss_fn(logits, y)
        return (loss, logits) if returns_logits else loss

    return Fn(forward, n=V)


def _ce_check(loss_fn, rewrites=1, text=None, reason=None, x=None, y=None, returns_logits=False, **kw):
    x = _x(B, S, K) if x is None else x
    y = _labels(x.shape[:-1]) if y is None else y
    _check(_ce_head(loss_fn, returns_logits), (x, y), "cross_entropy", rewrites, skipped=1 - rewrites,
           reason=reason, text=text, atol=1e-5, rtol=1e-5, **kw)


# ========================================================================================================
# Cross-entropy, classes at dim 1
# ========================================================================================================

MOVES = {
    # name: (logits (B, S, V) -> (B, V, S), the step named in the rewrite)
    "transpose(1, 2)": (lambda lg: lg.transpose(1, 2), "transpose"),
    "torch.transpose(2, 1)": (lambda lg: torch.transpose(lg, 2, 1), "transpose"),
    "transpose(-1, -2)": (lambda lg: lg.transpose(-1, -2), "transpose"),
    "transpose(dim0=, dim1=)": (lambda lg: lg.transpose(dim0=-1, dim1=1), "transpose"),
    "permute(0, 2, 1)": (lambda lg: lg.permute(0, 2, 1), "permute"),
    "torch.permute(dims=)": (lambda lg: torch.permute(lg, dims=(0, 2, 1)), "permute"),
    "mT": (lambda lg: lg.mT, "mT"),
    "movedim(-1, 1)": (lambda lg: lg.movedim(-1, 1), "movedim"),
    "swapaxes(1, 2)": (lambda lg: lg.swapaxes(1, 2), "swapaxes"),
    "transpose.contiguous": (lambda lg: lg.transpose(1, 2).contiguous(), "transpose -> contiguous"),
    "transpose.float": (lambda lg: lg.transpose(1, 2).float(), "transpose -> float"),
    "float.transpose": (lambda lg: lg.float().transpose(1, 2), "float -> transpose"),
}


@pytest.mark.parametrize("name", list(MOVES))
def test_cross_entropy_of_logits_moved_to_dim_1_is_fused(name):
    move, step = MOVES[name]
    _ce_check(lambda lg, y: F.cross_entropy(move(lg), y), text=f"F.linear -> {step} -> F.cross_entropy")


@pytest.mark.parametrize("reduction, ignore_index, smoothing", [
    ("mean", -100, 0.0), ("sum", 3, 0.1), ("none", -100, 0.2), ("none", 5, 0.0), ("mean", 0, 0.3),
])
def test_cross_entropy_arguments_with_classes_at_dim_1(reduction, ignore_index, smoothing):
    # the logits also returned: the op's logits feed them; reduction='none' is (B, S), as the target
    y = _labels((B, S), ignore=ignore_index)
    y[0, :2] = ignore_index
    _ce_check(lambda lg, y: F.cross_entropy(lg.transpose(1, 2), y, ignore_index=ignore_index,
                                            reduction=reduction, label_smoothing=smoothing),
              y=y, returns_logits=True, text="transpose -> F.cross_entropy")


class TorchtuneRecipeStep(nn.Module):
    """torchtune's (2024) full-finetune recipe: the shift, then ``logits.transpose(1, 2)`` into the module
    loss, the output projection bias-free."""

    def __init__(self, reduction="mean"):
        super().__init__()
        self.output = nn.Linear(K, V, bias=False)
        self._loss_fn = nn.CrossEntropyLoss(ignore_index=-100, reduction=reduction)

    def forward(self, h, labels):
        logits = self.output(h)
        # Shift so that tokens < n predict n
        logits = logits[..., :-1, :].contiguous()
        labels = labels[..., 1:].contiguous()
        logits = logits.transpose(1, 2)
        return self._loss_fn(logits, labels)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torchtune_recipe_shift_then_transpose(reduction):
    _check(TorchtuneRecipeStep(reduction), (_x(B, S, K), _labels((B, S))), "cross_entropy", 1,
           text="getitem -> contiguous -> transpose -> F.cross_entropy", atol=1e-5, rtol=1e-5)


def test_cross_entropy_over_4d_logits_moved_to_dim_1():
    # a per-pixel classifier: (B, H, W, K) -> (B, H, W, V) -> (B, V, H, W), target (B, H, W)
    _ce_check(lambda lg, y: F.cross_entropy(lg.permute(0, 3, 1, 2), y, reduction="none"),
              x=_x(2, 5, 3, K), text="permute -> F.cross_entropy")


def test_classes_at_dim_1_under_dynamic_shapes():
    argsets = [(_x(b, s, K), _labels((b, s))) for b, s in ((3, 7), (2, 9))]
    _check(_ce_head(lambda lg, y: F.cross_entropy(lg.transpose(1, 2), y, reduction="none")), argsets[0],
           "cross_entropy", 1, text="transpose -> F.cross_entropy", atol=1e-5, rtol=1e-5, dynamic=True,
           argsets=argsets)


def test_bf16_logits_cast_up_after_the_transpose():
    model = _ce_head(lambda lg, y: F.cross_entropy(lg.transpose(1, 2).float(), y)).to(torch.bfloat16)
    # the loss in fp32 from the same bf16 logits; the gradients are bf16 GEMMs summed in another order
    _check(model, (_x(B, S, K, dtype=torch.bfloat16), _labels((B, S))), "cross_entropy", 1,
           text="transpose -> float -> F.cross_entropy (logits upcast to fp32)", atol=2e-2, rtol=2e-2)


def test_classes_at_dim_1_end_to_end_through_inductor():
    # the per-row loss reshaped as the target (reshape_as in the graph) through AOTAutograd and Inductor
    check_end_to_end_through_inductor(lambda lg, y: F.cross_entropy(lg.transpose(1, 2), y, reduction="none"))


def test_transposed_logits_written_in_place_are_left_alone():
    def forward(m, x, y):
        moved = m.lin(x).transpose(1, 2)
        moved.mul_(2.0)  # through the view: the loss reads the written logits, the op would not
        return F.cross_entropy(moved, y)

    _check(Fn(forward, n=V), (_x(B, S, K), _labels((B, S))), "cross_entropy", 0, skipped=1,
           reason="written in place", atol=1e-5, rtol=1e-5)


NLL_FORMS = {
    "log_softmax(dim=1) of the transposed logits":
        lambda lg, y, **kw: F.nll_loss(F.log_softmax(lg.transpose(1, 2), dim=1), y, **kw),
    "nn.NLLLoss(nn.LogSoftmax(dim=1)) of the permuted logits":
        lambda lg, y, **kw: nn.NLLLoss(**kw)(nn.LogSoftmax(dim=1)(lg.permute(0, 2, 1)), y),
    "torch.log_softmax(dtype=float32) of .mT":
        lambda lg, y, **kw: F.nll_loss(torch.log_softmax(lg.mT, 1, dtype=torch.float32), y, **kw),
    "log_softmax(-1), then transposed":
        lambda lg, y, **kw: F.nll_loss(F.log_softmax(lg, -1).transpose(1, 2), y, **kw),
    "log_softmax(-1), then .mT":
        lambda lg, y, **kw: F.nll_loss(F.log_softmax(lg, -1).mT, y, **kw),
    "log_softmax(-1) of the shift, then transposed and contiguous":
        lambda lg, y, **kw: F.nll_loss(lg[:, :-1].log_softmax(-1).transpose(1, 2).contiguous(), y[:, 1:],
                                       **kw),
}


@pytest.mark.parametrize("kw", [{}, {"reduction": "sum", "ignore_index": 3}, {"reduction": "none"}],
                         ids=["mean", "sum_ignore_3", "none"])
@pytest.mark.parametrize("name", list(NLL_FORMS))
def test_nll_loss_with_classes_at_dim_1_is_fused(name, kw):
    loss_fn = NLL_FORMS[name]
    _ce_check(lambda lg, y: loss_fn(lg, y, **kw), y=_labels((B, S), ignore=kw.get("ignore_index", -100)),
              returns_logits=True, text="F.nll_loss")


CE_LEFT_ALONE = {
    # name: (loss_fn(logits, y), x, y, reason)
    "transpose(0, 2): classes at 0, the sequence read as classes": (
        lambda lg, y: F.cross_entropy(lg.transpose(0, 2), y), lambda: _x(B, S, K),
        lambda: torch.randint(0, S, (V, B)), "permutes the logits' dimensions by (2, 1, 0)"),
    ".mT of 4-D logits: classes at dim 2": (
        lambda lg, y: F.cross_entropy(lg.mT, y), lambda: _x(2, 5, 3, K),
        lambda: torch.randint(0, 5, (2, V, 3)), "by (0, 1, 3, 2)"),
    "a row selection after the transpose": (
        lambda lg, y: F.cross_entropy(lg.transpose(1, 2)[..., :-1], y[:, 1:]), lambda: _x(B, S, K),
        lambda: _labels((B, S)), "comes from getitem"),
    "probability targets": (
        lambda lg, y: F.cross_entropy(lg.transpose(1, 2), F.one_hot(y, V).transpose(1, 2) * 0.9 + 0.1 / V),
        lambda: _x(B, S, K), lambda: torch.randint(0, V, (B, S)), "not (N, d1, ..) int64 class indices"),
    "logits scaled, then transposed: not a Linear's": (
        lambda lg, y: F.cross_entropy((lg * 0.3).transpose(1, 2), y), lambda: _x(B, S, K),
        lambda: _labels((B, S)), "mul"),
    "nll_loss of a log_softmax over the sequence of the transposed logits": (
        lambda lg, y: F.nll_loss(F.log_softmax(lg.transpose(1, 2), dim=-1), y), lambda: _x(B, S, K),
        lambda: _labels((B, S)), "is over dim -1 of its 3-D input, not over the class dimension (1"),
    "nll_loss of log-probabilities rounded after the transpose": (
        lambda lg, y: F.nll_loss(F.log_softmax(lg, -1).transpose(1, 2).half().float(), y),
        lambda: _x(B, S, K), lambda: _labels((B, S)), "comes from float"),
}


@pytest.mark.parametrize("name", list(CE_LEFT_ALONE))
def test_classes_at_dim_1_look_alikes_are_left_alone(name):
    loss_fn, x, y, reason = CE_LEFT_ALONE[name]
    _ce_check(loss_fn, rewrites=0, reason=reason, x=x(), y=y())


def test_sequence_first_logits_permute_120_is_fused():
    # (session 33: was left alone) (S, B, V) -> (B, V, S) in one step is the row permutation (1, 0, 2), the
    # classes kept last, then the class move: the rows paired with their own targets
    _ce_check(lambda lg, y: F.cross_entropy(lg.permute(1, 2, 0), y), x=_x(S, B, K), y=_labels((B, S)),
              text="F.linear -> permute -> F.cross_entropy")


def test_square_4d_logits_transpose_13_is_fused():
    # (session 33: was left alone) (N, H, W, V) -> (N, V, W, H): the row permutation (0, 2, 1), then the
    # class move; each row is paired with its own target (the target's (N, W, H) order)
    _ce_check(lambda lg, y: F.cross_entropy(lg.transpose(1, 3), y), x=_x(2, 5, 5, K), y=_labels((2, 5, 5)),
              text="F.linear -> transpose -> F.cross_entropy")


class GenuineClassesAtDim1(nn.Module):
    """Logits written with their classes at dim 1 by something other than a transpose of a Linear's output."""

    def __init__(self, form):
        super().__init__()
        self.conv, self.lin, self.form = nn.Conv1d(K, V, 1), nn.Linear(K, V), form

    def forward(self, x, y):
        if self.form == "conv1d":
            logits = self.conv(x.transpose(1, 2))
        else:
            logits = torch.einsum("bsk,vk->bvs", x, self.lin.weight)
        return F.cross_entropy(logits, y)


@pytest.mark.parametrize("form, reason", [("conv1d", "comes from conv1d"), ("einsum", "comes from einsum")])
def test_genuine_classes_at_dim_1_are_left_alone(form, reason):
    _check(GenuineClassesAtDim1(form), (_x(B, S, K), _labels((B, S))), "cross_entropy", 0, skipped=1,
           reason=reason, atol=1e-5, rtol=1e-5)


def test_log_probs_over_dim_1_also_returned_are_left_alone():
    def forward(m, x, y):
        log_probs = F.log_softmax(m.lin(x).transpose(1, 2), dim=1)
        return F.nll_loss(log_probs, y), log_probs

    _check(Fn(forward, n=V), (_x(B, S, K), _labels((B, S))), "cross_entropy", 0, skipped=1,
           reason="are also used by output", atol=1e-5, rtol=1e-5)


# ========================================================================================================
# Dense: the GELU cast back with .to(...)
# ========================================================================================================

TO_FORMS = {
    # name: (fn(m, x), text in the rewrite for fp32, for bf16)
    "F.gelu(h.float()).to(h)": (lambda m, x: (lambda h: F.gelu(h.float()).to(h))(m.lin(x)),
                                ".to the pre-activation", "cast back to bfloat16"),
    "F.gelu(h.float()).to(h.dtype)": (lambda m, x: (lambda h: F.gelu(h.float()).to(h.dtype))(m.lin(x)),
                                      "F.linear + F.gelu", "cast back to bfloat16"),
    "F.gelu(h.float()).to(dtype=h.dtype)": (
        lambda m, x: (lambda h: F.gelu(h.float()).to(dtype=h.dtype))(m.lin(x)), "F.linear + F.gelu",
        "cast back to bfloat16"),
    "F.gelu(h.float()).to(x)": (lambda m, x: F.gelu(m.lin(x).float()).to(x), "F.linear + F.gelu",
                                "cast back to bfloat16"),
    "F.gelu(h).to(h)": (lambda m, x: (lambda h: F.gelu(h).to(h))(m.lin(x)), ".to the pre-activation",
                        ".to the pre-activation"),
    "F.gelu(h).type_as(h)": (lambda m, x: (lambda h: F.gelu(h).type_as(h))(m.lin(x)),
                             ".type_as the pre-activation", ".type_as the pre-activation"),
    "tanh GELU written out, .to(h)": (
        lambda m, x: (lambda h: (0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * (h + 0.044715 * h**3))))
                      .to(h))(m.lin(x)), "GELU written out (tanh) (.to the pre-activation)",
        "GELU written out (tanh) (.to the pre-activation)"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(TO_FORMS))
def test_gelu_cast_back_with_to_is_fused(name, dtype):
    fn, text32, text16 = TO_FORMS[name]
    text = text32 if dtype == torch.float32 else text16
    tol = 1e-5 if dtype == torch.float32 else 8e-2  # bf16: the GEMMs round differently, a bf16 ulp at 8..16
    _check(Fn(fn).to(dtype), (_x(B, S, K, dtype=dtype),), "dense", 1, text=text, atol=tol, rtol=tol)


def test_gelu_cast_back_to_the_pre_activation_under_autocast():
    # autocast: x and the weight fp32, h bf16; .to(h) casts the fp32 GELU back to bf16, what the op returns
    fn = _autocast(lambda m, x: (lambda h: F.gelu(h.float()).to(h))(m.lin(x)))
    _check(Fn(fn), (_x(B, S, K),), "dense", 1, text="(autocast to bfloat16)", atol=2e-2, rtol=2e-2)


def _cast_to(dtype):
    """The GELU (in h's dtype) cast to the dtype of another tensor, after it: kept after the op."""
    return lambda m, x: F.gelu(m.lin(x)).to(torch.zeros(1, dtype=dtype))


@pytest.mark.parametrize("dtype, to", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)],
                         ids=["fp32_to_bf16", "bf16_to_fp32"])
def test_gelu_then_cast_to_another_tensors_dtype_is_fused(dtype, to):
    tol = 1e-5 if dtype == torch.float32 else 8e-2
    _check(Fn(_cast_to(to)).to(dtype), (_x(B, S, K, dtype=dtype),), "dense", 1, text="F.linear + F.gelu",
           atol=tol, rtol=tol)


DENSE_LEFT_ALONE = {
    # name: (fn(m, x), model dtype, reason; None: no candidate, nothing reported)
    "bf16 h, fp32 GELU cast to fp16": (
        lambda m, x: F.gelu(m.lin(x).float()).to(torch.zeros(1, dtype=torch.float16)), torch.bfloat16,
        "is cast to float16 (by to), not back to bfloat16"),
    "bf16 h, fp32 GELU .to(an fp32 tensor)": (
        lambda m, x: F.gelu(m.lin(x).float()).to(torch.zeros(1)), torch.bfloat16, "is used in fp32"),
    "autocast, fp32 GELU .to(x), x fp32": (
        _autocast(lambda m, x: F.gelu(m.lin(x).float()).to(x)), torch.float32, "is used in fp32"),
    "pre-activation also read for its values (no candidate: the GELU reads h.float(), h has two readers)": (
        lambda m, x: (lambda h: (F.gelu(h.float()).to(h), h * 2))(m.lin(x)), torch.float32, None),
    "a second .to(h) of another tensor": (
        lambda m, x: (lambda h: (F.gelu(h).to(h), x.to(h)))(m.lin(x)), torch.float32,
        "pre-activation is needed"),
}


@pytest.mark.parametrize("name", list(DENSE_LEFT_ALONE))
def test_gelu_cast_look_alikes_are_left_alone(name):
    fn, dtype, reason = DENSE_LEFT_ALONE[name]
    tol = 1e-6 if dtype == torch.float32 and "autocast" not in name else 2e-2
    _check(Fn(fn).to(dtype), (_x(B, S, K, dtype=dtype),), "dense", 0, skipped=int(reason is not None),
           reason=reason, atol=tol, rtol=tol)
