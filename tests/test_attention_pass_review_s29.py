"""Review (session 29) of fx_passes/attention: constant masks written through views, buffers written in place,
and nn.Transformer*Layer's is_causal hint.

Each case runs through dynamo + the attention rewrite (the graph as plain PyTorch, the flash op on its CPU
reference: test_attention_pass's helpers), compares outputs (and gradients where it is rewritten) with eager
and asserts the rewrite count and what the rewrite took.

Fixed, another function was rewritten (each case failed before):
- A write through the result of an in-place call was not seen (_match.in_place_writers stops at an in-place
  call): ``keep = torch.ones(S, S, dtype=bool).tril_(); keep[0] = False`` was evaluated as the plain tril and
  rewritten as is_causal=True, row 0 attending to key 0 where eager masks every key (NaN with -inf, the
  average of v with finfo.min). Also ``kc = cache.mul_(1); s = q @ kc.mT; ...; kc[..., 0, :] = 0; p @ v``:
  the fused op read k after the write.
- A constant mask written through a view (``keep[None].tril_(-1)``, ``m.view(1, 1, S, S)[..., 0, :] = min``,
  ``mv = m[0, 0]; mv.masked_fill_(..)``) or read through one after the write (``m.triu_(0); s + m[None,
  None]``) was taken for a runtime mask, so the row it leaves without a key was not seen and the rewrite
  gave 0 there.
Now _const_eval evaluates a tensor's whole storage family (views, in-place results, writes through any of
them) in graph order when every read comes after the last write; a tensor read before a write into it, or
written from its own view, stays a runtime mask.

Now recognised (a runtime mask before): constant causal masks used or written through a view, and built from
a template read for its metadata only (``q.new_ones(S, S).tril()``, ``torch.ones_like(..)``): is_causal.
nn.MultiheadAttention with is_causal=True (TransformerEncoderLayer(is_causal=True), TransformerDecoderLayer
(tgt_is_causal=True)): left alone before; rewritten now as eager runs it (the mask dropped for SDPA's
top-left is_causal without key_padding_mask and need_weights, else the mask applied and the hint ignored).

A registered buffer is a graph input: never a constant, also when forward writes into it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from test_attention_pass import (  # noqa: F401  (_cold_inductor_cache: an autouse fixture)
    _check_same,
    _cold_inductor_cache,
    _qkv,
    _rewrites,
    _run_rewritten,
)

from fx_passes import collecting

S = 12
MIN = torch.finfo(torch.float32).min
NEG_INF = float("-inf")


def _s(q, k):
    return q @ k.transpose(-2, -1) * 0.25


def _left_alone(fn, *args, reason):
    """fn is not rewritten (one near miss, with reason) and returns eager's values, NaN included."""
    ref = fn(*args)
    with collecting() as report:
        out, _ = _run_rewritten(fn, *args)
    assert _rewrites() == (0, 1), str(report)
    assert any(reason in d.detail for d in report.near_misses), str(report)
    torch.testing.assert_close(out, ref, equal_nan=True)


def _causal(nodes):
    assert len(nodes) == 1
    kwargs = nodes[0].kwargs
    return kwargs.get("is_causal") is True and kwargs.get("attn_mask") is None


# --------------------------------------------------------------------------------------------------------
# Constant masks with a row that sees no key, written through a view or an in-place result: left alone
# --------------------------------------------------------------------------------------------------------


def _tril_then_setitem(q, k, v):
    keep = torch.ones(S, S, dtype=torch.bool).tril_()
    keep[0] = False  # through the in-place result: row 0 sees no key
    return torch.softmax(_s(q, k).masked_fill(~keep, MIN), -1) @ v


def _tril_then_view_write(q, k, v):
    keep = torch.ones(S, S, dtype=torch.bool).tril_()
    keep.view(1, 1, S, S)[..., 0, :] = False
    return torch.softmax(_s(q, k).masked_fill(keep.logical_not(), NEG_INF), -1) @ v


def _masked_fill_then_setitem(q, k, v):
    m = torch.zeros(S, S).masked_fill_(torch.ones(S, S, dtype=torch.bool).triu(1), NEG_INF)
    m[:, 0] = NEG_INF  # key 0 masked everywhere: row 0 has none left
    return torch.softmax(_s(q, k) + m, -1) @ v


def _write_through_view(q, k, v):
    keep = torch.ones(S, S, dtype=torch.bool)
    keep[None].tril_(-1)  # written through a view: row 0 sees no key
    return torch.softmax(_s(q, k).masked_fill(~keep, MIN), -1) @ v


def _read_through_view(q, k, v):
    m = torch.full((S, S), NEG_INF)
    m.triu_(0)
    return torch.softmax(_s(q, k) + m[None, None], -1) @ v


def _setitem_through_view(q, k, v):
    m = torch.zeros(S, S)
    m.view(1, 1, S, S)[..., 0, :] = NEG_INF
    return torch.softmax(_s(q, k) + m, -1) @ v


