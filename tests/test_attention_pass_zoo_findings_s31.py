"""fx_passes/attention on what the session-31 model-zoo review found (tests/findings/zoo_review_s31.md,
F1-F4).

F1: a mask factor provably all True (transformers' and_mask starts from ``q_idx.new_ones((), dtype=bool)``)
masks nothing; under dynamic shapes it was taken for a runtime mask over whole query rows and the attention
left alone. Runtime masks that broadcast over the keys are still refused.
F2: ``torch.max(s, finfo.min)`` (XGLM's, and old BART / OPT's, overflow guard) is the identity on finite
scores and makes -inf finfo.min, a masked value still: taken. Clamps at any other bound are reported.
F3: a softmax over the scores concatenated with other columns (GPT-OSS's attention sinks) is no attention
the op computes: reported as a near miss with that reason, never rewritten.
F4: q·kᵀ over more than two batch dims (Hiera's (B, heads, windows, tokens, head_dim)) is plain attention
over their product: the op runs it as (B, heads·windows, ...), when q, k, v and the masks merge alike.

Each case is written as the real code writes it, compared with eager (outputs and gradients) through the
rewrite-only backend, with the rewrite and near-miss counts asserted.
"""

import copy
import math

import pytest
import test_model_zoo_decoders as dec
import test_model_zoo_more_s31 as zoo
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_attention_pass import TOL, _check_same, _qkv, _rewrites, _run_rewritten

import fx_passes
from flash_backend.backend import rewrite_only_backend
from fx_passes._compat import counters

MIN = torch.finfo(torch.float32).min


def _near_misses(fn, *args, options=None):
    """fn's output checked against eager, the attention near misses' reasons."""
    with fx_passes.collecting() as report:
        out, _ = _run_rewritten(fn, *args, options=options)
    torch.testing.assert_close(out, fn(*args), **TOL)
    return [d.detail for d in report.near_misses if d.family == "attention"]


def _right_padded(B, S):
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[1, -3:] = False  # every query row still sees a key under a causal band
    return pad


