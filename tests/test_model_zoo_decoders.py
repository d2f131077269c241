"""Decoder language models from transformers through the flash passes: nothing crashes, every rewrite is the
same function as eager, and the rewrites fire where the pattern is plainly there.

Each model is built tiny and random (2 layers, hidden 64, vocab 101, no download) with every dropout at 0,
then compiled with the rewrite-only backend (the rewritten graph runs as plain PyTorch, the flash ops on
their CPU reference) and compared with eager: logits in inference (eval, no_grad; no padding, so the
causal mask is the constant one), loss and every parameter gradient in training (right-padded
attention_mask, labels). The attention and norm rewrite counts are asserted per model: one attention per
layer (eager and SDPA implementations alike) and every RMSNorm / LayerNorm; what is left alone on purpose
is listed with its reason. A few models also run end to end with backend="flash" (Inductor on CPU, slow):
`-k "not flash_backend"` leaves those out.
"""

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from test_attention_pass import _check_same, _qkv, _rewrites, _run_rewritten

import fx_passes
from flash_backend.backend import rewrite_only_backend
from fx_passes._compat import counters

V, B, S = 101, 2, 11
TOL = dict(atol=1e-4, rtol=1e-4)
_IDS = dict(vocab_size=V, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Llama-style configs: GQA (4 query heads, 2 k/v heads), head_dim 16
_LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, **_IDS)


def _falcon(**kw):
    return transformers.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, **kw, **_IDS)


