"""Padding masks on the Gluon attention kernels (kernels/attention_fwd_hopper.py, attention_bwd_hopper.py).

A padding mask is one row of keys per (batch, head), broadcast over the queries: BERT-style (B, 1, 1, Sk)
bool or additive masks. The Gluon kernels take it as prepared bias rows plus each row's live key range
(attention_fwd.mask_key_ranges with bias_len), visit only the key blocks that range touches, and add the
bias to every score they compute.

CPU: the bias rows under Triton's interpreter, the mask variants compile for sm_90, and which calls are
routed (fake CUDA tensors). GPU: forward and gradients against the fp32 reference over right / left
padding, holes, rows with no live key, per-head rows under GQA, broadcast dims, strided masks, every mask
dtype; the routing on real calls, opcheck and torch.compile.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
import zlib
from pathlib import Path

import pytest
import torch
import triton
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.library import opcheck

import flash_backend
from flash_backend.kernels import attention_bwd_hopper as hopper_bwd
from flash_backend.kernels import attention_fwd_hopper as hopper_fwd
from flash_backend.ops import attention as attention_ops
from flash_backend.ops.attention import attention_reference, flash_attention

LOG2E = 1.4426950408889634

# ---------------------------------------------------------------------------------------------- CPU


@pytest.mark.interpret
def test_bias_rows_under_interpreter(interpreter):
    """mask_key_ranges(bias_len=...) writes each mask row as the kernels add it (base 2: 0 / -inf for bool,
    value * log2(e) for additive, -inf past Sk up to bias_len), the same ranges as without it, and which
    rows are pure padding (no live key, or live keys exactly [lo, hi), each with bias 0)."""
    from torch.library import wrap_triton

    from flash_backend.kernels.attention_fwd import _mask_args, mask_key_ranges

    Sk, bias_len = 70, 128
    live = torch.rand(3, 2, Sk) < 0.7  # holes: not pure
    live[0, 1] = False  # a row with no live key: pure
    live[1, 0] = torch.arange(Sk) < 33  # right padding: pure unless its live bias is not 0
    live[2, 1] = torch.arange(Sk) >= 64  # left padding
    for dtype, values in ((torch.bool, None), (torch.float32, "randn"), (torch.bfloat16, "zeros"),
                          (torch.float16, "randn"), (torch.float32, "zeros")):
        if dtype == torch.bool:
            mask = live
            want = torch.where(live, 0.0, float("-inf"))
        else:
            fill = torch.randn(3, 2, Sk) if values == "randn" else torch.zeros(3, 2, Sk)
            mask = fill.to(dtype).masked_fill(~live, float("-inf"))
            want = mask.float() * LOG2E
        mask4 = mask.view(3, 2, 1, Sk)
        _, strides, _, is_bool = _mask_args(mask4, None)
        ranges, range_strides, bias, pure = mask_key_ranges(mask4, strides, Sk, is_bool, wrap_triton,
                                                            bias_len)
        plain_ranges, plain_strides = mask_key_ranges(mask4, strides, Sk, is_bool, wrap_triton)
        assert range_strides == plain_strides == (4, 2) and torch.equal(ranges, plain_ranges)
        assert bias.shape == (6, bias_len) and bias.dtype == torch.float32
        assert torch.equal(bias[:, :Sk], want.reshape(6, Sk)), dtype
        assert bool((bias[:, Sk:] == float("-inf")).all())
        assert ranges[1].tolist() == [0, 0]
        for row, (lo, hi) in enumerate(ranges.tolist()):
            row_live = live.reshape(6, Sk)[row]
            contiguous = bool(row_live[lo:hi].all()) and int(row_live.sum()) == hi - lo
            zero_bias = bool((want.reshape(6, Sk)[row][row_live] == 0).all())
            assert pure[row].item() == int(contiguous and zero_bias), (dtype, values, row)
    assert pure.tolist() == [0, 1, 1, 0, 0, 1]  # the last call (fp32 zeros): holes in rows 0, 3, 4


@pytest.mark.interpret
def test_bias_rows_of_strided_and_broadcast_masks_under_interpreter(interpreter):
    """padding_mask_args' view of masks as SDPA callers pass them: a key dim with stride 2 (a slice), a
    batch dim expanded from 1 (stride 0: every batch reads the same row), a (B, 1, Sq, Sk) mask expanded
    over the queries (transformers' 4-d padding mask). Rows, ranges and pure flags as for the contiguous
    (B, 1, 1, Sk) equivalent."""
    from torch.library import wrap_triton

    from flash_backend.kernels.attention_fwd import _mask_args, mask_key_ranges

    B, Sk, bias_len = 3, 50, 128
    live = torch.arange(Sk)[None, :] < torch.tensor([50, 17, 33])[:, None]
    dense = torch.zeros(B, 1, 1, Sk).masked_fill(~live.view(B, 1, 1, Sk), float("-inf"))
    strided = torch.full((B, 1, 1, 2 * Sk), 7.0)
    strided[..., ::2] = dense
    views = {
        "key_stride_2": strided[..., ::2],
        "batch_expanded": dense[:1].expand(B, 1, 1, Sk),
        "query_expanded": dense.expand(B, 1, 40, Sk),
    }
    _, strides, _, _ = _mask_args(dense, None)
    want = mask_key_ranges(dense, strides, Sk, False, wrap_triton, bias_len)
    for name, view in views.items():
        assert hopper_fwd.padding_mask_ok(view, -1, -1), name
        _, strides, _, _ = _mask_args(view, None)
        got = mask_key_ranges(view, strides, Sk, False, wrap_triton, bias_len)
        rows = [0, 0, 0] if name == "batch_expanded" else [0, 1, 2]
        assert torch.equal(got[0], want[0][rows]), name
        assert torch.equal(got[2], want[2][rows]), name
        assert torch.equal(got[3], want[3][rows]), name
    assert want[3].tolist() == [1, 1, 1]  # right padding with bias 0: pure


def _ptxas_report(kernel) -> str:
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        ptx_file = Path(tmp) / "k.ptx"
        ptx_file.write_text(kernel.asm["ptx"])
        command = [str(ptxas), "-v", "-arch=sm_90a", str(ptx_file), "-o", str(Path(tmp) / "k.cubin")]
        return subprocess.run(command, capture_output=True, text=True, check=True).stderr


def _spill_bytes(kernel) -> int:
    return max(int(n) for n in re.findall(r"(\d+) bytes spill stores", _ptxas_report(kernel)))


def _sass_key_loops(kernel) -> list[tuple[int, int, int, int]]:
    """The innermost loops of the kernel's sm_90 SASS that issue wgmma (the key loops): (instructions, FSEL,
    global loads, local loads / stores) of each, from nvdisasm's labels and backward branches."""
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    labels, ins = {}, []
    for line in sass.splitlines():
        if m := re.match(r"^(\.L_x_\d+):", line):
            labels[m.group(1)] = len(ins)
        elif m := re.match(r"^\s+/\*[0-9a-f]+\*/\s+(.*?);", line):
            ins.append(m.group(1))
    # the branches after the first EXIT are the mbarrier waits' retries, not loops
    end = next(i for i, op in enumerate(ins) if re.match(r"(@!?U?P\w+\s+)?EXIT", op))
    loops = []
    for i, op in enumerate(ins[:end]):
        m = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", op)
        if m and labels.get(m.group(1), i) < i:
            body = ins[labels[m.group(1)]:i + 1]
            # a loop holding setmaxnreg is the worker warps' partition dispatch, around every partition
            if any("HGMMA" in op for op in body) and not any("SETMAXREG" in op for op in body):
                loops.append((len(body), sum(bool(re.search(r"\bFSEL\b", op)) for op in body),
                              sum(bool(re.search(r"\bLDG\b", op)) for op in body),
                              sum(bool(re.search(r"\b(LDL|STL)\b", op)) for op in body)))
    return loops


