"""Review (session 32) of inference / generation code paths under torch.compile: greedy decoding as real code
bases run it, the compiled step against eager's step token by token.

- transformers' StaticCache (``index_copy_`` at ``cache_position`` into fixed (B, Hkv, Smax, D) buffers, the
  4-d float mask built from ``cache_position`` in the graph, or built outside it with a left-padding mask as
  generate() does for a static cache), prefill with Sq = prompt length, then decode with Sq = 1 against
  Sk = Smax; compiled with dynamic=False and dynamic=True; speculative decoding's verification step (Sq = k
  draft tokens against the cache) on the same model;
- transformers' dynamic cache (``torch.cat`` of the past k / v: Sk grows) under dynamic=True, and beam
  search reordering it by ``index_select`` (``_reorder_cache``);
- gpt-fast (KVCache with ``k_cache[:, :, input_pos] = k``, the causal mask buffer indexed by input_pos, SDPA
  with attn_mask, GQA by repeat_interleave, fullgraph, dynamic=False);
- nanoGPT's generate (idx cropped to block_size, a full recompute each step, ``x[:, [-1], :]`` before the
  head), manual and SDPA attention, dropout modules under eval();
- Meta's llama reference model (plain tensor attributes as caches, ``cache[:bsz, start_pos:start_pos+S] =
  xk``, the ``triu(full(-inf), 1)`` mask hstacked with zeros for the cached part, start_pos an int, forward
  under ``@torch.inference_mode()``, complex rotary);
- mistral-src's rolling buffer cache (``positions % window``), decode against a full ring;
- BART-style encoder-decoder decoding (encoder once, cross-attention k / v computed at the first step and
  reused, the self-attention cache by torch.cat);
- perplexity evaluation under inference_mode (the LM-head + cross-entropy rewrite without autograd);
- bf16 and fp16 inference on the CPU against an fp32 reference (teacher forced).

Every case checks eager's tokens and logits at each step, the rewrites per family (counters["flash"]) and
that the decode steps do not recompile (a counting backend). Findings (findings/inference_review_s32.md):
no wrong result, no crash, no per-step recompile, no missed rewrite of a provably-same form; the decode step's
Sq = 1 attention with its cache mask, the norms and the GELU MLPs are rewritten in every graph.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from flash_backend.backend import rewrite_only_backend
from fx_passes import collecting
from fx_passes._compat import counters

FAMILIES = ("attention", "norm", "dense", "cross_entropy")
TOL = dict(atol=5e-5, rtol=5e-5)
VOCAB, DIM, HEADS, KV_HEADS, LAYERS = 53, 32, 4, 2, 2
HEAD_DIM = DIM // HEADS
MAX_LEN = 16
PROMPT = 5
STEPS = 4


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _cold_inductor_cache():
    """An Inductor cache hit skips the pre-grad passes, and with them the counters these tests assert."""
    from torch._inductor.utils import fresh_inductor_cache

    with fresh_inductor_cache():
        yield


class Counting:
    """A dynamo backend that counts the graphs it compiles and hands them to `inner`."""

    def __init__(self, inner=rewrite_only_backend):
        self.inner, self.graphs = inner, 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return self.inner(gm, example_inputs)


def _compile(fn, backend, **kwargs):
    torch._dynamo.reset()
    counters.clear()
    return torch.compile(fn, backend=backend, **kwargs)


def _flash_counts():
    return {f: counters["flash"].get(f, 0) for f in FAMILIES}


def _assert_steps_equal(got, expected, report, tol=TOL):
    """got / expected: lists of (tokens, logits) per step."""
    assert len(got) == len(expected)
    for i, ((gt, gl), (et, el)) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(gl, el, **tol, msg=lambda m, i=i: f"step {i}: {m}\n{report}")
        assert torch.equal(gt, et), (i, gt, et, str(report))


def _assert_rewrites_per_graph(report, attention, norm, dense, cross_entropy=0, extra=None):
    """Every graph dynamo compiled got `attention` / `norm` / ... rewrites (`extra`: {family: n} more, from
    a graph of another kind), and nothing was left alone."""
    graphs = counters["stats"]["unique_graphs"]
    extra = extra or {}
    per_graph = dict(attention=attention, norm=norm, dense=dense, cross_entropy=cross_entropy)
    expected = {f: per_graph[f] * graphs + extra.get(f, 0) for f in FAMILIES}
    assert graphs >= 1 and _flash_counts() == expected, f"{graphs} graphs\n{report}"
    assert not report.near_misses, str(report)


# ========================================================================================================
# transformers-style decoder (Llama / GPT-NeoX-ish): RMSNorm in fp32, rotary, GQA, eager attention
# ========================================================================================================


class HFRMSNorm(nn.Module):
    """LlamaRMSNorm."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class HFRotary(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].float()
        freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype=x.dtype), emb.sin().to(dtype=x.dtype)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class StaticLayerCache(nn.Module):
    """transformers' StaticCache for one layer: fixed buffers written by index_copy_ at cache_position."""

    def __init__(self, batch, max_len, dtype=torch.float32):
        super().__init__()
        shape = (batch, KV_HEADS, max_len, HEAD_DIM)
        self.register_buffer("key_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("value_cache", torch.zeros(shape, dtype=dtype), persistent=False)

    def update(self, key_states, value_states, cache_position):
        k_out, v_out = self.key_cache, self.value_cache
        k_out.index_copy_(2, cache_position, key_states)
        v_out.index_copy_(2, cache_position, value_states)
        return k_out, v_out


class HFAttention(nn.Module):
    def __init__(self, attention_dropout=0.0):
        super().__init__()
        self.num_key_value_groups = HEADS // KV_HEADS
        self.scaling = HEAD_DIM**-0.5
        self.attention_dropout = attention_dropout
        self.q_proj = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask, past, cache_position):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, HEAD_DIM)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        present = None
        if isinstance(past, StaticLayerCache):
            key_states, value_states = past.update(key_states, value_states, cache_position)
        elif past is not None:  # the dynamic cache: DynamicCache.update's torch.cat
            key_states = torch.cat([past[0], key_states], dim=-2)
            value_states = torch.cat([past[1], value_states], dim=-2)
            present = (key_states, value_states)
        else:
            present = (key_states, value_states)
        # eager_attention_forward
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
            attn_weights = attn_weights + causal_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_weights = nn.functional.dropout(attn_weights, p=self.attention_dropout, training=self.training)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), present