def _masked_fill_into_a_slice(q, k, v):
    m = torch.zeros(1, 1, S, S)
    mv = m[0, 0]
    mv.masked_fill_(torch.ones(S, S, dtype=torch.bool).triu(0), NEG_INF)
    return torch.softmax(_s(q, k) + m, -1) @ v


DEAD = {
    "tril_then_setitem": _tril_then_setitem,
    "tril_then_view_write": _tril_then_view_write,
    "masked_fill_then_setitem": _masked_fill_then_setitem,
    "write_through_view": _write_through_view,
    "read_through_view": _read_through_view,
    "setitem_through_view": _setitem_through_view,
    "masked_fill_into_a_slice": _masked_fill_into_a_slice,
}


@pytest.mark.parametrize("case", DEAD)
def test_constant_dead_row_written_through_a_view_is_left_alone(case):
    """Rewritten before (as is_causal, or as a runtime mask): the op gave 0 on the row eager fills with NaN or
    the average of v."""
    _left_alone(DEAD[case], *_qkv(S=S), reason="leaves a query row with no visible key")


def _k_written_between_reads(q, k, v, cache):
    kc = cache.mul_(1.0)  # k is the in-place result
    p = torch.softmax(q @ kc.transpose(-2, -1) * 0.25, -1)
    kc[:, :, 0] = 0  # written after q·kᵀ read it, before p·v
    return p @ v


def test_k_written_through_an_in_place_result_inside_the_pattern_is_left_alone():
    """Rewritten before: the op, placed at p·v, read k after the write."""
    q, k, v = _qkv(S=S)
    ref = _k_written_between_reads(q, k, v, k.clone())
    with collecting() as report:
        out, _ = _run_rewritten(_k_written_between_reads, q, k, v, k.clone())
    assert _rewrites() == (0, 1), str(report)
    assert any("after the attention reads it" in d.detail for d in report.near_misses), str(report)
    torch.testing.assert_close(out, ref)


# --------------------------------------------------------------------------------------------------------
# Constant causal masks through views and templates: is_causal
# --------------------------------------------------------------------------------------------------------


def _tril_statement_then_view(q, k, v):
    m = torch.ones(S, S)
    m.tril_()
    return torch.softmax(_s(q, k).masked_fill(m.view(1, 1, S, S) == 0, NEG_INF), -1) @ v


def _masked_fill_statement_then_view(q, k, v):
    m = torch.zeros(S, S)
    m.masked_fill_(torch.ones(S, S, dtype=torch.bool).triu(1), NEG_INF)
    return torch.softmax(_s(q, k) + m.view(1, 1, S, S), -1) @ v


def _causal_written_through_a_slice(q, k, v):
    m = torch.zeros(1, 1, S, S)
    m[0, 0].masked_fill_(torch.ones(S, S, dtype=torch.bool).triu(1), NEG_INF)
    return torch.softmax(_s(q, k) + m, -1) @ v


def _bool_view_of_statement(q, k, v):
    keep = torch.ones(S, S, dtype=torch.bool)
    keep.tril_()
    return torch.softmax(_s(q, k).masked_fill(~keep.view(1, 1, S, S), MIN), -1) @ v


def _new_ones_template(q, k, v):
    keep = q.new_ones(S, S, dtype=torch.bool).tril()
    return torch.softmax(_s(q, k).masked_fill(~keep, NEG_INF), -1) @ v


def _ones_like_template(q, k, v):
    keep = torch.ones_like(q[0, 0, :, :S], dtype=torch.bool).tril()
    return torch.softmax(_s(q, k).masked_fill(~keep, NEG_INF), -1) @ v


CAUSAL = {
    "tril_statement_then_view": _tril_statement_then_view,
    "masked_fill_statement_then_view": _masked_fill_statement_then_view,
    "causal_written_through_a_slice": _causal_written_through_a_slice,
    "bool_view_of_statement": _bool_view_of_statement,
    "new_ones_template": _new_ones_template,
    "ones_like_template": _ones_like_template,
}


@pytest.mark.parametrize("case", CAUSAL)
def test_constant_causal_mask_through_a_view_is_causal(case):
    """A runtime attn_mask before."""
    assert _causal(_check_same(CAUSAL[case], *_qkv(S=S)))


def _read_before_the_write(q, k, v):
    """A copy of the mask made before a write into it: the copy keeps the values before the write (causal
    here; all -inf after it)."""
    m = torch.zeros(S, S)
    early = m.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), NEG_INF)
    m.fill_(NEG_INF)
    return torch.softmax(_s(q, k) + early, -1) @ v, m


def test_mask_read_before_a_write_keeps_the_values_before_it():
    """Evaluated with the write, the copy would be all -inf (a dead row: left alone); it is a runtime mask."""
    nodes = _check_same(lambda q, k, v: _read_before_the_write(q, k, v)[0], *_qkv(S=S))
    assert nodes[0].kwargs.get("attn_mask") is not None


