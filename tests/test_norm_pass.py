"""The norm family pass (fx_passes/norm.py): [dropout +] [residual add +] LayerNorm / RMSNorm -> one call.

Two levels, as STYLE.md asks: a traced graph whose node targets are checked after the pass, and whole
models. Most pattern variants run through the rewrite-only backend (the pass, then the rewritten graph as
plain PyTorch, forward and backward through the op's autograd), which costs a dynamo trace rather than an
Inductor compile; a handful of models go through `torch.compile(backend="flash", fullgraph=True)`.
"""

from __future__ import annotations

import math
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import flash_backend
from flash_backend.ops.add_dropout_norm import add_dropout_norm
from fx_passes import collecting, norm, run_passes

N = 97  # an awkward hidden size on purpose
EPS = 1e-6


# --------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------


def _rewritten(model, *args, dynamic=None):
    """Compile with the pass but without Inductor; returns (compiled, report, graphs compiled)."""
    graphs = []

    def backend(gm, example_inputs):
        run_passes(gm.graph)
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)
    return compiled, graphs


def _leaves(args):
    return [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]


def _outputs(out):
    return [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]


def _assert_same(model, compiled, args, atol=2e-5, rtol=2e-5, grads=True):
    """Forward (and backward) of compiled equals eager on fresh copies of args."""
    eager_args, comp_args = _leaves(args), _leaves(args)
    expected, got = _outputs(model(*eager_args)), _outputs(compiled(*comp_args))
    assert len(expected) == len(got)
    for e, g in zip(expected, got, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        torch.testing.assert_close(g, e, atol=atol, rtol=rtol)
    if not grads:
        return
    cotangents = [torch.randn_like(e) for e in expected]
    params = [p for p in model.parameters() if p.requires_grad] if isinstance(model, nn.Module) else []
    inputs = [a for a in eager_args if a.requires_grad]
    e_grads = torch.autograd.grad(expected, inputs + params, cotangents, allow_unused=True)
    g_grads = torch.autograd.grad(got, [a for a in comp_args if a.requires_grad] + params, cotangents,
                                  allow_unused=True)
    for e, g in zip(e_grads, g_grads, strict=True):
        assert (e is None) == (g is None)
        if e is not None:
            torch.testing.assert_close(g, e, atol=10 * atol, rtol=10 * rtol)


def _check_rewrite(model, args, rewrites=1, text=None, **tol):
    """The pass rewrites `rewrites` subgraphs of model, and the result equals eager in training."""
    counters.clear()
    with collecting() as report:
        compiled, _ = _rewritten(model)
        _assert_same(model, compiled, args, **tol)
    assert counters["flash"]["norm"] == rewrites, str(report)
    assert counters["flash"]["norm_skipped"] == 0, str(report)
    if text is not None:
        assert text in str(report), str(report)
    return report


def _check_near_miss(model, args, reason: str):
    """The candidate is left alone, counted as a near miss, and the explain report names the reason."""
    counters.clear()
    report = flash_backend.explain(model, *args, print_report=False)
    assert counters["flash"]["norm"] == 0, str(report)
    assert counters["flash"]["norm_skipped"] >= 1, str(report)
    assert any(reason in d.detail for d in report.near_misses), str(report)
    return report


def _x(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


class Fn(nn.Module):
    """A module around a function of (module, *inputs), so that parameters get gradients checked too."""

    def __init__(self, fn, weight_shape=(N,), bias=True, dtype=torch.float32):
        super().__init__()
        self.fn = fn
        self.weight = nn.Parameter(torch.randn(weight_shape, dtype=dtype))
        self.bias = nn.Parameter(torch.randn(weight_shape, dtype=dtype)) if bias else None

    def forward(self, *args):
        return self.fn(self, *args)


# --------------------------------------------------------------------------------------------------------
# Models as real code writes them
# --------------------------------------------------------------------------------------------------------


class BertSelfOutput(nn.Module):
    """Post-norm (BERT): LayerNorm(dropout(dense(h)) + input)."""

    def __init__(self, n=N, p=0.0):
        super().__init__()
        self.dense = nn.Linear(n, n)
        self.dropout = nn.Dropout(p)
        self.LayerNorm = nn.LayerNorm(n, eps=1e-12)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dropout(self.dense(hidden_states))
        return self.LayerNorm(hidden_states + input_tensor)


class GPT2Block(nn.Module):
    """Pre-norm (GPT-2): the sum feeds ln_2 and the next residual add."""

    def __init__(self, n=N, p=0.0):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n), nn.LayerNorm(n)
        self.attn = nn.Linear(n, n)
        self.mlp = nn.Sequential(nn.Linear(n, 2 * n), nn.GELU(), nn.Linear(2 * n, n))
        self.resid_dropout = nn.Dropout(p)

    def forward(self, x):
        h = x + self.resid_dropout(self.attn(self.ln_1(x)))
        return h + self.resid_dropout(self.mlp(self.ln_2(h)))


class LlamaRMSNorm(nn.Module):
    def __init__(self, n=N, eps=EPS):
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(n))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class LlamaBlock(nn.Module):
    def __init__(self, n=N):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = LlamaRMSNorm(n), LlamaRMSNorm(n)
        self.attn = nn.Linear(n, n, bias=False)
        self.mlp = nn.Sequential(nn.Linear(n, 2 * n, bias=False), nn.SiLU(), nn.Linear(2 * n, n, bias=False))

    def forward(self, x):
        residual = x
        h = self.attn(self.input_layernorm(x))
        h = residual + h
        residual = h
        h = self.mlp(self.post_attention_layernorm(h))
        return residual + h