# name: (model class, config factory, attention rewrites, norm rewrites, attention near misses).
# Every count is for 2 layers and was checked by reading the model: norms per layer + the final norm.
MODELS = {
    "llama": (transformers.LlamaForCausalLM, lambda: transformers.LlamaConfig(**_LLAMA), 2, 5, 0),
    # sliding window 4 < S: a windowed causal mask, passed to the op as a mask
    "mistral": (transformers.MistralForCausalLM,
                lambda: transformers.MistralConfig(**_LLAMA, sliding_window=4), 2, 5, 0),
    "qwen2": (transformers.Qwen2ForCausalLM, lambda: transformers.Qwen2Config(**_LLAMA), 2, 5, 0),
    # + q_norm and k_norm (RMSNorm over head_dim) per layer
    "qwen3": (transformers.Qwen3ForCausalLM,
              lambda: transformers.Qwen3Config(**_LLAMA, head_dim=16), 2, 9, 0),
    "gemma": (transformers.GemmaForCausalLM,
              lambda: transformers.GemmaConfig(**_LLAMA, head_dim=16), 2, 5, 0),
    # Gemma 2 soft-caps the scores (tanh(s / 50) * 50): the op has no soft cap, so both layers are near
    # misses with that reason. Its final logit soft-cap likewise keeps the loss out of the cross-entropy
    # family. 4 norms per layer (pre and post, attention and MLP).
    "gemma2": (transformers.Gemma2ForCausalLM,
               lambda: transformers.Gemma2Config(**_LLAMA, head_dim=16, sliding_window=4), 0, 9, 2),
    "gemma2_no_softcap": (transformers.Gemma2ForCausalLM, lambda: transformers.Gemma2Config(
        **_LLAMA, head_dim=16, sliding_window=4, attn_logit_softcapping=None, final_logit_softcapping=None),
        2, 9, 0),
    # 4 norms per layer + q_norm / k_norm
    "gemma3": (transformers.Gemma3ForCausalLM,
               lambda: transformers.Gemma3TextConfig(**_LLAMA, head_dim=16, sliding_window=4), 2, 13, 0),
    # parallel attention and MLP after one LayerNorm; partial rotary
    "phi": (transformers.PhiForCausalLM, lambda: transformers.PhiConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, partial_rotary_factor=0.5, **_IDS), 2, 3, 0),
    "phi3": (transformers.Phi3ForCausalLM, lambda: transformers.Phi3Config(**_LLAMA), 2, 5, 0),
    # one global and one local (window 4) layer; GPT-Neo does not scale the scores
    "gpt_neo": (transformers.GPTNeoForCausalLM, lambda: transformers.GPTNeoConfig(
        hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]], window_size=4,
        max_position_embeddings=64, **_IDS), 2, 5, 0),
    # parallel attention and MLP after one LayerNorm
    "gptj": (transformers.GPTJForCausalLM, lambda: transformers.GPTJConfig(
        n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64, **_IDS), 2, 3, 0),
    "gpt_neox": (transformers.GPTNeoXForCausalLM, lambda: transformers.GPTNeoXConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, rotary_pct=0.5, **_IDS), 2, 5, 0),
    "opt": (transformers.OPTForCausalLM, lambda: transformers.OPTConfig(
        hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
        word_embed_proj_dim=64, **_IDS), 2, 5, 0),
    # multi-query (one k/v head): SDPA is called without enable_gqa and broadcasts the k/v head
    "falcon": (transformers.FalconForCausalLM,
               lambda: _falcon(new_decoder_architecture=False, multi_query=True), 2, 3, 0),
    # ALiBi, sequential blocks. Eager scales the scores after adding the alibi, (s + alibi) * inv_norm_factor:
    # the op would add alibi * inv_norm_factor, which rounds differently, so eager is left alone (reported);
    # the SDPA implementation passes the alibi as the mask and is rewritten.
    "falcon_alibi": (transformers.FalconForCausalLM,
                     lambda: _falcon(alibi=True, multi_query=False, parallel_attn=False),
                     {"eager": 0, "sdpa": 2}, 5, {"eager": 2, "sdpa": 0}),
    "falcon_new_arch": (transformers.FalconForCausalLM,
                        lambda: _falcon(new_decoder_architecture=True, num_kv_heads=2), 2, 5, 0),
    # + the LayerNorm after the word embeddings
    "bloom": (transformers.BloomForCausalLM, lambda: transformers.BloomConfig(
        hidden_size=64, n_layer=2, n_head=4, **_IDS), 2, 6, 0),
    # parallel attention and MLP after one LayerNorm; the mask is added before the scale, (s + m) / sqrt(d)
    "codegen": (transformers.CodeGenForCausalLM, lambda: transformers.CodeGenConfig(
        n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64, n_ctx=64, **_IDS), 2, 3, 0),
    "stablelm": (transformers.StableLmForCausalLM,
                 lambda: transformers.StableLmConfig(**_LLAMA, partial_rotary_factor=0.5), 2, 5, 0),
    "starcoder2": (transformers.Starcoder2ForCausalLM,
                   lambda: transformers.Starcoder2Config(**_LLAMA), 2, 5, 0),
    "gpt_bigcode": (transformers.GPTBigCodeForCausalLM, lambda: transformers.GPTBigCodeConfig(
        n_embd=64, n_layer=2, n_head=4, n_positions=64, multi_query=True, **_IDS), 2, 5, 0),
    # ALiBi as an additive bias
    "mpt": (transformers.MptForCausalLM, lambda: transformers.MptConfig(
        d_model=64, n_layers=2, n_heads=4, max_seq_len=64, expansion_ratio=2, **_IDS), 2, 5, 0),
}


def _build(name, impl):
    cls, make_config, *_ = MODELS[name]
    cfg = make_config()
    cfg._attn_implementation = impl
    # every dropout at 0 (attention_dropout, resid_pdrop, hidden_dropout, attn_config.attn_pdrop, ...), so
    # that training mode compares exactly; the graphs keep their training-mode ops
    for sub in (cfg, getattr(cfg, "attn_config", None)):
        for key, value in list(getattr(sub, "__dict__", {}).items()):
            if "drop" in key and isinstance(value, float):
                setattr(sub, key, 0.0)
    torch.manual_seed(0)
    model = cls(cfg)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model


