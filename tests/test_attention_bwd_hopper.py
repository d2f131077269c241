"""The Gluon attention backward for Hopper (flash_backend/kernels/attention_bwd_hopper.py).

CPU: the kernel compiles for sm_90 (Gluon has no interpreter) and which calls flash::attention_backward
routes to it (fake CUDA tensors). GPU: dq, dk, dv against the fp32 reference on awkward sizes and layouts,
every element written, the routing of real calls (deterministic algorithms keep the Triton backward),
opcheck.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
import triton
from test_attention_hopper import _cuda_qkv, _fake_qkv, _routed
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.library import opcheck

import flash_backend
from flash_backend.kernels import attention_bwd_hopper as hopper_bwd
from flash_backend.kernels import attention_fwd_hopper as hopper_fwd
from flash_backend.ops import attention as attention_ops
from flash_backend.ops.attention import attention_reference, flash_attention

# ---------------------------------------------------------------------------------------------- CPU

# sm_90 ptxas's spill stores at the routed configs (bytes): at head_dim 128 the consumers' dK and dV
# accumulators (128 registers a thread) leave a few scalars to spill, loaded once an iteration (96 bytes,
# 124 causal); at head_dim 64 BLOCK_M 128's S^T and dP^T (64 registers each) do (192, 252 causal, 300 with a
# padding mask); what the H200 ran (bench/logs/attention_bwd_peel_s33_h200.log). A change that spills more
# fails here. Head_dim
# 256 (kernels/attention_bwd_hopper_256.py) keeps dK / dV for half of head_dim, 128 registers a thread too.
SPILL_LIMIT = {64: 256, 128: 256, 256: 256}


@pytest.mark.parametrize(("head_dim", "causal", "dtype"), [(128, True, "bf16"), (64, False, "fp16"),
                                                           (64, True, "bf16"), (256, True, "bf16"),
                                                           (256, False, "fp16")])
def test_kernel_compiles_for_sm90(head_dim, causal, dtype):
    """The warp-specialised kernel lowers to sm_90 machine code with wgmma, register reallocation, TMA loads
    and TMA's reduce-add (dQ) in it, in shared memory's limit."""
    if not hopper_bwd.GLUON_AVAILABLE:
        pytest.skip("this Triton has no Gluon Hopper API: every call takes the Triton backward")
    kernel = hopper_bwd.compile_sm90(head_dim, dtype, causal)
    ptx = kernel.asm["ptx"]
    for instruction in ("wgmma.mma_async", "setmaxnreg.inc", "cp.async.bulk.tensor",
                        "cp.reduce.async.bulk.tensor"):
        assert instruction in ptx, instruction
    assert kernel.metadata.shared <= 227 * 1024
    spills, report = _ptxas_spills(ptx)
    assert spills <= SPILL_LIMIT[head_dim], report


def _ptxas_spills(ptx: str) -> tuple[int, str]:
    """Bytes of spill stores ptxas reports for this PTX at sm_90a, and its report."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        ptx_file = Path(tmp) / "k.ptx"
        ptx_file.write_text(ptx)
        command = [str(ptxas), "-v", "-arch=sm_90a", str(ptx_file), "-o", str(Path(tmp) / "k.cubin")]
        report = subprocess.run(command, capture_output=True, text=True, check=True).stderr
    return int(re.search(r"(\d+) bytes spill stores", report).group(1)), report


@pytest.mark.parametrize("head_dim", [64, 128])
def test_staggered_kernel_compiles_for_sm90(head_dim):
    """The variant whose CTAs start at a query block of their own (STAGGER: non-causal calls from
    STAGGER_MIN_SEQ_K keys) lowers to sm_90 code within shared memory and the spill limit too."""
    if not hopper_bwd.GLUON_AVAILABLE:
        pytest.skip("this Triton has no Gluon Hopper API: every call takes the Triton backward")
    kernel = hopper_bwd.compile_sm90(head_dim, "bf16", False, stagger=True)
    assert kernel.metadata.shared <= 227 * 1024
    spills, report = _ptxas_spills(kernel.asm["ptx"])
    assert spills <= SPILL_LIMIT[head_dim], report