# --------------------------------------------------------------------------------------------------------
# Level 1: a traced graph, node targets after the pass
# --------------------------------------------------------------------------------------------------------


def _traced(fn, *args):
    gm = torch.fx.symbolic_trace(fn)
    FakeTensorProp(gm).propagate(*args)
    return gm


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


def test_graph_post_norm_becomes_one_call():
    def post_norm(x, residual, w, b):
        return F.layer_norm(residual + F.dropout(x, 0.1, True), (N,), w, b, 1e-5)

    args = (_x(2, 5, N), _x(2, 5, N), _x(N), _x(N))
    gm = _traced(post_norm, *args)
    norm.rewrite(gm.graph)
    gm.graph.lint()
    gm.recompile()
    assert _targets(gm) == [add_dropout_norm], gm.code
    call = next(n for n in gm.graph.nodes if n.target is add_dropout_norm)
    x, residual, w, b = (n.name for n in call.args)
    assert (x, residual, w, b) == ("x", "residual", "w", "b")
    assert call.kwargs == {"eps": 1e-5, "dropout_p": 0.1, "is_rms_norm": False, "return_residual": False}
    assert counters["flash"]["norm"] == 1


def test_graph_pre_norm_rms_returns_the_residual():
    def pre_norm(x, residual, w):
        h = residual + x
        hs = h.float()
        hs = hs * torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + EPS)
        return w * hs.to(h.dtype), h * 2

    args = (_x(3, N), _x(3, N), _x(N))
    gm = _traced(pre_norm, *args)
    norm.rewrite(gm.graph)
    run_passes(gm.graph)  # sorts and recompiles; nothing is left for a second rewrite
    targets = _targets(gm)
    assert targets.count(add_dropout_norm) == 1 and targets.count(operator.getitem) == 2, gm.code
    assert not {"pow", "mean", "float", "to", torch.rsqrt} & set(targets), gm.code
    call = next(n for n in gm.graph.nodes if n.target is add_dropout_norm)
    assert call.kwargs["is_rms_norm"] and call.kwargs["return_residual"] and call.kwargs["eps"] == EPS
    out, doubled = gm(*args)
    ref_out, ref_doubled = pre_norm(*args)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(doubled, ref_doubled)


# --------------------------------------------------------------------------------------------------------
# Level 2a: pattern variants through the rewrite-only backend (training, p=0: outputs and gradients)
# --------------------------------------------------------------------------------------------------------


def test_bert_post_norm_either_operand_order():
    _check_rewrite(BertSelfOutput(), (_x(2, 7, N), _x(2, 7, N)), text="dropout + residual add + F.layer_norm")

    class Swapped(BertSelfOutput):
        def forward(self, hidden_states, input_tensor):
            return self.LayerNorm(input_tensor + self.dropout(self.dense(hidden_states)))

    _check_rewrite(Swapped(), (_x(2, 7, N), _x(2, 7, N)))


