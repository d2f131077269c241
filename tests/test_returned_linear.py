"""Returned logits (flash_backend/returned_linear.py): a Linear output that a training graph returns and also
uses gets its gradient outside the compiled graph, so an unused one costs the backward no zeros of its shape.

Checked through AOTAutograd with the eager compiler (the mechanism is AOTAutograd's, not Inductor's; fast on
CPU) and once through the whole `flash` backend: the gradients match eager's whether the logits are used or
not, and when they are not, nothing of the logits' size is made in the backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch.utils._python_dispatch import TorchDispatchMode

from flash_backend import config as flash_config
from flash_backend import returned_linear
from flash_backend.backend import _detach_returned_logits
from fx_passes._compat import counters
from fx_passes._report import committed_only

K, V = 12, 97  # V > K: logits are wider than the hidden states
TOL = dict(atol=1e-5, rtol=1e-4)  # fp32, sums in another order


def _nop(gm, example_inputs):
    return make_boxed_func(gm)


def aot_eager_with_split(gm, example_inputs):
    """The flash backend's output handling around AOTAutograd without Inductor."""
    with committed_only():  # AOTAutograd restarts dynamo when it specialises a float input (dynamic=True)
        splits = _detach_returned_logits(gm)
        compiled = aot_autograd(fw_compiler=_nop, bw_compiler=_nop)(gm, example_inputs)
    return returned_linear.wrap(compiled, splits) if splits else compiled


class Head(nn.Module):
    """BERT's MLM head in small: transform, decoder Linear (weight tied to an embedding), loss and logits."""

    def __init__(self, bias=True, vocab=V, hidden=K):
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, hidden)
        self.transform = nn.Linear(hidden, hidden)
        self.decoder = nn.Linear(hidden, vocab, bias=bias)
        self.decoder.weight = self.embed.weight

    def forward(self, ids, labels):
        h = torch.tanh(self.transform(self.embed(ids)))
        logits = self.decoder(h)
        return F.cross_entropy(logits.view(-1, self.vocab), labels.view(-1)), logits


class BigZeros(TorchDispatchMode):
    """Records every constant fill (zeros, fill_, full, ...) that makes at least `numel` elements."""

    FILLS = {"zeros", "zeros_like", "new_zeros", "zero_", "fill_", "full", "full_like", "new_full", "fill"}

    def __init__(self, numel):
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in self.FILLS:
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.numel() >= self.numel:
                    self.ops.append(str(func))
        return out


def _inputs(batch=3, seq=5):
    return torch.randint(0, V, (batch, seq)), torch.randint(0, V, (batch, seq))


def _grads(model, ids, labels, logits_weight):
    """Parameter gradients of loss (+ <logits, logits_weight> when given), and the logits."""
    model.zero_grad()
    loss, logits = model(ids, labels)
    objective = loss if logits_weight is None else loss + (logits * logits_weight).sum()
    objective.backward()
    return [p.grad.clone() for p in model.parameters()], logits


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("use_logits", [False, True], ids=["loss-only", "loss-and-logits"])
def test_gradients_match_eager(bias, use_logits):
    torch.manual_seed(0)
    model = Head(bias)
    ids, labels = _inputs()
    weight = torch.randn(3, 5, V) if use_logits else None
    want, want_logits = _grads(model, ids, labels, weight)
    compiled = torch.compile(model, backend=aot_eager_with_split, fullgraph=True)
    got, got_logits = _grads(compiled, ids, labels, weight)
    assert counters["flash"]["returned_linear"] == 1
    torch.testing.assert_close(got_logits, want_logits)
    assert not got_logits._is_view() and got_logits.requires_grad
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL)