def _inputs(training):
    torch.manual_seed(1)
    ids = torch.randint(3, V, (B, S))
    if not training:
        return {"input_ids": ids}
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, -3:] = 0  # right padding: every query row still sees a key
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def _cases():
    for name, (cls, *_) in MODELS.items():
        for impl in ("eager", "sdpa"):
            if impl == "sdpa" and not getattr(cls, "_supports_sdpa", False):
                continue  # transformers raises for these (GPT-J, GPT-Neo, Bloom, CodeGen, MPT, Gemma 2)
            for mode in ("eval", "train"):
                yield pytest.param(name, impl, mode, id=f"{name}-{impl}-{mode}")


def _compare(model, training, backend):
    """Compile a copy with backend; its loss / logits and parameter gradients against eager's; the report."""
    inputs = _inputs(training)
    model.train(training)
    compiled = copy.deepcopy(model)
    torch._dynamo.reset()
    counters.clear()
    with fx_passes.collecting() as report, torch.set_grad_enabled(training):
        out_c = torch.compile(compiled, backend=backend)(**inputs)
        out_e = model(**inputs)
    key = "loss" if training else "logits"
    torch.testing.assert_close(getattr(out_c, key), getattr(out_e, key), **TOL,
                               msg=lambda m: f"{m}\n{report}")
    if training:
        out_c.loss.backward()
        out_e.loss.backward()
        for (name, pc), pe in zip(compiled.named_parameters(), model.parameters(), strict=True):
            if pe.grad is None:
                assert pc.grad is None, name
                continue
            torch.testing.assert_close(pc.grad, pe.grad, **TOL,
                                       msg=lambda m, name=name: f"{name}: {m}\n{report}")
    return report


@pytest.mark.parametrize("name, impl, mode", list(_cases()))
def test_decoder(name, impl, mode):
    _, _, attention, norms, attention_skipped = MODELS[name]
    attention, attention_skipped = (
        x[impl] if isinstance(x, dict) else x for x in (attention, attention_skipped)
    )
    report = _compare(_build(name, impl), mode == "train", rewrite_only_backend)
    flash = counters["flash"]
    assert not [d for d in report.near_misses if "internal error" in d.detail], str(report)
    assert (flash["attention"], flash["attention_skipped"]) == (attention, attention_skipped), str(report)
    assert flash["norm"] == norms, str(report)
    reason = {"gemma2": "tanh", "falcon_alibi": "scaled after an additive mask"}.get(name, "-")
    assert all(reason in d.detail for d in report.near_misses if d.family == "attention"), str(report)


# backend="flash" (Inductor on CPU): a few, chosen for what the rewrite-only runs cannot show: the GQA
# causal model in training, the mask scaled after it was added (CodeGen), the multi-query SDPA call (Falcon).
@pytest.mark.parametrize("name, impl, mode", [
    ("llama", "sdpa", "train"),
    ("codegen", "eager", "eval"),
    ("falcon", "sdpa", "eval"),
])
def test_decoder_flash_backend_end_to_end(name, impl, mode):
    from torch._inductor.utils import fresh_inductor_cache

    _, _, attention, norms, _ = MODELS[name]
    attention = attention[impl] if isinstance(attention, dict) else attention
    with fresh_inductor_cache():
        report = _compare(_build(name, impl), mode == "train", "flash")
    assert (counters["flash"]["attention"], counters["flash"]["norm"]) == (attention, norms), str(report)


# --------------------------------------------------------------------------------------------------------
# Regression tests for what the sweep found
# --------------------------------------------------------------------------------------------------------


def _padding_mask_added_before_the_scale(q, k, v, pad):
    # CodeGen: `(w + mask) / scale_attn` with transformers' eager mask where(keep, 0, finfo.min)
    keep = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).tril() & pad[:, None, None, :]
    mask = torch.where(keep, torch.zeros(()), torch.finfo(q.dtype).min)
    s = (q @ k.transpose(-2, -1) + mask) / math.sqrt(q.shape[-1])
    return torch.softmax(s, dim=-1) @ v


def _alibi_added_before_the_scale(q, k, v, alibi):
    # Falcon: `(w + alibi) * inv_norm_factor`; s * c + alibi * c would round differently: left alone
    return torch.softmax((q @ k.transpose(-2, -1) + alibi) * q.shape[-1] ** -0.5, dim=-1) @ v