def test_gpt2_pre_norm_block():
    report = _check_rewrite(GPT2Block(), (_x(2, 7, N),), rewrites=2)
    assert sum("pre-norm" in d.variant for d in report.rewrites) == 1, str(report)


def test_llama_block():
    report = _check_rewrite(LlamaBlock(), (_x(2, 7, N),), rewrites=2)
    assert all("hand-written RMSNorm + weight" in d.variant for d in report.rewrites), str(report)


def test_nn_rmsnorm_and_functional_forms():
    def fn(m, x, r):
        h = x + r
        return (nn.functional.rms_norm(h, (N,), m.weight),  # eps=None: finfo eps of the compute type
                F.rms_norm(x, (N,), eps=1e-5),
                F.layer_norm(x, (N,), m.weight, m.bias, 1e-6),
                F.layer_norm(x, (N,), weight=m.weight, eps=1e-3),
                torch.layer_norm(r, [N], None, m.bias),
                h)

    report = _check_rewrite(Fn(fn), (_x(3, 4, N), _x(3, 4, N)), rewrites=5)
    assert "pre-norm" in report.rewrites[0].variant
    _check_rewrite(nn.RMSNorm(N, eps=1e-5), (_x(5, N),))
    _check_rewrite(nn.RMSNorm(N, elementwise_affine=False), (_x(5, N),))


def test_no_residual_no_affine_and_dropout_only():
    _check_rewrite(nn.LayerNorm(N, elementwise_affine=False), (_x(4, N),), text="F.layer_norm")
    _check_rewrite(nn.LayerNorm(N, bias=False), (_x(4, N),))
    _check_rewrite(Fn(lambda m, x: F.layer_norm(F.dropout(x, 0.0), (N,))), (_x(4, N),), text="dropout")


def test_eval_mode_rewrites_to_the_p0_form():
    m = BertSelfOutput(p=0.3).eval()
    with collecting() as report:
        compiled, _ = _rewritten(m)
        _assert_same(m, compiled, (_x(2, 5, N), _x(2, 5, N)), grads=False)
    assert counters["flash"]["norm"] == 1, str(report)


def _llama_variant(cast, square, scale, weight):
    def fn(m, x):
        dt = x.dtype
        hs = {"to": lambda t: t.to(torch.float32), "float": lambda t: t.float(), "none": lambda t: t}[cast](x)
        sq = {"pow": lambda t: t.pow(2), "mul": lambda t: t * t, "square": torch.square,
              "op": lambda t: t**2}[square](hs)
        var = sq.mean(-1, keepdim=True) if square != "op" else torch.mean(sq, dim=-1, keepdim=True)
        if scale == "rsqrt":
            hs = hs * torch.rsqrt(var + m.eps)
        elif scale == "sqrt":
            hs = hs / torch.sqrt(var + m.eps)
        else:
            hs = (var + m.eps).rsqrt() * hs
        hs = hs.to(dt)
        return {"left": lambda: m.weight * hs, "right": lambda: hs * m.weight, "none": lambda: hs}[weight]()

    m = Fn(fn, bias=False)
    m.eps = EPS
    return m


@pytest.mark.parametrize("cast,square,scale,weight", [
    ("to", "pow", "rsqrt", "left"),
    ("float", "mul", "sqrt", "right"),
    ("none", "square", "rsqrt_method", "none"),
    ("float", "op", "rsqrt", "right"),
    ("to", "mul", "rsqrt_method", "left"),
    ("none", "pow", "sqrt", "left"),
])
def test_llama_rmsnorm_spellings(cast, square, scale, weight):
    text = "hand-written RMSNorm" + (" + weight" if weight != "none" else "")
    _check_rewrite(_llama_variant(cast, square, scale, weight), (_x(3, 5, N),), text=text)


def test_llama_rmsnorm_bf16_matches_eager_dtype():
    # bf16 weight: the op returns bf16 like eager, weight folded in. fp32 weight: eager promotes to fp32
    # after the downcast, which the op (bf16 out) cannot: it ends at the downcast and the fp32 weight
    # multiply runs after it, as in eager.
    for weight_dtype, variant in ((torch.bfloat16, "RMSNorm + weight"), (torch.float32, "RMSNorm ->")):
        m = LlamaRMSNorm().to(weight_dtype)
        _check_rewrite(m, (_x(4, N, dtype=torch.bfloat16),), text=variant, atol=2e-2, rtol=2e-2)