@pytest.mark.parametrize("raw_scores", [False, True])
def test_pure_row_key_loop_has_no_masking_for_sm90(raw_scores):
    """PEEL_RANGE: the head_dim-64 padding forward (three consumers) gives pure rows partitions of their
    own whose key blocks end at the row's live end, so that their key loop has no masking code: no FSEL
    (64 an iteration with the range's edges masked inside the loop, session 32), no spill anywhere, no
    wgmma serialisation (ptxas C7513), and a loop no longer than the unmasked kernel's (KEYS_PLAIN's
    interior: 513 instructions, 451 with RAW_SCORES, where the pure rows' measured 481 / 419). The biased
    rows' loops (a bias load an iteration) compile beside them, clean as well. RAW_SCORES: what the pure
    rows' loop would run with the FMA softmax (routed_config keeps it off with a mask)."""
    if not hopper_fwd.GLUON_AVAILABLE:
        pytest.skip("this Triton has no Gluon Hopper API")
    assert hopper_fwd.PEEL_RANGE and 64 in hopper_fwd.RANGE_LOOP_HEAD_DIMS
    config = hopper_fwd.routed_config(64, 4096, False, True)
    consumers = config[3]
    config = (*config[:4], raw_scores, config[5])
    kernel = hopper_fwd.compile_sm90(64, "bf16", False, config, mask=True)
    report = _ptxas_report(kernel)
    assert "C7513" not in report, report
    assert _spill_bytes(kernel) == 0, report
    loops = _sass_key_loops(kernel)
    pure = [loop for loop in loops if loop[2] == 0]
    biased = [loop for loop in loops if loop[2] > 0]
    assert len(pure) == consumers and len(biased) == consumers, loops
    assert all(fsel == 0 and local == 0 for _, fsel, _, local in pure), loops
    assert all(local == 0 for *_, local in biased), loops
    assert max(n for n, *_ in pure) <= (451 if raw_scores else 513), loops


