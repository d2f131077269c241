"""Rewrites inside ``torch.no_grad()`` / ``enable_grad()`` regions of a compiled forward.

Dynamo records such a region as grad-mode nodes in the graph. A fused call used to be inserted right after its
inputs, so a pattern inside ``with torch.no_grad():`` whose inputs came from before it ran with grad
enabled: its parameters got gradients eager never gives (fx_passes/_match.py: state_regions). The call now
runs in the state of the nodes it replaces, and a pattern that a region boundary cuts is left alone and
reported.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import flash_backend

C = 32


def _compare(model, *inputs, no_grad_call=False, tol=1e-5):
    """Outputs, input and parameter gradients of model compiled with backend="flash" against eager."""
    compiled_model = copy.deepcopy(model)
    compiled = torch.compile(compiled_model, backend="flash")
    results = []
    for m, fn in ((model, model), (compiled_model, compiled)):
        xs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
        with torch.set_grad_enabled(not no_grad_call):
            out = fn(*xs)
        if out.requires_grad:
            out.square().sum().backward()
        grads = [t.grad for t in xs] + [p.grad for p in m.parameters()]
        results.append((out.detach(), out.requires_grad, grads))
    (e_out, e_req, e_grads), (g_out, g_req, g_grads) = results
    assert g_req == e_req
    torch.testing.assert_close(g_out, e_out, atol=tol, rtol=tol)
    for (name, _), e, g in zip([("input", None)] * len(inputs) + list(model.named_parameters()), e_grads,
                               g_grads, strict=True):
        assert (e is None) == (g is None), name  # no gradient where eager has none
        if e is not None:
            if tol <= 1e-4:
                torch.testing.assert_close(g, e, atol=10 * tol, rtol=10 * tol)
            else:  # bf16: single elements of a weight gradient summed in bf16 differ by its rounding
                assert ((g.float() - e.float()).norm() / e.float().norm()).item() < tol, name


class NoGradTargets(nn.Module):
    """A LayerNorm and a Linear + GELU inside no_grad, fed by a Linear outside it (a target network)."""

    def __init__(self):
        super().__init__()
        self.lin, self.ln, self.fc = nn.Linear(C, C), nn.LayerNorm(C), nn.Linear(C, 2 * C)
        nn.init.normal_(self.ln.weight)
        nn.init.normal_(self.ln.bias)

    def forward(self, x):
        y = self.lin(x)
        with torch.no_grad():
            t = self.ln(y)
            u = F.gelu(self.fc(y))
        return (y - t).square() + u[..., :C] * y


def test_patterns_inside_no_grad_get_no_gradients():
    torch.manual_seed(0)
    counters.clear()
    _compare(NoGradTargets(), torch.randn(2, 9, C, requires_grad=True))
    assert counters["flash"]["norm"] == 1 and counters["flash"]["dense"] == 1, dict(counters["flash"])


@pytest.mark.cuda
def test_patterns_inside_no_grad_get_no_gradients_cuda():
    """The same on the GPU kernels (bf16; the norm and dense ops run their Triton / cuBLASLt paths)."""
    torch.manual_seed(0)
    counters.clear()
    model = NoGradTargets().cuda().to(torch.bfloat16)
    _compare(model, torch.randn(2, 9, C, device="cuda", dtype=torch.bfloat16, requires_grad=True), tol=2e-2)
    assert counters["flash"]["norm"] == 1 and counters["flash"]["dense"] == 1, dict(counters["flash"])


def test_attention_inside_no_grad_gets_no_gradients():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(8, 8)

        def forward(self, x):
            q = self.q(x)
            with torch.no_grad():
                a = (q @ x.transpose(-1, -2) / math.sqrt(8)).softmax(-1) @ x
            return q * a

    torch.manual_seed(0)
    counters.clear()
    _compare(Model(), torch.randn(2, 3, 9, 8, requires_grad=True))
    assert counters["flash"]["attention"] == 1, dict(counters["flash"])


def test_attention_input_from_a_closed_no_grad_block():
    """v is computed inside a no_grad block that closes between the softmax and ·v: the fused call goes
    after the block, back in the softmax's state (it used to look for a state change before the softmax:
    an internal error, reported as a near miss)."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.v = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            p = (self.q(x) @ x.transpose(-1, -2) / math.sqrt(8)).softmax(-1)
            with torch.no_grad():
                v = self.v(x)
            return p @ v

    torch.manual_seed(0)
    counters.clear()
    _compare(Model(), torch.randn(2, 3, 9, 8, requires_grad=True))
    assert counters["flash"]["attention"] == 1, dict(counters["flash"])