class T5LayerNorm(nn.Module):
    """T5: squares x.float() but scales x itself, downcasts only for half-precision weights."""

    def __init__(self, n=N, eps=EPS):
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(n))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in [torch.float16, torch.bfloat16]:
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


class GemmaRMSNorm(nn.Module):
    """Gemma: the weight is stored as an offset from one, the norm is computed in fp32."""

    def __init__(self, n=N, eps=EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(0.1 * torch.randn(n))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_t5_and_gemma_rmsnorm(dtype):
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {}
    for module in (T5LayerNorm, GemmaRMSNorm):
        _check_rewrite(module().to(dtype), (_x(3, 5, N, dtype=dtype),), text="RMSNorm + weight", **tol)


def _hand_ln(var_form, scale, affine):
    def fn(m, x):
        u = x.mean(-1, keepdim=True)
        if var_form == "sq":
            s = (x - u).pow(2).mean(-1, keepdim=True)
        elif var_form == "unbiased_false":
            s = x.var(-1, unbiased=False, keepdim=True)
        elif var_form == "correction":
            s = torch.var(x, dim=-1, correction=0, keepdim=True)
        else:
            d = x - u
            s = (d * d).mean(dim=-1, keepdim=True)
        if scale == "sqrt":
            y = (x - u) / torch.sqrt(s + 1e-5)
        else:
            y = (x - u) * torch.rsqrt(s + 1e-5)
        if affine == "wb":
            return m.weight * y + m.bias
        if affine == "bw":
            return m.bias + y * m.weight
        return y

    return Fn(fn)


@pytest.mark.parametrize("var_form,scale,affine", [
    ("sq", "sqrt", "wb"),
    ("unbiased_false", "rsqrt", "bw"),
    ("correction", "sqrt", "none"),
    ("mul", "rsqrt", "wb"),
])
def test_hand_written_layernorm_spellings(var_form, scale, affine):
    text = "hand-written LayerNorm" + (" + weight + bias" if affine != "none" else "")
    _check_rewrite(_hand_ln(var_form, scale, affine), (_x(2, 3, N),), text=text, atol=1e-4, rtol=1e-4)


def _stats(form, x):
    """(mean, variance) of x over the last dim, or (mean, standard deviation) for the "std" forms."""
    if form == "var_mean":
        var, mu = torch.var_mean(x, dim=-1, keepdim=True, unbiased=False)
    elif form == "var_mean_correction":
        var, mu = torch.var_mean(x, -1, keepdim=True, correction=0)
    elif form == "var_method":
        mu, var = x.mean(-1, keepdim=True), x.var(-1, keepdim=True, unbiased=False)
    elif form == "sq_op":
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
    elif form == "square":
        mu = torch.mean(x, dim=-1, keepdim=True)
        var = torch.square(x - mu).mean(dim=-1, keepdim=True)
    elif form == "std_mean":  # no eps: LayerNorm with eps=0, the same function
        var, mu = torch.std_mean(x, -1, keepdim=True, correction=0)
    return mu, var


def _scaled(scale, c, var):
    return {
        "div_sqrt": lambda: c / torch.sqrt(var + 1e-5),
        "rsqrt_method": lambda: c * (var + 1e-5).rsqrt(),
        "torch_rsqrt": lambda: torch.rsqrt(var + 1e-5) * c,
        "pow_half": lambda: c / (var + 1e-5).pow(0.5),
        "op_half": lambda: c / (1e-5 + var) ** 0.5,
        "op_mhalf": lambda: c * (var + 1e-5) ** -0.5,
        "reciprocal": lambda: c * torch.reciprocal(torch.sqrt(var + 1e-5)),
        "one_over": lambda: c * (1.0 / torch.sqrt(var + 1e-5)),
        "div_std": lambda: c / var,
    }[scale]()


def _hand_ln2(stats, scale, affine):
    def fn(m, x):
        mu, var = _stats(stats, x)
        y = _scaled(scale, x - mu, var)
        return {
            "w*y+b": lambda: m.weight * y + m.bias,
            "y*w+b": lambda: y * m.weight + m.bias,
            "addcmul": lambda: torch.addcmul(m.bias, y, m.weight),
            "addcmul_w_first": lambda: m.bias.addcmul(m.weight, y),
            "none": lambda: y,
        }[affine]()

    return Fn(fn)


@pytest.mark.parametrize("stats,scale,affine", [
    ("var_mean", "div_sqrt", "w*y+b"),
    ("var_mean_correction", "rsqrt_method", "y*w+b"),
    ("var_mean", "torch_rsqrt", "addcmul"),
    ("var_method", "pow_half", "addcmul_w_first"),
    ("sq_op", "op_half", "w*y+b"),
    ("square", "op_mhalf", "none"),
    ("var_method", "reciprocal", "y*w+b"),
    ("sq_op", "one_over", "addcmul"),
    ("std_mean", "div_std", "w*y+b"),
])
def test_hand_written_layernorm_more_spellings(stats, scale, affine):
    text = "hand-written LayerNorm" + (" + weight + bias" if affine != "none" else " ->")
    _check_rewrite(_hand_ln2(stats, scale, affine), (_x(2, 3, N),), text=text, atol=1e-4, rtol=1e-4)


def test_weight_on_the_numerator():
    # w * (x - mean) / sqrt(var + eps) + b parses as (w * (x - mean)) / ...: the op's weight all the same
    def ln(m, x):
        var, mu = torch.var_mean(x, -1, keepdim=True, unbiased=False)
        return m.weight * (x - mu) / torch.sqrt(var + 1e-5) + m.bias

    def rms(m, x):
        return x * m.weight * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)

    _check_rewrite(Fn(ln), (_x(2, 3, N),), text="hand-written LayerNorm + weight + bias", atol=1e-4,
                   rtol=1e-4)
    _check_rewrite(Fn(rms, bias=False), (_x(2, 3, N),), text="hand-written RMSNorm + weight")


