"""Review (session 26) of graph reuse under dynamic shapes, in every pass family: with dynamic=True dynamo
compiles one graph with symbolic sizes and reuses it while its guards hold, so a pass decision checked at
the example's sizes (or values) only, without a guard, can make the reused graph compute another function.

Each case compiles a small model in a real-model style with dynamic=True (through the passes and the
rewritten graph as plain PyTorch, some also with backend="flash"), calls it at several sizes / attribute
values in sequence, and compares every call with eager (outputs, and input and parameter gradients in
training), counting the graphs dynamo compiled: a recompile where a decision stops holding is fine, a wrong
result is a bug, and a recompile for an ordinary batch / sequence change is a regression.

Fixes (each case failed before):
- attention, constant masks built from symbolic sizes: constant_dead_row samples sizes 2, 3, 17, the
  example's and the example's + 64; a band whose rows die only past a larger constant of the mask (a top-left
  causal band with a bottom-right window of 100 keys: no row has a key once past >= 100) was rewritten at
  past = 6 and reused at past = 146, 0 where eager gives the average of v. The masks' own integer constants
  (the largest three) are now sampled too, at c, c + 1 and c + the example's + 64.
- attention, SDPA with a float attn_mask: the constant dead-row check was not made at all, so a bottom-right
  finfo.min band compiled at Sq <= Sk was reused at Sq > Sk (and one built at Sq > Sk rewritten), 0 where
  eager SDPA gives the average of v. Now checked as the softmax path does (sampled sizes and the Sq / Sk order
  guard). A bool attn_mask's dead rows are 0 in eager SDPA too: still rewritten.

Checked and safe (one graph for batch / sequence changes, eager's numbers throughout):
- norm: a hand-written LayerNorm dividing by ``x.shape[-1]`` (the size itself, statically the count) at other
  hidden sizes; a divisor that is another dim equal to the hidden size at the example (duck sizing guards
  the equality: recompiles); eps as a module float (a SymFloat input, specialised with a guard: a changed eps
  recompiles); the 2-norm RMSNorm scaled by ``x.shape[-1] ** -0.5`` (symbolic: a near miss, not a guess).
- dense: transformers' NewGELU (``math.sqrt(2 / math.pi)`` from the float input math.pi, baked in with a
  guard) and an erf GELU constant stored on the module, changed after compiling (recompiles).
- cross_entropy: the causal-LM shift at several sequence lengths, label_smoothing and ignore_index stored
  on the loss module and changed after compiling (specialised, guarded: recompiles), a row selection
  ``logits[:, start:]`` by an int argument.
- attention: GPT-2's sliced causal buffer and a tril mask built in forward over several sequence lengths;
  scales read off the tensor (``q.shape[-1] ** -0.5``, ``1 / math.sqrt(k.size(-1))``, baddbmm's alpha);
  a head_dim that stops being a multiple of 8 (guarded: recompiles, left alone); a temperature stored on
  the module and changed; a Mistral-style bottom-right window of 4096 (still rewritten: no dead row).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from flash_backend.backend import rewrite_only_backend
from fx_passes import collecting
from fx_passes._compat import counters

B, H, D = 2, 2, 8
E = H * D
V = 37
TOL = dict(atol=3e-5, rtol=3e-5)


@pytest.fixture(autouse=True)
def _cold_inductor_cache():
    """An Inductor cache hit skips the pre-grad passes, and with them the counters these tests assert."""
    from torch._inductor.utils import fresh_inductor_cache

    with fresh_inductor_cache():
        yield


def _run(model, args, train):
    leaves = [a.detach().clone().requires_grad_(train and a.is_floating_point())
              if isinstance(a, torch.Tensor) else a for a in args]
    with torch.set_grad_enabled(train):
        out = model(*leaves)
    outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
    if not train:
        return outs
    gen = torch.Generator().manual_seed(0)
    diff = [o for o in outs if o.requires_grad]
    cotangents = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in diff]
    params = list(model.parameters()) if isinstance(model, nn.Module) else []
    wrt = [a for a in leaves if isinstance(a, torch.Tensor) and a.requires_grad] + params
    grads = torch.autograd.grad(diff, wrt, cotangents, allow_unused=True)
    return outs + [g for g in grads if g is not None]


def _reuse(model, calls, family, expected, backend=rewrite_only_backend, train=True, tol=TOL):
    """Compile once with dynamic=True and call at each of `calls`: (args, change or None), where change(model)
    runs before the call (an attribute set after compiling). expected: per call, (graphs compiled so far,
    rewrites of `family` so far, near misses of `family` so far); every call gives eager's numbers."""
    if isinstance(model, nn.Module):
        model.train(train)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=backend, dynamic=True)
    for i, ((args, change), (graphs, rewrites, skipped)) in enumerate(zip(calls, expected, strict=True)):
        if change is not None:
            change(model)
        with collecting() as report:
            got = _run(compiled, args, train)
        want = _run(model, args, train)
        assert len(got) == len(want), (i, str(report))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, **tol, equal_nan=True, msg=lambda m, i=i: f"call {i}: {m}")
        assert counters["stats"]["unique_graphs"] == graphs, (i, str(report))
        assert counters["flash"][family] == rewrites, (i, str(report))
        assert counters["flash"][f"{family}_skipped"] == skipped, (i, str(report))