@pytest.mark.parametrize(("kind", "head_dim", "spill_limit"),
                         [("fwd", 64, 0), ("fwd", 128, 0), ("bwd", 64, 320), ("bwd", 128, 320)])
def test_padding_variants_compile_for_sm90(kind, head_dim, spill_limit):
    """The padding-mask variants lower to sm_90 with wgmma and within a spill budget: the bias comes from
    prepared rows at constant offsets (reading the mask itself spilled ~950 bytes in the three-warpgroup
    head_dim-64 forward, choosing between pure and biased rows inside one loop ~450); the backward spills
    96 bytes without a mask and 168 with at head_dim 128, 192 / 300 at 64 (BLOCK_M 128: S^T and dP^T are 64
    registers each; 180 / 216 before its loops lost their divisions in session 33, which measured 1.06-1.08x
    faster with a mask: bench/logs/attention_bwd_peel_s33_h200.log)."""
    if not hopper_bwd.GLUON_AVAILABLE:
        pytest.skip("this Triton has no Gluon Hopper API (or no TMA reduce-add)")
    if kind == "fwd":
        config = hopper_fwd.routed_config(head_dim, 4096, False, True)  # what a padding-mask call runs
        kernel = hopper_fwd.compile_sm90(head_dim, "bf16", False, config, mask=True)
    else:
        kernel = hopper_bwd.compile_sm90(head_dim, "bf16", False, mask=True)
    assert "wgmma.mma_async" in kernel.asm["ptx"] and kernel.metadata.shared <= 227 * 1024
    assert _spill_bytes(kernel) <= spill_limit


def test_no_causal_padding_variant():
    """A causal padding-mask variant is refused at compile time (rows before the first live key)."""
    if not hopper_bwd.GLUON_AVAILABLE:
        pytest.skip("this Triton has no Gluon Hopper API")
    with pytest.raises(Exception, match="padding mask runs without causal"):
        hopper_fwd.compile_sm90(128, "bf16", True, hopper_fwd.CONFIGS[(128, True)], mask=True)
    with pytest.raises(ValueError, match="head_dim 256"):
        hopper_bwd.compile_sm90(256, "bf16", False, mask=True)


