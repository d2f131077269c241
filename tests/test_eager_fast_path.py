"""The eager fast path (flash_backend/ops/_eager.py): when it applies, and that it computes exactly what the
registered ops compute."""

import pytest
import torch

from flash_backend import config
from flash_backend.ops._eager import direct_call_ok
from flash_backend.ops.add_dropout_norm import add_dropout_norm
from flash_backend.ops.attention import flash_attention


def test_plain_tensors_take_the_fast_path():
    x = torch.randn(2, 3)
    assert direct_call_ok(x, None, torch.nn.Parameter(torch.randn(3)), device_type="cpu")
    assert not direct_call_ok(x)  # CPU tensors run the reference through the op


def test_switch_turns_it_off(monkeypatch):
    monkeypatch.setattr(config, "eager_direct_calls", False)
    assert not direct_call_ok(torch.randn(2), device_type="cpu")


def test_traced_or_transformed_calls_stay_on_the_op():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.randn(2, 3))
        assert not direct_call_ok(fake, device_type="cpu")

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Spy():
        assert not direct_call_ok(torch.randn(2), device_type="cpu")

    seen = []
    torch.func.vmap(lambda t: seen.append(direct_call_ok(t, device_type="cpu")) or t)(torch.randn(3, 2))
    assert seen == [False]

    @torch.compile(backend="eager", fullgraph=True)
    def compiled(t):
        return t * 2 if direct_call_ok(t, device_type="cpu") else t * 3

    t = torch.randn(2)
    torch.testing.assert_close(compiled(t), t * 3)


def _grads(fn, inputs):
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.manual_seed(123)
    loss = sum((o.float() * torch.randn_like(o, dtype=torch.float32)).sum() for o in outs)
    grads = torch.autograd.grad(loss, [t for t in inputs if t.requires_grad])
    return [o.detach() for o in outs], list(grads)


def _same_both_paths(monkeypatch, fn, inputs):
    results = []
    for direct in (True, False):
        monkeypatch.setattr(config, "eager_direct_calls", direct)
        torch.manual_seed(0)  # the dropout seed: both paths draw the same one
        results.append(_grads(fn, inputs))
    (outs_a, grads_a), (outs_b, grads_b) = results
    for a, b in zip(outs_a + grads_a, outs_b + grads_b, strict=True):
        assert torch.equal(a, b)


@pytest.mark.cuda
def test_cuda_attention_fast_path_equals_op(monkeypatch):
    q = torch.randn(2, 4, 77, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 2, 93, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 2, 93, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(2, 1, 77, 93, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    _same_both_paths(monkeypatch, lambda q, k, v, b: flash_attention(q, k, v, attn_mask=b, dropout_p=0.2),
                     [q, k, v, bias])
    _same_both_paths(monkeypatch, lambda q, k, v: flash_attention(q, k, v, is_causal=True), [q, k, v])


@pytest.mark.cuda
def test_cuda_norm_fast_path_equals_op(monkeypatch):
    x = torch.randn(37, 1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn_like(x, requires_grad=True)
    w = torch.randn(1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    _same_both_paths(monkeypatch, lambda x, r, w, b: add_dropout_norm(x, r, w, b, dropout_p=0.1,
                                                                      return_residual=True), [x, r, w, b])
    _same_both_paths(monkeypatch, lambda x, w: add_dropout_norm(x, None, w, is_rms_norm=True), [x, w])


@pytest.mark.interpret
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU-only machines")
@pytest.mark.parametrize("used", ["out", "residual_out", "both"])
def test_norm_fast_path_grads_when_an_output_is_unused(monkeypatch, used):
    # The fast path's Function does not materialise zero grads for unused outputs (set_materialize_grads):
    # its backward must still give what the registered op's autograd gives with zero-filled ones.
    import flash_backend.ops.add_dropout_norm as adn

    x, r = torch.randn(5, 40, requires_grad=True), torch.randn(5, 40, requires_grad=True)
    w, b = torch.randn(40, requires_grad=True), torch.randn(40, requires_grad=True)
    g_out, g_res = torch.randn(5, 40), torch.randn(5, 40)
    results = []
    for direct in (True, False):
        monkeypatch.setattr(adn, "direct_call_ok", lambda *t, direct=direct: direct)
        out, h = add_dropout_norm(x, r, w, b, dropout_p=0.0, return_residual=True)
        loss = {"out": (out * g_out).sum(), "residual_out": (h * g_res).sum(),
                "both": (out * g_out).sum() + (h * g_res).sum()}[used]
        results.append(torch.autograd.grad(loss, (x, r, w, b), allow_unused=True))
    for fast, op in zip(*results, strict=True):
        if op is None or fast is None:
            assert fast is None or not fast.any()
            assert op is None or not op.any()
        else:
            torch.testing.assert_close(fast, op, atol=1e-5, rtol=1e-5)
