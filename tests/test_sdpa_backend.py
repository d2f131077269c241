"""flash_backend.sdpa: the SDPA backend registration, its overrides of the fused SDPA kernels, and on CUDA
that F.scaled_dot_product_attention then runs the flash op (eager and compiled) and matches PyTorch's."""

import logging
import math
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.attention as attention
import torch.nn.functional as F

import flash_backend.sdpa as sdpa

_FUSED_OPS = sdpa._FORWARD_OPS + sdpa._BACKWARD_OPS


def _cuda_kernel_is_ours(op: str) -> bool:
    dump = torch._C._dispatch_dump(f"aten::{op}")
    line = next((ln for ln in dump.splitlines() if ln.startswith("CUDA:")), "")
    return "flash_backend/sdpa.py" in line


@pytest.fixture
def restored():
    """Whatever a test activates is given back."""
    yield
    sdpa.deactivate()


def test_registered_and_not_active_on_import():
    code = textwrap.dedent(
        """
        import torch, torch.nn.attention as attention
        import flash_backend, flash_backend.sdpa
        assert "flash_backend" in attention.list_flash_attention_impls()
        assert attention.current_flash_attention_impl() is None
        dump = torch._C._dispatch_dump("aten::_scaled_dot_product_flash_attention")
        assert "flash_backend" not in dump, dump
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


def test_activate_restore_round_trip(restored):
    assert not any(_cuda_kernel_is_ours(op) for op in _FUSED_OPS)
    for _ in range(2):
        attention.activate_flash_attention_impl("flash_backend")
        assert attention.current_flash_attention_impl() == "flash_backend" and sdpa.is_active()
        assert all(_cuda_kernel_is_ours(op) for op in _FUSED_OPS)
        sdpa.deactivate()  # restore_flash_attention_impl where torch has it
        assert attention.current_flash_attention_impl() is None and not sdpa.is_active()
        assert not any(_cuda_kernel_is_ours(op) for op in _FUSED_OPS)


def test_unsupported_reasons():
    q = torch.randn(2, 4, 16, 64, dtype=torch.bfloat16)
    assert sdpa.unsupported_reason(q, q, q) is None
    assert "dtype" in sdpa.unsupported_reason(q.float(), q.float(), q.float())
    assert "dropout" in sdpa.unsupported_reason(q, q, q, dropout_p=0.1)
    q12 = torch.randn(2, 4, 16, 12, dtype=torch.bfloat16)
    assert "head_dim" in sdpa.unsupported_reason(q12, q12, q12)
    assert "attn_bias" in sdpa.unsupported_reason(q, q, q, torch.randn(3, 4, 16, 16, dtype=torch.bfloat16))


# --------------------------------------------------------------------------------------------------------
# The override functions themselves, on CPU tensors (the flash op runs its reference): each must return
# what the aten op's meta function allocates (shapes, strides, dtypes), with SDPA's numbers.
# --------------------------------------------------------------------------------------------------------


def _inputs(B=2, H=4, S=24, D=32, dtype=torch.bfloat16):
    q, k, v = (torch.randn(B, S, H, D, dtype=dtype).transpose(1, 2) for _ in range(3))  # BSHD memory
    return q, k, v


def _meta(t):
    return t.to("meta") if isinstance(t, torch.Tensor) else t


def _assert_like_meta(ours, meta):
    for a, m in zip(ours, meta, strict=True):
        if isinstance(m, torch.Tensor):
            assert a.shape == m.shape and a.dtype == m.dtype, (a.shape, m.shape, a.dtype, m.dtype)
            if a.numel() > 1:
                assert a.stride() == m.stride(), (a.stride(), m.stride())


def _reference(q, k, v, mask=None, is_causal=False):
    return F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, is_causal=is_causal
    )


_KEYSET = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)


@pytest.mark.parametrize("is_causal", [False, True])
def test_flash_override_matches_aten_contract(is_causal):
    q, k, v = _inputs()
    out = sdpa._flash_fwd(_KEYSET, q, k, v, 0.0, is_causal, False)
    meta = torch.ops.aten._scaled_dot_product_flash_attention(*map(_meta, (q, k, v)), 0.0, is_causal)
    _assert_like_meta([out[0], out[1]], [meta[0], meta[1]])
    torch.testing.assert_close(out[0].float(), _reference(q, k, v, is_causal=is_causal), atol=2e-2, rtol=2e-2)
    go = torch.randn_like(out[0])
    grads = sdpa._flash_bwd(
        _KEYSET, go, q, k, v, out[0], out[1], None, None, 24, 24, 0.0, is_causal, out[6], out[7]
    )
    _assert_like_meta(grads, (torch.empty_like(_meta(t)) for t in (q, k, v)))
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    _reference(qr, kr, vr, is_causal=is_causal).backward(go.float())
    for g, r in zip(grads, (qr.grad, kr.grad, vr.grad), strict=True):
        torch.testing.assert_close(g.float(), r, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("bias_kind", [None, "float", "broadcast"])
def test_efficient_override_matches_aten_contract(bias_kind):
    q, k, v = _inputs()
    bias = {
        None: None,
        "float": torch.randn(2, 4, 24, 24, dtype=torch.bfloat16),
        "broadcast": torch.randn(2, 1, 1, 24, dtype=torch.bfloat16).expand(2, 4, 24, 24),
    }[bias_kind]
    out, lse, seed, offset = sdpa._efficient_fwd(_KEYSET, q, k, v, bias, True, 0.0, False)
    meta = torch.ops.aten._scaled_dot_product_efficient_attention(
        *map(_meta, (q, k, v, bias)), True, 0.0, False
    )
    _assert_like_meta([out, lse], meta[:2])
    mask = None if bias is None else bias.float()
    torch.testing.assert_close(out.float(), _reference(q, k, v, mask), atol=2e-2, rtol=2e-2)
    go = torch.randn_like(out)
    grad_mask = [True, True, True, bias is not None]
    grads = sdpa._efficient_bwd(_KEYSET, go, q, k, v, bias, out, lse, seed, offset, 0.0, grad_mask, False)
    meta_grads = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        *map(_meta, (go, q, k, v, bias, out, lse, seed, offset)), 0.0, grad_mask, False
    )
    _assert_like_meta([g for g in grads if g is not None], [m for m in meta_grads if m is not None])
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    _reference(qr, kr, vr, mask).backward(go.float())
    for g, r in zip(grads[:3], (qr.grad, kr.grad, vr.grad), strict=True):
        torch.testing.assert_close(g.float(), r, atol=5e-2, rtol=5e-2)


def test_cudnn_override_matches_aten_contract():
    q, k, v = _inputs()
    out = sdpa._cudnn_fwd(_KEYSET, q, k, v, None, True, 0.0, True, False)
    meta = torch.ops.aten._scaled_dot_product_cudnn_attention(
        *map(_meta, (q, k, v)), None, True, 0.0, True, False
    )
    _assert_like_meta(out[:2], meta[:2])
    torch.testing.assert_close(out[0].float(), _reference(q, k, v, is_causal=True), atol=2e-2, rtol=2e-2)
    go = torch.randn_like(out[0])
    grads = sdpa._cudnn_bwd(
        _KEYSET, go, q, k, v, out[0], out[1], out[6], out[7], None, None, None, 24, 24, 0.0, True
    )
    _assert_like_meta(grads, (torch.empty_like(_meta(t)) for t in (q, k, v)))


# --------------------------------------------------------------------------------------------------------
# CUDA: SDPA runs the flash op once activated, in eager and compiled code, and matches PyTorch's default
# --------------------------------------------------------------------------------------------------------


def _cuda_case(case, dtype=torch.bfloat16):
    B, H, S, D = 4, 8, 1000, 64
    Hkv = 2 if case == "gqa" else H
    q = torch.randn(B, H, S, D, device="cuda", dtype=dtype)
    k, v = (torch.randn(B, Hkv, S, D, device="cuda", dtype=dtype) for _ in range(2))
    kwargs = {}
    if case == "causal":
        kwargs["is_causal"] = True
    elif case == "bool_mask":
        lengths = torch.randint(S // 2, S + 1, (B,), device="cuda")
        kwargs["attn_mask"] = (torch.arange(S, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]
    elif case == "float_mask":
        kwargs["attn_mask"] = torch.randn(B, 1, S, S, device="cuda", dtype=dtype)
    elif case == "gqa":
        kwargs["enable_gqa"] = True
    return (q, k, v), kwargs


def _fwd_bwd(fn, args, kwargs, grad=None):
    args = [a.detach().clone().requires_grad_() for a in args]
    out = fn(*args, **kwargs)
    grad = torch.randn_like(out) if grad is None else grad
    out.backward(grad)
    return out.detach(), [a.grad for a in args], grad


def _bound(ours, default, reference):
    """Our error against fp32 at most ~2x PyTorch's own low-precision error, plus a floor."""
    err_ours = (ours.float() - reference).abs().max().item()
    err_default = (default.float() - reference).abs().max().item()
    assert err_ours <= 2 * err_default + 1e-2, (err_ours, err_default)


@pytest.mark.cuda
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", ["plain", "causal", "bool_mask", "float_mask", "gqa"])
def test_cuda_sdpa_runs_flash_and_matches_default(case, compiled, restored):
    torch._dynamo.reset()
    args, kwargs = _cuda_case(case)
    fn = torch.compile(F.scaled_dot_product_attention) if compiled else F.scaled_dot_product_attention
    default_out, default_grads, grad = _fwd_bwd(fn, args, kwargs)
    attention.activate_flash_attention_impl("flash_backend")
    torch._dynamo.reset()
    fn = torch.compile(F.scaled_dot_product_attention) if compiled else F.scaled_dot_product_attention
    out, grads, _ = _fwd_bwd(fn, args, kwargs, grad)
    assert sdpa.calls["flash"] >= 2, sdpa.calls  # forward and backward
    assert sdpa.calls["fallback"] == 0, sdpa.calls
    ref_args = [a.detach().float().requires_grad_() for a in args]
    ref_kwargs = dict(kwargs)
    if "attn_mask" in ref_kwargs and ref_kwargs["attn_mask"].is_floating_point():
        ref_kwargs["attn_mask"] = ref_kwargs["attn_mask"].float()
    ref = F.scaled_dot_product_attention(*ref_args, **ref_kwargs)
    ref.backward(grad.float())
    _bound(out, default_out, ref.detach())
    for g, d, r in zip(grads, default_grads, ref_args, strict=True):
        _bound(g, d, r.grad)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "FLASH_ATTENTION"])
