"""Review of the norm, dense and cross-entropy passes (session 30): forms no earlier review names.

Every case is compiled through the passes (dynamo + fx_passes, the graph then run as plain PyTorch, the flash
ops on their CPU reference), in training (outputs and the gradients of the inputs and parameters) and in
eval, with fixed seeds and random inputs, and compared with eager at fp32 tolerances
(tests/test_norm_dense_ce_review_s25.py's harness).

- cross-entropy, GAP fixed (fx_passes/cross_entropy.py, _head_scale / _scale_factor): a head whose logits are
  scaled before the loss, Cohere's ``logits = lm_head(h) * self.logit_scale`` (1/16) and Granite's ``logits =
  lm_head(h) / config.logits_scaling`` (transformers' Cohere, Cohere2, Granite, GraniteMoe, ... causal LMs),
  was a near miss ("the logits pass through mul"). A scale s = +-2**k is the same function as the op called
  with the weight and bias times s (a power of two only moves the exponent: every product, sum and rounding
  of the GEMM, forward and backward, is s times eager's), so it is rewritten now, in fp32 and bf16, with the
  scaled logits returned as before; with dynamic=True a module's float scale is specialised and guarded (a
  new value recompiles). Left alone, reported: a scale that is not a power of two (the weight scaled instead
  rounds differently), fp16 logits (scaled weights may fall into fp16's subnormals), the unscaled logits
  read elsewhere too, and a temperature applied after a reshape (pinned as left alone by
  test_norm_ce_pass_adversarial.py).
- dense, BUG fixed (a crash; fx_passes/dense.py, _view_after): ``torch.addmm(b, x, w.t()).view(())`` (a (1, 1)
  result viewed to 0-d) then a GELU raised IndexError out of the backend, failing the compile. Left alone now.
- dense and cross-entropy, BUG fixed (robustness; rewrite()): an unexpected exception inside their matchers
  escaped the backend and failed the user's compile, where norm and attention report it as a near miss
  ("matcher error" / "internal error"). Now an "internal error" near miss, the candidate left alone.
- norm, GAP fixed (fx_passes/_match.py, written_before_end, used by norm, dense and cross-entropy): a tensor
  read as the result of an in-place write (``t *= mask`` returns t written) counted as "written in place
  before the pattern ends", although the pattern and the op, which runs after its inputs, both read the
  written value. transformers' XLM / FlauBERT (``tensor *= mask.unsqueeze(-1)`` after each LayerNorm) lost a
  residual add + LayerNorm per layer. A write after the node read and before the pattern ends is still
  refused (control).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_norm_dense_ce_review_s25 import _check

from flash_backend.backend import rewrite_only_backend
from fx_passes import collecting
from fx_passes._compat import counters

K, V = 24, 37


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def _compile_fn(fn):
    return torch.compile(fn, backend=rewrite_only_backend, fullgraph=True)


def _labels(*shape):
    y = torch.randint(0, V, shape)
    y.view(-1)[:3] = -100  # a few ignored rows
    return y


class Head(nn.Module):
    """fn(module, x, labels) with a head K -> V (bias or not) and a float attribute scale."""

    def __init__(self, fn, bias=True, scale=0.0625, dtype=torch.float32):
        super().__init__()
        self.fn, self.logit_scale = fn, scale
        self.lm_head = nn.Linear(K, V, bias=bias, dtype=dtype)

    def forward(self, x, labels):
        return self.fn(self, x, labels)


def _cohere(m, x, labels):
    logits = m.lm_head(x)
    logits = logits * m.logit_scale
    loss = F.cross_entropy(logits.float().view(-1, V), labels.view(-1))
    return loss, logits


def _granite_shifted(m, x, labels):
    logits = m.lm_head(x) / 8.0
    shift = logits[..., :-1, :].contiguous()
    loss = F.cross_entropy(shift.view(-1, V), labels[..., 1:].reshape(-1), label_smoothing=0.1)
    return loss, logits


def _scale_on_the_left_per_token(m, x, labels):
    logits = -2 * m.lm_head(x)
    return F.cross_entropy(logits.view(-1, V), labels.view(-1), reduction="none"), logits


def _nll_of_scaled(m, x, labels):
    logp = F.log_softmax(m.lm_head(x).div(0.25), dim=-1)
    return F.nll_loss(logp.view(-1, V), labels.view(-1), reduction="sum")


@pytest.mark.parametrize("fn, bias", [
    (_cohere, False), (_cohere, True), (_granite_shifted, True), (_scale_on_the_left_per_token, True),
    (_nll_of_scaled, False),
], ids=["cohere", "cohere_bias", "granite_shifted", "minus_two_per_token", "nll_over_quarter"])
def test_head_logits_scaled_by_a_power_of_two_are_fused(fn, bias):
    model = Head(fn, bias=bias)
    _check(model, (torch.randn(2, 7, K), _labels(2, 7)), "cross_entropy", rewrites=1, atol=1e-5, rtol=1e-5)


def test_head_logits_scaled_in_bf16_are_fused_as_eager_computes_them():
    # bf16 logits, the loss upcast first (Cohere's loss_function): the op's logits are eager's bit for bit
    model = Head(_cohere, bias=True, dtype=torch.bfloat16)
    x, labels = torch.randn(2, 7, K, dtype=torch.bfloat16), _labels(2, 7)
    model.eval()
    counters.clear()
    with torch.no_grad(), collecting() as report:
        loss, logits = torch.compile(model, backend=rewrite_only_backend, fullgraph=True)(x, labels)
        ref_loss, ref_logits = model(x, labels)
    assert counters["flash"]["cross_entropy"] == 1, str(report)
    torch.testing.assert_close(logits, ref_logits, atol=0, rtol=0)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scale, dtype, reason", [
    (0.3, torch.float32, "not a power of two"),
    (1 / 3, torch.float32, "not a power of two"),
    (0.0625, torch.float16, "float16"),
], ids=["0.3", "third", "fp16"])
def test_other_scales_are_left_alone(scale, dtype, reason):
    model = Head(_cohere, scale=scale, dtype=dtype)
    x = torch.randn(2, 7, K, dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    _check(model, (x, _labels(2, 7)), "cross_entropy", rewrites=0, skipped=1, reason=reason, atol=tol,
           rtol=tol)


def test_unscaled_logits_read_elsewhere_are_left_alone():
    def both(m, x, labels):
        raw = m.lm_head(x)
        return F.cross_entropy((raw * 2.0).view(-1, V), labels.view(-1)), raw

    _check(Head(both), (torch.randn(2, 7, K), _labels(2, 7)), "cross_entropy", rewrites=0, skipped=1,
           reason="pass through mul", atol=1e-5, rtol=1e-5)


def test_scaled_logits_written_in_place_are_left_alone():
    def written(m, x, labels):
        logits = m.lm_head(x) * 0.5
        loss = F.cross_entropy(logits.view(-1, V), labels.view(-1))
        logits.add_(1.0)
        return loss, logits

    _check(Head(written), (torch.randn(2, 7, K), _labels(2, 7)), "cross_entropy", rewrites=0, skipped=1,
           reason="written in place", atol=1e-5, rtol=1e-5)


def test_module_float_scale_under_dynamic_shapes_is_specialised_and_guarded():
    """dynamic=True makes the module's float logit_scale a graph input (a SymFloat): the rewrite bakes its
    value into the scaled weight, so dynamo must guard on it. A new power of two recompiles (fused again); a
    non-power of two recompiles and is left alone; the results stay eager's throughout."""
    model = Head(_cohere)
    compiled_model = copy.deepcopy(model)
    compiled = torch.compile(compiled_model, backend=rewrite_only_backend, dynamic=True)
    counters.clear()
    for batch, scale in ((2, 0.0625), (3, 0.0625), (3, 0.125), (3, 0.3)):
        model.logit_scale = compiled_model.logit_scale = scale
        x, labels = torch.randn(batch, 5, K), _labels(batch, 5)
        with collecting() as report:
            loss, logits = compiled(x, labels)
        ref_loss, ref_logits = model(x, labels)
        torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
        grads = torch.autograd.grad(loss, list(compiled_model.parameters()))
        ref_grads = torch.autograd.grad(ref_loss, list(model.parameters()))
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    # fused for 1/16 (one compile for both batches) and for 1/8; 0.3 reported
    assert counters["flash"]["cross_entropy"] == 2, str(report)
    assert counters["flash"]["cross_entropy_skipped"] == 1, str(report)


