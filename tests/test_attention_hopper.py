"""The Gluon attention forward for Hopper (flash_backend/kernels/attention_fwd_hopper.py).

CPU: the kernel compiles for sm_90 (Gluon has no interpreter, so compiling is what CI can check of it), and
which calls flash::attention_forward routes to it (fake CUDA tensors). GPU: its output and logsumexp against
the fp32 reference on awkward sizes and layouts, every output element written, the routing on real calls,
gradients through the shared backward, opcheck, torch.compile.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
import triton
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.library import opcheck

import flash_backend  # noqa: F401
from flash_backend.kernels import attention_fwd_hopper as hopper
from flash_backend.ops import attention as attention_ops
from flash_backend.ops.attention import attention_reference, flash_attention

# ---------------------------------------------------------------------------------------------- CPU


# sm_90 ptxas's spill stores (bytes) where not 0: head_dim 64 causal (three consumers, 160 registers a
# thread) spills one value of the launch order's arithmetic (_heaviest_first), stored and loaded once a CTA
# outside the key loops (nvdisasm: no STL / LDL between a loop's head and its back branch).
SPILL_LIMIT = {(64, True): 8}


@pytest.mark.parametrize(("head_dim", "causal", "dtype", "pingpong"),
                         [(128, True, "bf16", True), (128, False, "fp16", False), (64, True, "bf16", False)])
def test_kernel_compiles_for_sm90(head_dim, causal, dtype, pingpong):
    """The warp-specialised kernel lowers to sm_90 machine code with no spills, wgmma and register
    reallocation in it: what the H200 ran (bench/logs/attention_gluon_probe_h200.log); head_dim 64 causal
    with three consumers and the per-warpgroup block skip (attention_gluon_causal_skip_s25_h200.log)."""
    if not hopper.GLUON_AVAILABLE:
        pytest.skip("this Triton has no Gluon Hopper API: every call takes the Triton forward")
    block_n, stages, _, consumers, raw_scores = hopper.CONFIGS[(head_dim, causal)]
    kernel = hopper.compile_sm90(head_dim, dtype, causal, (block_n, stages, pingpong, consumers, raw_scores))
    spills, report = _sm90_spills(kernel)
    assert spills <= SPILL_LIMIT.get((head_dim, causal), 0), report


def _sm90_spills(kernel):
    """(spill store bytes, ptxas's report) of a kernel compiled by compile_sm90, after checking that it is
    the warp-specialised kernel (wgmma, register reallocation, TMA) and fits shared memory."""
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "setmaxnreg.inc" in ptx and "cp.async.bulk.tensor" in ptx
    assert kernel.metadata.shared <= 227 * 1024
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        ptx_file = Path(tmp) / "k.ptx"
        ptx_file.write_text(ptx)
        command = [str(ptxas), "-v", "-arch=sm_90a", str(ptx_file), "-o", str(Path(tmp) / "k.cubin")]
        report = subprocess.run(command, capture_output=True, text=True, check=True).stderr
    return int(re.search(r"(\d+) bytes spill stores", report).group(1)), report


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_persistent_kernel_compiles_for_sm90(dtype):
    """The persistent variant the routing runs (head_dim 128 non-causal up to PERSISTENT_MAX_SEQ_Q_128 query
    rows) compiles spill-free, its output tiles (o_tiles) within shared memory."""
    if not hopper.GLUON_AVAILABLE:
        pytest.skip("this Triton has no Gluon Hopper API: every call takes the Triton forward")
    config = hopper.routed_config(128, hopper.PERSISTENT_MAX_SEQ_Q_128, False, False)
    assert config[5]
    spills, report = _sm90_spills(hopper.compile_sm90(128, dtype, False, config))
    assert spills == 0, report


@pytest.mark.parametrize(("head_dim", "seq_q", "causal", "has_mask", "persistent"), [
    (128, 2048, False, False, True), (128, 97, False, False, True), (128, 2049, False, False, False),
    (128, 2048, True, False, False), (128, 2048, False, True, False), (64, 2048, False, False, False),
    (256, 2048, False, False, False)])
def test_routed_config_persistent(head_dim, seq_q, causal, has_mask, persistent):
    """Persistent CTAs only where they measured faster: head_dim 128, no causal masking, no mask, up to
    PERSISTENT_MAX_SEQ_Q_128 query rows; the rest of the configuration is CONFIGS', but for RAW_SCORES,
    off with a padding mask (its loops keep their masking inside, where the FMA softmax measured slower)."""
    assert hopper.PERSISTENT_MAX_SEQ_Q_128 == 2048
    config = hopper.routed_config(head_dim, seq_q, causal, has_mask)
    configured = hopper._full_config(hopper.CONFIGS[(head_dim, causal)])
    assert config[:4] == configured[:4]
    assert config[4] is (configured[4] and not has_mask)
    assert config[5] is persistent


def test_persistent_launch_grid(monkeypatch):
    """A persistent launch has one CTA an SM (fewer when there are fewer tiles of 128 query rows), and tells
    the kernel the number of (batch, head) pairs; the others keep the (query blocks, B * H) grid."""
    launches = []

    class Recorder:
        def __init__(self, kernel):
            pass

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, args, kwargs))

    monkeypatch.setattr(hopper, "fast_kernel", Recorder)
    monkeypatch.setattr(hopper, "sm_count", lambda device: 132)
    cases = [  # B, H, Sq, causal, grid, persistent
        (8, 16, 2048, False, (132, 1), True),  # 16 tiles a head: 2048 tiles
        (1, 2, 1000, False, (16, 1), True),  # 8 tiles a head
        (4, 16, 4096, False, (32, 64), False),
        (8, 16, 2048, True, (16, 128), False)]
    for B, H, Sq, causal, grid, persistent in cases:
        q = torch.randn(B, H, Sq, 128, dtype=torch.bfloat16)
        out, lse = torch.empty_like(q), torch.empty(B, H, Sq)
        hopper.attention_forward_hopper_launch(q, q, q, 0.125, causal, out, lse)
        got_grid, args, kwargs = launches.pop()
        assert got_grid == grid and kwargs["PERSISTENT"] is persistent
        assert args[-1] == B * H  # num_bh


@pytest.mark.parametrize("raw_scores", [True, False])
def test_raw_scores_softmax_is_one_fma_an_element(raw_scores):
    """RAW_SCORES (the routed head_dim 64 causal configuration's): exp2's argument s * qk_scale - m is one
    fma an element, no multiply and subtraction; without it, every score is multiplied by qk_scale before
    its row max (LLVM may still contract the subtraction into an fma where no select sits between: the
    blocks between the key edges, since session 32)."""
    if not hopper.GLUON_AVAILABLE:
        pytest.skip("this Triton has no Gluon Hopper API: every call takes the Triton forward")
    config = (*hopper.CONFIGS[(64, True)][:4], raw_scores)
    assert hopper.CONFIGS[(64, True)][4]
    ptx = hopper.compile_sm90(64, "bf16", True, config).asm["ptx"]
    exps = len(re.findall(r"^\s*ex2\.approx", ptx, re.M))
    fmas = len(re.findall(r"^\s*fma\.rn\.f32", ptx, re.M))
    subs = len(re.findall(r"^\s*sub\.f32", ptx, re.M))
    muls = len(re.findall(r"^\s*mul\.f32", ptx, re.M))
    assert exps > 100
    if raw_scores:
        assert fmas >= exps - 20 and subs < 20 and muls < exps // 2, (exps, fmas, subs, muls)
    else:
        assert muls >= exps and fmas + subs >= exps - 20, (exps, fmas, subs, muls)


def test_launch_refuses_a_scale_that_is_not_positive():
    """max(s) * c is max(s * c) only for c > 0: the launcher says so before any kernel runs (the routing
    sends such calls to the Triton forward)."""
    q = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(1, 2, 64)
    for scale in (0.0, -0.125):
        with pytest.raises(ValueError, match="scale must be > 0"):
            hopper.attention_forward_hopper_launch(q, q, q, scale, True, out, lse)


def _fake_qkv(B=8, H=16, Hkv=16, Sq=2048, Sk=2048, D=128, dtype=torch.bfloat16, bshd=False):
    shape_q, shape_kv = (B, H, Sq, D), (B, Hkv, Sk, D)
    if bshd:  # transformers' (B, S, H, D) tensors, transposed for the op
        return (torch.empty(B, Sq, H, D, device="cuda", dtype=dtype).transpose(1, 2),
                torch.empty(B, Sk, Hkv, D, device="cuda", dtype=dtype).transpose(1, 2),
                torch.empty(B, Sk, Hkv, D, device="cuda", dtype=dtype).transpose(1, 2))
    return tuple(torch.empty(shape, device="cuda", dtype=dtype) for shape in (shape_q, shape_kv, shape_kv))


ROUTING = {
    # name: (tensor kwargs, call kwargs, routed to the Gluon forward)
    "plain": ({}, {}, True),
    "causal": ({}, dict(window_right=0), True),
    "causal_sq_ne_sk_top_left": (dict(Sq=4096, Sk=1500), dict(window_right=0), True),
    "causal_bottom_right_square": ({}, dict(window_right=0, bottom_right=True), True),
    "causal_bottom_right_sq_ne_sk": (dict(Sq=2000, Sk=3000), dict(window_right=0, bottom_right=True), False),
    "gqa": (dict(H=8, Hkv=2), {}, True),
    "small_problem": (dict(B=1, H=4, Hkv=4, Sq=1000, Sk=1000), {}, False),  # host-bound: MIN_SCORES
    "head_dim_64_short_q": (dict(D=64, B=64, Sq=1024, Sk=1024), {}, False),  # MIN_SEQ_Q_THREE_CONSUMERS
    "bshd_layout": (dict(bshd=True), dict(window_right=0), True),
    "fp16": (dict(dtype=torch.float16), {}, True),
    "fp32": (dict(dtype=torch.float32), {}, False),
    "head_dim_64": (dict(D=64), {}, True),  # three consumer warpgroups
    "head_dim_64_causal": (dict(D=64), dict(window_right=0), True),
    # MIN_SEQ_Q_CAUSAL_64
    "head_dim_64_causal_short": (dict(D=64, B=16, Sq=1024, Sk=1024), dict(window_right=0), False),
    "head_dim_64_causal_long": (dict(D=64, B=4, Sq=4096, Sk=4096), dict(window_right=0), True),
    "head_dim_256": (dict(D=256), dict(window_right=0), True),
    "head_dim_96": (dict(D=96), {}, False),
    "dropout": ({}, dict(dropout_p=0.1), False),
    "window": ({}, dict(window_left=64), False),
    "right_window": ({}, dict(window_right=16), False),
    "mask": ({}, dict(attn_mask="bool"), False),
    "no_keys": (dict(Sk=0), {}, False),
    "too_many_heads_for_the_grid": (dict(B=70000, H=1, Hkv=1, Sq=64, Sk=64), {}, False),
}


@pytest.mark.parametrize("case", list(ROUTING))
def test_routing_to_the_hopper_forward(case, monkeypatch):
    """hopper_forward_supported takes exactly the calls the kernel computes, from dtypes, shapes and strides
    (what a traced graph and its run both see); everything else keeps the Triton forward."""
    tensor_kw, call_kw, routed = ROUTING[case]
    monkeypatch.setattr(hopper, "_is_sm90", lambda index: True)
    assert _routed(hopper.hopper_forward_supported, tensor_kw, call_kw) is routed


def _routed(predicate, tensor_kw, call_kw):
    """predicate (a routing function) on fake CUDA inputs of _fake_qkv(**tensor_kw), a plain call updated by
    call_kw; attn_mask="bool" stands for a (B, 1, Sq, Sk) boolean mask."""
    call = dict(attn_mask=None, dropout_p=0.0, window_left=-1, window_right=-1, bottom_right=False) | call_kw
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = _fake_qkv(**tensor_kw)
        if call["attn_mask"] == "bool":
            call["attn_mask"] = torch.empty(q.shape[0], 1, q.shape[2], k.shape[2], device="cuda",
                                            dtype=torch.bool)
        return predicate(q, k, v, **call)


def test_routing_needs_tma_strides(monkeypatch):
    """A last dim that is not contiguous, or a row stride that is not 16-byte aligned, is not TMA's: such
    inputs stay on the Triton forward (which takes any strides)."""
    monkeypatch.setattr(hopper, "_is_sm90", lambda index: True)
    kw = dict(attn_mask=None, dropout_p=0.0, window_left=-1, window_right=-1, bottom_right=False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = _fake_qkv()
        assert hopper.hopper_forward_supported(q, k, v, **kw)
        shape = q.shape
        strided_last = torch.empty_strided(shape, (16 * 2048 * 256, 2048 * 256, 256, 2), device="cuda",
                                           dtype=torch.bfloat16)
        assert not hopper.hopper_forward_supported(strided_last, k, v, **kw)
        odd_rows = torch.empty_strided(shape, (16 * 2048 * 131, 2048 * 131, 131, 1), device="cuda",
                                       dtype=torch.bfloat16)
        assert not hopper.hopper_forward_supported(q, odd_rows, v, **kw)
        buffer = torch.empty(q.numel() + 8, device="cuda", dtype=torch.bfloat16)
        offset = buffer.as_strided(shape, v.stride(), 3)
        assert not hopper.hopper_forward_supported(q, k, offset, **kw)
        assert hopper.hopper_forward_supported(q, k, buffer.as_strided(shape, v.stride(), 8), **kw)


def test_routing_under_dynamic_shapes(monkeypatch):
    """Under torch.compile(dynamic=True) the sizes are SymInts: the predicate compares them (guards), it must
    not hash them (a dict lookup on head_dim raised "unhashable type: SymInt" in opcheck's dynamic test)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    monkeypatch.setattr(hopper, "_is_sm90", lambda index: True)
    env = ShapeEnv()

    def symbolic(value, name):
        symbol = env.create_symbol(value, ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC)
        return env.create_symintnode(symbol, hint=value)

    with FakeTensorMode(shape_env=env, allow_non_fake_inputs=True):
        batch, seq, head_dim = symbolic(8, "batch"), symbolic(2048, "seq"), symbolic(128, "head_dim")
        shape = (batch, 16, seq, head_dim)
        q, k, v = (torch.empty(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        assert hopper.hopper_forward_supported(q, k, v, None, 0.0, -1, 0, False)


def test_causal_launch_groups_of_rows(monkeypatch):
    """heaviest_first_rows: the plain order (1) without causal masking; causal, the power of two at or below
    the rows holding `waves` waves of CTAs (132 SMs), at most the grid's rows, at least one row; the
    forward's groups 4 waves, the backward's 1 (attention_causal_order_probe_s28_h200.log)."""
    from flash_backend.kernels import attention_bwd_hopper as hopper_bwd

    monkeypatch.setattr(hopper, "sm_count", lambda device: 132)
    device = torch.device("cuda", 0)
    assert (hopper.HEAVIEST_FIRST_WAVES, hopper_bwd.HEAVIEST_FIRST_WAVES) == (4, 1)
    assert hopper.heaviest_first_rows(16, 128, False, device, 4) == 1
    assert hopper.heaviest_first_rows(16, 128, True, device, 4) == 32  # 528 / 16 = 33 rows
    assert hopper.heaviest_first_rows(16, 128, True, device, 1) == 8  # 132 / 16 = 8.25: 9 rows
    assert hopper.heaviest_first_rows(128, 16, True, device, 4) == 4  # 5 rows
    assert hopper.heaviest_first_rows(36, 15, True, device, 4) == 8  # 15 rows: all of them
    assert hopper.heaviest_first_rows(256, 16, True, device, 1) == 1
    assert hopper.heaviest_first_rows(16, 20, True, device, 4) == 16  # the grid's 20 rows


def test_routing_off_on_other_gpus(monkeypatch):
    monkeypatch.setattr(hopper, "_is_sm90", lambda index: False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = _fake_qkv()
        assert not hopper.hopper_forward_supported(q, k, v, None, 0.0, -1, -1, False)


# ------------------------------------------------------------------------------------------- GPU

_HAS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(not (_HAS_HOPPER and hopper.GLUON_AVAILABLE),
                                  reason="needs an sm_90 GPU and Gluon")

CUDA_CASES = {
    # name: (B, H, Hkv, Sq, Sk, D, causal, bottom_right, bshd)
    "square_odd": (2, 4, 4, 1000, 1000, 128, False, False, False),
    "causal_odd": (2, 4, 4, 1000, 1000, 128, True, False, False),
    "tiny": (1, 3, 3, 97, 97, 128, True, False, False),
    "one_row_one_key": (1, 2, 2, 1, 1, 128, False, False, False),
    "long_q_short_k": (2, 4, 4, 700, 129, 128, False, False, False),
    "short_q_long_k_causal_top_left": (2, 4, 4, 300, 3000, 128, True, False, False),
    "long_q_short_k_causal_top_left": (1, 4, 4, 3000, 300, 128, True, False, False),
    "causal_bottom_right_square": (1, 4, 4, 513, 513, 128, True, True, False),
    "gqa": (2, 8, 2, 640, 640, 128, True, False, False),
    "bshd": (2, 4, 4, 777, 777, 128, True, False, True),
    "d256_odd": (1, 4, 4, 513, 700, 256, False, False, False),
    "d256_causal_gqa": (2, 8, 2, 1000, 1000, 256, True, False, False),
    "d256_bshd_causal_short_q": (1, 4, 4, 300, 701, 256, True, False, True),
    "d64_three_consumers_odd": (2, 4, 4, 1000, 1000, 64, False, False, False),
    "d64_sq_ne_sk_gqa": (2, 8, 2, 97, 3000, 64, False, False, False),
    "d64_bshd": (2, 4, 4, 500, 500, 64, False, False, True),
    # causal: each warpgroup computes only the key blocks its rows see and releases the rest; three
    # consumers of 64 rows against 128-key blocks, odd lengths, Sq != Sk top-left both ways, GQA, (B, S, H, D)
    "d64_causal_odd": (2, 4, 4, 1000, 1000, 64, True, False, False),
    "d64_causal_short_q_long_k": (2, 4, 4, 300, 3000, 64, True, False, False),
    "d64_causal_long_q_short_k": (1, 4, 4, 3000, 300, 64, True, False, False),
    "d64_causal_gqa_bshd": (2, 8, 2, 777, 777, 64, True, False, True),
    # head_dim 128 non-causal up to 2048 query rows runs persistent CTAs (routed_config): fewer tiles than
    # SMs, many tiles a CTA (24 * 12 heads of 8 tiles: 2304 tiles), GQA in (B, S, H, D), Sq != Sk
    "persistent_few_tiles": (1, 2, 2, 300, 300, 128, False, False, False),
    "persistent_many_tiles": (24, 12, 12, 1000, 1000, 128, False, False, False),
    "persistent_gqa_bshd": (2, 8, 2, 1500, 1500, 128, False, False, True),
    "persistent_short_q_long_k": (2, 4, 4, 97, 3000, 128, False, False, False),
}


def _cuda_qkv(B, H, Hkv, Sq, Sk, D, dtype, bshd):
    if bshd:
        return (torch.randn(B, Sq, H, D, device="cuda", dtype=dtype).transpose(1, 2),
                torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype).transpose(1, 2),
                torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype).transpose(1, 2))
    heads_and_lengths = ((H, Sq), (Hkv, Sk), (Hkv, Sk))
    return tuple(torch.randn(B, h, s, D, device="cuda", dtype=dtype) for h, s in heads_and_lengths)


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(CUDA_CASES))
def test_cuda_hopper_forward_matches_reference(case, dtype):
    """out within 2x PyTorch's own low-precision error of the fp32 reference (plus a floor), logsumexp within
    fp32 rounding, every element written (outputs poisoned with NaN first)."""
    B, H, Hkv, Sq, Sk, D, causal, bottom_right, bshd = CUDA_CASES[case]
    q, k, v = _cuda_qkv(B, H, Hkv, Sq, Sk, D, dtype, bshd)
    window_right = 0 if causal else -1
    out, lse = attention_ops._alloc_forward(q, v)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    hopper.attention_forward_hopper_launch(q, k, v, D ** -0.5, causal, out, lse)
    args = (None, None, 0.0, None, -1, window_right, bottom_right)
    ref_out, ref_lse = attention_reference(q, k, v, *args)
    low_out, _ = attention_reference(q, k, v, *args, upcast=False)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    err = (out.float() - ref_out.float()).abs().max().item()
    err_low = (low_out.float() - ref_out.float()).abs().max().item()
    floor = 2e-3 if dtype == torch.float16 else 1e-2
    assert err <= 2 * err_low + floor, f"out err {err:.3g} vs torch low precision {err_low:.3g}"
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-4, rtol=1e-5)
    if bshd:
        assert out.stride() == q.stride()


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize(("B", "H", "Hkv", "Sq", "Sk"), [(3, 7, 7, 3000, 2500), (1, 2, 2, 300, 300),
                                                        (2, 8, 2, 2048, 2048)])
def test_cuda_persistent_forward_agrees_with_the_plain_one(B, H, Hkv, Sq, Sk):
    """Persistent CTAs (PERSISTENT) compute each tile as a CTA a tile does, past the routed lengths too
    (3000 rows): out within a bf16 rounding and the logsumexp within fp32's of the plain launch (checked
    against fp32 above), every element written."""
    q, k, v = _cuda_qkv(B, H, Hkv, Sq, Sk, 128, torch.bfloat16, False)
    results = []
    for persistent in (False, True):
        out, lse = attention_ops._alloc_forward(q, v)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        hopper.attention_forward_hopper_launch(q, k, v, 128 ** -0.5, False, out, lse,
                                               config=(*hopper.CONFIGS[(128, False)][:5], persistent))
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        results.append((out, lse))
    (plain_out, plain_lse), (out, lse) = results
    torch.testing.assert_close(out, plain_out, atol=8e-3, rtol=0)
    torch.testing.assert_close(lse, plain_lse, atol=1e-5, rtol=0)


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cuda_causal_launch_orders_agree(head_dim):
    """Causal launches in groups of rows (_heaviest_first) compute every tile as the plain order does:
    the output and logsumexp bitwise the same for groups of 1 row, of 5 (12 rows: the last group short) and
    of all 12, every element written; the plain order's is checked against fp32 by the tests above."""
    q, k, v = _cuda_qkv(2, 6, 3, 1000, 1000, head_dim, torch.bfloat16, False)
    results = []
    for rows_per_group in (1, 5, 12):
        out, lse = attention_ops._alloc_forward(q, v)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        hopper.attention_forward_hopper_launch(q, k, v, head_dim ** -0.5, True, out, lse,
                                               rows_per_group=rows_per_group)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        results.append((out, lse))
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


@pytest.mark.cuda
@needs_hopper
def test_cuda_calls_take_the_hopper_forward_and_gradients_match(monkeypatch):
    """Eager calls (the direct path) and the registered op both run the Gluon forward on eligible inputs,
    bitwise the same; the switch turns it off; gradients through the shared backward match the reference."""
    calls = []
    original = attention_ops._hopper_forward
    monkeypatch.setattr(attention_ops, "_hopper_forward", lambda *a: calls.append(1) or original(*a))
    # large enough to be routed (MIN_SCORES)
    q, k, v = (t.requires_grad_() for t in _cuda_qkv(4, 16, 4, 2048, 2048, 128, torch.bfloat16, False))
    out = flash_attention(q, k, v, is_causal=True)
    assert len(calls) == 1
    op_out, _ = torch.ops.flash.attention_forward(q.detach(), k.detach(), v.detach(), None, None, 0.0,
                                                  128 ** -0.5, -1, 0, False)
    assert len(calls) == 2
    assert torch.equal(out.detach(), op_out)
    monkeypatch.setattr(flash_backend.config, "hopper_attention_forward", False)
    triton_out = flash_attention(q.detach(), k.detach(), v.detach(), is_causal=True)
    assert len(calls) == 2
    torch.testing.assert_close(triton_out, op_out, atol=2e-2, rtol=0)

    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    xs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_reference(*xs, None, None, 0.0, None, -1, 0, False)
    ref_grads = torch.autograd.grad(ref, xs, dout.float())
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        rel = ((got.float() - want).norm() / want.norm()).item()
        assert rel < 2e-2, f"d{name}: relative error {rel:.3g}"


@pytest.mark.cuda
@needs_hopper
def test_cuda_hopper_opcheck_and_compile():
    q, k, v = _cuda_qkv(4, 16, 4, 2048, 2048, 128, torch.bfloat16, False)  # routed: 2**28 scores
    opcheck(torch.ops.flash.attention_forward_hopper, (q, k, v, 128 ** -0.5, True))
    opcheck(torch.ops.flash.attention_forward, (q, k, v, None, None, 0.0, 128 ** -0.5, -1, 0, False))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    f = lambda q, k, v: flash_attention(q, k, v, is_causal=True)
    for mode in (None, "reduce-overhead"):
        torch._dynamo.reset()
        want = f(*leaves)
        got = torch.compile(f, fullgraph=True, mode=mode)(*leaves)
        torch.testing.assert_close(got, want)
        g = torch.randn_like(got)
        grads = zip(torch.autograd.grad(got, leaves, g), torch.autograd.grad(want, leaves, g), strict=True)
        for a, b in grads:
            torch.testing.assert_close(a, b)
