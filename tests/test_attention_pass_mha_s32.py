"""nn.MultiheadAttention / F.multi_head_attention_forward: separate projection weights and dynamic=True
(review s32, findings A1 and A3; fx_passes/attention.py _rewrite_mha).

A1: fairseq's MultiheadAttention (and nn.MultiheadAttention with kdim / vdim) calls the function with
use_separate_proj_weight=True: q, k and v each projected by their own weight, in_proj_bias the three biases
concatenated. Eager's _in_projection is then ``F.linear(x, w_x, b_x)`` per input, what the rewrite writes
out. A3: under dynamic=True the module's dropout float is a graph input; in eval eager ignores it (any p,
even 1), in training the rewrite bakes it in and has it specialised (dynamo guards on it and restarts, as
the norm and dense passes do), so a later change of p recompiles.

Compiled with the rewrite-only backend (and once through backend="flash"), compared with eager in training
(outputs and the gradients of every input and parameter) and eval, fp32, on fresh random inputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_codebases_review_s31 import TOL
from test_norm_dense_ce_review_s25 import _run

from flash_backend.backend import rewrite_only_backend
from flash_backend.ops.attention import flash_attention
from fx_passes import collecting
from fx_passes._compat import counters

R = torch.randn


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def _check(model, argsets, rewrites=1, near_miss=None, dynamic=False, modes=(True, False), backend=None):
    """For each mode (training, eval), one compile over every argument set: eager's results and `rewrites`
    attention rewrites (exactly one near miss holding near_miss when given). Returns the graphs the
    backend ran (after the passes)."""
    graphs = []

    def capturing(gm, example_inputs):
        forward = rewrite_only_backend(gm, example_inputs)
        graphs.append(gm.graph)
        return forward

    for train in modes:
        model.train(train)
        torch._dynamo.reset()
        counters.clear()
        with collecting() as report:
            compiled = torch.compile(model, backend=backend or capturing, fullgraph=True, dynamic=dynamic)
            for args in argsets:
                got, want = _run(compiled, args, train), _run(model, args, train)
                for g, w in zip(got, want, strict=True):
                    torch.testing.assert_close(g, w, **TOL, msg=lambda m: f"{m}\n{report}")
        assert counters["flash"]["attention"] == rewrites, f"{train=}: {report}"
        if near_miss is not None:
            assert [near_miss in d.detail for d in report.near_misses] == [True], str(report)
    return graphs


def _flash_calls(graph):
    return [n for n in graph.nodes if n.op == "call_function" and n.target is flash_attention]


# ========================================================================================================
# A1: separate projection weights
# ========================================================================================================


class FairseqMultiheadAttention(nn.Module):
    """fairseq's MultiheadAttention on its usual path (no incremental state): q/k/v_proj Linears, one
    F.multi_head_attention_forward call with use_separate_proj_weight=True, an empty in_proj_weight."""

    def __init__(self, embed_dim=24, num_heads=3, dropout=0.0, bias=True, kdim=None, vdim=None):
        super().__init__()
        self.embed_dim, self.num_heads, self.dropout_p = embed_dim, num_heads, dropout
        self.k_proj = nn.Linear(kdim or embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(vdim or embed_dim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=False, attn_mask=None):
        bias = torch.cat((self.q_proj.bias, self.k_proj.bias, self.v_proj.bias)) \
            if self.q_proj.bias is not None else None
        return F.multi_head_attention_forward(
            query, key, value, self.embed_dim, self.num_heads, torch.empty([0]), bias, None, None, False,
            self.dropout_p, self.out_proj.weight, self.out_proj.bias, self.training, key_padding_mask,
            need_weights, attn_mask, use_separate_proj_weight=True, q_proj_weight=self.q_proj.weight,
            k_proj_weight=self.k_proj.weight, v_proj_weight=self.v_proj.weight)


class _Self(nn.Module):
    def __init__(self, attn, need_weights=False):
        super().__init__()
        self.attn, self.need_weights = attn, need_weights

    def forward(self, x, key_padding_mask=None):
        return self.attn(x, x, x, key_padding_mask=key_padding_mask, need_weights=self.need_weights)[0]


class _Cross(nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def forward(self, x, memory, values, attn_mask):
        return self.attn(x, memory, values, attn_mask=attn_mask)[0]


def _padding(b=2, s=9):
    mask = torch.zeros(b, s, dtype=torch.bool)
    mask[-1, 5:] = True
    return mask


@pytest.mark.parametrize("key_padding", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("need_weights", [False, True])
def test_fairseq_self_attention_with_separate_weights(key_padding, bias, need_weights):
    """(T, B, C) self-attention, the weights returned but unused when need_weights."""
    model = _Self(FairseqMultiheadAttention(bias=bias), need_weights)
    args = (R(9, 2, 24), _padding()) if key_padding else (R(9, 2, 24),)
    _check(model, [args])


@pytest.mark.parametrize("batch_first", [False, True])
def test_multihead_attention_with_kdim_vdim(batch_first):
    """nn.MultiheadAttention(kdim, vdim): separate weights of three widths; a float (L, S) mask."""
    model = _Cross(nn.MultiheadAttention(24, 3, kdim=16, vdim=20, batch_first=batch_first))
    shapes = [(7, 2, 24), (11, 2, 16), (11, 2, 20)]
    x, memory, values = (R(*((s[1], s[0], s[2]) if batch_first else s)) for s in shapes)
    _check(model, [(x, memory, values, R(7, 11))])


def test_fairseq_cross_attention_of_other_widths():
    model = _Cross(FairseqMultiheadAttention(kdim=16, vdim=20))
    _check(model, [(R(7, 2, 24), R(11, 2, 16), R(11, 2, 20), torch.rand(7, 11) > 0.2)])


def test_separate_weights_with_the_attention_weights_used_are_left_alone():
    class UsesWeights(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = FairseqMultiheadAttention()

        def forward(self, x):
            out, weights = self.attn(x, x, x, need_weights=True)
            return out, weights

    _check(UsesWeights(), [(R(9, 2, 24),)], rewrites=0, near_miss="the attention weights are used")


def test_separate_weights_with_bias_kv_are_left_alone():
    model = _Self(nn.MultiheadAttention(24, 3, kdim=16, vdim=16, add_bias_kv=True))

    class Adapt(nn.Module):  # kdim / vdim 16: the keys and values are a projection of x
        def __init__(self):
            super().__init__()
            self.inner, self.down = model, nn.Linear(24, 16)

        def forward(self, x):
            kv = self.down(x)
            return self.inner.attn(x, kv, kv, need_weights=False)[0]

    _check(Adapt(), [(R(9, 2, 24),)], rewrites=0, near_miss="bias_k")


# ========================================================================================================
# A3: dynamic=True (the module's dropout a symbolic float input)
# ========================================================================================================


def _seq(lengths=(7, 10, 13)):
    return [(R(2, s, 24),) for s in lengths]


@pytest.mark.parametrize("p", [0.0, 0.1, 1.0])
def test_eval_under_dynamic_shapes_takes_any_dropout(p):
    """In eval eager MultiheadAttention drops nothing whatever p is (1.0 included)."""
    model = _Self(nn.MultiheadAttention(24, 3, dropout=p, batch_first=True))
    graphs = _check(model, _seq(), dynamic=True, modes=(False,))
    assert [n.kwargs["dropout_p"] for n in _flash_calls(graphs[-1])] == [0.0]


@pytest.mark.parametrize("separate", [False, True])
def test_training_under_dynamic_shapes(separate):
    attn = FairseqMultiheadAttention() if separate else nn.MultiheadAttention(24, 3)
    _check(_Self(attn), [(R(s, 2, 24),) for s in (7, 10, 13)], dynamic=True, modes=(True,))


def test_training_dropout_is_specialised_and_guarded():
    """p > 0 in training: the op gets p as a constant; a change of p recompiles with the new value."""
    model = _Self(nn.MultiheadAttention(24, 3, dropout=0.2, batch_first=True)).train()
    graphs = []

    def capturing(gm, example_inputs):
        forward = rewrite_only_backend(gm, example_inputs)
        graphs.append(gm.graph)
        return forward

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=capturing, fullgraph=True, dynamic=True)
    compiled(R(2, 7, 24))
    compiled(R(2, 10, 24))
    assert [n.kwargs["dropout_p"] for n in _flash_calls(graphs[-1])] == [pytest.approx(0.2)]
    # retraced with p a constant (the restart), not a graph input the rewritten graph ignores
    assert not [n.name for n in graphs[-1].nodes if n.op == "placeholder" and "dropout" in n.name]
    model.attn.dropout = 0.5
    compiled(R(2, 7, 24))
    assert [n.kwargs["dropout_p"] for n in _flash_calls(graphs[-1])] == [pytest.approx(0.5)]
    assert counters["flash"]["attention"] == 2  # once per compile, the restarts not counted


def test_training_dropout_of_one_is_left_alone():
    """p = 1 in training: not a p the op takes; eager returns the out-projection's bias."""
    model = _Self(nn.MultiheadAttention(24, 3, dropout=1.0, batch_first=True))
    _check(model, _seq(), rewrites=0, dynamic=True, modes=(True,), near_miss="dropout_p=1.0 in training")


def test_training_under_dynamic_shapes_through_inductor():
    """backend="flash": the restart happens once, the rewrite is counted once, eager's results."""
    from torch._inductor.utils import fresh_inductor_cache

    with fresh_inductor_cache():
        _check(_Self(nn.MultiheadAttention(24, 3, batch_first=True)), _seq((7, 10)), dynamic=True,
               modes=(True,), backend="flash")
