"""Forward-mode AD through our ops raises instead of returning a wrong (zero or absent) tangent
(flash_backend/ops/_forward_ad.py). Without the guard, torch.func.jvp of flash_attention returned a zero
tangent and a dual-tensor call returned no tangent at all."""

import pytest
import torch
import torch.autograd.forward_ad as forward_ad

from flash_backend.ops.add_dropout_norm import add_dropout_norm
from flash_backend.ops.attention import flash_attention, flash_attention_varlen
from flash_backend.ops.cross_entropy import linear_cross_entropy
from flash_backend.ops.dense import linear_bias, linear_bias_gelu


def _cases():
    """(name, function of one tensor, that tensor): each public function differentiated in one input."""
    torch.manual_seed(0)
    q = torch.randn(2, 3, 9, 16)
    kv = torch.randn(2, 3, 9, 16)
    packed = torch.randn(9, 3, 16)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    x = torch.randn(5, 24)
    w = torch.randn(16, 24)
    b = torch.randn(16)
    target = torch.randint(0, 16, (5,))
    return [
        ("flash_attention", lambda t: flash_attention(t, kv, kv), q),
        ("flash_attention_varlen", lambda t: flash_attention_varlen(t, packed, packed, cu, cu, 5, 5), packed),
        ("add_dropout_norm", lambda t: add_dropout_norm(t, residual=x, weight=torch.ones(24)), x),
        ("linear_bias_gelu", lambda t: linear_bias_gelu(t, w, b), x),
        ("linear_bias", lambda t: linear_bias(t, w, b), x),
        ("linear_cross_entropy", lambda t: linear_cross_entropy(t, w, b, target)[0], x),
    ]


@pytest.mark.parametrize("name, fn, t", _cases(), ids=[c[0] for c in _cases()])
def test_jvp_raises(name, fn, t):
    with pytest.raises(NotImplementedError, match=f"{name}: forward-mode AD"):
        torch.func.jvp(fn, (t,), (torch.randn_like(t),))
    with pytest.raises(NotImplementedError, match=f"{name}: forward-mode AD"):
        torch.func.jacfwd(fn)(t)


@pytest.mark.parametrize("name, fn, t", _cases(), ids=[c[0] for c in _cases()])
def test_dual_tensors_raise(name, fn, t):
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(t, torch.randn_like(t))
        with pytest.raises(NotImplementedError, match=f"{name}: forward-mode AD"):
            fn(dual)
        # inside a dual level, inputs without a tangent are ordinary inputs, reverse mode included
        leaf = t.clone().requires_grad_()
        (grad,) = torch.autograd.grad(fn(leaf).float().sum(), leaf)
    leaf = t.clone().requires_grad_()
    (expected,) = torch.autograd.grad(fn(leaf).float().sum(), leaf)
    torch.testing.assert_close(grad, expected)
