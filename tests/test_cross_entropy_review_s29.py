"""Cross-entropy pass review s29: the head's input written in place after the loss, under a frozen head.

The fused op keeps x (the head's input) for its backward. Eager's ``h @ w.t()`` keeps x only when the
weight needs a gradient: with a frozen head (LoRA, a frozen tied embedding) it keeps the weight alone, so
``h.add_(..)`` after the loss trains in eager and failed the compiled backward ("modified by an inplace
operation", backend="flash" too). Now a near miss; with a trained head, or under no_grad, it is fused.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fx_passes
from flash_backend.backend import rewrite_only_backend
from fx_passes._compat import counters

V, K, N = 11, 8, 6


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(N, K, generator=gen), torch.randn(V, K, generator=gen)
    return x, w, torch.randint(0, V, (N,), generator=gen)


def _written_after(x, w, y):
    h = x * 1.0
    loss = F.cross_entropy(h @ w.t(), y)
    h.add_(1.0)
    return loss, h


def _not_written(x, w, y):
    h = x * 1.0
    return F.cross_entropy(h @ w.t(), y), h


def _run(fn, x, w, y, compiled, train=True):
    x = x.clone().requires_grad_(train)
    run = torch.compile(fn, backend=rewrite_only_backend, fullgraph=True) if compiled else fn
    with torch.set_grad_enabled(train):
        loss, h = run(x, w, y)
    if not train:
        return loss, h, None
    (loss + h.sum()).backward()
    return loss, h, x.grad


@pytest.mark.parametrize(("fn", "frozen", "rewritten"), [
    (_written_after, True, False),  # the fix: left alone (failed before)
    (_not_written, True, True),
    (_not_written, False, True),
])
def test_head_input_written_after_the_loss(fn, frozen, rewritten):
    x, w, y = _inputs()
    w = w.requires_grad_(not frozen)
    expected = _run(fn, x, w, y, compiled=False)
    torch._dynamo.reset()
    counters.clear()
    with fx_passes.collecting() as report:
        got = _run(fn, x, w, y, compiled=True)
    assert counters["flash"]["cross_entropy"] == int(rewritten), str(report)
    if not rewritten:
        assert any("written in place" in d.detail for d in report.near_misses), str(report)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)


def test_head_input_written_after_the_loss_under_no_grad_is_fused():
    x, w, y = _inputs()
    expected = _run(_written_after, x, w, y, compiled=False, train=False)
    torch._dynamo.reset()
    counters.clear()
    got = _run(_written_after, x, w, y, compiled=True, train=False)
    assert counters["flash"]["cross_entropy"] == 1
    for g, e in zip(got[:2], expected[:2], strict=True):
        torch.testing.assert_close(g, e)
