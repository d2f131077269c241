"""fx_passes/attention, session 33 second batch (tests/findings/codebase_review_s33b.md, finding S1): SDPA
called with more than two batch dims was refused ("5-d inputs; the flash op takes (B, H, S, D)") while the
same attention written by hand was rewritten (_Layout._merge, Hiera's mask units). timm's Twins
LocallyGroupedAttn (and every timm attention whose fused_attn path keeps a windows dim: (B, windows, heads,
ws², d)) calls F.scaled_dot_product_attention on 5-d q, k, v. SDPA treats every dim before the last two as a
batch dim: the op runs on q, k, v flattened to (B, prod(rest), S, D) and its output is unflattened back, the
same function. Taken only where q, k, v have the same batch dims (no broadcast among them) and the mask, if
any, broadcasts over every batch dim; else refused with the reason.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_attention_pass_s33 import _check, _qkv


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _sdpa(**kw):
    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **kw)

    return f


@pytest.mark.parametrize("shape", [(2, 4, 3, 5, 8), (2, 3, 2, 2, 5, 8), (1, 2, 3, 7, 8)])
def test_sdpa_with_more_than_two_batch_dims_is_rewritten(shape):
    _check(_sdpa(), _qkv(*shape), 1, words=[f"{len(shape)}-d inputs merged to (B, H)"])


def test_sdpa_5d_with_scale_causal_and_sq_ne_sk():
    q = torch.randn(2, 3, 2, 4, 8)
    k, v = torch.randn(2, 3, 2, 6, 8), torch.randn(2, 3, 2, 6, 16)
    _check(_sdpa(is_causal=True, scale=0.3), (q, k, v), 1, words=["5-d inputs merged"])


def test_sdpa_5d_with_a_mask_over_the_keys_only():
    mask = torch.rand(5, 5) > 0.3
    mask[:, 0] = True

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    _check(f, _qkv(2, 4, 2, 5, 8), 1, words=["5-d inputs merged"])

    bias = torch.randn(1, 1, 5, 5)

    def g(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    _check(g, _qkv(2, 4, 2, 5, 8), 1, words=["5-d inputs merged"])


def test_twins_locally_grouped_sdpa_under_dynamic_shapes():
    """The batch varies (no size equal to another: duck sizing would recompile): the merged dims are read
    from q (sym_size) where symbolic."""

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v) * 2

    argsets = [_qkv(b, 4, 3, 7, 8) for b in (2, 5, 6)]
    _check(f, argsets[0], 1, dynamic=True, argsets=argsets)


def test_sdpa_5d_refusals():
    # k broadcast over a batch dim (SDPA's math path broadcasts): not merged
    q, v = torch.randn(2, 4, 2, 5, 8), torch.randn(2, 4, 2, 5, 8)
    k = torch.randn(2, 1, 2, 5, 8)
    _check(_sdpa(), (q, k, v), 0, near="only where q, k, v hold every batch index")
    # a mask that varies over the batch dims
    mask = torch.randn(2, 4, 1, 5, 5)

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    _check(f, _qkv(2, 4, 2, 5, 8), 0, near="only with a mask that broadcasts over every batch dim")


def test_sdpa_5d_with_the_merged_dims_symbolic():
    """The windows dim varies: the unflatten reads it from q."""

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v) * 2

    argsets = [_qkv(2, w, 3, 7, 8) for w in (4, 5, 6)]
    _check(f, argsets[0], 1, dynamic=True, argsets=argsets)