def _randn(*shape, seed=0):
    torch.manual_seed(seed)
    return torch.randn(*shape)


# --------------------------------------------------------------------------------------------------------
# norm
# --------------------------------------------------------------------------------------------------------


class _SumOverSize(nn.Module):
    """Residual + LayerNorm written out with sums divided by the size read off the tensor, no affine."""

    def forward(self, x, r):
        h = x + r
        u = h.sum(-1, keepdim=True) / h.shape[-1]
        c = h - u
        v = (c * c).sum(-1, keepdim=True) / h.shape[-1]
        return c / torch.sqrt(v + 1e-5)


def test_norm_divisor_read_off_the_tensor_is_reused_at_other_hidden_sizes():
    calls = [((_randn(b, s, e, seed=s), _randn(b, s, e, seed=s + 1)), None)
             for b, s, e in ((2, 5, 32), (3, 7, 32), (2, 5, 48), (2, 6, 17))]
    _reuse(_SumOverSize(), calls, "norm", [(1, 1, 0)] * 4)


class _OtherDimDivisor(nn.Module):
    """The mean's divisor is dim 1, the hidden size only at the example (both 8: one symbol, duck sizing)."""

    def forward(self, x):
        u = x.sum(-1, keepdim=True) / x.shape[1]
        c = x - u
        return c * torch.rsqrt((c * c).mean(-1, keepdim=True) + 1e-5)


def test_norm_divisor_equal_to_the_hidden_size_at_the_example_only_recompiles():
    calls = [((_randn(2, 8, 8),), None), ((_randn(2, 6, 8),), None), ((_randn(2, 5, 9),), None)]
    _reuse(_OtherDimDivisor(), calls, "norm", [(1, 1, 0), (2, 2, 0), (2, 2, 0)])


class _RMSNorm(nn.Module):
    def __init__(self, n):
        super().__init__()
        torch.manual_seed(1)
        self.weight = nn.Parameter(torch.randn(n))
        self.eps = 1e-6

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def test_norm_eps_attribute_changed_after_compiling_recompiles():
    small = _randn(2, 5, 16) * 1e-2  # where eps = 0.5 changes the result
    calls = [((_randn(2, 5, 16),), None), ((_randn(3, 7, 16),), None),
             ((small,), lambda m: setattr(m, "eps", 0.5)), ((small[:, :3],), None)]
    _reuse(_RMSNorm(16), calls, "norm", [(1, 1, 0), (1, 1, 0), (2, 2, 0), (2, 2, 0)])


def test_norm_two_norm_scaled_by_a_symbolic_size_is_a_near_miss():
    def two_norm(x):
        return x / (x.norm(2, -1, keepdim=True) * x.shape[-1] ** -0.5)

    calls = [((_randn(2, 5, 16),), None), ((_randn(2, 5, 24),), None)]
    _reuse(two_norm, calls, "norm", [(1, 0, 1), (1, 0, 1)])


