"""A query row that a finite additive mask as large as finfo.min blocks entirely (transformers' padded
rows: where(keep, 0, finfo.min)) gets what eager's softmax gives it, the average of v, from the reference
(CPU, fp32). It got sum(v): its logsumexp rounded to the row's max and every key had probability 1."""

import pytest
import torch

from flash_backend.ops.attention import flash_attention


def _eager(q, k, v, mask, scale):
    return torch.softmax(q @ k.transpose(-1, -2) * scale + mask, -1) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_blocked_by_finfo_min_match_eager(dtype):
    torch.manual_seed(0)
    q = torch.randn(2, 3, 6, 16, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 3, 9, 16, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 3, 9, 16, dtype=dtype, requires_grad=True)
    keep = torch.rand(2, 1, 6, 9) > 0.4
    keep[0, :, 1] = False  # query rows with no visible key
    keep[1, :, 4] = False
    mask = torch.zeros(2, 1, 6, 9, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)
    scale = 0.25
    out = flash_attention(q, k, v, attn_mask=mask, scale=scale)
    ref = _eager(q, k, v, mask, scale)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(out[0, :, 1], v[0].mean(1).detach().expand_as(out[0, :, 1]))
    grad = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad),
                         strict=True):
        torch.testing.assert_close(got, want)


def test_rows_blocked_by_minus_inf_still_give_zero():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, requires_grad=True) for _ in range(3))
    keep = torch.ones(1, 1, 5, 5, dtype=torch.bool)
    keep[..., 2, :] = False
    out = flash_attention(q, k, v, attn_mask=keep)
    assert torch.equal(out[0, :, 2], torch.zeros_like(out[0, :, 2]))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)
    torch.testing.assert_close(out[0, :, [0, 1, 3, 4]],
                               _eager(q, k, v, torch.zeros(1, 1, 5, 5).masked_fill(~keep, float("-inf")),
                                      8 ** -0.5)[0, :, [0, 1, 3, 4]])