def _fake_call(mask_shape, mask_dtype=torch.bool, D=128, H=16, Hkv=16, expand_queries=False, **call_kw):
    """Fake CUDA q, k, v (8, H, 2048, D) and a mask of mask_shape (None: no mask), as routing sees them."""
    B, S = 8, 2048
    q = torch.empty(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.empty(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = None
    if mask_shape is not None:
        mask = torch.empty(mask_shape, device="cuda", dtype=mask_dtype)
        if expand_queries:
            mask = mask.expand(mask_shape[0], mask_shape[1], S, S)
    call = dict(attn_mask=mask, dropout_p=0.0, window_left=-1, window_right=-1, bottom_right=False)
    return (q, k, v), call | call_kw


FORWARD_ROUTING = {
    # name: (_fake_call kwargs, routed to the Gluon forward)
    "bool_row": (dict(mask_shape=(8, 1, 1, 2048)), True),
    "additive_bf16_row": (dict(mask_shape=(8, 1, 1, 2048), mask_dtype=torch.bfloat16), True),
    "additive_fp32_row": (dict(mask_shape=(8, 1, 1, 2048), mask_dtype=torch.float32), True),
    "additive_fp16_row": (dict(mask_shape=(8, 1, 1, 2048), mask_dtype=torch.float16), True),
    "fp64_row": (dict(mask_shape=(8, 1, 1, 2048), mask_dtype=torch.float64), False),
    "per_head_rows": (dict(mask_shape=(8, 16, 1, 2048)), True),
    "one_row_for_all": (dict(mask_shape=(1, 1, 1, 2048)), True),
    "rows_expanded_over_queries": (dict(mask_shape=(8, 1, 1, 2048), expand_queries=True), True),
    "full_tile": (dict(mask_shape=(8, 1, 2048, 2048)), False),
    "causal_with_padding": (dict(mask_shape=(8, 1, 1, 2048), window_right=0), False),
    "window_with_padding": (dict(mask_shape=(8, 1, 1, 2048), window_left=128), False),
    "dropout_with_padding": (dict(mask_shape=(8, 1, 1, 2048), dropout_p=0.1), False),
    "head_dim_256_row": (dict(mask_shape=(8, 1, 1, 2048), D=256), True),
    "gqa_row": (dict(mask_shape=(8, 1, 1, 2048), H=16, Hkv=4), True),
}


@pytest.mark.parametrize("case", list(FORWARD_ROUTING))
def test_forward_routing_with_padding_masks(case, monkeypatch):
    kw, routed = FORWARD_ROUTING[case]
    monkeypatch.setattr(hopper_fwd, "_is_sm90", lambda index: True)
    with FakeTensorMode(allow_non_fake_inputs=True):
        qkv, call = _fake_call(**kw)
        assert hopper_fwd.hopper_forward_supported(*qkv, **call) is routed


BACKWARD_ROUTING = {
    # name: (_fake_call kwargs, compute_dbias, routed to the Gluon backward)
    "bool_row": (dict(mask_shape=(8, 1, 1, 2048)), False, True),
    "additive_row_head_dim_64": (dict(mask_shape=(8, 1, 1, 2048), mask_dtype=torch.bfloat16, D=64), False,
                                 True),
    "per_head_rows_gqa": (dict(mask_shape=(8, 16, 1, 2048), Hkv=4), False, True),
    "mask_gradient_wanted": (dict(mask_shape=(8, 1, 1, 2048), mask_dtype=torch.bfloat16), True, False),
    "head_dim_256_row": (dict(mask_shape=(8, 1, 1, 2048), D=256), False, False),
    "head_dim_256_no_mask": (dict(mask_shape=None, D=256), False, True),
    "full_tile": (dict(mask_shape=(8, 1, 2048, 2048)), False, False),
}


@pytest.mark.parametrize("case", list(BACKWARD_ROUTING))
def test_backward_routing_with_padding_masks(case, monkeypatch):
    kw, compute_dbias, routed = BACKWARD_ROUTING[case]
    monkeypatch.setattr(hopper_fwd, "_is_sm90", lambda index: True)
    with FakeTensorMode(allow_non_fake_inputs=True):
        qkv, call = _fake_call(**kw)
        got = hopper_bwd.hopper_backward_supported(*qkv, **call, deterministic=False,
                                                   compute_dbias=compute_dbias)
        assert got is routed


def test_op_bodies_pass_the_padding_mask_to_the_opaque_ops(monkeypatch):
    """flash::attention_forward's and flash::attention_backward's bodies (what Inductor traces) call the
    opaque Gluon ops with the padding mask as their attn_mask argument (a mask whose gradient is wanted
    keeps the Triton backward: BACKWARD_ROUTING's mask_gradient_wanted)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    monkeypatch.setattr(hopper_fwd, "_is_sm90", lambda index: True)
    calls = {}

    class RecordOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.setdefault(str(func), []).append(args)
            return func(*args, **(kwargs or {}))

    with FakeTensorMode(allow_non_fake_inputs=True):
        (q, k, v), call = _fake_call(mask_shape=(8, 1, 1, 2048), mask_dtype=torch.bfloat16, D=64)
        mask = call["attn_mask"]
        with RecordOps():
            out, lse = attention_ops._attention_forward_impl(q, k, v, mask, None, 0.0, 0.125, -1, -1, False)
            dq, dk, dv, dbias = attention_ops._attention_backward_impl(
                torch.empty_like(out), q, k, v, out, lse, mask, None, 0.0, 0.125, -1, -1, False, False, False)
    (fwd_args,) = calls["flash.attention_forward_hopper.default"]
    (bwd_args,) = calls["flash.attention_backward_hopper.default"]
    assert fwd_args[-1] is mask and bwd_args[-1] is mask
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape and dbias.numel() == 0


# ------------------------------------------------------------------------------------------- GPU

_HAS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(not (_HAS_HOPPER and hopper_bwd.GLUON_AVAILABLE),
                                  reason="needs an sm_90 GPU and Gluon")


def _padding_mask(B, Hm, Sk, kind, dtype, pattern, generator):
    """A (B, Hm, 1, Sk) padding mask. kind: "bool", "0/-inf" (additive, pure padding like bool), "-inf" /
    "finfo.min" (random live values: every row takes the forward's bias loop). pattern: "right" (each row
    live up to a random length, one row with no live key when B * Hm > 2), "left" (live from a random
    start), "middle" (a random run of keys), "holes" (right padding plus random dead keys inside)."""
    rows = B * Hm
    lengths = torch.randint(1, Sk + 1, (rows,), generator=generator)
    keys = torch.arange(Sk)
    if pattern == "left":
        live = keys[None, :] >= (Sk - lengths)[:, None]
    elif pattern == "middle":
        starts = (torch.rand(rows, generator=generator) * (Sk - lengths + 1)).long()
        live = (keys[None, :] >= starts[:, None]) & (keys[None, :] < (starts + lengths)[:, None])
    else:
        live = keys[None, :] < lengths[:, None]
    if pattern == "holes":
        live &= torch.rand(rows, Sk, generator=generator) > 0.2
        live[:, 0] = True
    # Row 1 gets no live key (out 0, logsumexp +inf, zero gradients), except with finfo.min: a row of it is
    # not "no live key" for the reference (eager's softmax over it), a documented difference (ops/attention).
    if rows > 2 and kind != "finfo.min":
        live[1] = False
    live = live.view(B, Hm, 1, Sk)
    if kind == "bool":
        return live.cuda()
    values = torch.randn(B, Hm, 1, Sk, generator=generator).to(dtype)
    if kind == "0/-inf":
        values.zero_()
    dead = torch.finfo(dtype).min if kind == "finfo.min" else float("-inf")
    return values.masked_fill(~live, dead).cuda()


CUDA_CASES = {
    # name: (B, H, Hkv, Sq, Sk, D, mask heads, kind, mask dtype, pattern)
    "d128_bool_right": (3, 4, 4, 1000, 1000, 128, 1, "bool", None, "right"),
    "d128_zero_inf_left": (3, 4, 4, 900, 1300, 128, 1, "0/-inf", torch.bfloat16, "left"),
    "d128_bool_holes": (2, 4, 4, 700, 1000, 128, 1, "bool", None, "holes"),
    "d64_zero_inf_per_head_right": (2, 4, 4, 1000, 1000, 64, 4, "0/-inf", torch.float32, "right"),
    "d128_bf16_left_sq_ne_sk": (2, 4, 4, 700, 1500, 128, 1, "-inf", torch.bfloat16, "left"),
    "d128_fp32_holes": (2, 4, 4, 513, 777, 128, 1, "-inf", torch.float32, "holes"),
    "d128_finfo_min_bf16": (2, 4, 4, 600, 600, 128, 1, "finfo.min", torch.bfloat16, "right"),
    "d128_per_head_gqa": (2, 8, 2, 640, 640, 128, 8, "bool", None, "right"),
    "d64_bool_right_three_consumers": (3, 4, 4, 1000, 1000, 64, 1, "bool", None, "right"),
    "d64_per_head_gqa_holes": (2, 6, 2, 517, 1100, 64, 6, "-inf", torch.float16, "holes"),
    "d64_short_q": (2, 4, 4, 97, 3000, 64, 1, "-inf", torch.bfloat16, "right"),
    # pure rows (PEEL_RANGE) with their live range away from key 0 and short of Sk
    "d64_bool_left": (3, 4, 4, 1000, 1300, 64, 1, "bool", None, "left"),
    "d64_zero_inf_middle_per_head": (2, 4, 4, 700, 1500, 64, 4, "0/-inf", torch.bfloat16, "middle"),
    "d256_forward_triton_backward": (2, 4, 4, 513, 700, 256, 1, "bool", None, "right"),
}


def _qkv(B, H, Hkv, Sq, Sk, D, dtype, generator):
    shapes = ((B, H, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, D))
    return [torch.randn(s, generator=generator).to(dtype).cuda() for s in shapes]


def _reference(q, k, v, mask, dout, upcast):
    xs = [(t.float() if upcast else t).detach().requires_grad_() for t in (q, k, v)]
    m = mask.float() if upcast and mask.is_floating_point() else mask
    out, lse = attention_reference(*xs, m, None, 0.0, None, -1, -1, False, upcast=upcast)
    return (out, lse, *torch.autograd.grad(out, xs, dout.float() if upcast else dout))


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(CUDA_CASES))
def test_cuda_padding_forward_backward_match_reference(case, dtype):
    """out, logsumexp, dq, dk, dv of the Gluon launchers within 2x PyTorch's own low-precision error of the
    fp32 reference (plus a floor), every element written (poisoned with NaN first); rows with no live key
    give out 0, logsumexp +inf and zero dq."""
    B, H, Hkv, Sq, Sk, D, Hm, kind, mask_dtype, pattern = CUDA_CASES[case]
    gen = torch.Generator().manual_seed(zlib.crc32(case.encode()))
    q, k, v = _qkv(B, H, Hkv, Sq, Sk, D, dtype, gen)
    mask = _padding_mask(B, Hm, Sk, kind, mask_dtype or dtype, pattern, gen)
    scale = D ** -0.5
    out, lse = attention_ops._alloc_forward(q, v)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    hopper_fwd.attention_forward_hopper_launch(q, k, v, scale, False, out, lse, attn_mask=mask)
    dout = torch.randn(out.shape, generator=gen).to(dtype).cuda()
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    if D in hopper_bwd.CONFIGS:
        hopper_bwd.attention_backward_hopper_launch(dout, q, k, v, out, lse, scale, False, dq, dk, dv,
                                                    attn_mask=mask)
    else:  # the Triton backward from the Gluon forward's out and logsumexp
        dq, dk, dv, _ = attention_ops._attention_backward_impl(dout, q, k, v, out, lse, mask, None, 0.0,
                                                               scale, -1, -1, False, False, False)
    ref = _reference(q, k, v, mask, dout, upcast=True)
    low = _reference(q, k, v, mask, dout, upcast=False)
    floor = 2e-3 if dtype == torch.float16 else 1e-2
    for name, got, want, lowp in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref[:1] + ref[2:],
                                     low[:1] + low[2:], strict=True):
        assert torch.isfinite(got).all(), f"{name}: not every element written"
        err = (got.float() - want).abs().max().item()
        err_low = (lowp.float() - want).abs().max().item()
        assert err <= 2 * err_low + floor, f"{name}: err {err:.3g} vs torch low precision {err_low:.3g}"
    torch.testing.assert_close(lse, ref[1].float(), atol=1e-4, rtol=1e-5)
    if kind != "finfo.min" and B * Hm > 2:
        rows_without_keys = [(b, h) for b in range(B) for h in range(H) if (b * Hm + h % Hm) == 1]
        for b, h in rows_without_keys:
            assert bool((out[b, h] == 0).all()) and bool((lse[b, h] == float("inf")).all())
            assert bool((dq[b, h] == 0).all())


def _counting(monkeypatch, name):
    calls = []
    original = getattr(attention_ops, name)
    monkeypatch.setattr(attention_ops, name, lambda *a: calls.append(1) or original(*a))
    return calls


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("mask_grad", [False, True])
def test_cuda_padded_calls_take_the_gluon_kernels(mask_grad, monkeypatch):
    """flash_attention with a BERT-style padding mask runs the Gluon forward and backward on eligible
    inputs, matching the Triton kernels (the switches off); a mask that requires grad keeps the Triton
    backward, which also gives its gradient."""
    fwd_calls = _counting(monkeypatch, "_hopper_forward")
    bwd_calls = _counting(monkeypatch, "_hopper_backward")
    gen = torch.Generator().manual_seed(7)
    q, k, v = (t.requires_grad_() for t in _qkv(8, 16, 16, 2048, 2048, 64, torch.bfloat16, gen))
    mask = _padding_mask(8, 1, 2048, "-inf", torch.bfloat16, "right", gen).requires_grad_(mask_grad)
    out = flash_attention(q, k, v, attn_mask=mask)
    dout = torch.randn(out.shape, generator=gen).to(out.dtype).cuda()
    grads = torch.autograd.grad(out, (q, k, v, mask) if mask_grad else (q, k, v), dout)
    assert (len(fwd_calls), len(bwd_calls)) == (1, 0 if mask_grad else 1)
    monkeypatch.setattr(flash_backend.config, "hopper_attention_forward", False)
    monkeypatch.setattr(flash_backend.config, "hopper_attention_backward", False)
    triton_out = flash_attention(q, k, v, attn_mask=mask)
    triton_grads = torch.autograd.grad(triton_out, (q, k, v, mask) if mask_grad else (q, k, v), dout)
    torch.testing.assert_close(out, triton_out, atol=2e-2, rtol=0)
    for got, want in zip(grads, triton_grads, strict=True):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@needs_hopper
def test_cuda_padding_opcheck_and_compile():
    gen = torch.Generator().manual_seed(3)
    q, k, v = _qkv(4, 16, 4, 2048, 2048, 128, torch.bfloat16, gen)
    mask = _padding_mask(4, 1, 2048, "bool", None, "right", gen)
    scale = 128 ** -0.5
    opcheck(torch.ops.flash.attention_forward_hopper, (q, k, v, scale, False, mask))
    out, lse = torch.ops.flash.attention_forward(q, k, v, mask, None, 0.0, scale, -1, -1, False)
    dout = torch.randn(out.shape, generator=gen).to(out.dtype).cuda()
    opcheck(torch.ops.flash.attention_backward_hopper, (dout, q, k, v, out, lse, scale, False, mask))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    f = lambda q, k, v, mask: flash_attention(q, k, v, attn_mask=mask)
    torch._dynamo.reset()
    want = f(*leaves, mask)
    got = torch.compile(f, fullgraph=True)(*leaves, mask)
    torch.testing.assert_close(got, want)
    pairs = zip(torch.autograd.grad(got, leaves, dout), torch.autograd.grad(want, leaves, dout), strict=True)
    for a, b in pairs:
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)  # dQ's reduce-adds in any order