# --------------------------------------------------------------------------------------------------------
# Registered buffers: graph inputs, never constants, also when forward writes into them
# --------------------------------------------------------------------------------------------------------


class _BufferMask(nn.Module):
    """nanoGPT's causal buffer, which forward writes through a view before it is read (a dead first row once
    written when `kill_row`, else a causal band re-written to itself)."""

    def __init__(self, kill_row):
        super().__init__()
        self.kill_row = kill_row
        self.register_buffer("bias", torch.ones(32, 32).tril().view(1, 1, 32, 32))

    def forward(self, q, k, v):
        T = q.shape[-2]
        if self.kill_row:
            self.bias[:, :, 0, :] = 0
        else:
            self.bias[:, :, :T, :T].tril_()
        att = _s(q, k).masked_fill(self.bias[:, :, :T, :T] == 0, MIN)
        return torch.softmax(att, -1) @ v


def test_buffer_written_in_forward_stays_a_runtime_mask():
    nodes = _check_same(_BufferMask(kill_row=False), *_qkv(S=S))
    assert nodes[0].kwargs.get("attn_mask") is not None and not nodes[0].kwargs.get("is_causal")


def test_buffer_with_a_row_killed_in_forward_is_not_taken_as_causal():
    """The buffer is no constant: rewritten with the runtime mask (a row with no key is then the documented
    degenerate input, reported), never as is_causal."""
    model = _BufferMask(kill_row=True)
    q, k, v = _qkv(S=S)
    with collecting() as report:
        out, graphs = _run_rewritten(model, q, k, v)
    assert _rewrites() == (1, 0), str(report)
    assert "causal" not in report.rewrites[0].detail
    assert "mask [1, 1, 12, 12]" in report.rewrites[0].detail
    ref = model(q, k, v)
    torch.testing.assert_close(out[:, :, 1:], ref[:, :, 1:])  # row 0: 0 here, eager's average of v there


# --------------------------------------------------------------------------------------------------------
# nn.MultiheadAttention's is_causal hint
# --------------------------------------------------------------------------------------------------------

E, HEADS, B = 32, 4, 3


class _Encoder(nn.Module):
    def __init__(self, batch_first):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(E, HEADS, 64, dropout=0.0, batch_first=batch_first)

    def forward(self, x, mask):
        return self.layer(x, src_mask=mask, is_causal=True)


class _Decoder(nn.Module):
    def __init__(self, batch_first):
        super().__init__()
        self.layer = nn.TransformerDecoderLayer(E, HEADS, 64, dropout=0.0, batch_first=batch_first)

    def forward(self, x, memory, mask):
        return self.layer(x, memory, tgt_mask=mask, tgt_is_causal=True)


def _x(batch_first, length=10):
    return torch.randn(B, length, E) if batch_first else torch.randn(length, B, E)


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
def test_encoder_layer_is_causal(batch_first, train):
    model = _Encoder(batch_first).train(train)
    mask = nn.Transformer.generate_square_subsequent_mask(10)
    assert _causal(_check_same(model, _x(batch_first), mask))


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
def test_decoder_layer_tgt_is_causal(batch_first, train):
    model = _Decoder(batch_first).train(train)
    mask = nn.Transformer.generate_square_subsequent_mask(10)
    nodes = _check_same(model, _x(batch_first), _x(batch_first, 13), mask, rewrites=2)
    assert sum(n.kwargs.get("is_causal") is True for n in nodes) == 1


class _Hinted(nn.Module):
    def __init__(self, need_weights):
        super().__init__()
        self.mha = nn.MultiheadAttention(E, HEADS, batch_first=True)
        self.need_weights = need_weights

    def forward(self, x, mask, kpm=None):
        return self.mha(x, x, x, attn_mask=mask, key_padding_mask=kpm, need_weights=self.need_weights,
                        is_causal=True)[0]


def test_is_causal_hint_drops_a_mask_that_is_not_causal():
    """Eager's SDPA path drops attn_mask for is_causal: so does the rewrite (a random bias is not applied)."""
    assert _causal(_check_same(_Hinted(need_weights=False), _x(True), torch.randn(10, 10)))


def test_is_causal_hint_with_key_padding_mask_applies_the_mask():
    """With a key_padding_mask eager ignores the hint and applies attn_mask (here a bias, not causal)."""
    kpm = torch.zeros(B, 10, dtype=torch.bool)
    kpm[1, -3:] = True
    nodes = _check_same(_Hinted(need_weights=False), _x(True), torch.randn(10, 10), kpm.float() * -1e9)
    assert nodes[0].kwargs.get("is_causal") is False and nodes[0].kwargs.get("attn_mask") is not None


def test_is_causal_hint_with_need_weights_applies_the_mask():
    nodes = _check_same(_Hinted(need_weights=True), _x(True), torch.randn(10, 10))
    assert nodes[0].kwargs.get("is_causal") is False and nodes[0].kwargs.get("attn_mask") is not None