def _check_dynamic(fn, make_args, lengths=(9, 13, 6), rewrites=1):
    """fn compiled once with dynamic=True, run at several sequence lengths: outputs and input gradients
    equal eager's at each; the rewrite counts over all of them."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, backend=rewrite_only_backend, dynamic=True)
    for length in lengths:
        args = make_args(length)
        grads = []
        outs = []
        for f in (fn, compiled):
            leaves = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
            out = f(*leaves)
            out.backward(torch.ones_like(out))
            outs.append(out)
            grads.append([a.grad for a in leaves if a.is_floating_point()])
        torch.testing.assert_close(outs[1], outs[0], **TOL)
        for got, want in zip(grads[1], grads[0], strict=True):
            torch.testing.assert_close(got, want, **TOL)
    assert _rewrites() == (rewrites, 0)


# ----------------------------------------------------------------------------------------------------------
# F1: factors provably all True mask nothing
# ----------------------------------------------------------------------------------------------------------


def _and_mask_eager(q, k, v, pad):
    """transformers' masking_utils: and_mask(causal, padding) from a 0-d True start, vmap-free index form,
    then eager_mask's where(mask, 0, finfo.min) added to the scores."""
    S = q.shape[-2]
    q_idx = torch.arange(S)[None, None, :, None]
    kv_idx = torch.arange(S)[None, None, None, :]
    result = q_idx.new_ones((), dtype=torch.bool)
    result = result & (kv_idx <= q_idx).to(q.device)
    result = result & pad[:, None, None, :].to(q.device)
    min_dtype = torch.finfo(q.dtype).min
    mask = torch.where(result.expand(q.shape[0], -1, S, S), torch.zeros((), dtype=q.dtype), min_dtype)
    s = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5 + mask
    return torch.matmul(F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _ones_start_masked_fill(q, k, v, pad):
    # a keep mask from torch.ones((), bool) and torch.full(.., True) of the scores' (symbolic) size
    S = q.shape[-2]
    keep = torch.ones((), dtype=torch.bool) & torch.full((1, 1, S, S), True)
    keep = keep & pad[:, None, None, :]
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return s.masked_fill(~keep, float("-inf")).softmax(-1) @ v


def _new_full_and_ones_like(q, k, v, pad):
    # new_full(.., 1, bool) and ones_like of the padding mask, cast to bool, viewed: all True
    start = q.new_full((), 1, dtype=torch.bool)
    every = torch.ones_like(pad, dtype=torch.float32).bool()[:, None, None, :]
    keep = (start & every) & pad[:, None, None, :]
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5
    return torch.where(keep, s, torch.finfo(s.dtype).min).softmax(-1) @ v


def _or_mask_start(q, k, v, pad):
    # or_mask's start, False, or-ed into a masked-positions condition: masks nothing
    masked = pad.new_zeros((), dtype=torch.bool) | ~pad[:, None, None, :]
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    return torch.softmax(s.masked_fill(masked, -1e9), dim=-1) @ v


ALL_TRUE_FORMS = [_and_mask_eager, _ones_start_masked_fill, _new_full_and_ones_like, _or_mask_start]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("form", ALL_TRUE_FORMS, ids=lambda f: f.__name__.strip("_"))
def test_all_true_factor_masks_nothing(form, dynamic):
    q, k, v = _qkv(S=9, D=16)
    _check_same(form, q, k, v, _right_padded(2, 9), options=dict(dynamic=dynamic))


@pytest.mark.parametrize("form", ALL_TRUE_FORMS, ids=lambda f: f.__name__.strip("_"))
def test_all_true_factor_one_dynamic_graph_serves_every_length(form):
    def make(S):
        return (*_qkv(S=S, D=16), _right_padded(2, S))

    _check_dynamic(form, make)


@pytest.mark.parametrize("form, factories", [
    (_and_mask_eager, ("new_ones",)),
    (_ones_start_masked_fill, (torch.ones, torch.full)),
    (_or_mask_start, ("new_zeros",)),
], ids=["and_mask", "ones_and_full", "or_mask"])
def test_factors_that_mask_nothing_do_not_reach_the_op(form, factories):
    """Under dynamic shapes (symbolic sizes, no compile-time constant) the factors that mask nothing are
    dropped from the mask the op gets: the padding (and causal) factors are left."""
    q, k, v = _qkv(S=9, D=16)
    (node,) = _check_same(form, q, k, v, _right_padded(2, 9), options=dict(dynamic=True))
    mask = node.kwargs.get("attn_mask")
    assert mask is not None
    seen, pending = set(), [mask]
    while pending:
        n = pending.pop()
        if n in seen or not isinstance(n, torch.fx.Node):
            continue
        seen.add(n)
        pending.extend(n.all_input_nodes)
    assert not [n for n in seen if n.target in factories], "a factor that masks nothing reached the op"


def _runtime_row_mask(q, k, v, pad):
    # a genuinely runtime 0-d factor (every sequence complete, or not): masks every row or none
    S = q.shape[-2]
    keep = q.new_ones((), dtype=torch.bool) & pad.all() & torch.ones(S, S, dtype=torch.bool).tril()
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    return torch.softmax(s.masked_fill(~keep, torch.finfo(s.dtype).min), dim=-1) @ v


def _query_padding_and_start(q, k, v, pad):
    # a query padding mask (..., Sq, 1) and-ed with the all-True start and a key padding mask
    keep = pad.new_ones((), dtype=torch.bool) & pad[:, None, :, None] & pad[:, None, None, :]
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    return torch.softmax(torch.where(keep, s, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("form", [_runtime_row_mask, _query_padding_and_start], ids=lambda f: f.__name__)
def test_runtime_masks_over_whole_rows_are_still_refused(form, dynamic):
    q, k, v = _qkv(S=9, D=16)
    pad = torch.ones(2, 9, dtype=torch.bool)  # no row masked here: eager's NaN rows would fail the compare
    reasons = _near_misses(form, q, k, v, pad, options=dict(dynamic=dynamic))
    assert _rewrites() == (0, 1)
    assert "broadcasts over the key dim" in reasons[0]


def _all_false_start(q, k, v, pad):
    # a 0-d False factor masks every key of every row: eager gives the average of v, the op would give 0
    keep = q.new_zeros((), dtype=torch.bool) & pad[:, None, None, :]
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    return torch.softmax(torch.where(keep, s, torch.finfo(s.dtype).min), dim=-1) @ v


def _ones_written_in_place(q, k, v, pad):
    # ones, then its last query row cleared in place: not all True (that row has no visible key)
    S = q.shape[-2]
    rows = q.new_ones((1, 1, S, 1), dtype=torch.bool)
    rows[:, :, -1] = False
    keep = rows & pad[:, None, None, :]
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    return torch.softmax(s.masked_fill(~keep, torch.finfo(s.dtype).min), dim=-1) @ v


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("form", [_all_false_start, _ones_written_in_place], ids=lambda f: f.__name__)
def test_constant_factors_that_mask_rows_are_refused(form, dynamic):
    q, k, v = _qkv(S=9, D=16)
    reasons = _near_misses(form, q, k, v, _right_padded(2, 9), options=dict(dynamic=dynamic))
    assert _rewrites() == (0, 1)
    assert "no visible key" in reasons[0], reasons


def _dynamic_model_check(name, training, impl="eager"):
    """A zoo decoder compiled once with dynamic=True, three sequence lengths, outputs and parameter gradients
    against eager; every attention layer rewritten."""
    build = zoo._build_decoder if name in zoo.DECODERS else dec._build
    model = build(name, impl)
    compiled = torch.compile(copy.deepcopy(model), backend=rewrite_only_backend, dynamic=True)
    torch._dynamo.reset()
    counters.clear()
    with fx_passes.collecting() as report:
        zoo.compare_over_lengths(model, compiled, training, report)
    return counters["flash"], report


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_llama_eager_padding_mask_under_dynamic_shapes(training):
    """F1 as the zoo met it: Llama, eager attention, right-padded attention_mask in
    training, dynamic=True."""
    flash, report = _dynamic_model_check("llama", training)
    assert (flash["attention"], flash["attention_skipped"]) == (2, 0), str(report)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_llama4_chunked_layer_under_dynamic_shapes(training):
    """Llama 4's chunked layer: and_masks(causal, chunk) from the same scalar start, reported in eval
    before."""
    flash, report = _dynamic_model_check("llama4", training)
    assert (flash["attention"], flash["attention_skipped"]) == (2, 0), str(report)


# ----------------------------------------------------------------------------------------------------------
# F2: the scores clamped from below at finfo.min
# ----------------------------------------------------------------------------------------------------------


class XGLMStyleAttention(nn.Module):
    """XGLMAttention.forward as transformers 5.24 writes it (bmm on (B·H, S, D), the mask added to the
    (B, H, S, S) view, the finfo.min clamp, softmax on the (B·H, S, S) view, dropout, bmm)."""

    def __init__(self, dim=64, heads=4, dropout=0.0):
        super().__init__()
        self.heads, self.head_dim, self.dropout = heads, dim // heads, dropout
        self.scaling = self.head_dim**-0.5
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dim, dim) for _ in range(4))

    def _shape(self, t, S, B):
        return t.view(B, S, self.heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, x, attention_mask):
        B, S, _ = x.shape
        q = self._shape(self.q_proj(x) * self.scaling, S, B).view(B * self.heads, -1, self.head_dim)
        k = self._shape(self.k_proj(x), S, B).view(B * self.heads, -1, self.head_dim)
        v = self._shape(self.v_proj(x), S, B).view(B * self.heads, -1, self.head_dim)
        w = torch.bmm(q, k.transpose(1, 2))
        w = w.view(B, self.heads, S, S) + attention_mask
        w = torch.max(w, torch.full((), torch.finfo(w.dtype).min, device=w.device))
        w = w.view(B * self.heads, S, S)
        w = nn.functional.softmax(w, dim=-1)
        p = nn.functional.dropout(w, p=self.dropout, training=self.training)
        out = torch.bmm(p, v).view(B, self.heads, S, self.head_dim).transpose(1, 2).reshape(B, S, -1)
        return self.out_proj(out)


def _causal_padding_mask(pad, dtype=torch.float32):
    """The 4-d additive mask the old BART / XGLM code builds: causal and padding, finfo.min where masked."""
    B, S = pad.shape
    keep = torch.ones(S, S, dtype=torch.bool).tril()[None, None] & pad[:, None, None, :]
    return torch.zeros(B, 1, S, S, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("S", [9, 13])
def test_xglm_clamped_scores_are_rewritten(S, training):
    torch.manual_seed(0)
    module = XGLMStyleAttention().train(training)
    x = torch.randn(2, S, 64)
    _check_same(module, x, _causal_padding_mask(_right_padded(2, S)))


def test_xglm_clamped_scores_under_dynamic_shapes():
    torch.manual_seed(0)
    module = XGLMStyleAttention()

    def make(S):
        return torch.randn(2, S, 64), _causal_padding_mask(_right_padded(2, S))

    _check_dynamic(module, make)


def test_xglm_rows_with_every_key_masked_match_eager_on_the_reference():
    """Left padding: the pad query rows see no key. Eager (with the clamp) averages v there, as the op's CPU
    reference does for a finfo.min mask (the GPU kernels give 0: the README's known gap)."""
    torch.manual_seed(0)
    module = XGLMStyleAttention().eval()
    pad = torch.ones(2, 9, dtype=torch.bool)
    pad[1, :3] = False
    with torch.no_grad():
        x, mask = torch.randn(2, 9, 64), _causal_padding_mask(pad)
        out, _ = _run_rewritten(module, x, mask)
        torch.testing.assert_close(out, module(x, mask), **TOL)
    assert _rewrites() == (1, 0)


def _clamped(spelling, bound=None):
    """Attention whose masked scores are clamped from below, spelled as given."""

    def fn(q, k, v, mask):
        s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5 + mask
        low = torch.finfo(s.dtype).min if bound is None else bound
        if spelling == "max":
            s = torch.max(s, torch.full((), low, dtype=s.dtype))
        elif spelling == "max_reversed":
            s = torch.max(torch.tensor(low, dtype=s.dtype), s)
        elif spelling == "maximum":
            s = torch.maximum(s, torch.full((), low, dtype=s.dtype))
        elif spelling == "clamp":
            s = s.clamp(min=low)
        elif spelling == "clamp_min":
            s = torch.clamp_min(s, low)
        elif spelling == "clamp_max_too":
            s = s.clamp(min=low, max=1e4)
        elif spelling == "min":
            s = torch.min(s, torch.full((), 1e4))
        return torch.softmax(s, dim=-1) @ v

    fn.__name__ = f"clamped_{spelling}"
    return fn


@pytest.mark.parametrize("spelling", ["max", "max_reversed", "maximum", "clamp", "clamp_min"])
@pytest.mark.parametrize("bound", [None, float("-inf")], ids=["finfo_min", "minus_inf"])
def test_clamp_spellings_at_finfo_min_or_minus_inf(spelling, bound):
    q, k, v = _qkv(S=11, D=16)
    mask = _causal_padding_mask(_right_padded(2, 11))
    _check_same(_clamped(spelling, bound), q, k, v, mask)


def test_clamp_makes_a_minus_inf_fill_finite_and_says_so():
    """masked_fill(-inf) inside the clamp: eager's fully masked rows average v (not NaN); the report speaks
    of a finite fill, not of NaN."""

    def fn(q, k, v, pad):
        s = (q @ k.transpose(-2, -1)).masked_fill(~pad[:, None, None, :], float("-inf"))
        return torch.softmax(torch.max(s, torch.full((), torch.finfo(s.dtype).min)) / 4.0, dim=-1) @ v

    q, k, v = _qkv(S=9, D=16)
    with fx_passes.collecting() as report:
        _check_same(fn, q, k, v, _right_padded(2, 9))
    (line,) = [r.detail for r in report.rewrites if r.family == "attention"]
    assert "taken as -inf" in line and "NaN" not in line, line


def test_clamp_in_float64_takes_float64s_min():
    q, k, v = (t.double() for t in _qkv(S=9, D=16))
    mask = _causal_padding_mask(_right_padded(2, 9), torch.float64)
    _check_same(_clamped("max"), q, k, v, mask)


@pytest.mark.parametrize("spelling, bound, reason", [
    ("max", -1e4, "clamps the scores from below at -10000"),
    ("clamp", 0.0, "clamps the scores from below at 0"),
    ("clamp_min", -50.0, "clamps the scores from below at -50"),
])
def test_clamps_from_below_at_other_bounds_are_reported(spelling, bound, reason):
    q, k, v = _qkv(S=9, D=16)
    mask = _causal_padding_mask(_right_padded(2, 9))
    reasons = _near_misses(_clamped(spelling, bound), q, k, v, mask)
    assert _rewrites() == (0, 1)
    assert reason in reasons[0], reasons


@pytest.mark.parametrize("spelling", ["clamp_max_too", "min"])
def test_clamps_from_above_are_left_alone(spelling):
    """No candidate, as before (test_attention_pass_review_s26b: clamped scores are not a candidate)."""
    q, k, v = _qkv(S=9, D=16)
    _near_misses(_clamped(spelling), q, k, v, _causal_padding_mask(_right_padded(2, 9)))
    assert _rewrites()[0] == 0


def test_float32_min_against_float64_scores_is_reported():
    """finfo(float32).min is no bound of float64 scores: max(s, -3.4e38) changes the smaller finite ones."""
    q, k, v = (t.double() for t in _qkv(S=9, D=16))
    mask = _causal_padding_mask(_right_padded(2, 9), torch.float64)
    reasons = _near_misses(_clamped("max", MIN), q, k, v, mask)
    assert _rewrites() == (0, 1)
    assert "float64 minimum" in reasons[0], reasons


def test_xglm_model_is_rewritten():
    """The zoo's XGLM, both layers, eval and training (findings F2)."""
    for training in (False, True):
        report = dec._compare(zoo._build_decoder("xglm", "eager"), training, rewrite_only_backend)
        assert (counters["flash"]["attention"], counters["flash"]["attention_skipped"]) == (2, 0), str(report)


# ----------------------------------------------------------------------------------------------------------
# F3: softmax over the scores and other columns (attention sinks): reported, never rewritten
# ----------------------------------------------------------------------------------------------------------


class SinkAttention(nn.Module):
    """GPT-OSS's eager_attention_forward: a learned per-head sink logit as an extra key column."""

    def __init__(self, heads=4, sink_first=False):
        super().__init__()
        self.sinks = nn.Parameter(torch.randn(heads))
        self.sink_first = sink_first

    def forward(self, q, k, v, mask):
        s = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5 + mask
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
        if self.sink_first:
            logits = torch.cat([sinks, s], dim=3)
            probs = F.softmax(logits, dim=-1)[..., 1:]
        else:
            logits = torch.cat([s, sinks], dim=-1)
            logits = logits - logits.max(dim=-1, keepdim=True).values
            probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
        p = nn.functional.dropout(probs, p=0.0, training=self.training).to(v.dtype)
        return torch.matmul(p, v)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("sink_first", [False, True], ids=["sink_last", "sink_first"])
def test_attention_sinks_are_reported(sink_first, training):
    module = SinkAttention(sink_first=sink_first).train(training)
    q, k, v = _qkv(S=9, D=16)
    mask = _causal_padding_mask(_right_padded(2, 9))
    reasons = _near_misses(module, q, k, v, mask)
    assert _rewrites() == (0, 1)
    assert "concatenated with other columns along the key dim" in reasons[0], reasons
    assert "sinks" in reasons[0]


def test_attention_sinks_under_dynamic_shapes_are_reported():
    module = SinkAttention()
    q, k, v = _qkv(S=9, D=16)
    reasons = _near_misses(module, q, k, v, _causal_padding_mask(_right_padded(2, 9)),
                           options=dict(dynamic=True))
    assert _rewrites() == (0, 1)
    assert "concatenated with other columns" in reasons[0], reasons


def test_scores_concatenated_over_another_dim_are_no_sink():
    """Two attentions' scores joined over the head dim: no key columns added, not reported as sinks."""

    def fn(q, k, v):
        s = torch.cat([q[:, :2] @ k[:, :2].transpose(-2, -1), q[:, 2:] @ k[:, 2:].transpose(-2, -1)], dim=1)
        return torch.softmax(s * 0.25, dim=-1) @ v

    q, k, v = _qkv(S=9, D=16)
    assert not [r for r in _near_misses(fn, q, k, v) if "concatenated" in r]


def test_gpt_oss_model_reports_both_layers():
    with fx_passes.collecting() as report:
        dec._compare(zoo._build_decoder("gpt_oss", "eager"), False, rewrite_only_backend)
    assert (counters["flash"]["attention"], counters["flash"]["attention_skipped"]) == (0, 2), str(report)
    assert all("sinks" in d.detail for d in report.near_misses if d.family == "attention"), str(report)



# ----------------------------------------------------------------------------------------------------------
# F4: attention over more than two batch dims (Hiera's mask units), merged into the op's (B, H)
# ----------------------------------------------------------------------------------------------------------


class MaskUnitAttention(nn.Module):
    """HieraMaskUnitAttention.forward: (B, heads, windows, tokens, head_dim) from one qkv Linear, the
    queries max-pooled over query_stride groups of tokens, ((q * scale) @ kᵀ).softmax(-1) @ v."""

    def __init__(self, dim=32, heads=2, windows=3, query_stride=1):
        super().__init__()
        self.heads, self.windows, self.query_stride = heads, windows, query_stride
        self.head_dim = dim // heads
        self.scale = self.head_dim**-0.5
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        B, S, _ = x.shape
        tokens = S // self.windows
        qkv = self.qkv(x).reshape(B, tokens, self.windows, 3, self.heads, self.head_dim)
        qkv = qkv.permute(3, 0, 4, 2, 1, 5)
        q, k, v = qkv.unbind(0)
        if self.query_stride > 1:
            pooled = tokens // self.query_stride
            q = q.view(B, self.heads, self.windows, self.query_stride, pooled, self.head_dim)
            q = q.max(dim=3).values
        w = ((q * self.scale) @ k.transpose(-1, -2)).softmax(dim=-1)
        out = (w @ v).transpose(1, 3).reshape(B, -1, self.heads * self.head_dim)
        return self.proj(out)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("query_stride", [1, 2], ids=["mask_units", "pooled_queries"])
def test_mask_unit_attention_is_rewritten(query_stride, dynamic):
    torch.manual_seed(0)
    module = MaskUnitAttention(query_stride=query_stride)
    nodes = _check_same(module, torch.randn(2, 3 * 14, 32), options=dict(dynamic=dynamic))
    (node,) = nodes
    assert node.args[0].target is torch.flatten  # q reaches the op as (B, heads·windows, S, D)


def _five_d_einsum(q, k, v):
    s = torch.einsum("bhwqd,bhwkd->bhwqk", q, k) * q.shape[-1] ** -0.5
    return torch.einsum("bhwqk,bhwkd->bhwqd", s.softmax(-1), v)


def _five_d_causal(q, k, v):
    S = q.shape[-2]
    future = torch.ones(S, S, dtype=torch.bool).triu(1)
    s = (q @ k.transpose(-1, -2) * 0.25).masked_fill(future, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _five_d_mask(q, k, v, mask):
    return torch.softmax(q @ k.transpose(-1, -2) * 0.25 + mask, dim=-1) @ v


def _key_padding(B, S):
    keep = torch.rand(B, 1, 1, 1, S) > 0.3
    keep[..., 0] = True
    return torch.zeros(B, 1, 1, 1, S).masked_fill(~keep, torch.finfo(torch.float32).min)


FIVE_D = (2, 3, 4, 11, 16)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("fn, extra", [
    (_five_d_einsum, None),
    (_five_d_causal, None),
    (_five_d_mask, lambda: _key_padding(2, 11)),
    (_five_d_mask, lambda: torch.randn(2, 3, 4, 11, 11)),
    (_five_d_mask, lambda: torch.randn(1, 1, 1, 11, 11)),
], ids=["einsum", "causal", "key_padding", "bias_per_head_and_window", "shared_bias"])
def test_five_d_attention_forms(fn, extra, dynamic):
    q, k, v = (torch.randn(*FIVE_D) for _ in range(3))
    _check_same(fn, q, k, v, *([extra()] if extra else []), options=dict(dynamic=dynamic))


def test_five_d_attention_one_dynamic_graph_serves_every_length():
    _check_dynamic(_five_d_causal, lambda S: tuple(torch.randn(2, 3, 4, S, 16) for _ in range(3)))


@pytest.mark.parametrize("fn, args, reason", [
    # k and v shared over the heads: broadcast by matmul over a merged dim
    (lambda q, k, v: _five_d_causal(q, k[:, :1], v[:, :1]), (), "hold every batch index"),
    # a bias per window, the same for every head: broadcast over some of the merged dims only
    (_five_d_mask, (torch.randn(2, 1, 4, 11, 11),), "only with masks that hold all the batch dims"),
], ids=["k_v_broadcast_over_heads", "mask_over_windows_only"])
def test_five_d_attention_that_does_not_merge_is_reported(fn, args, reason):
    q, k, v = (torch.randn(*FIVE_D) for _ in range(3))
    reasons = _near_misses(fn, q, k, v, *args)
    assert _rewrites() == (0, 1)
    assert "operands are 5-d" in reasons[0] and reason in reasons[0], reasons


def _truth(fn, *args):
    """_constant_truth of what fn returns, traced by dynamo with dynamic shapes (symbolic sizes)."""
    from fx_passes.attention import _constant_truth

    found = []

    def backend(gm, example_inputs):
        (out,) = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
        found.append(_constant_truth(out))
        return gm

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, dynamic=True, fullgraph=True)(*args)
    return found[0]


def _written(x):
    m = x.new_ones(x.shape[0], dtype=torch.bool)
    m[0] = False
    return m


@pytest.mark.parametrize("fn, want", [
    (lambda x: x.new_ones((), dtype=torch.bool), True),
    (lambda x: torch.full((1, x.shape[0]), True), True),
    (lambda x: torch.ones_like(x, dtype=torch.float16).bool()[None].expand(3, -1), True),
    (lambda x: ~torch.zeros(x.shape[0], dtype=torch.bool) | (x > 0), True),
    (lambda x: torch.zeros((), dtype=torch.bool) & (x > 0), False),
    (lambda x: x.new_full((x.shape[0],), 0.0).bool(), False),
    (lambda x: x > 0, None),
    (lambda x: torch.ones(x.shape[0], x.shape[0], dtype=torch.bool).tril(), None),
    (_written, None),
    # float64 -> float32 rounds 1e-50 to 0, and repeat_interleave(repeats) returns indices from 0
    (lambda x: torch.full((x.shape[0],), 1e-50, dtype=torch.float64).float().bool(), None),
    (lambda x: torch.repeat_interleave(torch.ones(x.shape[0], dtype=torch.int64)).bool(), None),
], ids=["new_ones_0d", "full_true", "ones_like_cast_expand", "not_zeros_or", "zeros_and", "new_full_zero",
        "runtime", "tril", "written_in_place", "float64_to_float32", "repeat_interleave_indices"])
def test_constant_truth(fn, want):
    assert _truth(fn, torch.randn(7)) is want