def test_var_mean_layernorm_with_dropout_residual_and_upcast():
    # pre-norm: dropout(x) + residual feeds the var_mean LayerNorm and is returned
    def pre_norm(m, x, r):
        h = r + F.dropout(x, 0.0)
        var, mu = torch.var_mean(h, dim=-1, keepdim=True, correction=0)
        return (h - mu) * torch.rsqrt(var + 1e-5) * m.weight + m.bias, h

    _check_rewrite(Fn(pre_norm), (_x(3, N), _x(3, N)), text="dropout + residual add + hand-written LayerNorm")

    # bf16 input, statistics in fp32, cast back (the upcast folds into the op)
    def upcast(m, x):
        h = x.float()
        var, mu = torch.var_mean(h, -1, keepdim=True, unbiased=False)
        return m.weight * ((h - mu) * torch.rsqrt(var + 1e-5)).to(x.dtype) + m.bias

    _check_rewrite(Fn(upcast, dtype=torch.bfloat16), (_x(4, N, dtype=torch.bfloat16),),
                   text="hand-written LayerNorm + weight + bias", atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("form", ["tensor_norm", "torch_norm", "vector_norm"])
def test_rmsnorm_from_the_2_norm_without_eps(form):
    # x / (‖x‖ / sqrt(N)) is x * rsqrt(mean(x²)): RMSNorm with eps = 0, the same function
    def fn(m, x):
        if form == "tensor_norm":
            rms = x.norm(2, dim=-1, keepdim=True) * N**-0.5
        elif form == "torch_norm":
            rms = N**-0.5 * torch.norm(x, dim=-1, keepdim=True)
        else:
            rms = torch.linalg.vector_norm(x, dim=-1, keepdim=True) / math.sqrt(N)
        return m.weight * (x / rms)

    text = "hand-written RMSNorm (2-norm / sqrt(N)) + weight"
    _check_rewrite(Fn(fn, bias=False), (_x(3, 5, N),), text=text)


def test_mixed_dtype_residual_promotes_like_eager():
    # bf16 x + fp32 residual is an fp32 sum; the op promotes the same way, and so does its output.
    def fn(m, x, r):
        h = F.dropout(x, 0.0) + r
        return F.layer_norm(h, (N,), m.weight, m.bias), h

    # x's gradient is bf16: eager and the op round slightly different fp32 values to it, which may land
    # one bf16 ulp (up to 2**-7 relative) apart; gradients are checked at 10x the rtol given, 2e-2.
    _check_rewrite(Fn(fn), (_x(3, N, dtype=torch.bfloat16), _x(3, N)), text="pre-norm", rtol=2e-3)


@pytest.mark.parametrize("block", [GPT2Block, LlamaBlock])
def test_dynamic_shapes_do_not_recompile(block):
    # dynamic=True also turns module float attributes (eps, dropout p) into SymFloat graph inputs: the
    # pass specialises them, with a guard, so that changing one recompiles rather than goes stale.
    m = block()
    compiled, graphs = _rewritten(m, dynamic=True)
    for b, s in ((2, 5), (3, 7), (4, 11)):
        x = _x(b, s, N)
        torch.testing.assert_close(compiled(x), m(x), atol=2e-5, rtol=2e-5)
    assert len(graphs) == 1
    assert counters["flash"]["norm"] == 2
    if block is GPT2Block:
        m.ln_2.eps = 0.5
        x = _x(2, 5, N)
        torch.testing.assert_close(compiled(x), m(x), atol=2e-5, rtol=2e-5)
        assert len(graphs) == 2


# --------------------------------------------------------------------------------------------------------
# Near misses: left alone, counted, and explained
# --------------------------------------------------------------------------------------------------------


def test_near_miss_normalised_over_more_than_the_last_dim():
    _check_near_miss(Fn(lambda m, x: F.layer_norm(x, (5, N))), (_x(2, 5, N),), "last 2 dims")

    def over_dim1(m, x):
        var = x.pow(2).mean(1, keepdim=True)
        return x * torch.rsqrt(var + EPS)

    _check_near_miss(Fn(over_dim1), (_x(2, 5, N),), "not only the last dim")


def test_near_miss_unbiased_variance():
    def fn(m, x):
        u = x.mean(-1, keepdim=True)
        return (x - u) / torch.sqrt(x.var(-1, keepdim=True) + 1e-5)

    _check_near_miss(Fn(fn), (_x(3, N),), "unbiased")


def test_dropout_output_with_other_users_stays_as_the_residual():
    # Folding this dropout would draw its mask twice (once for d, once inside the op): it stays where it is
    # and its output is the add's residual operand (DistilBERT's first layer, BART's: was a near miss).
    def fn(x, r, p=0.1):
        d = F.dropout(x, p, True)
        return F.layer_norm(d + r, (N,)), d

    gm = _traced(fn, _x(3, N), _x(3, N))
    norm.rewrite(gm.graph)
    gm.graph.lint()
    call = next(n for n in gm.graph.nodes if n.target is add_dropout_norm)
    drop = next(n for n in gm.graph.nodes if n.target is F.dropout)
    assert set(call.args[:2]) == {drop, next(n for n in gm.graph.nodes if n.name == "r")}
    assert call.kwargs["dropout_p"] == 0.0
    assert counters["flash"]["norm"] == 1 and counters["flash"]["norm_skipped"] == 0
    _check_rewrite(Fn(lambda m, x, r: fn(x, r, 0.0)), (_x(3, N), _x(3, N)))  # numerics: p=0


def test_near_miss_inplace_dropout_whose_input_has_other_users():
    def fn(m, x, r):
        y = x * 2
        d = F.dropout(y, 0.1, True, inplace=True)
        return F.layer_norm(d + r, (N,)), y

    _check_near_miss(Fn(fn), (_x(3, N), _x(3, N)), "inplace dropout")


def test_near_miss_weight_not_of_shape_n():
    # a (1, 1, N) weight on a 2-d x adds a dim to eager's output; on a 3-d x it is a row, rewritten
    # (tests/test_norm_review_s28.py)
    def fn(m, x):
        hs = x.float()
        hs = hs * torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + EPS)
        return m.weight * hs.to(x.dtype)

    _check_near_miss(Fn(fn, weight_shape=(1, 1, N), bias=False), (_x(3, N),), "not (97,)")


