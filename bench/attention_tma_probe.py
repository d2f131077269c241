"""Probe (H200): does a tensor-descriptor (TMA) attention forward beat our pointer-load forward, and does
issuing the next key block's QK^T before this block's softmax ("ovl": FA3's overlap, as far as Triton
lets one write it) help? A standalone forward (no mask, dropout, window or varlen) timed with do_bench
against ours and cuDNN, errors against fp32 SDPA. Log: bench/logs/attention_tma_probe_h200.log;
findings in bench/NOTES_attention.md (session 20).

    python bench/attention_tma_probe.py [quick]
"""
import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flash_backend.kernels.attention_fwd import attention_forward_launch  # noqa: E402

LOG2E = 1.4426950408889634


def _alloc(size, align, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


triton.set_allocator(_alloc)


@triton.jit
def _softmax_step(qk, m_i, l_i, acc, v, MASKED: tl.constexpr, offs_m, cols, seqlen_k, CAUSAL: tl.constexpr):
    if MASKED:
        visible = cols[None, :] < seqlen_k
        if CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None])
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, l_i, m_new


@triton.jit
def _loop(acc, l_i, m_i, q, k_desc, v_desc, lo, hi, qk_scale, offs_m, seqlen_k, BLOCK_N: tl.constexpr,
          MASKED: tl.constexpr, CAUSAL: tl.constexpr, STAGES: tl.constexpr, OVERLAP: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    if OVERLAP and not MASKED:
        if hi > lo:
            qk = tl.dot(q, tl.trans(k_desc.load([lo, 0]))) * qk_scale
            for start_n in tl.range(lo + BLOCK_N, hi, BLOCK_N, num_stages=STAGES):
                k = k_desc.load([start_n, 0])
                qk_next = tl.dot(q, tl.trans(k)) * qk_scale
                v = v_desc.load([start_n - BLOCK_N, 0])
                acc, l_i, m_i = _softmax_step(qk, m_i, l_i, acc, v, False, offs_m, start_n + offs_n, seqlen_k,
                                              CAUSAL)
                qk = qk_next
            v = v_desc.load([hi - BLOCK_N, 0])
            acc, l_i, m_i = _softmax_step(qk, m_i, l_i, acc, v, False, offs_m, offs_n, seqlen_k, CAUSAL)
    else:
        for start_n in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
            k = k_desc.load([start_n, 0])
            v = v_desc.load([start_n, 0])
            qk = tl.dot(q, tl.trans(k)) * qk_scale
            acc, l_i, m_i = _softmax_step(qk, m_i, l_i, acc, v, MASKED, offs_m, start_n + offs_n, seqlen_k,
                                          CAUSAL)
    return acc, l_i, m_i


@triton.jit
def _fwd_tma(Q, K, V, OUT, LSE,
             stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
             stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
             H, GROUP, SEQ_Q, SEQ_K, qk_scale,
             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             CAUSAL: tl.constexpr, STAGES: tl.constexpr, OVERLAP: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    qk_scale = tl.cast(qk_scale, tl.float32)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    m0 = pid_m * BLOCK_M
    q_desc = tl.make_tensor_descriptor(Q + b.to(tl.int64) * stride_qb + h * stride_qh,
                                       shape=[SEQ_Q, HEAD_DIM], strides=[stride_qm, 1],
                                       block_shape=[BLOCK_M, BLOCK_D])
    k_desc = tl.make_tensor_descriptor(K + b.to(tl.int64) * stride_kb + hk * stride_kh,
                                       shape=[SEQ_K, HEAD_DIM], strides=[stride_kn, 1],
                                       block_shape=[BLOCK_N, BLOCK_D])
    v_desc = tl.make_tensor_descriptor(V + b.to(tl.int64) * stride_vb + hk * stride_vh,
                                       shape=[SEQ_K, HEAD_DIM], strides=[stride_vn, 1],
                                       block_shape=[BLOCK_N, BLOCK_D])
    o_desc = tl.make_tensor_descriptor(OUT + b.to(tl.int64) * stride_ob + h * stride_oh,
                                       shape=[SEQ_Q, HEAD_DIM], strides=[stride_om, 1],
                                       block_shape=[BLOCK_M, BLOCK_D])
    offs_m = m0 + tl.arange(0, BLOCK_M)
    q = q_desc.load([m0, 0])
    hi = SEQ_K
    full_hi = (SEQ_K // BLOCK_N) * BLOCK_N
    if CAUSAL:
        hi = tl.minimum(m0 + BLOCK_M, SEQ_K)
        full_hi = tl.minimum(full_hi, ((m0 + 1) // BLOCK_N) * BLOCK_N)
    full_hi = tl.minimum(full_hi, hi)  # (also makes the bound a scalar for the interpreter)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    acc, l_i, m_i = _loop(acc, l_i, m_i, q, k_desc, v_desc, 0, full_hi, qk_scale, offs_m, SEQ_K, BLOCK_N,
                          False, CAUSAL, STAGES, OVERLAP)
    acc, l_i, m_i = _loop(acc, l_i, m_i, q, k_desc, v_desc, full_hi, hi, qk_scale, offs_m, SEQ_K, BLOCK_N,
                          True, CAUSAL, 1, False)
    empty = l_i == 0.0
    inv_l = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    o_desc.store([m0, 0], (acc * inv_l[:, None]).to(OUT.dtype.element_ty))
    lse = tl.where(empty, float("inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    tl.store(LSE + pid_bh.to(tl.int64) * SEQ_Q + offs_m, lse, mask=offs_m < SEQ_Q)


def tma_forward(q, k, v, causal, cfg):
    bm, bn, warps, stages, overlap = cfg
    B, H, S, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(B, H, S, device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(S, bm), B * H)
    _fwd_tma[grid](q, k, v, out, lse, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
                   k.stride(2), v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1),
                   out.stride(2), H, H // k.shape[1], S, k.shape[2], D ** -0.5 * LOG2E,
                   HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal,
                   STAGES=stages, OVERLAP=overlap, num_warps=warps, num_stages=stages)
    return out


def ours_forward(q, k, v, causal):
    B, H, S, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(B, H, S, device=q.device, dtype=torch.float32)
    attention_forward_launch(q, k, v, None, None, 0.0, D ** -0.5, -1, 0 if causal else -1, False, out, lse,
                             launch=lambda kern: kern)
    return out


def bench(fn, *args):
    return triton.testing.do_bench(functools.partial(fn, *args), warmup=50, rep=300)


def cudnn_forward(q, k, v, causal):
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def run_shape(B, H, S, D, causal, cfgs):
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * B * H * S * S * D / (2 if causal else 1)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    rows = []
    impls = [("cudnn", cudnn_forward, ()), ("ours", ours_forward, ())]
    impls += [("tma" + ",".join(map(str, c[:4])) + (" ovl" if c[4] else ""), tma_forward, (c,)) for c in cfgs]
    for name, fn, extra in impls:
        try:
            err = (fn(q, k, v, causal, *extra).float() - ref).abs().max().item()
            rows.append((name, bench(fn, q, k, v, causal, *extra), err))
        except Exception as e:  # noqa: BLE001
            print(f"  {name}: {type(e).__name__}: {str(e)[:200]}")
    t_cudnn, t_ours = rows[0][1], rows[1][1]
    shape = str((B, H, S, D, "c" if causal else "nc"))
    for name, t, err in rows:
        print(f"{shape:<26} {name:<26} {t:8.3f} {flops / t / 1e9:7.1f} {t_ours / t:7.3f} {t_cudnn / t:7.3f} "
              f"{err:9.2e}", flush=True)


def main():
    quick = len(sys.argv) > 1 and sys.argv[1] == "quick"
    torch.manual_seed(0)
    shapes = [(4, 16, 4096, 128, False), (4, 16, 4096, 128, True), (8, 16, 2048, 64, False),
              (8, 16, 2048, 64, True), (1, 16, 16384, 256, False), (8, 16, 2048, 128, True),
              (16, 16, 1024, 64, True), (2, 16, 8192, 64, False)]
    # (BLOCK_M, BLOCK_N, num_warps, stages, overlap) per head_dim
    cfgs = {
        64: [(128, 64, 8, 3, False), (128, 128, 8, 3, False), (128, 64, 4, 3, False), (64, 64, 4, 3, False),
             (128, 64, 8, 3, True), (128, 128, 8, 2, True)],
        128: [(128, 128, 8, 3, False), (128, 128, 8, 2, False), (128, 64, 8, 3, False),
              (128, 128, 8, 2, True), (128, 64, 8, 3, True), (128, 128, 8, 3, True)],
        256: [(128, 64, 8, 2, False), (128, 64, 8, 2, True), (128, 32, 8, 2, False), (64, 64, 4, 2, False)],
    }
    if quick:
        shapes = shapes[:2]
    print(f"{'shape':<26} {'impl':<26} {'ms':>8} {'TF/s':>7} {'x ours':>7} {'x cudnn':>7} {'err':>9}")
    for B, H, S, D, causal in shapes:
        run_shape(B, H, S, D, causal, cfgs[D])


if __name__ == "__main__":
    main()
