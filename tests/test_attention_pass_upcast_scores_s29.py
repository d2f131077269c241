"""The attention pass on half-precision q / k cast up to fp32 for the scores (review s29).

GPT-J, CodeGen and GPT-Neo compute their scores in fp32 in a bf16 / fp16 model: ``query.to(torch.float32)``,
``key.to(torch.float32)``, the softmax in fp32, the probabilities cast back to the value's dtype before ·v.
The pass left these alone ("q, k, v and the output dtypes differ"), so the three models had no fused
attention in half precision. That is the op's own arithmetic (exact products of half-precision values
accumulated in fp32, an fp32 softmax, P rounded to v's dtype before P·V), so q and k are now taken before
their casts (fx_passes/attention.py _strip_score_upcasts). What is not that function stays left alone: an
upcast to float64, q and k of another dtype than v, probabilities kept in fp32 for ·v.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from test_attention_pass import _rewrites, _run_rewritten
from test_model_zoo_decoders import MODELS, _build, _inputs

import fx_passes
from flash_backend.backend import rewrite_only_backend
from fx_passes._compat import counters

B, H, S, D = 2, 3, 9, 16


def _qkv(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, S, D, generator=gen).to(dtype) for _ in range(3)]


def _float_scores(q, k, v):
    s = q.float() @ k.float().transpose(-1, -2) / math.sqrt(D)
    return torch.softmax(s, dim=-1).to(v.dtype) @ v


def _gptj_form(q, k, v):
    # transformers' GPTJAttention._attn: casts by .to(torch.float32), a causal mask with finfo.min, the scale
    # as a division after the mask fill
    query, key = q.to(torch.float32), k.to(torch.float32)
    w = torch.matmul(query, key.transpose(-1, -2))
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    w = torch.where(causal, w, torch.tensor(torch.finfo(w.dtype).min, dtype=w.dtype))
    w = w / math.sqrt(D)
    w = torch.softmax(w, dim=-1).to(v.dtype)
    return torch.matmul(w, v)


def _type_as_form(q, k, v):
    s = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float()) * D ** -0.5
    return s.softmax(-1).type_as(v) @ v


REWRITTEN = {"float_scores": _float_scores, "gptj": _gptj_form, "type_as": _type_as_form}


def _errors(fn, dtype):
    """(compiled, eager) errors against the fp32 function, outputs and input gradients, with the counts."""
    q, k, v = _qkv(dtype)
    ref_in = [t.float().requires_grad_() for t in (q, k, v)]
    ref = fn(*ref_in)
    eager_in = [t.clone().requires_grad_() for t in (q, k, v)]
    eager = fn(*eager_in)
    comp_in = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = _run_rewritten(fn, *comp_in)
    counts = _rewrites()
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5))
    for o in (ref, eager, out):
        o.backward(grad.to(o.dtype))

    def err(o, ins):
        pairs = [(o, ref)] + [(a.grad, r.grad) for a, r in zip(ins, ref_in, strict=True)]
        return [((x.float() - y).norm() / y.norm()).item() for x, y in pairs]

    return err(out, comp_in), err(eager, eager_in), counts, out.dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", REWRITTEN)
def test_scores_in_fp32_of_half_inputs_are_rewritten(name, dtype):
    got, eager, counts, out_dtype = _errors(REWRITTEN[name], dtype)
    assert counts == (1, 0)
    assert out_dtype == dtype
    for g, e in zip(got, eager, strict=True):  # as close to the fp32 function as eager's own half precision
        assert g <= 2 * e + 2 ** -8, (got, eager)


def _float64_scores(q, k, v):
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(D)
    return torch.softmax(s, dim=-1).to(v.dtype) @ v


def _probs_kept_in_fp32(q, k, v):
    s = q.float() @ k.float().transpose(-1, -2) / math.sqrt(D)
    return (torch.softmax(s, dim=-1) @ v.float()).to(v.dtype)


def _k_of_another_dtype(q, k, v):
    s = q.float() @ k.half().float().transpose(-1, -2) / math.sqrt(D)
    return torch.softmax(s, dim=-1).to(v.dtype) @ v


LEFT_ALONE = {
    "float64_scores": _float64_scores,  # the op accumulates in fp32, eager in fp64
    "k_of_another_dtype": _k_of_another_dtype,  # k rounded to fp16 first: not v's bf16
}


@pytest.mark.parametrize("name", LEFT_ALONE)
def test_other_upcasts_are_left_alone(name):
    q, k, v = _qkv(torch.bfloat16)
    fn = LEFT_ALONE[name]
    out, _ = _run_rewritten(fn, q, k, v)
    assert _rewrites() == (0, 1)
    torch.testing.assert_close(out, fn(q, k, v), atol=0, rtol=0)


def test_probabilities_kept_in_fp32_are_fp32_attention():
    """P·V in fp32 with v upcast too: q, k, v all fp32 inputs of the op (the same function in fp32), not
    the half-precision op."""
    q, k, v = _qkv(torch.bfloat16)
    out, graphs = _run_rewritten(_probs_kept_in_fp32, q, k, v)
    assert _rewrites() == (1, 0)
    torch.testing.assert_close(out, _probs_kept_in_fp32(q, k, v), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("name", ["gptj", "codegen", "gpt_neo"])
def test_half_precision_models_with_fp32_scores_get_fused_attention(name):
    """The zoo's tiny GPT-J / CodeGen / GPT-Neo in bf16: every layer's attention rewritten (two), the logits
    as close to the fp32 model's as eager bf16's are."""
    model = _build(name, "eager").to(torch.bfloat16).eval()
    reference = copy.deepcopy(model).float()
    inputs = _inputs(False)
    torch._dynamo.reset()
    counters.clear()
    with fx_passes.collecting() as report, torch.no_grad():
        got = torch.compile(copy.deepcopy(model), backend=rewrite_only_backend)(**inputs).logits.float()
        eager = model(**inputs).logits.float()
        ref = reference(**inputs).logits
    assert counters["flash"]["attention"] == MODELS[name][2], str(report)
    assert counters["flash"]["attention_skipped"] == 0, str(report)
    err = ((got - ref).norm() / ref.norm()).item()
    err_eager = ((eager - ref).norm() / ref.norm()).item()
    assert err <= 2 * err_eager + 2 ** -8, (err, err_eager)