def test_near_miss_dtype_the_op_cannot_take():
    _check_near_miss(nn.LayerNorm(N, dtype=torch.float64), (_x(3, N, dtype=torch.float64),), "float64")


def test_near_miss_mean_without_keepdim():
    # never given back: on a square x the (N,) row statistics broadcast along the rows, scaling columns
    # (a dim given back later is the same function: tests/test_norm_pass_more_forms.py)
    def fn(m, x):
        var = x.pow(2).mean(-1)
        return x * torch.rsqrt(var + EPS)

    _check_near_miss(Fn(fn), (_x(N, N),), "keepdim")


def test_near_miss_intermediate_with_other_users():
    def fn(m, x):
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        return (x - u) * torch.rsqrt(s + 1e-5), s

    _check_near_miss(Fn(fn), (_x(3, N),), "users outside the norm")


def test_near_miss_unbiased_var_mean_and_correction_1():
    def var_mean(m, x):
        var, mu = torch.var_mean(x, dim=-1, keepdim=True)  # correction=1 by default
        return (x - mu) * torch.rsqrt(var + 1e-5)

    def correction_1(m, x):
        mu = x.mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(torch.var(x, -1, keepdim=True, correction=1) + 1e-5)

    _check_near_miss(Fn(var_mean), (_x(3, N),), "var_mean is unbiased")
    _check_near_miss(Fn(correction_1), (_x(3, N),), "the variance is unbiased")