class GeluMLP(nn.Module):
    """GPT-NeoX / Phi's MLP: dense_h_to_4h, GELU, dense_4h_to_h (with biases: the dense family's form)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(DIM, 3 * DIM)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(3 * DIM, DIM)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class HFDecoderLayer(nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.self_attn = HFAttention(dropout)
        self.mlp = GeluMLP()
        self.input_layernorm = HFRMSNorm(DIM)
        self.post_attention_layernorm = HFRMSNorm(DIM)

    def forward(self, hidden_states, position_embeddings, attention_mask, past, cache_position):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, present = self.self_attn(hidden_states, position_embeddings, attention_mask, past,
                                                cache_position)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states, present


def hf_causal_mask_with_cache_position(attention_mask, sequence_length, target_length, dtype,
                                       cache_position, batch_size):
    """transformers' _prepare_4d_causal_attention_mask_with_cache_position (4.4x)."""
    min_dtype = torch.finfo(dtype).min
    causal_mask = torch.full((sequence_length, target_length), fill_value=min_dtype, dtype=dtype)
    if sequence_length != 1:
        causal_mask = torch.triu(causal_mask, diagonal=1)
    causal_mask *= torch.arange(target_length) > cache_position.reshape(-1, 1)
    causal_mask = causal_mask[None, None, :, :].expand(batch_size, 1, -1, -1)
    if attention_mask is not None:
        causal_mask = causal_mask.clone()
        mask_length = attention_mask.shape[-1]
        padding_mask = causal_mask[:, :, :, :mask_length] + attention_mask[:, None, None, :].to(dtype)
        padding_mask = padding_mask == 0
        causal_mask[:, :, :, :mask_length] = causal_mask[:, :, :, :mask_length].masked_fill(
            padding_mask, min_dtype)
    return causal_mask