# --------------------------------------------------------------------------------------------------------
# dense
# --------------------------------------------------------------------------------------------------------


class _NewGELU(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.fc = nn.Linear(E, 24)
        self.c = math.sqrt(2.0 / math.pi)

    def forward(self, x):
        h = self.fc(x)
        return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))


class _ErfGELU(_NewGELU):
    def __init__(self):
        super().__init__()
        self.c = 0.7071067811865476

    def forward(self, x):
        h = self.fc(x)
        return h * 0.5 * (1.0 + torch.erf(h * self.c))


def test_dense_new_gelu_one_graph_over_batch_and_sequence():
    calls = [((_randn(b, s, E),), None) for b, s in ((2, 5), (3, 9), (2, 4))]
    _reuse(_NewGELU(), calls, "dense", [(1, 1, 0)] * 3)


def test_dense_gelu_constant_attribute_changed_after_compiling_recompiles():
    calls = [((_randn(2, 5, E),), None), ((_randn(3, 9, E),), None),
             ((_randn(3, 9, E),), lambda m: setattr(m, "c", 0.5))]
    _reuse(_ErfGELU(), calls, "dense", [(1, 1, 0), (1, 1, 0), (2, 1, 0)])


# --------------------------------------------------------------------------------------------------------
# cross_entropy
# --------------------------------------------------------------------------------------------------------


class _CausalLMHead(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.lm_head = nn.Linear(E, V)
        self.loss = nn.CrossEntropyLoss(ignore_index=-100, label_smoothing=0.0)

    def forward(self, h, labels):
        logits = self.lm_head(h)
        shifted = logits[..., :-1, :].contiguous()
        target = labels[..., 1:].contiguous()
        return self.loss(shifted.view(-1, shifted.size(-1)), target.view(-1)), logits


def _lm(b, s, ignore=-100):
    torch.manual_seed(s)
    labels = torch.randint(0, V, (b, s))
    labels[0, 2] = ignore
    labels[-1, 1] = 5  # the class that becomes ignore_index below
    return torch.randn(b, s, E), labels


def test_cross_entropy_causal_shift_one_graph_over_batch_and_sequence():
    calls = [(_lm(b, s), None) for b, s in ((2, 6), (3, 9), (2, 4))]
    _reuse(_CausalLMHead(), calls, "cross_entropy", [(1, 1, 0)] * 3)


@pytest.mark.parametrize("attribute,value", [("label_smoothing", 0.3), ("ignore_index", 5)])
def test_cross_entropy_loss_attribute_changed_after_compiling_recompiles(attribute, value):
    model = _CausalLMHead()
    last = _lm(2, 4, ignore=value if attribute == "ignore_index" else -100)
    calls = [(_lm(2, 6), None), (_lm(3, 9), None), (last, lambda m: setattr(m.loss, attribute, value))]
    _reuse(model, calls, "cross_entropy", [(1, 1, 0), (1, 1, 0), (2, 2, 0)])


def test_cross_entropy_row_selection_by_an_int_argument():
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(1)
            self.lm_head = nn.Linear(E, V)

        def forward(self, h, labels, start):
            logits = self.lm_head(h)
            rows = logits[:, start:].reshape(-1, logits.shape[-1])
            return F.cross_entropy(rows, labels[:, start:].reshape(-1))

    a, b = _lm(2, 8), _lm(2, 9)
    calls = [((*a, 2), None), ((*b, 3), None), ((*b, -3), None), ((*a, 0), None), ((*b, 5), None)]
    # dynamo guards on the sign of the start (and specialises 0): each graph is checked at its own values
    _reuse(Head(), calls, "cross_entropy", [(1, 1, 0), (1, 1, 0), (2, 2, 0), (3, 3, 0), (3, 3, 0)])


# --------------------------------------------------------------------------------------------------------
# attention: masks and scales built from sizes
# --------------------------------------------------------------------------------------------------------


class _GPT2Attention(nn.Module):
    def __init__(self, style, max_len=64):
        super().__init__()
        torch.manual_seed(1)
        self.style = style
        self.c_attn = nn.Linear(E, 3 * E)
        self.c_proj = nn.Linear(E, E)
        self.temperature = 1.0
        self.register_buffer("bias", torch.tril(torch.ones(max_len, max_len)).view(1, 1, max_len, max_len))

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = (z.view(b, t, H, c // H).transpose(1, 2) for z in self.c_attn(x).split(E, dim=2))
        if self.style == "buffer":  # GPT-2 / nanoGPT
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        else:  # a tril built in forward, the scale read off q, a temperature stored on the module
            att = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5 / self.temperature
            keep = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device))
            att = att.masked_fill(~keep, torch.finfo(att.dtype).min)
        att = F.softmax(att, dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(b, t, c))


@pytest.mark.parametrize("style", ["buffer", "tril"])
def test_attention_causal_one_graph_over_batch_and_sequence(style):
    calls = [((_randn(b, t, E, seed=t),), None) for b, t in ((2, 5), (3, 9), (2, 17))]
    _reuse(_GPT2Attention(style), calls, "attention", [(1, 1, 0)] * 3)


def test_attention_temperature_attribute_changed_after_compiling_recompiles():
    calls = [((_randn(2, 5, E),), None), ((_randn(3, 9, E),), None),
             ((_randn(2, 7, E),), lambda m: setattr(m, "temperature", 0.25)), ((_randn(2, 8, E),), None)]
    _reuse(_GPT2Attention("tril"), calls, "attention", [(1, 1, 0), (1, 1, 0), (2, 2, 0), (2, 2, 0)])


def _qkv(sq, sk, d=D, seed=0):
    torch.manual_seed(seed)
    return torch.randn(B, H, sq, d), torch.randn(B, H, sk, d), torch.randn(B, H, sk, d)


def _scale_off_q(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, -1) @ v


def _scale_sqrt_k(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(k.size(-1)), -1) @ v


def _baddbmm_alpha(q, k, v):
    b, h, sq, d = q.shape
    s = torch.baddbmm(torch.zeros(b * h, sq, k.shape[2]), q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2),
                      beta=0, alpha=1 / math.sqrt(d))
    return (torch.softmax(s, -1) @ v.flatten(0, 1)).view(b, h, sq, v.shape[-1])