class AnnotatedTransformerLayerNorm(nn.Module):
    """The Annotated Transformer's LayerNorm: unbiased std, eps added to the std. Not nn.LayerNorm."""

    def __init__(self, n=N, eps=1e-6):
        super().__init__()
        self.a_2, self.b_2, self.eps = nn.Parameter(torch.ones(n)), nn.Parameter(torch.zeros(n)), eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        std = x.std(-1, keepdim=True)
        return self.a_2 * (x - mean) / (std + self.eps) + self.b_2


class ReferenceRMSNorm(nn.Module):
    """Zhang & Sennrich's reference RMSNorm: eps added to the root mean square, x / (rms + eps)."""

    def __init__(self, d=N, eps=1e-8):
        super().__init__()
        self.d, self.eps, self.scale = d, eps, nn.Parameter(torch.ones(d))

    def forward(self, x):
        norm_x = x.norm(2, dim=-1, keepdim=True)
        rms_x = norm_x * self.d ** (-1.0 / 2)
        return self.scale * (x / (rms_x + self.eps))


def test_near_miss_eps_outside_the_square_root():
    reason = "eps is added after the square root"
    report = _check_near_miss(AnnotatedTransformerLayerNorm(), (_x(3, N),), reason)
    assert "standard deviation is unbiased" in report.near_misses[0].detail  # both reasons are given
    _check_near_miss(ReferenceRMSNorm(), (_x(3, N),), "eps is added to the root mean square")

    def clamped(m, x):  # lucidrains' RMSNorm
        norm = torch.norm(x, dim=-1, keepdim=True) * N**-0.5
        return x / norm.clamp(min=1e-8) * m.weight

    def ln_sqrt_then_eps(m, x):
        var, mu = torch.var_mean(x, -1, keepdim=True, correction=0)
        return (x - mu) / (torch.sqrt(var) + 1e-5)

    def rms_sqrt_then_eps(m, x):
        return x / (torch.sqrt(x.pow(2).mean(-1, keepdim=True)) + EPS)

    _check_near_miss(Fn(clamped, bias=False), (_x(3, N),), "the root mean square is clamped")
    _check_near_miss(Fn(ln_sqrt_then_eps), (_x(3, N),), "eps is added after the square root")
    _check_near_miss(Fn(rms_sqrt_then_eps), (_x(3, N),), "eps is added after the square root")


# --------------------------------------------------------------------------------------------------------
# Level 2b: end to end with torch.compile(backend="flash") (Inductor compiles the rest)
# --------------------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_autograd_cache(monkeypatch):
    # torch 2.13 runs the pre-grad passes (ours) after the AOTAutograd cache lookup: on a hit from an
    # earlier test run the graph is rewritten as before but nothing is counted.
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False, raising=False)


def _compile_flash(model, **kw):
    return torch.compile(model, backend="flash", fullgraph=True, **kw)


def test_e2e_bert_post_norm_training_and_inference():
    m = BertSelfOutput()
    args = (_x(2, 9, N), _x(2, 9, N))
    compiled = _compile_flash(m)
    _assert_same(m, compiled, args, atol=1e-4, rtol=1e-4)
    assert counters["flash"]["norm"] == 1
    m.eval()
    with torch.no_grad():
        _assert_same(m, compiled, args, atol=1e-4, rtol=1e-4, grads=False)
    assert counters["flash"]["norm"] == 2  # the eval graph is a second compile, rewritten too