def test_unused_logits_make_no_zeros_in_the_backward(monkeypatch):
    torch.manual_seed(0)
    ids, labels = _inputs(4, 8)
    for split in (False, True):  # the check fails without the split: autograd's zeros are seen
        monkeypatch.setattr(flash_config, "detach_returned_logits", split)
        torch._dynamo.reset()
        loss, _ = torch.compile(Head(), backend=aot_eager_with_split)(ids, labels)
        with BigZeros(ids.numel() * V) as big:
            loss.backward()
        if split:
            assert big.ops == [], big.ops
        else:
            assert "aten.zeros.default" in big.ops, big.ops


def test_returned_logits_can_be_written_in_place():
    torch.manual_seed(0)
    model = Head()
    ids, labels = _inputs()
    loss, logits = torch.compile(model, backend=aot_eager_with_split)(ids, labels)
    ref_loss, ref_logits = model(ids, labels)
    logits.mul_(2)  # as on the graph's own output: the caller owns it
    ref_logits.mul_(2)
    (loss + logits.sum()).backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    (ref_loss + ref_logits.sum()).backward()
    for g, p in zip(got, model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, **TOL)


def test_dynamic_batch_does_not_recompile():
    torch.manual_seed(0)
    model = Head()
    compiled = torch.compile(model, backend=aot_eager_with_split, dynamic=True)
    for batch in (2, 6):
        ids, labels = _inputs(batch)
        weight = torch.randn(batch, 5, V)
        got, _ = _grads(compiled, ids, labels, weight)
        want, _ = _grads(model, ids, labels, weight)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, **TOL)
    assert counters["flash"]["returned_linear"] == 1


class Returned(nn.Module):
    """A Linear output returned by the graph, in the forms that keep their in-graph gradient."""

    def __init__(self, form):
        super().__init__()
        self.form = form
        self.proj = nn.Linear(K, K if form == "narrow" else V)

    def forward(self, x):
        if self.form == "computed-weight":
            y = F.linear(x, self.proj.weight * 2, self.proj.bias)
        else:
            y = self.proj(x)
        if self.form == "unused":  # GPT-2's logits before a graph break: only the caller uses them
            return (y,)
        if self.form == "written":
            y.mul_(2)
        return y.square().mean(), y


@pytest.mark.parametrize("form", ["narrow", "computed-weight", "unused", "written"])
def test_left_in_the_graph(form):
    torch.manual_seed(0)
    model = Returned(form)
    x = torch.randn(4, K, requires_grad=True)
    compiled = torch.compile(model, backend=aot_eager_with_split)
    got = compiled(x)
    want = model(x)
    assert counters["flash"]["returned_linear"] == 0
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL)
    grads = torch.autograd.grad(sum(t.sum() for t in got), [x, *model.parameters()])
    ref = torch.autograd.grad(sum(t.sum() for t in want), [x, *model.parameters()])
    for g, w in zip(grads, ref, strict=True):
        torch.testing.assert_close(g, w, **TOL)


def test_inference_is_untouched():
    model = Head()
    ids, labels = _inputs()
    with torch.no_grad():
        loss, logits = torch.compile(model, backend=aot_eager_with_split)(ids, labels)
        ref_loss, ref_logits = model(ids, labels)
    assert counters["flash"]["returned_linear"] == 0
    assert not logits.requires_grad
    torch.testing.assert_close(logits, ref_logits)
    torch.testing.assert_close(loss, ref_loss)


def test_flash_backend_end_to_end():
    """The whole backend (the cross-entropy rewrite, then Inductor): loss-only and loss-and-logits steps."""
    torch.manual_seed(0)
    model = Head()
    ids, labels = _inputs(4, 8)
    compiled = torch.compile(model, backend="flash", fullgraph=True)
    loss, _ = compiled(ids, labels)
    with BigZeros(ids.numel() * V) as big:
        loss.backward()
    assert big.ops == [], big.ops
    assert counters["flash"]["returned_linear"] == 1 and counters["flash"]["cross_entropy"] == 1
    weight = torch.randn(4, 8, V)
    got, _ = _grads(compiled, ids, labels, weight)
    want, _ = _grads(model, ids, labels, weight)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL)