def test_cuda_every_fused_choice_is_overridden(backend, restored):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    args, kwargs = _cuda_case("causal")
    # Only PyTorch's own kernel may justify a skip: a torch built without this backend, or a GPU it does
    # not support, has no such choice to override. SDPA then raises "No available kernel"; any other error
    # is a failure, and once ours is active every error is.
    try:
        with sdpa_kernel(getattr(SDPBackend, backend)):
            _fwd_bwd(F.scaled_dot_product_attention, args, kwargs)
    except RuntimeError as e:
        if "No available kernel" not in str(e):
            raise
        pytest.skip(f"this torch has no usable {backend} kernel on this GPU, so no choice to override: {e}")
    attention.activate_flash_attention_impl("flash_backend")
    with sdpa_kernel(getattr(SDPBackend, backend)):
        out, grads, _ = _fwd_bwd(F.scaled_dot_product_attention, args, kwargs)
    assert sdpa.calls["flash"] == 2, sdpa.calls
    ref = F.scaled_dot_product_attention(*(a.float() for a in args), **kwargs)
    assert (out.float() - ref).abs().max().item() < 2e-2


@pytest.mark.cuda
def test_cuda_unsupported_input_falls_back_and_logs_once(restored, caplog):
    args, kwargs = _cuda_case("plain")
    attention.activate_flash_attention_impl("flash_backend")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with caplog.at_level(logging.INFO, logger="flash_backend"), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for _ in range(3):
            torch.manual_seed(0)
            out = F.scaled_dot_product_attention(*args, dropout_p=0.2)
    assert sdpa.calls["fallback"] == 3 and sdpa.calls["flash"] == 0
    assert sum("dropout" in r.getMessage() for r in caplog.records) == 1
    assert torch.isfinite(out).all()


@pytest.mark.cuda
def test_cuda_restore_gives_pytorch_back(restored):
    args, kwargs = _cuda_case("causal")
    attention.activate_flash_attention_impl("flash_backend")
    F.scaled_dot_product_attention(*args, **kwargs)
    assert sdpa.calls["flash"] == 1
    sdpa.deactivate()
    F.scaled_dot_product_attention(*args, **kwargs)
    assert sdpa.calls["flash"] == 1


@pytest.mark.cuda
def test_cuda_transformers_model_with_sdpa_backend(restored):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=256,
        n_head=4,
        vocab_size=1000,
        n_positions=256,
        attn_implementation="sdpa",
        attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(cfg).cuda().to(torch.bfloat16)
    ids = torch.randint(0, 1000, (2, 256), device="cuda")
    ref = model(input_ids=ids, labels=ids).loss
    attention.activate_flash_attention_impl("flash_backend")
    loss = model(input_ids=ids, labels=ids).loss
    assert sdpa.calls["flash"] >= 2
    assert math.isclose(loss.item(), ref.item(), rel_tol=2e-2)