def test_enable_grad_inside_a_call_under_no_grad():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.fc = nn.LayerNorm(C), nn.Linear(C, 2 * C)

        def forward(self, x):
            with torch.enable_grad():
                return F.gelu(self.fc(self.ln(x)))

    torch.manual_seed(0)
    _compare(Model(), torch.randn(2, 9, C), no_grad_call=True)


def test_pattern_cut_by_a_region_boundary_is_a_near_miss():
    """The residual sum is computed with grad and also used after the region; the norm of it under no_grad.
    One fused call would compute the sum under no_grad too: left alone, reported."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(C)

        def forward(self, x, r):
            h = x + r
            with torch.no_grad():
                t = self.ln(h)
            return h * t

    torch.manual_seed(0)
    x, r = torch.randn(2, 9, C, requires_grad=True), torch.randn(2, 9, C, requires_grad=True)
    _compare(Model(), x, r)
    report = flash_backend.explain(Model(), x, r, print_report=False)
    assert any("no_grad" in d.detail for d in report.near_misses), str(report)


def test_first_call_inside_activation_checkpointing():
    """The first call of a compiled module inside torch.utils.checkpoint compiles under the checkpoint's
    saved-tensor hooks. The passes evaluate a few things on real tensors; with grad enabled those were
    saved too, so the recomputation saved fewer tensors than the forward: CheckpointError. They run under
    no_grad now (fx_passes.run_passes)."""
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.fc = nn.LayerNorm(C), nn.Linear(C, 2 * C)

        def forward(self, x):
            return F.gelu(self.fc(self.ln(x)))

    torch.manual_seed(0)
    model = Block()
    compiled_model = copy.deepcopy(model)
    compiled = torch.compile(compiled_model, backend="flash")
    x = torch.randn(2, 9, C, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    counters.clear()
    expected = checkpoint(model, x, use_reentrant=False)
    got = checkpoint(compiled, x2, use_reentrant=False)
    weights = torch.randn_like(expected)
    (expected * weights).sum().backward()
    (got * weights).sum().backward()
    assert counters["flash"]["norm"] == 1 and counters["flash"]["dense"] == 1, dict(counters["flash"])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x2.grad, x.grad, atol=1e-4, rtol=1e-4)
    for p, q in zip(model.parameters(), compiled_model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-4, rtol=1e-4)


class SpansABlock(nn.Module):
    """Dropout + residual + LayerNorm whose dropout runs before a block in another state and whose norm runs
    after it, back in the entry state: transformers' decoders compute the rotary embedding between the
    embedding dropout and the first norm, under ``@torch.no_grad()`` and ``autocast(enabled=False)``."""

    def __init__(self, block: str):
        super().__init__()
        self.block = block
        self.ln, self.lin = nn.LayerNorm(C), nn.Linear(C, C)
        nn.init.normal_(self.ln.weight)

    def forward(self, x, r):
        h = F.dropout(x, 0.0, self.training) + r
        if self.block == "no_grad":
            with torch.no_grad():
                side = self.lin(r).cos()
        elif self.block == "enable_grad":
            with torch.enable_grad():
                side = self.lin(r).cos()
        else:
            with torch.autocast(r.device.type, enabled=False):
                side = self.lin(r).cos()
        return self.ln(h) * side


def test_pattern_around_a_block_in_another_state_is_rewritten():
    """Both ends of the pattern run in the same state (the block between them is closed): the same function,
    so it is rewritten; it used to be reported as cut by a region boundary."""
    for block in ("no_grad", "autocast"):
        torch.manual_seed(0)
        x, r = torch.randn(2, 9, C, requires_grad=True), torch.randn(2, 9, C, requires_grad=True)
        counters.clear()
        _compare(SpansABlock(block), x, r)
        assert counters["flash"]["norm"] == 1, (block, dict(counters["flash"]))
        report = flash_backend.explain(SpansABlock(block), x, r, print_report=False)
        assert not report.near_misses, str(report)


def test_pattern_around_a_block_traced_under_no_grad():
    """Called under no_grad, an enable_grad block is ``_set_grad_enabled(True)`` ... ``(False)``: the closing
    one restores the entry state (the grad mode the graph was traced in; dynamo compiles one graph per grad
    mode), so the pattern around it is rewritten too."""
    torch.manual_seed(0)
    x, r = torch.randn(2, 9, C), torch.randn(2, 9, C)
    counters.clear()
    _compare(SpansABlock("enable_grad"), x, r, no_grad_call=True)
    assert counters["flash"]["norm"] == 1, dict(counters["flash"])