@pytest.mark.cuda
@pytest.mark.parametrize("use_logits", [False, True], ids=["loss-only", "loss-and-logits"])
def test_cuda_bf16_head(use_logits):
    """On CUDA in bf16 through the flash backend (the fused cross-entropy's padded logits, Inductor): the
    gradients are within 2x eager bf16's error against the fp32 model, and a loss-only backward makes no
    zeros of the logits' size."""
    torch.manual_seed(0)
    vocab = 1003  # odd: the op pads the logits' rows to 1008
    model = Head(vocab=vocab, hidden=64).cuda()
    ids = torch.randint(0, vocab, (4, 33), device="cuda")
    labels = torch.randint(0, vocab, (4, 33), device="cuda")
    labels[:, ::4] = -100
    weight = torch.randn(4, 33, vocab, device="cuda") if use_logits else None

    def run(m):
        m.zero_grad(set_to_none=True)
        loss, logits = m(ids, labels)
        objective = loss if weight is None else loss + (logits.float() * weight).sum() * 1e-3
        objective.backward()
        return [p.grad.float() for p in m.parameters()]

    exact = run(model)
    model.bfloat16()
    want = run(model)
    compiled = torch.compile(model, backend="flash", fullgraph=True)
    got = run(compiled)
    if not use_logits:  # after the first step: compiling the backward autotunes, zeroing a cache-flush buffer
        loss, _ = compiled(ids, labels)
        with BigZeros(ids.numel() * vocab) as big:
            loss.backward()
        assert big.ops == [], big.ops
    assert counters["flash"]["returned_linear"] == 1 and counters["flash"]["cross_entropy"] == 1
    for g, w, e in zip(got, want, exact, strict=True):
        ours, eager = (g - e).abs().max().item(), (w - e).abs().max().item()
        assert ours <= 2 * eager + 1e-3, (ours, eager)


class SavedLogits(nn.Module):
    """A loss whose backward needs the logits themselves (x², as a classifier's cross-entropy needs its
    unpadded logits): the compiled graph saves the very tensor it returns."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(K, V)

    def forward(self, x):
        logits = self.proj(x)
        return logits.square().mean(), logits


@pytest.mark.parametrize("use_logits", [False, True], ids=["loss-only", "loss-and-logits"])
def test_logits_saved_for_the_backward(use_logits):
    torch.manual_seed(0)
    model = SavedLogits()
    x = torch.randn(6, K, requires_grad=True)
    weight = torch.randn(6, V) if use_logits else None
    grads = []
    for m in (model, torch.compile(model, backend=aot_eager_with_split)):
        loss, logits = m(x)
        objective = loss if weight is None else loss + (logits * weight).sum()
        grads.append(torch.autograd.grad(objective, [x, *model.parameters()]))
    assert counters["flash"]["returned_linear"] == 1
    for g, w in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(g, w, **TOL)


@pytest.mark.cuda
def test_cuda_reduce_overhead_steps():
    """Under mode="reduce-overhead" (CUDA graphs replayed from a static memory pool) the split's x and the
    returned logits come from the pool: several loss-only and loss-and-logits steps in a row still give
    eager's gradients."""
    torch.manual_seed(0)
    vocab = 1003
    model = Head(vocab=vocab, hidden=64).cuda()
    compiled = torch.compile(model, backend="flash", mode="reduce-overhead")
    for step in range(4):
        ids = torch.randint(0, vocab, (4, 33), device="cuda")
        labels = torch.randint(0, vocab, (4, 33), device="cuda")
        weight = torch.randn(4, 33, vocab, device="cuda") if step % 2 else None
        grads = []
        for m in (model, compiled):
            model.zero_grad(set_to_none=True)
            loss, logits = m(ids, labels)
            (loss if weight is None else loss + (logits * weight).sum() * 1e-3).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for g, w in zip(grads[1], grads[0], strict=True):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-3)
    assert counters["flash"]["returned_linear"] >= 1