@pytest.mark.parametrize("fn", [_scale_off_q, _scale_sqrt_k, _baddbmm_alpha])
def test_attention_scale_read_off_a_symbolic_head_dim(fn):
    """The scale follows head_dim in the reused graph (the op specialises it: a new head_dim recompiles);
    a head_dim that is not a multiple of 8 fails the op's guarded limit and is left alone."""
    calls = [(_qkv(5, 7, 16), None), (_qkv(6, 9, 16, seed=1), None), (_qkv(6, 9, 24), None),
             (_qkv(4, 6, 12), None)]
    _reuse(fn, calls, "attention", [(1, 1, 0), (1, 1, 0), (2, 2, 0), (3, 2, 1)])


# Decode (Sq new queries, Sk = past + Sq keys) with a top-left causal band and a bottom-right window: no row
# loses its keys while past < WINDOW, every row does from past >= WINDOW (then eager averages v, the op 0).
WINDOW = 100


def _mixed_alignment_window(q, k, v):
    sq, sk = q.shape[-2], k.shape[-2]
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    s = q @ k.transpose(-1, -2) * D**-0.5
    s = s.masked_fill(j > i, torch.finfo(s.dtype).min)
    s = s.masked_fill(j <= i + (sk - sq) - WINDOW, torch.finfo(s.dtype).min)
    return torch.softmax(s, -1) @ v


def test_dynamic_mask_dead_only_past_its_own_window_is_not_reused_there():
    """Rewritten before the fix at (4, 10) and reused at past = 146 and 397: every row's keys masked there,
    0 where eager gives the average of v. The window's size is now among the sampled sizes: left alone."""
    calls = [(_qkv(4, 10), None), (_qkv(5, 30, seed=1), None), (_qkv(4, 150), None), (_qkv(3, 400), None)]
    _reuse(_mixed_alignment_window, calls, "attention", [(1, 0, 1)] * 4)