def test_scale_after_a_zero_or_masked_additive_mask_is_rewritten():
    """Was a near miss ("the scores are scaled after an additive mask was added"): CodeGen's eager attention
    was never rewritten. A mask of 0 and finfo.min only gives (s + m) * c = s * c + m where visible and a
    masked-out value where not, also once scaled."""
    q, k, v = _qkv(S=9, D=16)
    pad = torch.ones(2, 9, dtype=torch.bool)
    pad[1, -3:] = False
    (node,) = _check_same(_padding_mask_added_before_the_scale, q, k, v, pad)
    assert node.kwargs["attn_mask"] is not None and math.isclose(node.kwargs["scale"], 0.25)
    torch._dynamo.reset()
    counters.clear()
    with fx_passes.collecting() as report:
        out, _ = _run_rewritten(_alibi_added_before_the_scale, q, k, v, torch.randn(2, 4, 1, 9))
    assert _rewrites() == (0, 1)
    assert "scaled after an additive mask" in report.near_misses[0].detail


def test_scale_after_a_mask_that_is_not_masked_once_scaled_is_left_alone():
    # 0 / -1e4 scaled by 1e-3: -10 is not a masked-out value
    def fn(q, k, v):
        keep = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).tril()
        mask = torch.where(keep, 0.0, -1e4)
        return torch.softmax((q @ k.transpose(-2, -1) + mask) * 1e-3, dim=-1) @ v

    q, k, v = _qkv(S=7, D=8)
    out, _ = _run_rewritten(fn, q, k, v)
    assert _rewrites() == (0, 1)
    torch.testing.assert_close(out, fn(q, k, v))


def test_finite_fill_scaled_down_after_masking_is_left_alone():
    """A wrong rewrite before: where(keep, s, -1e4) * 1e-3 leaves -10 at masked keys, which softmax weighs
    (e^-10); the op took the fill as -inf. A fill that stays a masked value after the scale is still
    rewritten."""

    def scaled_to_minus_10(q, k, v):
        keep = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).tril()
        s = (q @ k.transpose(-2, -1)).masked_fill(~keep, -1e4) * 1e-3
        return torch.softmax(s, -1) @ v

    def finfo_min_divided(q, k, v):
        keep = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).tril()
        s = torch.where(keep, q @ k.transpose(-2, -1), torch.finfo(q.dtype).min) / 8
        return torch.softmax(s, -1) @ v

    q, k, v = _qkv(S=7, D=8)
    out, _ = _run_rewritten(scaled_to_minus_10, q, k, v)
    assert _rewrites() == (0, 1)
    torch.testing.assert_close(out, scaled_to_minus_10(q, k, v))
    (node,) = _check_same(finfo_min_divided, q, k, v)
    assert node.kwargs["is_causal"] is True


@pytest.mark.parametrize("masked", [False, True])
def test_sdpa_one_kv_head_without_enable_gqa_is_gqa(masked):
    """Falcon's multi-query SDPA call passes k/v with one head and no enable_gqa: SDPA broadcasts the head
    dim, the same function as GQA with one group. It was a near miss ("SDPA raises")."""

    def fn(q, k, v, m=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=m is None)

    q, k, v = _qkv(S=7, D=8, Hkv=1)
    extra = [torch.randn(2, 1, 7, 7)] if masked else []
    (node,) = _check_same(fn, q, k, v, *extra)
    assert node.kwargs["enable_gqa"] is True


def test_soft_capped_scores_are_a_reported_near_miss():
    """Gemma 2's soft cap: no rewrite (the op has none), and now a near miss that says why rather than
    silence."""

    def fn(q, k, v):
        s = torch.tanh(q @ k.transpose(-2, -1) * 0.25 / 50.0) * 50.0
        return torch.softmax(s, -1) @ v

    q, k, v = _qkv(S=7, D=8)
    with fx_passes.collecting() as report:
        out, _ = _run_rewritten(fn, q, k, v)
    assert _rewrites() == (0, 1)
    assert "tanh" in report.near_misses[0].detail
    torch.testing.assert_close(out, fn(q, k, v))
