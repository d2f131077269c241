"""A compiled model's outputs keep their values through backward().

The CPU bodies of our ops used to fill preallocated outputs with ``out.copy_(result)``. Inductor drops such
a copy (same layout: a no-op to it) after AOTAutograd has picked, from the traced storages, the saved tensors
the backward may overwrite; so an affine-free LayerNorm's output returned as a view (its normalised rows
are also what the backward saves) was overwritten by the backward's dx (ops/_outputs.py). Every case here
returns an op's output through a view, runs backward, then compares the returned tensors with eager's, and
the gradients too.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

B, S, N, H, D = 2, 9, 40, 3, 8


class Wrap(nn.Module):
    def __init__(self, fn, **modules):
        super().__init__()
        self.fn = fn
        for name, module in modules.items():
            setattr(self, name, module)

    def forward(self, *args):
        return self.fn(self, *args)


def _attention(q, k, v):
    return (q @ k.transpose(-2, -1) / math.sqrt(D)).softmax(-1) @ v


# name: (make the model, the input shapes, the family the flash counters must show)
CASES = {
    "layer_norm no affine [:, 0]": (lambda: Wrap(lambda m, x: F.layer_norm(x, (N,))[:, 0]), [(B, S, N)],
                                    "norm"),
    "layer_norm no affine .transpose": (lambda: Wrap(lambda m, x: m.ln(x).transpose(1, 2),
                                                     ln=nn.LayerNorm(N, elementwise_affine=False)),
                                        [(B, S, N)], "norm"),
    "rms_norm no affine .view": (lambda: Wrap(lambda m, x: F.rms_norm(x, (N,)).view(B, S * N)), [(B, S, N)],
                                 "norm"),
    "residual + LayerNorm no affine [:, 1:]": (
        lambda: Wrap(lambda m, x: m.ln(m.lin(x) + x)[:, 1:], lin=nn.Linear(N, N),
                     ln=nn.LayerNorm(N, elementwise_affine=False)), [(B, S, N)], "norm"),
    "pre-norm h and out as views": (
        lambda: Wrap(lambda m, x, r: (lambda h: (m.ln(h)[:, 0], h.transpose(1, 2)))(x + r),
                     ln=nn.LayerNorm(N, elementwise_affine=False)), [(B, S, N), (B, S, N)], "norm"),
    "affine LayerNorm .transpose": (lambda: Wrap(lambda m, x: m.ln(x).transpose(1, 2), ln=nn.LayerNorm(N)),
                                    [(B, S, N)], "norm"),
    "attention .transpose(1, 2)": (lambda: Wrap(lambda m, q, k, v: _attention(q, k, v).transpose(1, 2)),
                                   [(B, H, S, D)] * 3, "attention"),
    "attention [..., :4]": (lambda: Wrap(lambda m, q, k, v: _attention(q, k, v)[..., :4]),
                            [(B, H, S, D)] * 3, "attention"),
    "Linear + GELU [:, 0]": (lambda: Wrap(lambda m, x: F.gelu(m.lin(x))[:, 0], lin=nn.Linear(N, 24)),
                             [(B, S, N)], "dense"),
}


def _run(model, inputs, weights):
    outs = model(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    before = [o.detach().clone() for o in outs]
    sum((o * w).sum() for o, w in zip(outs, weights, strict=True)).backward()
    return before, [o.detach() for o in outs]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("name", list(CASES))
def test_returned_views_survive_backward(name, device):
    """fp32: on CUDA the norm and dense ops run their kernels, attention its reference (fp32 is not a
    kernel dtype), so both kinds of body are covered there."""
    make, shapes, family = CASES[name]
    torch.manual_seed(0)
    model = make().to(device)
    inputs = [torch.randn(shape, device=device) for shape in shapes]
    with torch.no_grad():
        probe = model(*inputs)
    probe = probe if isinstance(probe, tuple) else (probe,)
    weights = [torch.linspace(0.3, 1.7, o.numel(), device=device).view(o.shape) for o in probe]

    eager_in = [t.clone().requires_grad_() for t in inputs]
    eager_before, eager_after = _run(model, eager_in, weights)
    eager_grads = [t.grad for t in eager_in] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    counters.clear()
    compiled_in = [t.clone().requires_grad_() for t in inputs]
    before, after = _run(torch.compile(model, backend="flash"), compiled_in, weights)
    assert counters["flash"][family] >= 1, dict(counters["flash"])
    for got_before, got_after, expected in zip(before, after, eager_after, strict=True):
        torch.testing.assert_close(got_before, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_after, expected, atol=1e-5, rtol=1e-5)  # not overwritten by backward
    grads = [t.grad for t in compiled_in] + [p.grad for p in model.parameters()]
    for got, expected in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