def _mistral_window(q, k, v, window=4096):
    sq, sk = q.shape[-2], k.shape[-2]
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    s = q @ k.transpose(-1, -2) * D**-0.5
    s = s.masked_fill((j > i) | (j <= i - window), torch.finfo(s.dtype).min)
    return torch.softmax(s, -1) @ v


def test_dynamic_bottom_right_window_of_4096_is_still_rewritten():
    """Both bands bottom-right (Mistral's sliding window): no dead row at any Sq <= Sk, the sampled window
    sizes included; one graph for the decode sizes."""
    calls = [(_qkv(4, 10), None), (_qkv(5, 30, seed=1), None), (_qkv(3, 150), None)]
    _reuse(_mistral_window, calls, "attention", [(1, 1, 0)] * 3)


# --------------------------------------------------------------------------------------------------------
# attention: SDPA with a mask built from the sizes
# --------------------------------------------------------------------------------------------------------


def _sdpa_bottom_right_additive(q, k, v):
    sq, sk = q.shape[-2], k.shape[-2]
    mask = torch.full((sq, sk), torch.finfo(q.dtype).min).triu(diagonal=sk - sq + 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _sdpa_bottom_right_bool(q, k, v):
    sq, sk = q.shape[-2], k.shape[-2]
    keep = torch.ones(sq, sk, dtype=torch.bool).tril(diagonal=sk - sq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def test_dynamic_sdpa_float_mask_reused_where_it_has_dead_rows():
    """Compiled at Sq < Sk (no dead row) and rewritten; at Sq > Sk the first rows have no key (eager SDPA:
    the average of v with finfo.min, the op 0): before the fix the graph was reused there. Now the Sq / Sk
    order is guarded and the other order recompiles, left alone."""
    calls = [(_qkv(4, 10), None), (_qkv(6, 12, seed=1), None), (_qkv(9, 5), None), (_qkv(12, 4), None)]
    _reuse(_sdpa_bottom_right_additive, calls, "attention", [(1, 1, 0), (1, 1, 0), (2, 1, 1), (2, 1, 1)])


def test_sdpa_float_mask_with_dead_rows_at_the_example_is_left_alone():
    _reuse(_sdpa_bottom_right_additive, [(_qkv(9, 5), None)], "attention", [(1, 0, 1)])


def test_dynamic_sdpa_bool_mask_dead_rows_match_eager():
    """Eager SDPA gives 0 on a bool mask's dead rows, as the op does: rewritten at either order."""
    calls = [(_qkv(4, 10), None), (_qkv(9, 5), None)]
    _reuse(_sdpa_bottom_right_bool, calls, "attention", [(1, 1, 0), (1, 1, 0)])


# --------------------------------------------------------------------------------------------------------
# End to end with Inductor
# --------------------------------------------------------------------------------------------------------


def test_backend_flash_decoder_block_one_graph_over_batch_and_sequence():
    """A GPT-2 block (LayerNorm, causal attention, Linear + NewGELU) and an LM head with the shifted loss,
    backend="flash", dynamic=True: every family rewritten, one graph over batch and sequence changes."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(3)
            self.ln_1, self.ln_2, self.ln_f = nn.LayerNorm(E), nn.LayerNorm(E), nn.LayerNorm(E)
            self.attn = _GPT2Attention("tril")
            self.mlp = _NewGELU()
            self.proj = nn.Linear(24, E)
            self.head = _CausalLMHead()

        def forward(self, x, labels):
            x = x + self.attn(self.ln_1(x))
            x = x + self.proj(self.mlp(self.ln_2(x)))
            return self.head(self.ln_f(x), labels)

    model = Block().train()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="flash", dynamic=True)
    for b, s in ((2, 6), (3, 9)):
        args = _lm(b, s)
        got, want = _run(compiled, args, True), _run(model, args, True)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
        assert counters["stats"]["unique_graphs"] == 1
    for family in ("norm", "attention", "dense", "cross_entropy"):
        assert counters["flash"][family] >= 1, family