ROUTING = {
    # name: (tensor kwargs, call kwargs, routed to the Gluon backward)
    "plain": ({}, {}, True),
    "causal": ({}, dict(window_right=0), True),
    "causal_sq_ne_sk_top_left": (dict(Sq=4096, Sk=1500), dict(window_right=0), True),
    "causal_bottom_right_square": ({}, dict(window_right=0, bottom_right=True), True),
    "causal_bottom_right_sq_ne_sk": (dict(Sq=2000, Sk=3000), dict(window_right=0, bottom_right=True), False),
    "gqa": (dict(H=8, Hkv=2), {}, True),
    "bshd_layout": (dict(bshd=True), dict(window_right=0), True),
    "fp16": (dict(dtype=torch.float16), {}, True),
    "head_dim_64": (dict(D=64), dict(window_right=0), True),
    "head_dim_64_causal_short_q": (dict(D=64, B=16, Sq=1024, Sk=1024), dict(window_right=0), False),
    "head_dim_64_short_q": (dict(D=64, B=16, Sq=1024, Sk=1024), {}, True),
    "deterministic": ({}, dict(deterministic=True), False),  # dQ is added with TMA reduce-add
    "small_problem": (dict(B=1, H=4, Hkv=4, Sq=1000, Sk=1000), {}, False),  # host-bound: MIN_SCORES
    "fp32": (dict(dtype=torch.float32), {}, False),
    "head_dim_256": (dict(D=256), {}, True),  # a kernel of its own: the warpgroups split head_dim
    "head_dim_256_causal_gqa": (dict(D=256, H=8, Hkv=2), dict(window_right=0), True),
    "head_dim_96": (dict(D=96), {}, False),
    "dropout": ({}, dict(dropout_p=0.1), False),
    "window": ({}, dict(window_left=64), False),
    "right_window": ({}, dict(window_right=16), False),
    "mask": ({}, dict(attn_mask="bool"), False),
    "too_many_heads_for_the_grid": (dict(B=70000, H=1, Hkv=1, Sq=64, Sk=64), {}, False),
}


@pytest.mark.parametrize("case", list(ROUTING))
def test_routing_to_the_hopper_backward(case, monkeypatch):
    """hopper_backward_supported takes exactly the calls the kernel computes; the rest keep the Triton
    backward, which is also the deterministic one."""
    tensor_kw, call_kw, routed = ROUTING[case]
    monkeypatch.setattr(hopper_fwd, "_is_sm90", lambda index: True)
    call_kw = dict(deterministic=False) | call_kw
    assert _routed(hopper_bwd.hopper_backward_supported, tensor_kw, call_kw) is routed