class HFCausalLM(nn.Module):
    """LlamaForCausalLM-like with a GELU MLP; past is a list of StaticLayerCache, of (k, v) or None."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([HFDecoderLayer(dropout) for _ in range(LAYERS)])
        self.norm = HFRMSNorm(DIM)
        self.rotary_emb = HFRotary(HEAD_DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids, cache_position, past=None, attention_mask=None, target_length=None,
                logits_to_keep=1, labels=None):
        inputs_embeds = self.embed_tokens(input_ids)
        position_ids = cache_position.unsqueeze(0)
        if attention_mask is None or attention_mask.dim() == 2:  # built here from cache_position
            target = target_length if target_length is not None else int(cache_position.shape[0]) + (
                0 if past is None or past[0] is None else past[0][0].shape[-2])
            attention_mask = hf_causal_mask_with_cache_position(
                attention_mask, input_ids.shape[1], target, inputs_embeds.dtype, cache_position,
                input_ids.shape[0])
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        presents = []
        for i, layer in enumerate(self.layers):
            hidden_states, present = layer(hidden_states, position_embeddings, attention_mask,
                                           None if past is None else past[i], cache_position)
            presents.append(present)
        hidden_states = self.norm(hidden_states)
        if labels is not None:
            logits = self.lm_head(hidden_states)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), labels[:, 1:].reshape(-1))
            return logits, loss
        logits = self.lm_head(hidden_states[:, -logits_to_keep:, :])
        return logits, presents


def _static_model(batch=2, dtype=torch.float32, dropout=0.0):
    model = HFCausalLM(dropout).to(dtype).eval()
    model.caches = nn.ModuleList([StaticLayerCache(batch, MAX_LEN, dtype) for _ in range(LAYERS)])
    return model


def _reset_static(model):
    for c in model.caches:
        c.key_cache.zero_()
        c.value_cache.zero_()


def static_generate(model, step, input_ids, steps=STEPS, attention_mask=None, forced=None):
    """generate() with a StaticCache, greedy: prefill (Sq = prompt), then Sq = 1 decode steps at
    cache_position. With a 2-d attention_mask the 4-d mask is built outside the step (as generate() does for
    a static cache) over MAX_LEN keys; `forced` feeds those tokens instead of the argmax (teacher forcing).
    Returns [(tokens, logits)] per step."""
    _reset_static(model)
    b, p = input_ids.shape
    cache_position = torch.arange(p)
    ids, out = input_ids, []
    for i in range(steps + 1):
        kwargs = dict(past=list(model.caches), target_length=MAX_LEN)
        if attention_mask is not None:
            kwargs["attention_mask"] = hf_causal_mask_with_cache_position(
                attention_mask, ids.shape[1], MAX_LEN, torch.float32, cache_position, b).to(
                    model.lm_head.weight.dtype)
        logits, _ = step(ids, cache_position, **kwargs)
        tokens = logits[:, -1].argmax(-1)
        out.append((tokens, logits[:, -1].float()))
        ids = (tokens if forced is None else forced[:, i])[:, None]
        cache_position = cache_position[-1:] + 1
        if attention_mask is not None:
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(b, 1)], dim=-1)
    return out


def _prompt(batch=2, length=PROMPT):
    return torch.randint(0, VOCAB, (batch, length))


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("mask_outside", [False, True], ids=["mask_in_graph", "left_padding_mask"])
def test_static_cache_generate(dynamic, mask_outside):
    eager_model = _static_model()
    model = copy.deepcopy(eager_model)
    ids = _prompt()
    attention_mask = None
    if mask_outside:
        attention_mask = torch.ones(2, PROMPT, dtype=torch.long)
        attention_mask[1, :2] = 0  # left padding of the second prompt
    with torch.no_grad():
        expected = static_generate(eager_model, eager_model, ids, attention_mask=attention_mask)
    backend = Counting()
    step = _compile(model, backend, dynamic=dynamic, fullgraph=True)
    with collecting() as report, torch.no_grad():
        got = static_generate(model, step, ids, steps=2, attention_mask=attention_mask)
        graphs = backend.graphs
        got += static_generate(model, step, ids, attention_mask=attention_mask)[len(got):]
        got = static_generate(model, step, ids, attention_mask=attention_mask)
    _assert_rewrites_per_graph(report, attention=2, norm=5, dense=2)
    _assert_steps_equal(got, expected, report)
    assert backend.graphs == graphs, f"decode steps recompiled: {graphs} -> {backend.graphs}"
    _assert_rewrites_per_graph(report, attention=2, norm=5, dense=2)


def test_speculative_verification_step():
    """Speculative decoding's verification: k = 4 draft tokens scored in one step against the static cache
    (Sq = 4 < Sk = MAX_LEN, the mask from cache_position), then the accepted prefix kept."""
    eager_model = _static_model(batch=1)
    model = copy.deepcopy(eager_model)
    ids, draft = _prompt(1), _prompt(1, 4)
    step = _compile(model, Counting(), dynamic=False, fullgraph=True)
    results = []
    with collecting() as report, torch.no_grad():
        for m, f in ((eager_model, eager_model), (model, step)):
            static_generate(m, f, ids, steps=0)  # the prefill fills the cache
            logits, _ = f(draft, torch.arange(PROMPT, PROMPT + 4), past=list(m.caches), target_length=MAX_LEN,
                          logits_to_keep=4)
            results.append((logits.argmax(-1), logits))
    _assert_steps_equal(results[1:], results[:1], report)
    _assert_rewrites_per_graph(report, attention=2, norm=5, dense=2)


def dynamic_generate(step, input_ids, steps=STEPS, beams=None):
    """generate() with the dynamic cache (torch.cat per step), greedy; with `beams` a fixed permutation of the
    batch reorders the cache before each decode step (beam search's _reorder_cache, index_select)."""
    b, p = input_ids.shape
    cache_position = torch.arange(p)
    logits, past = step(input_ids, cache_position)
    out = []
    for i in range(steps + 1):
        tokens = logits[:, -1].argmax(-1)
        out.append((tokens, logits[:, -1]))
        if i == steps:
            break
        if beams is not None:
            beam_idx = beams[i]
            past = [tuple(t.index_select(0, beam_idx) for t in layer) for layer in past]
            tokens = tokens.index_select(0, beam_idx)
        cache_position = cache_position[-1:] + 1
        logits, past = step(tokens[:, None], cache_position, past=past)
    return out


@pytest.mark.parametrize("beam", [False, True], ids=["greedy", "beam_reorder"])
def test_dynamic_cache_generate(beam):
    model = HFCausalLM().eval()
    ids = _prompt(3)
    beams = [torch.randint(0, 3, (3,)) for _ in range(STEPS)] if beam else None
    with torch.no_grad():
        expected = dynamic_generate(model, ids, beams=beams)
    backend = Counting()
    step = _compile(model, backend, dynamic=True, fullgraph=True)
    with collecting() as report, torch.no_grad():
        got = dynamic_generate(step, ids, steps=2, beams=beams)
        graphs = backend.graphs
        got = dynamic_generate(step, ids, beams=beams)
    _assert_steps_equal(got, expected, report)
    assert backend.graphs == graphs, f"decode steps recompiled: {graphs} -> {backend.graphs}"
    _assert_rewrites_per_graph(report, attention=2, norm=5, dense=2)


# ========================================================================================================
# gpt-fast (pytorch-labs/gpt-fast, model.py + generate.py)
# ========================================================================================================


def gf_precompute_freqs_cis(seq_len, n_elem, base=10000, dtype=torch.float32):
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2)[: (n_elem // 2)].float() / n_elem))
    t = torch.arange(seq_len, device=freqs.device)
    freqs = torch.outer(t, freqs)
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
    cache = torch.stack([freqs_cis.real, freqs_cis.imag], dim=-1)
    return cache.to(dtype=dtype)


def gf_apply_rotary_emb(x, freqs_cis):
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out2 = torch.stack([
        xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
        xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
    ], -1)
    x_out2 = x_out2.flatten(3)
    return x_out2.type_as(x)


class GFKVCache(nn.Module):
    def __init__(self, max_batch_size, max_seq_length, n_heads, head_dim, dtype):
        super().__init__()
        cache_shape = (max_batch_size, n_heads, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(cache_shape, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(cache_shape, dtype=dtype))

    def update(self, input_pos, k_val, v_val):
        assert input_pos.shape[0] == k_val.shape[2]
        k_out = self.k_cache
        v_out = self.v_cache
        k_out[:, :, input_pos] = k_val
        v_out[:, :, input_pos] = v_val
        return k_out, v_out


class GFRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def _norm(self, x):
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float()).type_as(x)
        return output * self.weight


class GFAttention(nn.Module):
    def __init__(self):
        super().__init__()
        total_head_dim = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        self.wqkv = nn.Linear(DIM, total_head_dim, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)
        self.kv_cache = None

    def forward(self, x, freqs_cis, mask, input_pos=None):
        bsz, seqlen, _ = x.shape
        kv_size = KV_HEADS * HEAD_DIM
        q, k, v = self.wqkv(x).split([DIM, kv_size, kv_size], dim=-1)
        q = q.view(bsz, seqlen, HEADS, HEAD_DIM)
        k = k.view(bsz, seqlen, KV_HEADS, HEAD_DIM)
        v = v.view(bsz, seqlen, KV_HEADS, HEAD_DIM)
        q = gf_apply_rotary_emb(q, freqs_cis)
        k = gf_apply_rotary_emb(k, freqs_cis)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(input_pos, k, v)
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        y = y.transpose(1, 2).contiguous().view(bsz, seqlen, DIM)
        return self.wo(y)


class GFFeedForward(nn.Module):
    """gpt-fast's SwiGLU (w2(silu(w1 x) * w3 x)): no candidate of the dense family."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, 3 * DIM, bias=False)
        self.w3 = nn.Linear(DIM, 3 * DIM, bias=False)
        self.w2 = nn.Linear(3 * DIM, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GFBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = GFAttention()
        self.feed_forward = GFFeedForward()
        self.ffn_norm = GFRMSNorm(DIM)
        self.attention_norm = GFRMSNorm(DIM)

    def forward(self, x, input_pos, freqs_cis, mask):
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class GFTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(GFBlock() for _ in range(LAYERS))
        self.norm = GFRMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.freqs_cis = None
        self.mask_cache = None
        self.max_batch_size = -1
        self.max_seq_length = -1

    def setup_caches(self, max_batch_size, max_seq_length, dtype=torch.float32):
        self.max_seq_length = max_seq_length
        self.max_batch_size = max_batch_size
        for b in self.layers:
            b.attention.kv_cache = GFKVCache(max_batch_size, max_seq_length, KV_HEADS, HEAD_DIM, dtype)
        self.freqs_cis = gf_precompute_freqs_cis(max_seq_length, HEAD_DIM, dtype=dtype)
        self.causal_mask = torch.tril(torch.ones(self.max_seq_length, self.max_seq_length, dtype=torch.bool))

    def forward(self, idx, input_pos):
        mask = self.causal_mask[None, None, input_pos]
        freqs_cis = self.freqs_cis[input_pos]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, input_pos, freqs_cis, mask)
        x = self.norm(x)
        return self.output(x)


def gf_generate(model, prefill, decode_one_token, prompt, steps=STEPS):
    """gpt-fast's generate(): prefill at input_pos = arange(T), then decode_n_tokens one at a time
    (greedy: sample() with top_k=1)."""
    model.setup_caches(prompt.shape[0], MAX_LEN)
    input_pos = torch.arange(0, prompt.shape[1])
    logits = prefill(model, prompt, input_pos)
    out = [(logits[:, -1].argmax(-1), logits[:, -1])]
    input_pos = torch.tensor([prompt.shape[1]], dtype=torch.int)
    cur = out[-1][0][:, None]
    for _ in range(steps):
        logits = decode_one_token(model, cur, input_pos)
        input_pos += 1
        out.append((logits[:, -1].argmax(-1), logits[:, -1]))
        cur = out[-1][0][:, None]
    return out


def gf_prefill(model, x, input_pos):
    return model(x, input_pos)


def gf_decode_one_token(model, x, input_pos):
    return model(x, input_pos)


def test_gpt_fast_generate():
    """gpt-fast compiles decode_one_token with fullgraph (dynamic=False) and the prefill with dynamic=True."""
    model = GFTransformer().eval()
    prompt = _prompt(2)
    with torch.no_grad():
        expected = gf_generate(model, gf_prefill, gf_decode_one_token, prompt)
    torch._dynamo.reset()
    counters.clear()
    backend = Counting()
    decode = torch.compile(gf_decode_one_token, backend=backend, fullgraph=True, dynamic=False)
    prefill = torch.compile(gf_prefill, backend=backend, fullgraph=True, dynamic=True)
    with collecting() as report, torch.no_grad():
        got = gf_generate(model, prefill, decode, prompt, steps=2)
        graphs = backend.graphs
        got = gf_generate(model, prefill, decode, prompt)
    _assert_steps_equal(got, expected, report)
    assert backend.graphs == graphs, f"decode steps recompiled: {graphs} -> {backend.graphs}"
    _assert_rewrites_per_graph(report, attention=2, norm=5, dense=0)


# ========================================================================================================
# nanoGPT (karpathy/nanoGPT, model.py): generate() recomputes the cropped context every step
# ========================================================================================================


class NanoLayerNorm(nn.Module):
    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(ndim))
        self.bias = nn.Parameter(0.1 * torch.randn(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class NanoCausalSelfAttention(nn.Module):
    def __init__(self, block_size, dropout, flash):
        super().__init__()
        self.c_attn = nn.Linear(DIM, 3 * DIM)
        self.c_proj = nn.Linear(DIM, DIM)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head, self.n_embd, self.dropout = HEADS, DIM, dropout
        self.flash = flash
        if not self.flash:
            self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size))
                                 .view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None,
                                               dropout_p=self.dropout if self.training else 0, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class NanoMLP(nn.Module):
    def __init__(self, dropout):
        super().__init__()
        self.c_fc = nn.Linear(DIM, 4 * DIM)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * DIM, DIM)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class NanoBlock(nn.Module):
    def __init__(self, block_size, dropout, flash):
        super().__init__()
        self.ln_1 = NanoLayerNorm(DIM, bias=True)
        self.attn = NanoCausalSelfAttention(block_size, dropout, flash)
        self.ln_2 = NanoLayerNorm(DIM, bias=True)
        self.mlp = NanoMLP(dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, block_size=8, dropout=0.1, flash=False):
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, DIM), wpe=nn.Embedding(block_size, DIM), drop=nn.Dropout(dropout),
            h=nn.ModuleList([NanoBlock(block_size, dropout, flash) for _ in range(LAYERS)]),
            ln_f=NanoLayerNorm(DIM, bias=True)))
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        b, t = idx.size()
        assert t <= self.block_size, f"Cannot forward sequence of length {t}, block size {self.block_size}"
        pos = torch.arange(0, t, dtype=torch.long)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss


@torch.no_grad()
def nano_generate(model, idx, max_new_tokens, temperature=1.0, top_k=1):
    """GPT.generate with top_k = 1: multinomial over one nonzero probability, greedy."""
    out = []
    for _ in range(max_new_tokens):
        idx_cond = idx if idx.size(1) <= model.block_size else idx[:, -model.block_size:]
        logits, _ = model(idx_cond)
        logits = logits[:, -1, :] / temperature
        step_logits = logits
        if top_k is not None:
            v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
            logits[logits < v[:, [-1]]] = -float("Inf")
        probs = F.softmax(logits, dim=-1)
        idx_next = torch.multinomial(probs, num_samples=1)
        idx = torch.cat((idx, idx_next), dim=1)
        out.append((idx_next[:, 0], step_logits))
    return out


@pytest.mark.parametrize("flash", [False, True], ids=["manual", "sdpa"])
def test_nanogpt_generate(flash):
    """model.eval() with dropout 0.1 modules; lengths 5..8 and then cropped at block_size 8."""
    model = NanoGPT(flash=flash).eval()
    idx = _prompt(2)
    expected = nano_generate(model, idx, 6)
    backend = Counting()
    compiled = _compile(model, backend, fullgraph=True)
    compiled.block_size = model.block_size
    with collecting() as report:
        got = nano_generate(compiled, idx, 6)
    _assert_steps_equal(got, expected, report)
    # 5 (static), 6.. (dynamic); the cropped steps reuse the dynamic graph
    assert backend.graphs <= 2 * 2, backend.graphs
    _assert_rewrites_per_graph(report, attention=2, norm=5, dense=2)


# ========================================================================================================
# Meta's llama reference (meta-llama/llama, llama/model.py) and mistral-src's rolling buffer cache
# ========================================================================================================


def ml_precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def ml_reshape_for_broadcast(freqs_cis, x):
    ndim = x.ndim
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def ml_apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = ml_reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def ml_repeat_kv(x, n_rep):
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim)
            .reshape(bs, slen, n_kv_heads * n_rep, head_dim))


class MLRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float()).type_as(x)
        return output * self.weight


class MLAttention(nn.Module):
    """llama/model.py's Attention; window: mistral-src's rolling buffer (cache slot = position % window)."""

    def __init__(self, max_batch_size, max_seq_len, window=None):
        super().__init__()
        self.n_rep = HEADS // KV_HEADS
        self.window = window
        self.wq = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.wv = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.wo = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)
        slots = window or max_seq_len
        self.cache_k = torch.zeros((max_batch_size, slots, KV_HEADS, HEAD_DIM))
        self.cache_v = torch.zeros((max_batch_size, slots, KV_HEADS, HEAD_DIM))

    def forward(self, x, start_pos, freqs_cis, mask, positions=None):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, HEADS, HEAD_DIM)
        xk = xk.view(bsz, seqlen, KV_HEADS, HEAD_DIM)
        xv = xv.view(bsz, seqlen, KV_HEADS, HEAD_DIM)
        xq, xk = ml_apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        self.cache_k = self.cache_k.to(xq)
        self.cache_v = self.cache_v.to(xq)
        if self.window is None:
            self.cache_k[:bsz, start_pos: start_pos + seqlen] = xk
            self.cache_v[:bsz, start_pos: start_pos + seqlen] = xv
            keys = self.cache_k[:bsz, : start_pos + seqlen]
            values = self.cache_v[:bsz, : start_pos + seqlen]
        else:  # mistral-src: scatter into the ring; decode attends over every slot (mask: empty slots)
            scatter_pos = (positions % self.window)[None, :, None, None].repeat(bsz, 1, KV_HEADS, HEAD_DIM)
            self.cache_k[:bsz].scatter_(dim=1, index=scatter_pos, src=xk)
            self.cache_v[:bsz].scatter_(dim=1, index=scatter_pos, src=xv)
            keys, values = self.cache_k[:bsz], self.cache_v[:bsz]
        keys = ml_repeat_kv(keys, self.n_rep)
        values = ml_repeat_kv(values, self.n_rep)
        xq = xq.transpose(1, 2)
        keys = keys.transpose(1, 2)
        values = values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(HEAD_DIM)
        if mask is not None:
            scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class MLFeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, 3 * DIM, bias=False)
        self.w2 = nn.Linear(3 * DIM, DIM, bias=False)
        self.w3 = nn.Linear(DIM, 3 * DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MLBlock(nn.Module):
    def __init__(self, max_batch_size, max_seq_len, window=None):
        super().__init__()
        self.attention = MLAttention(max_batch_size, max_seq_len, window)
        self.feed_forward = MLFeedForward()
        self.attention_norm = MLRMSNorm(DIM)
        self.ffn_norm = MLRMSNorm(DIM)

    def forward(self, x, start_pos, freqs_cis, mask, positions=None):
        h = x + self.attention(self.attention_norm(x), start_pos, freqs_cis, mask, positions)
        return h + self.feed_forward(self.ffn_norm(h))


class MLTransformer(nn.Module):
    def __init__(self, max_batch_size=2, max_seq_len=MAX_LEN):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(MLBlock(max_batch_size, max_seq_len) for _ in range(LAYERS))
        self.norm = MLRMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.freqs_cis = ml_precompute_freqs_cis(HEAD_DIM, max_seq_len * 2)

    @torch.inference_mode()
    def forward(self, tokens, start_pos: int):
        _bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        self.freqs_cis = self.freqs_cis.to(h.device)
        freqs_cis = self.freqs_cis[start_pos: start_pos + seqlen]
        mask = None
        if seqlen > 1:
            mask = torch.full((seqlen, seqlen), float("-inf"), device=tokens.device)
            mask = torch.triu(mask, diagonal=1)
            mask = torch.hstack([torch.zeros((seqlen, start_pos), device=tokens.device), mask]).type_as(h)
        for layer in self.layers:
            h = layer(h, start_pos, freqs_cis, mask)
        h = self.norm(h)
        return self.output(h).float()


def ml_generate(model, prompt, steps=STEPS, chunk=None):
    """Llama.generate, greedy (temperature 0): forward(tokens[:, prev_pos:cur_pos], prev_pos). `chunk`: a
    second prefill chunk (seqlen > 1 with start_pos > 0: the hstacked zeros)."""
    for layer in model.layers:
        layer.attention.cache_k.zero_()
        layer.attention.cache_v.zero_()
    tokens = prompt
    prev_pos, out = 0, []
    if chunk is not None:
        model(tokens[:, :chunk], 0)
        prev_pos = chunk
    for _ in range(steps + 1):
        logits = model(tokens[:, prev_pos:], prev_pos)
        next_token = torch.argmax(logits[:, -1], dim=-1)
        out.append((next_token, logits[:, -1].clone()))
        prev_pos = tokens.shape[1]
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
    return out


@pytest.mark.parametrize("dynamic", [None, True])
def test_meta_llama_generate(dynamic):
    """The llama reference: forward under @torch.inference_mode(), plain tensor attributes as caches, an int
    start_pos; a prompt prefilled in two chunks (the second's mask hstacks zeros for the cached part)."""
    eager_model = MLTransformer()
    model = copy.deepcopy(eager_model)
    prompt = _prompt(2, 7)
    expected = ml_generate(eager_model, prompt, chunk=3)
    backend = Counting()
    compiled = _compile(model, backend, dynamic=dynamic)
    compiled.layers = model.layers
    with collecting() as report:
        got = ml_generate(compiled, prompt, steps=3, chunk=3)
        graphs = backend.graphs
        got = ml_generate(compiled, prompt, chunk=3)
    _assert_steps_equal(got, expected, report)
    assert backend.graphs == graphs, f"decode steps recompiled: {graphs} -> {backend.graphs}"
    _assert_rewrites_per_graph(report, attention=2, norm=5, dense=0)


class RollingTransformer(MLTransformer):
    """mistral-src's rolling buffer cache: every token decoded one by one (Sq = 1), the ring of WINDOW slots
    wraps after WINDOW positions; the mask hides the slots not written yet."""

    WINDOW = 4

    def __init__(self):
        super().__init__(max_batch_size=2)
        self.layers = nn.ModuleList(MLBlock(2, MAX_LEN, self.WINDOW) for _ in range(LAYERS))

    def forward(self, tokens, positions):
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[positions]
        filled = torch.arange(self.WINDOW) <= positions[-1]
        mask = torch.full((1, self.WINDOW), float("-inf")).masked_fill(filled, 0.0)
        for layer in self.layers:
            h = layer(h, 0, freqs_cis, mask, positions)
        return self.output(self.norm(h)).float()


def rolling_generate(model, prompt, steps=STEPS + 3):
    for layer in model.layers:
        layer.attention.cache_k.zero_()
        layer.attention.cache_v.zero_()
    out, cur = [], prompt[:, :1]
    for pos in range(steps):
        logits = model(cur, torch.tensor([pos]))
        nxt = logits[:, -1].argmax(-1)
        out.append((nxt, logits[:, -1].clone()))
        cur = (prompt[:, pos + 1: pos + 2] if pos + 1 < prompt.shape[1] else nxt[:, None]).contiguous()
    return out


@pytest.mark.parametrize("dynamic", [False, True])
def test_rolling_buffer_cache_generate(dynamic):
    eager_model = RollingTransformer()
    model = copy.deepcopy(eager_model)
    prompt = _prompt(2, 3)
    with torch.no_grad():
        expected = rolling_generate(eager_model, prompt)
    backend = Counting()
    compiled = _compile(model, backend, dynamic=dynamic, fullgraph=True)
    compiled.layers = model.layers
    with collecting() as report, torch.no_grad():
        got = rolling_generate(compiled, prompt, steps=2)
        graphs = backend.graphs
        got = rolling_generate(compiled, prompt)
    _assert_steps_equal(got, expected, report)
    assert backend.graphs == graphs, f"decode steps recompiled: {graphs} -> {backend.graphs}"
    _assert_rewrites_per_graph(report, attention=2, norm=5, dense=0)


# ========================================================================================================
# BART-style encoder-decoder decoding: cross-attention k / v computed once, the self cache by torch.cat
# ========================================================================================================


class BartAttention(nn.Module):
    def __init__(self, dropout=0.1):
        super().__init__()
        self.num_heads, self.head_dim, self.dropout = HEADS, HEAD_DIM, dropout
        self.scaling = self.head_dim**-0.5
        self.k_proj = nn.Linear(DIM, DIM)
        self.v_proj = nn.Linear(DIM, DIM)
        self.q_proj = nn.Linear(DIM, DIM)
        self.out_proj = nn.Linear(DIM, DIM)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, key_value_states=None, past_key_value=None, attention_mask=None):
        is_cross_attention = key_value_states is not None
        bsz, tgt_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scaling
        if is_cross_attention and past_key_value is not None:
            key_states, value_states = past_key_value
        elif is_cross_attention:
            key_states = self._shape(self.k_proj(key_value_states), -1, bsz)
            value_states = self._shape(self.v_proj(key_value_states), -1, bsz)
        elif past_key_value is not None:
            key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
            value_states = self._shape(self.v_proj(hidden_states), -1, bsz)
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], value_states], dim=2)
        else:
            key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
            value_states = self._shape(self.v_proj(hidden_states), -1, bsz)
        past_key_value = (key_states, value_states)
        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.reshape(*proj_shape)
        value_states = value_states.reshape(*proj_shape)
        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        if attention_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_probs = nn.functional.dropout(attn_weights, p=self.dropout, training=self.training)
        attn_output = torch.bmm(attn_probs, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        attn_output = attn_output.reshape(bsz, tgt_len, DIM)
        return self.out_proj(attn_output), past_key_value


class BartEncoderLayer(nn.Module):
    def __init__(self, dropout=0.1):
        super().__init__()
        self.self_attn = BartAttention()
        self.self_attn_layer_norm = nn.LayerNorm(DIM)
        self.dropout = dropout
        self.fc1 = nn.Linear(DIM, 3 * DIM)
        self.fc2 = nn.Linear(3 * DIM, DIM)
        self.final_layer_norm = nn.LayerNorm(DIM)

    def forward(self, hidden_states, attention_mask):
        residual = hidden_states
        hidden_states, _ = self.self_attn(hidden_states, attention_mask=attention_mask)
        hidden_states = nn.functional.dropout(hidden_states, p=self.dropout, training=self.training)
        hidden_states = self.self_attn_layer_norm(residual + hidden_states)
        residual = hidden_states
        hidden_states = F.gelu(self.fc1(hidden_states))
        hidden_states = nn.functional.dropout(hidden_states, p=0.0, training=self.training)
        hidden_states = self.fc2(hidden_states)
        hidden_states = nn.functional.dropout(hidden_states, p=self.dropout, training=self.training)
        return self.final_layer_norm(residual + hidden_states)


class BartDecoderLayer(nn.Module):
    def __init__(self, dropout=0.1):
        super().__init__()
        self.self_attn = BartAttention()
        self.dropout = dropout
        self.self_attn_layer_norm = nn.LayerNorm(DIM)
        self.encoder_attn = BartAttention()
        self.encoder_attn_layer_norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 3 * DIM)
        self.fc2 = nn.Linear(3 * DIM, DIM)
        self.final_layer_norm = nn.LayerNorm(DIM)

    def forward(self, hidden_states, encoder_hidden_states, encoder_attention_mask, past_key_value):
        residual = hidden_states
        self_attn_past = past_key_value[:2] if past_key_value is not None else None
        hidden_states, present = self.self_attn(hidden_states, past_key_value=self_attn_past)
        hidden_states = nn.functional.dropout(hidden_states, p=self.dropout, training=self.training)
        hidden_states = self.self_attn_layer_norm(residual + hidden_states)
        residual = hidden_states
        cross_past = past_key_value[-2:] if past_key_value is not None else None
        hidden_states, cross_present = self.encoder_attn(hidden_states, encoder_hidden_states, cross_past,
                                                         encoder_attention_mask)
        hidden_states = nn.functional.dropout(hidden_states, p=self.dropout, training=self.training)
        hidden_states = self.encoder_attn_layer_norm(residual + hidden_states)
        residual = hidden_states
        hidden_states = F.gelu(self.fc1(hidden_states))
        hidden_states = self.fc2(hidden_states)
        hidden_states = nn.functional.dropout(hidden_states, p=self.dropout, training=self.training)
        hidden_states = self.final_layer_norm(residual + hidden_states)
        return hidden_states, present + cross_present


class BartLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Embedding(VOCAB, DIM)
        self.enc_pos = nn.Embedding(MAX_LEN, DIM)
        self.dec_pos = nn.Embedding(MAX_LEN, DIM)
        self.enc_ln = nn.LayerNorm(DIM)
        self.dec_ln = nn.LayerNorm(DIM)
        self.encoder_layers = nn.ModuleList(BartEncoderLayer() for _ in range(LAYERS))
        self.decoder_layers = nn.ModuleList(BartDecoderLayer() for _ in range(LAYERS))
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.register_buffer("final_logits_bias", 0.1 * torch.randn(1, VOCAB))

    def encode(self, input_ids, attention_mask):
        h = self.enc_ln(self.shared(input_ids) + self.enc_pos(torch.arange(input_ids.shape[1])))
        mask = (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        for layer in self.encoder_layers:
            h = layer(h, mask)
        return h

    def decode(self, decoder_input_ids, encoder_hidden_states, attention_mask, past, step: torch.Tensor):
        h = self.dec_ln(self.shared(decoder_input_ids) + self.dec_pos(step))
        mask = (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        presents = []
        for i, layer in enumerate(self.decoder_layers):
            h, present = layer(h, encoder_hidden_states, mask, None if past is None else past[i])
            presents.append(present)
        return self.lm_head(h) + self.final_logits_bias, presents


def bart_generate(encode, decode, input_ids, attention_mask, steps=STEPS):
    enc = encode(input_ids, attention_mask)
    cur = torch.zeros(input_ids.shape[0], 1, dtype=torch.long)  # decoder_start_token_id
    past, out = None, []
    for i in range(steps + 1):
        logits, past = decode(cur, enc, attention_mask, past, torch.tensor([i]))
        cur = logits[:, -1].argmax(-1)[:, None]
        out.append((cur[:, 0], logits[:, -1]))
    return out


@pytest.mark.parametrize("dynamic", [None, True])
def test_encoder_decoder_generate(dynamic):
    """eval() with dropout 0.1 modules; a padded source; the cross k / v reused from the first step."""
    model = BartLike().eval()
    ids = _prompt(2, 7)
    attention_mask = torch.ones(2, 7, dtype=torch.long)
    attention_mask[0, 5:] = 0
    with torch.no_grad():
        expected = bart_generate(model.encode, model.decode, ids, attention_mask)
    backend = Counting()
    encode = _compile(model.encode, backend, dynamic=dynamic, fullgraph=True)
    decode = torch.compile(model.decode, backend=backend, dynamic=dynamic, fullgraph=True)
    with collecting() as report, torch.no_grad():
        got = bart_generate(encode, decode, ids, attention_mask, steps=3)
        graphs = backend.graphs
        got = bart_generate(encode, decode, ids, attention_mask)
    _assert_steps_equal(got, expected, report)
    assert backend.graphs == graphs, f"decode steps recompiled: {graphs} -> {backend.graphs}"
    _assert_rewrites_per_graph(report, attention=4, norm=7, dense=2, extra=dict(attention=-2, norm=-2))


# ========================================================================================================
# Evaluation and precision
# ========================================================================================================


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
@pytest.mark.parametrize("which", ["nanogpt", "hf"])
def test_perplexity_eval(mode, which):
    """A validation loss as estimate_loss() / a perplexity script computes it: the LM head + cross-entropy
    rewrite with no autograd around the compiled call."""
    ctx = torch.inference_mode if mode == "inference_mode" else torch.no_grad
    ids = _prompt(3, 8)
    if which == "nanogpt":
        model = NanoGPT(dropout=0.1).eval()
        targets = ids.clone()
        targets[0, :2] = -1  # ignore_index=-1

        def fn(m):
            return m(ids, targets)
    else:
        model = HFCausalLM().eval()

        def fn(m):
            return m(ids, torch.arange(8), labels=ids, logits_to_keep=0)
    with ctx():
        expected = fn(model)
    compiled = _compile(model, Counting(), fullgraph=True)
    with collecting() as report, ctx():
        got = fn(compiled)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, **TOL, msg=lambda m: f"{m}\n{report}")
    _assert_rewrites_per_graph(report, attention=2, norm=5, dense=2, cross_entropy=1)


def _err(a, b):
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_static_cache_decode(dtype):
    """The static-cache generate in bf16 / fp16 on the CPU, teacher forced with the fp32 model's tokens: each
    step's logits within twice eager's own error against the fp32 model (plus a small floor)."""
    ref_model = _static_model()
    ids = _prompt()
    with torch.no_grad():
        reference = static_generate(ref_model, ref_model, ids)
    forced = torch.stack([t for t, _ in reference], 1)
    eager_model = copy.deepcopy(ref_model).to(dtype)
    model = copy.deepcopy(eager_model)
    with torch.no_grad():
        expected = static_generate(eager_model, eager_model, ids, forced=forced)
        step = _compile(model, Counting(), dynamic=False, fullgraph=True)
        with collecting() as report:
            got = static_generate(model, step, ids, forced=forced)
    floor = {torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    for i, ((_, r), (_, e), (_, g)) in enumerate(zip(reference, expected, got, strict=True)):
        assert _err(g, r) <= 2 * _err(e, r) + floor, (i, _err(g, r), _err(e, r), str(report))
    assert _flash_counts() == {"attention": 4, "norm": 10, "dense": 4, "cross_entropy": 0}, str(report)


def test_static_cache_decode_through_backend_flash():
    """backend="flash" (Inductor on the CPU), dynamic=False: eager's tokens and logits, no recompile per
    decode step."""
    eager_model = _static_model()
    model = copy.deepcopy(eager_model)
    ids = _prompt()
    with torch.no_grad():
        expected = static_generate(eager_model, eager_model, ids, steps=3)
    step = _compile(model, "flash", dynamic=False, fullgraph=True)
    with collecting() as report, torch.no_grad():
        got = static_generate(model, step, ids, steps=3)
    _assert_steps_equal(got, expected, report, tol=dict(atol=1e-4, rtol=1e-4))
    assert counters["stats"]["unique_graphs"] == 2, counters["stats"]
    assert _flash_counts() == {"attention": 4, "norm": 10, "dense": 4, "cross_entropy": 0}, str(report)