def test_e2e_gpt2_pre_norm_block_training():
    m = GPT2Block()
    _assert_same(m, _compile_flash(m), (_x(2, 9, N),), atol=1e-4, rtol=1e-4)
    assert counters["flash"]["norm"] == 2


def test_e2e_llama_block_bf16():
    m = LlamaBlock().to(torch.bfloat16)
    x = _x(2, 9, N, dtype=torch.bfloat16)
    got = _compile_flash(m)(x)
    assert counters["flash"]["norm"] == 2
    expected = m(x)
    reference = m.float()(x.float())
    assert got.dtype == expected.dtype == torch.bfloat16
    eager_err = (expected.float() - reference).abs().max().item()
    flash_err = (got.float() - reference).abs().max().item()
    assert flash_err <= 2 * eager_err + 1e-2, (flash_err, eager_err)


def test_e2e_var_mean_layernorm_and_2_norm_rmsnorm_training():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(N, N)
            self.w1, self.b1, self.w2 = (nn.Parameter(torch.randn(N)) for _ in range(3))

        def forward(self, x):
            var, mu = torch.var_mean(x, dim=-1, keepdim=True, unbiased=False)
            h = torch.addcmul(self.b1, (x - mu) * torch.rsqrt(var + 1e-5), self.w1)
            h = self.lin(h)
            return self.w2 * (h / (h.norm(2, dim=-1, keepdim=True) * N**-0.5))

    m = Block()
    _assert_same(m, _compile_flash(m), (_x(2, 9, N),), atol=1e-4, rtol=1e-4)
    assert counters["flash"]["norm"] == 2 and counters["flash"]["norm_skipped"] == 0

def test_e2e_dropout_statistics_and_gradient():
    # pre-norm with p > 0: the residual output shows the mask (zero or x / (1 - p)), the norm output is
    # the LayerNorm of that residual, and x's gradient is zero exactly where x was dropped.
    p = 0.25

    class PreNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(N)

        def forward(self, x, r):
            h = r + F.dropout(x, p, self.training)
            return self.ln(h), h

    m = PreNorm()
    x, r = _x(64, N, dtype=torch.float32).requires_grad_(), _x(64, N)
    out, h = _compile_flash(m)(x, r)
    assert counters["flash"]["norm"] == 1
    delta = (h - r).detach()
    dropped = delta == 0
    assert abs(dropped.float().mean().item() - p) < 0.03
    torch.testing.assert_close(delta[~dropped], (x / (1 - p)).detach()[~dropped])
    torch.testing.assert_close(out, m.ln(h), atol=1e-5, rtol=1e-5)
    (out * torch.randn_like(out)).sum().backward()
    assert (x.grad[dropped] == 0).all() and (x.grad[~dropped] != 0).all()


def test_e2e_dynamic_shapes_no_recompile():
    m = nn.Sequential(nn.Linear(N, N), nn.Dropout(0.0), nn.LayerNorm(N))
    compiled = _compile_flash(m, dynamic=True)
    for b, s in ((2, 5), (3, 8)):
        x = _x(b, s, N)
        torch.testing.assert_close(compiled(x), m(x), atol=1e-4, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1
    assert counters["flash"]["norm"] == 1


@pytest.mark.cuda
def test_e2e_cuda_bf16_blocks():
    # On the GPU the rewritten norms run the Triton kernels: GPT-2 (LayerNorm, pre-norm) and Llama (RMSNorm).
    for block in (GPT2Block, LlamaBlock):
        counters.clear()
        torch._dynamo.reset()
        m = block(n=1000).to("cuda", torch.bfloat16)
        x = torch.randn(4, 33, 1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        got = _compile_flash(m)(x)
        assert counters["flash"]["norm"] == 2
        expected = m(x)
        reference = m.float()(x.float())
        m.to(torch.bfloat16)
        eager_err = (expected.float() - reference).abs().max().item()
        flash_err = (got.float() - reference).abs().max().item()
        assert flash_err <= 2 * eager_err + 1e-2, (block.__name__, flash_err, eager_err)
        got.float().square().sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