def test_routing_needs_tma_strides(monkeypatch):
    """Inputs TMA cannot describe stay on the Triton backward: a broadcast (expanded, stride-0) head dim of
    k, a row stride that is not 16-byte aligned."""
    monkeypatch.setattr(hopper_fwd, "_is_sm90", lambda index: True)
    kw = dict(attn_mask=None, dropout_p=0.0, window_left=-1, window_right=-1, bottom_right=False,
              deterministic=False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = _fake_qkv()
        assert hopper_bwd.hopper_backward_supported(q, k, v, **kw)
        expanded = torch.empty(8, 1, 2048, 128, device="cuda", dtype=torch.bfloat16).expand(8, 16, 2048, 128)
        assert not hopper_bwd.hopper_backward_supported(q, expanded, v, **kw)
        odd_rows = torch.empty_strided(q.shape, (16 * 2048 * 131, 2048 * 131, 131, 1), device="cuda",
                                       dtype=torch.bfloat16)
        assert not hopper_bwd.hopper_backward_supported(q, k, odd_rows, **kw)


def test_backward_body_calls_the_opaque_hopper_op(monkeypatch):
    """flash::attention_backward's body (what Inductor traces) runs the Gluon backward as the opaque op
    flash::attention_backward_hopper, whose fake allocates dq, dk, dv like the inputs (the (B, S, H, D)
    layout kept), as the Triton path and the registered fake do."""
    from torch.utils._python_dispatch import TorchDispatchMode

    monkeypatch.setattr(hopper_fwd, "_is_sm90", lambda index: True)
    seen = []

    class RecordOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = _fake_qkv(H=8, Hkv=2, bshd=True)
        out, dout = torch.empty_like(q), torch.empty_like(q)
        lse = torch.empty(q.shape[:3], device="cuda")
        with RecordOps():
            dq, dk, dv, dbias = attention_ops._attention_backward_impl(
                dout, q, k, v, out, lse, None, None, 0.0, 128 ** -0.5, -1, 0, False, False, False)
    assert "flash.attention_backward_hopper.default" in seen
    assert dq.stride() == q.stride() and dk.stride() == k.stride() and dv.shape == v.shape
    assert dbias.numel() == 0


@pytest.mark.parametrize("scale", [0.0, -0.125])
def test_a_scale_that_is_not_positive_keeps_the_triton_backward(scale, monkeypatch):
    """The Gluon backward's products start from -logsumexp / scale: a scale <= 0 is routed to the Triton
    backward, and the launcher refuses it before any kernel runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    monkeypatch.setattr(hopper_fwd, "_is_sm90", lambda index: True)
    # past the Gluon routing, the Triton launch (which fake tensors cannot run) stands aside too
    monkeypatch.setattr(attention_ops, "_kernel_supports", lambda *args: False)
    seen = []

    class RecordOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    for s in (scale, 128 ** -0.5):  # and a positive one, which takes the Gluon backward
        seen.clear()
        with FakeTensorMode(allow_non_fake_inputs=True):
            q, k, v = _fake_qkv()
            out, dout = torch.empty_like(q), torch.empty_like(q)
            lse = torch.empty(q.shape[:3], device="cuda")
            with RecordOps():
                attention_ops._attention_backward_impl(dout, q, k, v, out, lse, None, None, 0.0, s, -1, -1,
                                                       False, False, False)
        assert ("flash.attention_backward_hopper.default" in seen) is (s > 0), (s, seen)
    q, lse = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16), torch.zeros(1, 2, 64)
    grads = (torch.empty_like(q),) * 3
    with pytest.raises(ValueError, match="scale must be > 0"):
        hopper_bwd.attention_backward_hopper_launch(q, q, q, q, q, lse, scale, False, *grads)


def test_routing_off_on_other_gpus(monkeypatch):
    monkeypatch.setattr(hopper_fwd, "_is_sm90", lambda index: False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = _fake_qkv()
        assert not hopper_bwd.hopper_backward_supported(q, k, v, None, 0.0, -1, -1, False, False)


# ------------------------------------------------------------------------------------------- GPU

_HAS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(not (_HAS_HOPPER and hopper_bwd.GLUON_AVAILABLE),
                                  reason="needs an sm_90 GPU and Gluon")

CUDA_CASES = {
    # name: (B, H, Hkv, Sq, Sk, D, causal, bshd)
    "square_odd": (2, 4, 4, 1000, 1000, 128, False, False),
    "causal_odd": (2, 4, 4, 1000, 1000, 128, True, False),
    "tiny": (1, 3, 3, 97, 97, 128, True, False),
    "one_row_one_key": (1, 2, 2, 1, 1, 128, False, False),
    "long_q_short_k": (2, 4, 4, 700, 129, 128, False, False),
    # key blocks past the last query: no query block, dK = dV = 0 written
    "short_q_long_k_causal_top_left": (2, 4, 4, 300, 3000, 128, True, False),
    "long_q_short_k_causal_top_left": (1, 4, 4, 3000, 300, 128, True, False),
    "gqa_causal": (2, 8, 2, 640, 640, 128, True, False),
    "bshd_causal": (2, 4, 4, 777, 777, 128, True, True),
    "d64_odd": (2, 4, 4, 1000, 1000, 64, False, False),
    "d64_causal_odd_gqa": (2, 6, 2, 517, 517, 64, True, False),
    "d64_sq_ne_sk_bshd": (2, 4, 4, 97, 3000, 64, False, True),
    # from SHORT_SEQ_Q query rows head_dim 64 takes BLOCK_M 128
    "d64_long_odd_gqa": (1, 4, 2, 1500, 1300, 64, False, False),
    "d64_long_causal_odd_bshd": (1, 4, 4, 2100, 2100, 64, True, True),
    "d64_long_q_short_k_causal_top_left": (1, 2, 2, 3000, 300, 64, True, False),
    # causal GQA: each head of the group starts with its diagonal blocks (masked), then the rest (not)
    "d64_long_causal_odd_gqa": (1, 4, 2, 1100, 1100, 64, True, False),
    "gqa4_causal_odd": (1, 8, 2, 333, 333, 128, True, False),
    # from STAGGER_MIN_SEQ_K keys the non-causal CTAs start at a query block of their own, going round
    "d128_staggered_short_q_gqa": (1, 4, 2, 300, 4200, 128, False, False),
    "d64_staggered_odd_bshd": (1, 2, 2, 4100, 4100, 64, False, True),
    "d256_odd": (2, 4, 4, 1000, 1000, 256, False, False),
    "d256_causal_odd_gqa": (2, 6, 2, 517, 517, 256, True, False),
    "d256_sq_ne_sk_bshd": (2, 4, 4, 97, 3000, 256, False, True),
    "d256_short_q_long_k_causal_top_left": (2, 4, 4, 300, 3000, 256, True, False),
    "d256_one_row_one_key": (1, 2, 2, 1, 1, 256, True, False),
}


def _reference_grads(q, k, v, dout, causal, upcast):
    xs = [t.detach().float() if upcast else t.detach() for t in (q, k, v)]
    xs = [t.requires_grad_() for t in xs]
    out, _ = attention_reference(*xs, None, None, 0.0, None, -1, 0 if causal else -1, False, upcast=upcast)
    return torch.autograd.grad(out, xs, dout.float() if upcast else dout)


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(CUDA_CASES))
def test_cuda_hopper_backward_matches_reference(case, dtype):
    """dq, dk, dv within 2x PyTorch's own low-precision error of the fp32 reference (plus a floor), every
    element written (poisoned with NaN first), in the inputs' layouts."""
    B, H, Hkv, Sq, Sk, D, causal, bshd = CUDA_CASES[case]
    q, k, v = _cuda_qkv(B, H, Hkv, Sq, Sk, D, dtype, bshd)
    scale = D ** -0.5
    out, lse = attention_ops._alloc_forward(q, v)
    hopper_fwd.attention_forward_hopper_launch(q, k, v, scale, causal, out, lse,
                                               config=(128, 2, True, 2) if D == 64 else None)
    dout = torch.randn_like(out)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    hopper_bwd.attention_backward_hopper_launch(dout, q, k, v, out, lse, scale, causal, dq, dk, dv)
    want = _reference_grads(q, k, v, dout, causal, upcast=True)
    low = _reference_grads(q, k, v, dout, causal, upcast=False)
    floor = 2e-3 if dtype == torch.float16 else 1e-2
    for name, got, ref, lowp in zip(("dq", "dk", "dv"), (dq, dk, dv), want, low, strict=True):
        assert torch.isfinite(got).all(), f"{name}: not every element written"
        err = (got.float() - ref).abs().max().item()
        err_low = (lowp.float() - ref).abs().max().item()
        assert err <= 2 * err_low + floor, f"{name}: err {err:.3g} vs torch low precision {err_low:.3g}"
    if bshd:
        assert dk.stride() == k.stride() and dq.stride() == q.stride()


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cuda_causal_launch_orders_agree(head_dim):
    """Causal launches in groups of rows (attention_fwd_hopper._heaviest_first) compute every key block as
    the plain order does: dK and dV bitwise the same for groups of 1 (kv) row, of 4 (6 rows, GQA: the last
    group short) and of all 6, dQ within its reduce-adds' reordering, every element written."""
    q, k, v = _cuda_qkv(2, 6, 3, 1000, 1000, head_dim, torch.bfloat16, False)
    scale = head_dim ** -0.5
    out, lse = attention_ops._alloc_forward(q, v)
    hopper_fwd.attention_forward_hopper_launch(q, k, v, scale, True, out, lse)
    dout = torch.randn_like(out)
    results = []
    for rows_per_group in (1, 4, 6):
        grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
        hopper_bwd.attention_backward_hopper_launch(dout, q, k, v, out, lse, scale, True, *grads,
                                                    rows_per_group=rows_per_group)
        assert all(torch.isfinite(g).all() for g in grads)
        results.append(grads)
    (dq1, dk1, dv1) = results[0]
    for dq, dk, dv in results[1:]:
        assert torch.equal(dk, dk1) and torch.equal(dv, dv1)
        torch.testing.assert_close(dq, dq1, atol=1e-2, rtol=1e-2)


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cuda_backward_routing_on_real_calls(head_dim, monkeypatch):
    """Eager backward (the direct path) and the registered op run the Gluon backward on eligible inputs;
    under deterministic algorithms, or with the switch off, the Triton backward runs, within rounding."""
    calls = []
    original = attention_ops._hopper_backward
    monkeypatch.setattr(attention_ops, "_hopper_backward", lambda *a: calls.append(1) or original(*a))
    q, k, v = (t.requires_grad_() for t in _cuda_qkv(4, 16, 4, 2048, 2048, head_dim, torch.bfloat16, False))
    scale = head_dim ** -0.5
    out = flash_attention(q, k, v, is_causal=True)
    dout = torch.randn_like(out)
    gluon_grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    assert len(calls) == 1
    with torch.no_grad():
        _, lse = torch.ops.flash.attention_forward(q, k, v, None, None, 0.0, scale, -1, 0, False)
    op_grads = torch.ops.flash.attention_backward(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse,
                                                  None, None, 0.0, scale, -1, 0, False, False, False)
    assert len(calls) == 2
    torch.use_deterministic_algorithms(True)
    try:
        triton_grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    finally:
        torch.use_deterministic_algorithms(False)
    monkeypatch.setattr(flash_backend.config, "hopper_attention_backward", False)
    switched_off = torch.autograd.grad(out, (q, k, v), dout)
    assert len(calls) == 2
    for gluon, op, tri, off in zip(gluon_grads, op_grads[:3], triton_grads, switched_off, strict=True):
        torch.testing.assert_close(op, gluon, atol=2e-2, rtol=2e-2)  # dQ's additions in another order
        torch.testing.assert_close(tri, gluon, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(off, tri)


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("head_dim", [128, 256])
def test_cuda_hopper_backward_opcheck(head_dim):
    q, k, v = _cuda_qkv(4, 16, 4, 2048, 2048, head_dim, torch.bfloat16, False)  # routed: 2**28 scores
    scale = head_dim ** -0.5
    out, lse = torch.ops.flash.attention_forward(q, k, v, None, None, 0.0, scale, -1, 0, False)
    dout = torch.randn_like(out)
    opcheck(torch.ops.flash.attention_backward_hopper, (dout, q, k, v, out, lse, scale, True))
    opcheck(torch.ops.flash.attention_backward,
            (dout, q, k, v, out, lse, None, None, 0.0, scale, -1, 0, False, False, False))
