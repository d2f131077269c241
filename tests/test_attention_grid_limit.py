"""Attention launch limits: more (batch, head) pairs than a CUDA grid's second axis takes (65535), and a
varlen max_seqlen below a sequence's length.

The Triton kernels put B * H on the grid's second axis; past 65535 (a large batch of short sequences: ViT-base
inference at B = 8192 has 98304 pairs) CUDA refused the launch ("invalid argument"). attention_fwd.bh_grid
swaps the axes there and the kernels read them swapped (BH_ON_X). On the CPU the swap is forced by lowering
the limit, and the kernels run under Triton's interpreter against the reference; on a GPU a real 70000-pair
call is checked against fp32."""

from __future__ import annotations

import pytest
import torch

from flash_backend.kernels import attention_fwd
from flash_backend.ops.attention import attention_backward_reference, attention_reference, flash_attention


def test_bh_grid_swaps_past_the_limit_and_names_the_sizes_it_cannot_launch():
    assert attention_fwd.bh_grid(7, 65535) == ((7, 65535), False)
    assert attention_fwd.bh_grid(7, 65536) == ((65536, 7), True)
    with pytest.raises(ValueError, match="70000 \\(batch, head\\) pairs with 70000 blocks"):
        attention_fwd.bh_grid(70000, 70000)


@pytest.mark.interpret
@pytest.mark.parametrize("case",
                         ["plain_dq_kernel", "causal_atomic_dq", "gqa_dropout", "bias_grad_split_dkdv"])
def test_swapped_grid_under_interpreter(interpreter, monkeypatch, case):
    """Every kernel (forward, backward preprocess, dK/dV in one or two launches, dQ or atomic dQ) with the
    (batch, head) pairs on the grid's first axis gives the reference's results."""
    from flash_backend.kernels.attention_bwd import attention_backward_launch
    from flash_backend.kernels.attention_fwd import attention_forward_launch

    monkeypatch.setattr(attention_fwd, "MAX_GRID_Y", 3)  # B * H = 4 pairs: swapped; 2 blocks: fits
    B, H, Hkv, Sq, Sk, D = 2, 2, 2, 37, 45, 32
    right, p, bias, atomic, dkdv = -1, 0.0, False, False, (16, 32, 4, 2)
    if case == "causal_atomic_dq":
        right, atomic = 0, True
    elif case == "gqa_dropout":
        Hkv, p = 1, 0.3
    elif case == "bias_grad_split_dkdv":
        bias, dkdv = True, ((16, 32, 4, 2), (32, 32, 4, 2))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, Sq, D, generator=gen).half()
    k, v = (torch.randn(B, Hkv, Sk, D, generator=gen).half() for _ in range(2))
    mask = torch.randn(1, H, Sq, Sk, generator=gen).half() if bias else None
    seed = torch.randint(0, 2**62, (1,), generator=gen) if p else None
    args = (mask, seed, p, 0.3, -1, right, False)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3])
    attention_forward_launch(q, k, v, *args, out, lse, config=(32, 32, 4, 2))
    ref_out, ref_lse = attention_reference(q, k, v, *args)
    torch.testing.assert_close(out, ref_out, atol=2e-3, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=0)
    dout = torch.randn(q.shape, generator=gen).half()
    grads = [torch.empty_like(t) for t in (q, k, v)] + [torch.empty_like(mask) if bias else None]
    attention_backward_launch(dout, q, k, v, ref_out, ref_lse, *args, *grads, config=(dkdv, (32, 32, 4, 2)),
                              atomic_dq=atomic)
    ref = attention_backward_reference(dout, q, k, v, ref_out, ref_lse, *args, compute_dbias=bias)
    for got, want in zip(grads, ref, strict=True):
        if want is not None:
            torch.testing.assert_close(got.float(), want.float(), atol=5e-3, rtol=2e-3)


@pytest.mark.interpret
def test_swapped_grid_varlen_under_interpreter(interpreter, monkeypatch):
    """Packed sequences: the grid's (sequence, head) pairs swapped too."""
    from flash_backend.ops.attention import flash_attention_varlen

    monkeypatch.setattr(attention_fwd, "MAX_GRID_Y", 3)
    monkeypatch.setattr("flash_backend.ops.attention._kernels_enabled", lambda t: True)
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 17, 9]
    cu = torch.tensor([0, 5, 22, 31], dtype=torch.int32)
    q, k, v = (torch.randn(sum(lengths), 2, 32, generator=gen).half().requires_grad_() for _ in range(3))
    out = flash_attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), is_causal=True)
    dout = torch.randn(out.shape, generator=gen).half()
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for i in range(len(lengths)):
        s = slice(int(cu[i]), int(cu[i + 1]))
        leaves = [t[s].detach().float().transpose(0, 1).requires_grad_() for t in (q, k, v)]
        ref = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
        ref_grads = torch.autograd.grad(ref, leaves, dout[s].float().transpose(0, 1))
        torch.testing.assert_close(out[s].float(), ref.transpose(0, 1), atol=2e-3, rtol=0)
        for got, want in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(got[s].float(), want.transpose(0, 1), atol=5e-3, rtol=2e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_more_pairs_than_the_grid_axis_takes(causal):
    """B * H = 70000 > 65535 with GQA (the dK/dV kernel's 17500 (batch, kv head) pairs stay unswapped),
    forward and every gradient against fp32; it failed to launch before."""
    gen = torch.Generator().manual_seed(2)
    B, H, Hkv, S, D = 4375, 16, 4, 40, 64
    q = torch.randn(B, H, S, D, generator=gen).cuda().bfloat16().requires_grad_()
    k, v = (torch.randn(B, Hkv, S, D, generator=gen).cuda().bfloat16().requires_grad_() for _ in range(2))
    out = flash_attention(q, k, v, is_causal=causal)
    dout = torch.randn(out.shape, generator=gen).cuda().bfloat16()
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, leaves, dout.float())
    for got, want in zip([out, *grads], [ref, *ref_grads], strict=True):
        err = (got.float() - want).abs().max().item()
        assert err <= 3e-2 * max(want.abs().max().item(), 1.0), err


@pytest.mark.parametrize("which", ["q", "k"])
def test_varlen_max_seqlen_below_a_sequence_is_an_error(which):
    """max_seqlen_* sizes the kernels' grid: a sequence longer than it had its rows past it left unwritten
    on CUDA. The check runs on the device without a sync (an error here on the CPU, eagerly and compiled)."""
    from flash_backend.ops.attention import flash_attention_varlen

    cu = torch.tensor([0, 5, 22, 31], dtype=torch.int32)
    q = torch.randn(31, 2, 32)
    lengths = {"q": 17, "k": 17, which: 16}
    with pytest.raises(RuntimeError, match=f"cu_seqlens_{which} is longer than max_seqlen_{which}"):
        flash_attention_varlen(q, q, q, cu, cu, lengths["q"], lengths["k"])
    compiled = torch.compile(flash_attention_varlen, backend="eager", fullgraph=True, dynamic=True)
    with pytest.raises(RuntimeError, match=f"cu_seqlens_{which} is longer than max_seqlen_{which}"):
        compiled(q, q, q, cu, cu, lengths["q"], lengths["k"])
    assert flash_attention_varlen(q, q, q, cu, cu, 17, 40).shape == q.shape  # larger is fine