@pytest.mark.parametrize("name", ["cohere", "granite"])
def test_transformers_heads_with_a_logit_scale_train_fused(name):
    """transformers' CohereForCausalLM (``logits * logit_scale``, 1/16 by default) and GraniteForCausalLM
    (``logits / logits_scaling``), tiny and random: the loss is fused, and the loss, the logits and every
    parameter gradient are eager's."""
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
    if name == "cohere":
        cls, config = transformers.CohereForCausalLM, transformers.CohereConfig(**common)
    else:
        cls = transformers.GraniteForCausalLM
        config = transformers.GraniteConfig(**common, logits_scaling=4.0)
    config._attn_implementation = "sdpa"
    model = cls(config).train()
    compiled_model = copy.deepcopy(model)
    ids = torch.randint(3, V, (2, 9))
    counters.clear()
    with collecting() as report:
        got = torch.compile(compiled_model, backend=rewrite_only_backend)(input_ids=ids, labels=ids)
    expected = model(input_ids=ids, labels=ids)
    assert counters["flash"]["cross_entropy"] == 1, str(report)
    torch.testing.assert_close(got.loss, expected.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-5)
    got.loss.backward()
    expected.loss.backward()
    for (pname, pc), pe in zip(compiled_model.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(pc.grad, pe.grad, atol=1e-5, rtol=1e-5, msg=lambda m, n=pname: f"{n}: {m}")


# ========================================================================================================
# Norm: a tensor read after an in-place write, as the write's own result (XLM)
# ========================================================================================================


N = 24


class TwoNorms(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn, self.ln1, self.ln2, self.lin = fn, nn.LayerNorm(N), nn.LayerNorm(N), nn.Linear(N, N)

    def forward(self, x, mask):
        return self.fn(self, x, mask)


def _xlm_block(m, x, mask):
    # transformers' XLM / FlauBERT: ``tensor *= mask.unsqueeze(-1)`` after every LayerNorm, then the next
    # residual add + LayerNorm reads the written tensor
    t = m.ln1(x)
    t *= mask.unsqueeze(-1).to(t.dtype)
    t = t + m.lin(t)
    return m.ln2(t)


def test_norm_of_a_tensor_read_as_its_in_place_write_result_is_fused():
    """``h *= mask`` returns h written; the next norm reads that result, so the written value wherever the op
    runs (it runs after its inputs, the write's result among them). It was a near miss ("written in place
    before the norm ends"): transformers' XLM (and FlauBERT, its copy) lost the first norm of every layer.
    Now both norms are fused, eager's results."""
    x, mask = torch.randn(2, 5, N), (torch.rand(2, 5) > 0.3).float()
    _check(TwoNorms(_xlm_block), (x, mask), "norm", rewrites=2, atol=1e-5, rtol=1e-5,
           text="residual add + F.layer_norm")


def test_norm_reading_a_tensor_written_between_its_reads_is_still_left_alone():
    """Control: t is read (by the Linear) before ``t.mul_(..)`` and by the residual add after it. The op would
    run right after its last input, the Linear, before the write, and read t unwritten: left alone."""
    def written_between(m, x, mask):
        t = m.ln1(x)
        a = m.lin(t)
        t.mul_(mask.unsqueeze(-1))
        return m.ln2(t + a)

    model = TwoNorms(written_between).eval()
    x, mask = torch.randn(2, 5, N), (torch.rand(2, 5) > 0.3).float()
    counters.clear()
    with torch.no_grad(), collecting() as report:
        got = _compile_fn(model)(x, mask)
        expected = model(x, mask)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert counters["flash"]["norm"] == 1 and counters["flash"]["norm_skipped"] == 1, str(report)
    assert any("written in place" in d.detail for d in report.near_misses), str(report)


# ========================================================================================================
# A matcher error costs the fusion, never the compile (dense and cross-entropy)
# ========================================================================================================


def test_addmm_viewed_to_0d_then_gelu_compiles():
    """Conv1D's ``addmm(..).view(..)`` read the view's last dim; a view to 0-d (a (1, 1) result) has none,
    and the IndexError failed the whole compile. Now it is no Conv1D view (the GELU reads a 0-d value): left
    alone, eager's result."""
    w, b = torch.randn(1, K, requires_grad=True), torch.randn(1, requires_grad=True)

    def fn(x):
        return F.gelu(torch.addmm(b, x, w.t()).view(()))

    x = torch.randn(1, K)
    counters.clear()
    with collecting() as report:
        got = _compile_fn(fn)(x)
    torch.testing.assert_close(got, fn(x), atol=1e-6, rtol=1e-6)
    assert counters["flash"]["dense"] == 0, str(report)


@pytest.mark.parametrize("module, helper, family", [
    ("fx_passes.dense", "_gelu_after", "dense"),
    ("fx_passes.cross_entropy", "_check_arguments", "cross_entropy"),
])
def test_an_error_inside_a_matcher_is_a_near_miss_not_a_failed_compile(monkeypatch, module, helper, family):
    """norm and attention already turn an unexpected exception in their matchers into a near miss
    ("matcher error" / "internal error"); dense and cross-entropy let it out of the backend, and the user's
    torch.compile failed on a model eager runs. Simulated here by a matcher step that raises."""
    import importlib

    def broken(*args, **kwargs):
        raise RuntimeError("simulated matcher bug")

    monkeypatch.setattr(importlib.import_module(module), helper, broken)
    lin, head = nn.Linear(K, K), nn.Linear(K, V)

    def fn(x, labels):
        return F.cross_entropy(head(F.gelu(lin(x))).view(-1, V), labels.view(-1))

    x, labels = torch.randn(2, 7, K), _labels(2, 7)
    counters.clear()
    with torch.no_grad(), collecting() as report:
        got = _compile_fn(fn)(x, labels)
        expected = fn(x, labels)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert counters["flash"][f"{family}_skipped"] == 1, str(report)
    simulated = "internal error RuntimeError: simulated matcher bug"
    assert any(simulated in d.detail for d in report.near_misses), str(report)
