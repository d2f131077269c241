"""The flash backend in the execution contexts training and inference code runs it in (review s25).

Three small models at odd sizes (sequence 37), written out as their families write them:
GPT-2 style (causal masked_fill attention, pre-LN, GELU MLP, LM head + cross-entropy), BERT style (post-LN,
additive padding mask, GELU MLP, MLM head + cross-entropy with ignore_index) and Llama style (hand-written
RMSNorm, GQA through repeat_kv, SDPA is_causal, SiLU-gated MLP). Each context compares the compiled model
with eager in the same context (outputs and every parameter gradient, or parameters after optimizer steps)
and checks that the rewrites happen:

1. bf16 autocast around the compiled call (fp32 parameters, backward outside) and inside the forward,
   training and eval: against eager under the same autocast, and no further from an fp32 run than eager
   bf16 is.
2. torch.utils.checkpoint(use_reentrant=False) around each block. Dynamo puts each checkpointed call's body
   in a subgraph of its own (tag_activation_checkpoint). backend="flash" rewrites inside them (Inductor runs
   its pre-grad passes, ours among them, on every subgraph), but explain() ran the passes on the top graph
   alone and reported no rewrite in any block; it now visits the subgraphs as Inductor does
   (flash_backend.backend.run_passes_with_subgraphs). The fused ops' dropout seeds are recomputed in the
   backward like eager dropout's. Bug: a body's entry grad mode was taken to be the compile's; a checkpoint
   called under no_grad with an enable_grad() block inside lost its parameters' gradients (silently).
3. torch.no_grad / torch.inference_mode / grad calls of one compiled model, and eval() after training
   (dropout off: deterministic, equal to eager eval).
4. dynamic=True with batch and sequence length changing between training calls (37, 41, 53), one graph.
5. Gradient accumulation, clip_grad_norm_, SGD / AdamW over 3 steps.
6. Frozen parameters (embeddings, LayerNorm / RMSNorm weights, a projection): no crash, no gradient for them.

Inductor on CPU costs ~20 s a training graph, so one case per context compiles with backend="flash"; the
others compile with the same passes and the same AOTAutograd (the fused ops' registered autograd, the
partitioner's recomputation of checkpointed regions) and run the graphs without Inductor's codegen
(_flash_aot_eager below).
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

import flash_backend
from flash_backend import backend as flash_backend_module
from flash_backend import returned_linear
from fx_passes import FlashGraphPass, mark_subgraph_entry_states
from fx_passes._report import committed_only

V, S = 97, 37
KINDS = ("gpt", "bert", "llama")
# rewrites per model (2 blocks): GPT / BERT attention + 4 norms in blocks + the final / embedding norm +
# 2 Linear-GELU + the loss; Llama attention + 5 RMSNorms + the loss (SiLU-gated MLP: no dense rewrite)
EXPECTED = {
    "gpt": {"attention": 2, "norm": 5, "dense": 2, "cross_entropy": 1},
    "bert": {"attention": 2, "norm": 5, "dense": 2, "cross_entropy": 1},
    "llama": {"attention": 2, "norm": 5, "cross_entropy": 1},
}


def _autocast(on: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if on else contextlib.nullcontext()


def _run_block(block, ckpt, *args):
    return checkpoint(block, *args, use_reentrant=False) if ckpt else block(*args)


class GPTBlock(nn.Module):
    def __init__(self, d, h, p):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop, self.attn_drop = nn.Dropout(p), nn.Dropout(p)

    def attn(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.h, D // self.h).transpose(1, 2) for t in (q, k, v))
        s = q @ k.transpose(-1, -2) / math.sqrt(D // self.h)
        causal = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device))
        a = self.attn_drop(s.masked_fill(~causal, float("-inf")).softmax(-1)) @ v
        return self.proj(a.transpose(1, 2).reshape(B, T, D))

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, d=56, h=7, n=2, p=0.0, ckpt=False, autocast_inside=False):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, d), nn.Embedding(64, d)
        self.drop = nn.Dropout(p)
        self.blocks = nn.ModuleList(GPTBlock(d, h, p) for _ in range(n))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, V, bias=False)
        self.ckpt, self.autocast_inside = ckpt, autocast_inside

    def forward(self, ids, labels=None):
        with _autocast(self.autocast_inside):
            x = self.drop(self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device)))
            for block in self.blocks:
                x = _run_block(block, self.ckpt, x)
            logits = self.head(self.ln_f(x))
            return logits if labels is None else F.cross_entropy(logits.view(-1, V), labels.view(-1))


class BertLayer(nn.Module):
    def __init__(self, d, h, p):
        super().__init__()
        self.h = h
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.ln1, self.ln2 = nn.LayerNorm(d, eps=1e-12), nn.LayerNorm(d, eps=1e-12)
        self.fc, self.out = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.drop1, self.drop2, self.attn_drop = nn.Dropout(p), nn.Dropout(p), nn.Dropout(p)

    def forward(self, x, ext_mask):
        B, T, D = x.shape

        def heads(t):
            return t.view(B, T, self.h, D // self.h).permute(0, 2, 1, 3)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(D // self.h) + ext_mask
        a = torch.matmul(self.attn_drop(F.softmax(s, dim=-1)), v).permute(0, 2, 1, 3).reshape(B, T, D)
        x = self.ln1(self.drop1(self.o(a)) + x)
        return self.ln2(self.drop2(self.out(F.gelu(self.fc(x)))) + x)


class Bert(nn.Module):
    def __init__(self, d=40, h=5, n=2, p=0.0, ckpt=False, autocast_inside=False):
        super().__init__()
        self.emb, self.pos = nn.Embedding(V, d), nn.Embedding(64, d)
        self.ln = nn.LayerNorm(d, eps=1e-12)
        self.drop = nn.Dropout(p)
        self.layers = nn.ModuleList(BertLayer(d, h, p) for _ in range(n))
        self.head = nn.Linear(d, V)
        self.ckpt, self.autocast_inside = ckpt, autocast_inside

    def forward(self, ids, mask, labels=None):
        with _autocast(self.autocast_inside):
            x = self.drop(self.ln(self.emb(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))))
            ext = (1.0 - mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
            for layer in self.layers:
                x = _run_block(layer, self.ckpt, x, ext)
            logits = self.head(x)
            if labels is None:
                return logits
            return F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100)


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)


def repeat_kv(x, n):
    B, H, T, Dh = x.shape
    return x if n == 1 else x[:, :, None, :, :].expand(B, H, n, T, Dh).reshape(B, H * n, T, Dh)


class LlamaBlock(nn.Module):
    def __init__(self, d, h, kvh):
        super().__init__()
        self.h, self.kvh, self.dh = h, kvh, d // h
        self.q, self.o = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.k, self.v = nn.Linear(d, kvh * self.dh, bias=False), nn.Linear(d, kvh * self.dh, bias=False)
        self.n1, self.n2 = RMSNorm(d), RMSNorm(d)
        self.gate, self.up = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        B, T, D = x.shape
        h = self.n1(x)
        q = self.q(h).view(B, T, self.h, self.dh).transpose(1, 2)
        k = self.k(h).view(B, T, self.kvh, self.dh).transpose(1, 2)
        v = self.v(h).view(B, T, self.kvh, self.dh).transpose(1, 2)
        k, v = repeat_kv(k, self.h // self.kvh), repeat_kv(v, self.h // self.kvh)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, D))
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, d=72, h=9, kvh=3, n=2, ckpt=False, autocast_inside=False):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.blocks = nn.ModuleList(LlamaBlock(d, h, kvh) for _ in range(n))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, V, bias=False)
        self.ckpt, self.autocast_inside = ckpt, autocast_inside

    def forward(self, ids, labels=None):
        with _autocast(self.autocast_inside):
            x = self.emb(ids)
            for block in self.blocks:
                x = _run_block(block, self.ckpt, x)
            logits = self.head(self.norm(x))
            return logits if labels is None else F.cross_entropy(logits.float().view(-1, V), labels.view(-1))


def _build(kind, **kw):
    torch.manual_seed(0)
    return {"gpt": GPT, "bert": Bert, "llama": Llama}[kind](**kw)


def _inputs(kind, B=2, T=S, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids, labels = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    if kind != "bert":
        return (ids,), labels
    mask = torch.ones(B, T, dtype=torch.long)
    mask[-1, T - 5:] = 0  # the last sequence is padded
    return (ids, mask), labels.masked_fill(mask == 0, -100)


def _boxed(gm, example_inputs):
    from functorch.compile import make_boxed_func

    return make_boxed_func(gm.forward)


_aot_eager = aot_autograd(fw_compiler=_boxed, bw_compiler=_boxed)


def _flash_aot_eager(gm, example_inputs):
    """backend="flash" up to Inductor's codegen: the returned-logits split, the flash passes as the pre-grad
    pass, AOTAutograd (the fused ops' autograd, the partitioner); the graphs then run as they are."""
    with committed_only():
        returned = flash_backend_module._detach_returned_logits(gm)
        mark_subgraph_entry_states(gm)
        flash_backend_module.run_passes_with_subgraphs(gm, FlashGraphPass())  # as Inductor runs them
        compiled = _aot_eager(gm, example_inputs)
    return returned_linear.wrap(compiled, returned) if returned else compiled


def _counts():
    return {k: v for k, v in counters["flash"].items() if v}


def _clear_grads(*models):
    for m in models:
        for p in m.parameters():
            p.grad = None


def _assert_grads_close(compiled_model, eager_model, rel=1e-4):
    """Every parameter: a gradient exactly where eager has one, equal to within rel of the gradient's scale
    (a key bias's gradient is mathematically zero: its elements are rounding noise, hence the floor)."""
    for (name, p), q in zip(compiled_model.named_parameters(), eager_model.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            tol = rel * max(q.grad.abs().max().item(), 1e-2)
            torch.testing.assert_close(p.grad, q.grad, atol=tol, rtol=rel, msg=lambda m, n=name: f"{n}: {m}")


def _train_step(fn, x, y, autocast=False):
    with _autocast(autocast):
        loss = fn(*x, labels=y)
    loss.backward()
    return loss.detach()


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------ 1. autocast
def _check_bf16(got, bf16, fp32, limit):
    """got (compiled under autocast) close to bf16 (eager under the same autocast), and no further from the
    fp32 run than eager bf16 is (with some slack: both round to bf16, differently)."""
    assert _rel(got, bf16) < limit, (_rel(got, bf16), limit)
    assert _rel(got, fp32) < 2 * _rel(bf16, fp32) + 1e-3, (_rel(got, fp32), _rel(bf16, fp32))


def _autocast_training(kind, inside, backend):
    base = _build(kind, autocast_inside=inside)
    x, y = _inputs(kind)
    fp32, eager, compiled_model = (copy.deepcopy(base) for _ in range(3))
    fp32.autocast_inside = False
    ref32 = _train_step(fp32, x, y)
    ref = _train_step(eager, x, y, autocast=not inside)
    counters.clear()
    got = _train_step(torch.compile(compiled_model, backend=backend), x, y, autocast=not inside)
    # the loss under autocast: the Linear computes in bf16 (its logits rounded to bf16), F.cross_entropy in
    # fp32. The pass gives the fused op the operands cast to bf16 in the graph, so its logits are the
    # Linear's and its loss is computed from them in fp32: eager's function (review s35b M1; it was left
    # alone before)
    assert _counts() == EXPECTED[kind], _counts()
    _check_bf16(got, ref, ref32, 1e-3)
    for (name, p), q, r in zip(compiled_model.named_parameters(), eager.parameters(), fp32.parameters(),
                               strict=True):
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        if r.grad.norm() > 1e-3:  # not the key biases (a gradient of rounding noise)
            _check_bf16(p.grad, q.grad, r.grad, 2e-2)


@pytest.mark.parametrize("kind,inside", [("gpt", True), ("bert", False), ("llama", True)])
def test_autocast_training(kind, inside):
    _autocast_training(kind, inside, _flash_aot_eager)


def test_autocast_training_flash_backend():
    _autocast_training("llama", False, "flash")


@pytest.mark.parametrize("kind", KINDS)
def test_autocast_eval(kind):
    base = _build(kind).eval()
    x, _ = _inputs(kind)
    compiled = torch.compile(copy.deepcopy(base), backend=_flash_aot_eager)
    counters.clear()
    with torch.no_grad():
        ref32 = base(*x)
        with _autocast(True):
            ref, got = base(*x), compiled(*x)
    assert got.dtype == ref.dtype == torch.bfloat16
    assert _counts() == {k: v for k, v in EXPECTED[kind].items() if k != "cross_entropy"}, _counts()
    _check_bf16(got, ref, ref32, 5e-3)


# --------------------------------------------------------------------------- 2. activation checkpointing
def _checkpointed_training(kind, backend):
    base = _build(kind, ckpt=True)
    x, y = _inputs(kind)
    eager, compiled_model = copy.deepcopy(base), copy.deepcopy(base)
    ref = _train_step(eager, x, y)
    counters.clear()
    got = _train_step(torch.compile(compiled_model, backend=backend), x, y)
    # every block is rewritten inside its checkpoint (it used to be only the norm and the loss outside them)
    assert _counts() == EXPECTED[kind], _counts()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    _assert_grads_close(compiled_model, eager)


@pytest.mark.parametrize("kind", KINDS)
def test_explain_sees_checkpointed_blocks(kind):
    """explain() reports what backend="flash" does inside checkpointed blocks (it reported the final norm and
    the loss only)."""
    x, y = _inputs(kind)
    report = flash_backend.explain(_build(kind, ckpt=True), *x, labels=y, print_report=False)
    assert dict(report.counts()) == EXPECTED[kind], str(report)
    assert not report.near_misses, str(report)


@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_checkpointed_blocks_are_rewritten(kind):
    _checkpointed_training(kind, _flash_aot_eager)


def test_checkpointed_blocks_are_rewritten_flash_backend():
    _checkpointed_training("llama", "flash")


def test_checkpointed_blocks_under_autocast_and_eval():
    base = _build("gpt", ckpt=True, autocast_inside=True)
    x, y = _inputs("gpt")
    fp32, eager, compiled_model = (copy.deepcopy(base) for _ in range(3))
    fp32.autocast_inside = False
    compiled = torch.compile(compiled_model, backend=_flash_aot_eager)
    counters.clear()
    _check_bf16(_train_step(compiled, x, y), _train_step(eager, x, y), _train_step(fp32, x, y), 1e-3)
    assert _counts()["attention"] == 2 and _counts()["dense"] == 2, _counts()
    for p, q, r in zip(compiled_model.parameters(), eager.parameters(), fp32.parameters(), strict=True):
        if r.grad.norm() > 1e-3:
            _check_bf16(p.grad, q.grad, r.grad, 2e-2)
    compiled_model.eval(), eager.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(*x), eager(*x), atol=2e-2, rtol=2e-2)


def test_checkpointed_dropout_recomputes_the_same_masks():
    """Dropout in the fused ops inside a checkpoint: the backward recomputes the block, seeds included. The
    same model compiled with and without checkpointing draws the same seeds in the same order (BERT's patterns
    all lie inside a layer), so loss and gradients must be identical."""
    x, y = _inputs("bert")
    results = []
    for ckpt in (False, True):
        model = _build("bert", ckpt=ckpt, p=0.3)
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(5)
        results.append((_train_step(torch.compile(model, backend=_flash_aot_eager), x, y), model, _counts()))
    (loss0, model0, counts0), (loss1, model1, counts1) = results
    assert counts0 == counts1 == EXPECTED["bert"], (counts0, counts1)
    torch.testing.assert_close(loss1, loss0, atol=0, rtol=0)
    _assert_grads_close(model1, model0, rel=1e-5)


class _EnableGradBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(40), nn.Linear(40, 80)

    def forward(self, x):
        h = x * 2
        with torch.enable_grad():
            return F.gelu(self.fc(self.ln(h)))


class _CheckpointUnderNoGrad(nn.Module):
    """A checkpointed block called inside no_grad, with an enable_grad() block in it (eager: its LayerNorm and
    Linear get gradients)."""

    def __init__(self):
        super().__init__()
        self.pre, self.block = nn.Linear(40, 40), _EnableGradBlock()

    def forward(self, x):
        y = self.pre(x)
        with torch.no_grad():
            z = checkpoint(self.block, y, use_reentrant=False)
        return y * z[..., :40]


def test_checkpoint_body_called_under_no_grad():
    """Inductor runs the passes on the checkpoint's body as a graph of its own; they took its entry grad mode
    to be the compile's (grad) where the call runs under no_grad, so the fused norm and dense calls went
    before the body's enable_grad block and the parameters in it got no gradient (silently). The body's entry
    state is now the grad mode at its call (fx_passes.mark_subgraph_entry_states)."""
    torch.manual_seed(0)
    eager = _CheckpointUnderNoGrad()
    compiled_model = copy.deepcopy(eager)
    x = torch.randn(2, S, 40)
    counters.clear()
    got, ref = torch.compile(compiled_model, backend="flash")(x), eager(x)
    assert _counts() == {"norm": 1, "dense": 1}, _counts()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    got.square().sum().backward()
    ref.square().sum().backward()
    _assert_grads_close(compiled_model, eager)
    report = flash_backend.explain(copy.deepcopy(eager), x, print_report=False)
    assert dict(report.counts()) == {"norm": 1, "dense": 1}, str(report)


# ------------------------------------------------------------------------ 3. grad modes and eval()
@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_grad_modes_and_eval_after_training(kind):
    base = _build(kind, p=0.3)
    x, y = _inputs(kind)
    eager, compiled_model = copy.deepcopy(base), copy.deepcopy(base)
    compiled = torch.compile(compiled_model, backend=_flash_aot_eager)
    counters.clear()
    _train_step(compiled, x, y)  # training mode, dropout active
    assert _counts() == EXPECTED[kind], _counts()
    with torch.no_grad():
        a, b = compiled(*x), compiled(*x)
    assert not torch.equal(a, b)  # still training mode: dropout draws new masks
    compiled_model.eval(), eager.eval()
    for mode in (torch.no_grad, torch.inference_mode, torch.enable_grad):
        with mode():
            ref, got, again = eager(*x), compiled(*x), compiled(*x)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(got, again), mode
        assert got.requires_grad == ref.requires_grad, mode
    # and training steps in eval mode (no dropout): gradients equal eager's
    _clear_grads(eager, compiled_model)
    torch.testing.assert_close(_train_step(compiled, x, y), _train_step(eager, x, y), atol=1e-5, rtol=1e-5)
    _assert_grads_close(compiled_model, eager)


def test_inference_mode_first_then_training():
    base = _build("llama")
    x, y = _inputs("llama")
    eager, compiled_model = copy.deepcopy(base), copy.deepcopy(base)
    compiled = torch.compile(compiled_model, backend=_flash_aot_eager)
    with torch.inference_mode():
        torch.testing.assert_close(compiled(*x, labels=y), eager(*x, labels=y), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_train_step(compiled, x, y), _train_step(eager, x, y), atol=1e-5, rtol=1e-5)
    _assert_grads_close(compiled_model, eager)


# ------------------------------------------------------------------------------- 4. dynamic shapes
def _dynamic_training(kind, backend):
    base = _build(kind)
    eager, compiled_model = copy.deepcopy(base), copy.deepcopy(base)
    compiled = torch.compile(compiled_model, backend=backend, dynamic=True)
    counters.clear()
    for batch, seq in ((2, 37), (3, 41), (2, 53)):  # batch 1 would specialise (a recompile, also correct)
        x, y = _inputs(kind, batch, seq, seed=seq)
        _clear_grads(eager, compiled_model)
        got, ref = _train_step(compiled, x, y), _train_step(eager, x, y)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        _assert_grads_close(compiled_model, eager)
    assert counters["stats"]["unique_graphs"] == 1
    assert _counts() == EXPECTED[kind], _counts()


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_dynamic_shapes_training(kind):
    _dynamic_training(kind, _flash_aot_eager)


def test_dynamic_shapes_training_flash_backend():
    _dynamic_training("bert", "flash")


# ------------------------------------------------------- 5. accumulation, clipping, optimizer steps
@pytest.mark.parametrize("kind,optimizer", [("gpt", "sgd"), ("bert", "sgd"), ("llama", "adamw")])
def test_accumulation_clipping_and_optimizer_steps(kind, optimizer):
    """AdamW only on the model without biases: a key bias's gradient is rounding noise around zero (the
    softmax does not see it), which Adam normalises into full steps whose sign is the noise's. Elsewhere an
    element whose gradient nearly vanishes still takes an Adam step that rounding moves: the parameters after
    AdamW are compared to 1% of its learning rate."""
    base = _build(kind)
    eager, compiled_model = copy.deepcopy(base), copy.deepcopy(base)
    compiled = torch.compile(compiled_model, backend=_flash_aot_eager)

    def make(params):
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        return torch.optim.AdamW(params, lr=1e-2)

    runs = [(eager, eager, make(eager.parameters())),
            (compiled_model, compiled, make(compiled_model.parameters()))]
    counters.clear()
    for step in range(3):
        for model, fn, opt in runs:
            opt.zero_grad()
            for micro in range(2):  # two backward calls before the gradients are read
                x, y = _inputs(kind, seed=10 * step + micro)
                (fn(*x, labels=y) / 2).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if step == 0:
            _assert_grads_close(compiled_model, eager)
        for _, _, opt in runs:
            opt.step()
    assert _counts() == EXPECTED[kind], _counts()
    atol = 1e-5 if optimizer == "sgd" else 1e-4
    for (name, p), q in zip(compiled_model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=atol, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


# ------------------------------------------------------------------------------ 6. frozen parameters
def _frozen(kind):
    """Frozen embeddings, the first block's norm weight (and GPT's first projection), the embedding
    LayerNorm (BERT), the final norm and the LM head (GPT)."""
    model = _build(kind)
    for name, p in model.named_parameters():
        if name.split(".")[0] in ("wte", "wpe", "emb", "ln", "ln_f") or name in (
                "blocks.0.ln1.weight", "blocks.0.n1.weight", "blocks.0.qkv.weight", "layers.0.ln2.weight",
                "head.weight", "norm.weight"):
            p.requires_grad_(False)
    return model


def _frozen_training(kind, backend):
    base = _frozen(kind)
    x, y = _inputs(kind)
    eager, compiled_model = copy.deepcopy(base), copy.deepcopy(base)
    counters.clear()
    torch.testing.assert_close(_train_step(torch.compile(compiled_model, backend=backend), x, y),
                               _train_step(eager, x, y), atol=1e-5, rtol=1e-5)
    assert _counts() == EXPECTED[kind], _counts()
    _assert_grads_close(compiled_model, eager)
    assert all(p.grad is None for p in compiled_model.parameters() if not p.requires_grad)


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_frozen_parameters(kind):
    _frozen_training(kind, _flash_aot_eager)


def test_frozen_parameters_flash_backend():
    _frozen_training("gpt", "flash")


def test_only_the_embeddings_train():
    """Every fused op's parameters frozen, their inputs needing a gradient (prompt tuning)."""
    base = _build("gpt")
    for name, p in base.named_parameters():
        p.requires_grad_(name == "wte.weight")
    x, y = _inputs("gpt")
    eager, compiled_model = copy.deepcopy(base), copy.deepcopy(base)
    counters.clear()
    _train_step(torch.compile(compiled_model, backend=_flash_aot_eager), x, y)
    _train_step(eager, x, y)
    assert _counts() == EXPECTED["gpt"], _counts()
    _assert_grads_close(compiled_model, eager)
