"""Review (session 30) of backend="flash" across compile modes and execution contexts, on a one-block GPT
(causal attention, pre-norm residuals, Linear-GELU MLP, LM head + cross-entropy) and a one-block BERT
(post-norm, additive padding mask). What tests/test_execution_contexts_s25.py and
tests/test_dynamic_reuse_review_s26.py already pin is not repeated: this file adds mark_dynamic, sequence
length 1, dropout reproducibility under torch.manual_seed, train / eval switching back and forth, a dtype
change through .to(), torch.autograd.grad / double backward, and Inductor option spelling.

Bug fixed: options={"epilogue-fusion": False} (the spelling torch.compile accepts for Inductor, which turns
"-" into "_") crashed the compile with AttributeError under backend="flash" (config.patch of the raw name).

Checked and correct (pinned below): one graph over batch / sequence with mark_dynamic; a sequence of 1
recompiles once (0/1 specialisation, as for Inductor) and is still rewritten; fullgraph=True; the same
dropout masks after the same manual_seed, new ones otherwise; eval() recompiles and turns dropout off, train()
goes back to the first graph; .to(bfloat16) recompiles and the rewrites happen in bf16 too; autograd.grad
with create_graph=False equals eager and leaves .grad alone; a double backward raises (never a silently wrong
second derivative). Also probed by hand, equal to eager (not repeated here: Inductor compiles cost ~30 s each
on CPU): mode="reduce-overhead" with dynamic=True and mode="max-autotune-no-cudagraphs" with fullgraph=True
in training, a checkpointed block under dynamic=True, a model returning loss and logits under dynamic=True.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_execution_contexts_s25 import BertLayer, _assert_grads_close, _clear_grads, _flash_aot_eager
from torch._dynamo.utils import counters

import fx_passes._compat
from flash_backend.backend import flash_backend as flash_backend_fn

V = 53
EXPECTED = {
    "gpt": {"attention": 1, "norm": 3, "dense": 1, "cross_entropy": 1},
    "bert": {"attention": 1, "norm": 2, "dense": 1, "cross_entropy": 1},
}
TOL = dict(atol=1e-5, rtol=1e-5)


class GPT(nn.Module):
    def __init__(self, d=24, h=3, p=0.0):
        super().__init__()
        self.h = h
        self.wte = nn.Embedding(V, d)
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop, self.attn_drop = nn.Dropout(p), nn.Dropout(p)
        self.head = nn.Linear(d, V, bias=False)

    def forward(self, ids, labels=None, emb=None):
        x = self.wte(ids) if emb is None else emb
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.h, D // self.h).transpose(1, 2) for t in (q, k, v))
        s = q @ k.transpose(-1, -2) / math.sqrt(D // self.h)
        causal = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device))
        a = self.attn_drop(s.masked_fill(~causal, float("-inf")).softmax(-1)) @ v
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(B, T, D)))
        x = x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))
        logits = self.head(self.ln_f(x))
        return logits if labels is None else F.cross_entropy(logits.view(-1, V), labels.view(-1))


class Bert(nn.Module):
    """A post-norm BERT layer (test_execution_contexts_s25.BertLayer) between an embedding and an LM head."""

    def __init__(self, d=40, h=5, p=0.0):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.layer = BertLayer(d, h, p)
        self.head = nn.Linear(d, V)

    def forward(self, ids, mask, labels=None):
        x = self.emb(ids)
        ext = (1.0 - mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        logits = self.head(self.layer(x, ext))
        return logits if labels is None else F.cross_entropy(logits.view(-1, V), labels.view(-1))


def _build(kind, **kw):
    torch.manual_seed(0)
    return {"gpt": GPT, "bert": Bert}[kind](**kw)


def _inputs(kind, B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids, labels = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    if kind == "gpt":
        return (ids,), labels
    mask = torch.ones(B, T, dtype=torch.long)
    mask[-1, (T + 1) // 2:] = 0  # the last sequence is padded (none at T = 1)
    return (ids, mask), labels


def _counts():
    return {k: v for k, v in counters["flash"].items() if v}


def _times(kind, n):
    return {k: n * v for k, v in EXPECTED[kind].items()}


def _step_equal(compiled, compiled_model, eager, x, y):
    _clear_grads(compiled_model, eager)
    got, ref = compiled(*x, labels=y), eager(*x, labels=y)
    got.backward(), ref.backward()
    torch.testing.assert_close(got, ref, **TOL)
    _assert_grads_close(compiled_model, eager)


# ------------------------------------------------------------------------------- dynamic shapes
@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_mark_dynamic_batch_and_sequence_one_graph_then_length_one(kind):
    """mark_dynamic on batch and sequence (no dynamic=True): one graph for odd batch / sequence sizes, each
    equal to eager in loss and every gradient; a sequence of 1 specialises (one more graph, as Inductor's)
    and is rewritten in full too."""
    base = _build(kind)
    eager, compiled_model = copy.deepcopy(base), copy.deepcopy(base)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(compiled_model, backend=_flash_aot_eager)
    for B, T in ((2, 7), (3, 33), (5, 13), (2, 1)):
        x, y = _inputs(kind, B, T, seed=T)
        for t in (*x, y):
            torch._dynamo.mark_dynamic(t, 0)
            if T > 1:
                torch._dynamo.mark_dynamic(t, 1)
        _step_equal(compiled, compiled_model, eager, x, y)
        assert counters["stats"]["unique_graphs"] == (1 if T > 1 else 2), (B, T, dict(counters["stats"]))
        assert _counts() == _times(kind, 1 if T > 1 else 2), (B, T, _counts())


# ---------------------------------------------------------------- dropout, train / eval, fullgraph
@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_dropout_seeds_and_train_eval_switching(kind):
    """fullgraph=True, dropout 0.2 in every fused op: the same masks after the same manual_seed, new ones
    without; eval() (grad, no_grad, inference_mode) recompiles with dropout off, equal to eager eval; train()
    reuses the training graph and its seeds draw the same masks as before."""
    base = _build(kind, p=0.2)
    eager, compiled_model = copy.deepcopy(base), copy.deepcopy(base)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(compiled_model, backend=_flash_aot_eager, fullgraph=True)
    x, y = _inputs(kind, 3, 11)
    torch.manual_seed(1)
    first = compiled(*x, labels=y)
    torch.manual_seed(1)
    again = compiled(*x, labels=y)
    other = compiled(*x, labels=y)
    assert torch.equal(first, again) and not torch.equal(again, other)
    assert _counts() == EXPECTED[kind], _counts()
    compiled_model.eval(), eager.eval()
    _step_equal(compiled, compiled_model, eager, x, y)
    assert _counts() == _times(kind, 2), _counts()
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            got, ref = compiled(*x, labels=y), eager(*x, labels=y)
        torch.testing.assert_close(got, ref, **TOL)
    graphs = counters["stats"]["unique_graphs"]
    compiled_model.train()
    torch.manual_seed(1)
    torch.testing.assert_close(compiled(*x, labels=y), first, atol=0, rtol=0)
    assert counters["stats"]["unique_graphs"] == graphs  # the training graph again, no recompile


# ----------------------------------------------------------------------------------- dtype change
def test_fp32_then_bfloat16_through_to():
    """The same compiled module, fp32 then .to(bfloat16): a second graph, rewritten in full, as close to
    eager bf16 as eager bf16 is to itself (the same loss; logits within bf16 rounding)."""
    base = _build("gpt")
    eager, compiled_model = copy.deepcopy(base), copy.deepcopy(base)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(compiled_model, backend=_flash_aot_eager)
    x, y = _inputs("gpt", 2, 9)
    _step_equal(compiled, compiled_model, eager, x, y)
    compiled_model.to(torch.bfloat16), eager.to(torch.bfloat16)
    fp32 = copy.deepcopy(eager).float()
    got, ref, ref32 = compiled(*x, labels=y), eager(*x, labels=y), fp32(*x, labels=y)
    assert got.dtype == ref.dtype == torch.bfloat16
    assert _counts() == _times("gpt", 2), _counts()
    assert abs(got.float() - ref32).item() <= 2 * abs(ref.float() - ref32).item() + 1e-2
    got.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in compiled_model.parameters())
    with torch.no_grad():
        logits, ref_logits = compiled(*x), eager(*x)
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits, ref_logits, atol=3e-2, rtol=2e-2)


# ------------------------------------------------------------------------- autograd.grad, double bwd
def test_autograd_grad_on_inputs_and_double_backward_refused():
    """A float input without requires_grad, then autograd.grad (create_graph=False) to an input and to
    parameters: eager's gradients, .grad untouched. create_graph=True and a second derivative: an error that
    says so, never a silently wrong or missing second derivative."""
    base = _build("gpt")
    eager, compiled_model = copy.deepcopy(base), copy.deepcopy(base)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(compiled_model, backend=_flash_aot_eager)
    (ids,), y = _inputs("gpt", 2, 9)
    emb = torch.randn(2, 9, 24)
    torch.testing.assert_close(compiled(ids, labels=y, emb=emb), eager(ids, labels=y, emb=emb), **TOL)
    e1, e2 = emb.clone().requires_grad_(), emb.clone().requires_grad_()
    got, ref = compiled(ids, labels=y, emb=e1), eager(ids, labels=y, emb=e2)
    grads = torch.autograd.grad(got, [e1, compiled_model.ln1.weight, compiled_model.fc.bias])
    refs = torch.autograd.grad(ref, [e2, eager.ln1.weight, eager.fc.bias])
    for g, r in zip(grads, refs, strict=True):
        torch.testing.assert_close(g, r, **TOL)
    assert all(p.grad is None for p in compiled_model.parameters())
    assert _counts() == _times("gpt", 2), _counts()  # emb's requires_grad is guarded: a second graph

    torch._dynamo.reset()
    compiled = torch.compile(compiled_model, backend=_flash_aot_eager)
    e1 = emb.clone().requires_grad_()
    (g,) = torch.autograd.grad(compiled(ids, labels=y, emb=e1), e1, create_graph=True)
    torch.testing.assert_close(g, refs[0], **TOL)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(g.square().sum(), compiled_model.fc.weight)


# --------------------------------------------------------------------------------- modes, options
def test_inductor_option_spelt_with_dashes_is_accepted(monkeypatch):
    """torch.compile(backend="inductor", options={"epilogue-fusion": False}) sets epilogue_fusion; under
    backend="flash" the raw name reached config.patch: AttributeError, the compile failed."""
    seen = {}

    def fake_compile_fx(gm, example_inputs, config_patches):
        seen.update(config_patches)
        return gm.forward

    monkeypatch.setattr(fx_passes._compat, "compile_fx", fake_compile_fx)
    gm = torch.fx.symbolic_trace(nn.Linear(4, 4))
    flash_backend_fn(gm, [torch.randn(2, 4)], mode="max-autotune-no-cudagraphs",
                     options={"epilogue-fusion": False, "triton.cudagraphs": False})
    assert seen["epilogue_fusion"] is False and "epilogue-fusion" not in seen
    assert seen["max_autotune"] is True and seen["triton.cudagraphs"] is False
    assert "pre_grad_custom_pass" in seen


def test_unknown_mode_and_option_are_refused_clearly():
    """Refused as Inductor refuses them, naming the mode / the option, at the first call."""
    lin = nn.Linear(4, 4)
    for kwargs, message in (({"mode": "reduce_overhead"}, "Unrecognized mode=reduce_overhead"),
                            ({"options": {"max_autotun": True}}, "max_autotun")):
        torch._dynamo.reset()
        with pytest.raises(Exception, match=message):
            torch.compile(lin, backend="flash", **kwargs)(torch.randn(2, 4))
