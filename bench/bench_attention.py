"""flash attention vs SDPA (cuDNN, FlashAttention-2, memory-efficient) and compiled FlexAttention, on one GPU.

    python bench/bench_attention.py            # the ANCHORS grid + D256 S16k + GQA + padding mask
    python bench/bench_attention.py --sweep    # time kernel configs per head_dim (to fill the tables)
    python bench/bench_attention.py --dropout  # dropout p=0.1 against the SDPA backends that take it
    python bench/bench_attention.py --overhead # host vs device time per call, small case
    python bench/bench_attention.py --atomic-dq  # backward GPU time: dQ kernel vs atomic dQ (use_atomic_dq)
    python bench/bench_attention.py --e2e-configs  # tile configs at bench_e2e's attention shapes, GPU time

TFLOP/s use flops = 4*B*H*S^2*D, halved when causal; fwd+bwd counts 3.5x the forward.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import (  # noqa: E402
    Results,
    bench_ms,
    capture_graph,
    env_info,
    graph_ms,
    interleaved_graph_us,
    markdown_table,
    max_rel_diff,
)
from flash_backend.ops.attention import flash_attention  # noqa: E402

DT = torch.bfloat16

# (B, Hq, Hkv, S, D, causal, mask)
GRID = [
    (16, 16, 16, 1024, 64, False, None),
    (16, 16, 16, 1024, 64, True, None),
    (8, 16, 16, 2048, 64, False, None),
    (8, 16, 16, 2048, 64, True, None),
    (8, 16, 16, 2048, 128, False, None),
    (8, 16, 16, 2048, 128, True, None),
    (4, 16, 16, 4096, 128, False, None),
    (4, 16, 16, 4096, 128, True, None),
    (2, 16, 16, 8192, 128, False, None),
    (2, 16, 16, 8192, 128, True, None),
    (2, 16, 16, 8192, 64, False, None),
    (2, 16, 16, 8192, 64, True, None),
    (1, 16, 16, 16384, 256, False, None),
    (1, 16, 16, 16384, 256, True, None),
    (4, 32, 8, 4096, 128, True, None),
    (8, 16, 16, 2048, 64, False, "padding"),
    # the attention of bench_e2e's ViT-base (197 tokens) and BERT-base (padding mask) steps
    (64, 12, 12, 197, 64, False, None),
    (32, 12, 12, 512, 64, False, "padding"),
]
FLEX_ROWS = {(8, 16, 2048, 64), (4, 16, 4096, 128)}
SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION}


def _inputs(B, Hq, Hkv, S, D, mask_kind):
    q = torch.randn(B, Hq, S, D, device="cuda", dtype=DT, requires_grad=True)
    k = torch.randn(B, Hkv, S, D, device="cuda", dtype=DT, requires_grad=True)
    v = torch.randn(B, Hkv, S, D, device="cuda", dtype=DT, requires_grad=True)
    # additive key-padding mask, up to a quarter of each sequence padded
    mask = _padding_mask(B, S, 0.75, "additive") if mask_kind == "padding" else None
    return q, k, v, mask


def _padding_mask(B, S, shortest, kind):
    """A right-padding mask, each sequence between shortest * S and S keys long: a (B, 1, 1, S) row, bool
    or additive (0 / -inf), or ("tile") a (B, 1, S, S) bool mask with a random 10 % of the live keys
    masked too."""
    lens = torch.randint(int(S * shortest), S + 1, (B,), device="cuda")
    live = (torch.arange(S, device="cuda")[None, :] < lens[:, None])[:, None, None, :]
    if kind == "tile":
        return live & (torch.rand(B, 1, S, S, device="cuda") > 0.1)
    if kind == "bool":
        return live
    return torch.zeros(live.shape, device="cuda", dtype=DT).masked_fill(~live, float("-inf"))


def _time(fn, q, k, v, mode):
    if mode == "fwd":
        with torch.no_grad():
            return bench_ms(fn)
    out = fn()
    dout = torch.randn_like(out)

    def fwd_bwd():
        o = fn()
        torch.autograd.grad(o, (q, k, v), dout)

    return bench_ms(fwd_bwd)


def _time_impls(impls, q, k, v, mode, flops, case, res, row):
    """Time every impl in one mode; TF/s into row[(name, mode)] and res. A backend that refuses the case
    (mask, head_dim, GQA, dropout) is reported and left out."""
    mode_flops = flops * (3.5 if mode == "fwd+bwd" else 1.0)
    for name, fn in impls.items():
        try:
            ms = _time(fn, q, k, v, mode)
        except Exception as e:  # noqa: BLE001
            print(f"  {name} {mode} {case}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            continue
        row[(name, mode)] = mode_flops / ms / 1e9
        res.add(name, mode, case, ms, tflops=row[(name, mode)])


def _sdpa(backend, q, k, v, mask, causal, gqa):
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)


def _flex_fn(q, k, v, causal):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, Hq, S, _ = q.shape
    block_mask = None
    if causal:
        block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device="cuda")
    flex = torch.compile(flex_attention, dynamic=False)
    gqa = k.shape[1] != Hq

    def call():
        return flex(q, k, v, block_mask=block_mask, enable_gqa=gqa)

    # Compiled here, before any implementation of the case is timed, so that no compile (flex's forward
    # in the forward timings, its backward in the first fwd+bwd call) runs between two timings. Suspected of
    # slowing the host-bound step timed next (ours at 8,16,2048,64 causal fwd+bwd: 1.05 ms in the bench,
    # 0.74 ms alone, bench/logs/attention_causal64_fwd_bwd_s31_h200.log), it was not the cause: the step
    # still took 1.06 ms with this (bench/logs/bench_attention_6f5a1a5_s31_h200.log).
    out = call()
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    torch.cuda.synchronize()
    time.sleep(2.0)  # whatever the compile left running on the host (its worker pool starting) settles
    return call


def run_grid(args):
    res = Results("attention")
    table = []
    for B, Hq, Hkv, S, D, causal, mask_kind in GRID:
        if args.quick and S * B * Hq > 2 * 16 * 8192:
            continue
        q, k, v, mask = _inputs(B, Hq, Hkv, S, D, mask_kind)
        gqa = Hkv != Hq
        flops = 4 * B * Hq * S * S * D / (2 if causal else 1)
        case = dict(B=B, Hq=Hq, Hkv=Hkv, S=S, D=D, causal=causal, mask=mask_kind, dtype="bf16")
        impls = {"ours": functools.partial(flash_attention, q, k, v, attn_mask=mask, is_causal=causal)}
        for name, backend in SDPA_BACKENDS.items():
            impls[name] = functools.partial(_sdpa, backend, q, k, v, mask, causal, gqa)
        if (B, Hq, S, D) in FLEX_ROWS and mask_kind is None and not args.no_flex:
            impls["flex"] = _flex_fn(q, k, v, causal)
        row = {}
        for mode in ("fwd", "fwd+bwd"):
            _time_impls(impls, q, k, v, mode, flops, case, res, row)
            got = ", ".join(f"{n}={row.get((n, mode), float('nan')):.0f}" for n in impls)
            print(f"{case} {mode}: {got}", flush=True)
        label = f"{B},{Hq}/{Hkv},{S},{D}" + (",pad" if mask_kind else "")
        for mode in ("fwd", "fwd+bwd"):
            ours = row.get(("ours", mode))
            sdpa_best = max((row[(n, mode)] for n in SDPA_BACKENDS if (n, mode) in row), default=None)

            def ratio(n, ours=ours, mode=mode, row=row):
                other = row.get((n, mode))
                return f"{ours / other:.2f}" if ours and other else "-"

            table.append([label, "yes" if causal else "no", mode, ours or "-",
                          row.get(("cudnn", mode), "-"), row.get(("fa2", mode), "-"),
                          row.get(("flex", mode), "-"), ratio("cudnn"), ratio("fa2"), ratio("flex"),
                          f"{ours / sdpa_best:.2f}" if ours and sdpa_best else "-"])
        del q, k, v, mask
        torch.cuda.empty_cache()
        res.write()  # rows so far: a run cut short by a time limit still leaves them
    path = res.write()
    print(f"\nwrote {path}\n")
    header = ["B,Hq/Hkv,S,D", "causal", "mode", "ours TF/s", "cudnn", "fa2", "flex", "x cudnn", "x fa2",
              "x flex", "x best sdpa"]
    print(markdown_table(header, table))


def run_sweep(args):
    """Kernel configs per head_dim, timed as GPU time (CUDA-graph replay): host-inclusive timing picked a
    128x128 causal forward tile that graph replay showed 1.05-1.32x slower than 64x64 (NOTES_attention.md)."""
    from flash_backend.kernels import attention_bwd, attention_fwd

    fwd_cands = {
        64: [(128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 4, 3), (64, 64, 4, 3),
             (128, 128, 8, 2)],
        128: [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3),
              (128, 32, 4, 3)],
        256: [(128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 4, 3), (128, 64, 8, 1)],
    }
    dkdv_cands = {
        64: [(64, 128, 8, 2), (32, 128, 4, 2), (64, 64, 4, 2), (32, 64, 4, 3), (64, 128, 8, 3),
             (128, 128, 8, 2)],
        128: [(64, 128, 8, 2), (32, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 2), (64, 128, 8, 1),
              ((64, 64, 8, 1), (32, 64, 4, 2)), ((32, 128, 8, 2), (32, 128, 8, 2))],
        # a pair of configs: dV and dK in two launches (attention_bwd.SPLIT_DKDV_CONFIGS)
        256: [(32, 32, 4, 2), ((64, 128, 8, 1), (32, 128, 8, 2)), ((32, 128, 8, 2), (32, 128, 8, 2)),
              ((64, 128, 8, 1), (64, 128, 8, 1)), ((64, 64, 8, 1), (64, 128, 8, 1)),
              ((64, 64, 8, 1), (32, 128, 8, 2))],
    }
    dq_cands = {
        64: [(128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 4, 2), (128, 64, 8, 3), (64, 128, 8, 2)],
        128: [(128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2), (64, 128, 8, 2)],
        256: [(128, 32, 8, 2), (64, 32, 4, 2), (128, 32, 8, 1), (128, 64, 8, 1), (64, 32, 8, 2)],
    }
    shapes = {64: (8, 16, 2048), 128: (4, 16, 4096), 256: (2, 16, 4096)}
    head_dims = [int(d) for d in args.sweep_head_dims.split(",")]
    t_end = time.time() + args.sweep_seconds
    for D in head_dims:
        B, H, S = shapes[D]
        q, k, v, _ = _inputs(B, H, H, S, D, None)
        q, k, v = (t.detach() for t in (q, k, v))
        out = torch.empty_like(q)
        lse = torch.empty(B, H, S, device="cuda", dtype=torch.float32)
        scale = D ** -0.5
        for causal in (False, True):
            flops = 4 * B * H * S * S * D / (2 if causal else 1)
            wr = 0 if causal else -1
            for cfg in fwd_cands[D] if "fwd" in args.sweep_modes else ():
                if time.time() > t_end:
                    print("sweep: out of time")
                    return
                try:
                    ms = graph_ms(functools.partial(attention_fwd.attention_forward_launch, q, k, v, None,
                                                    None, 0.0, scale, -1, wr, False, out, lse, config=cfg))
                    print(f"SWEEP fwd D={D} causal={causal} cfg={cfg}: {flops / ms / 1e9:.0f} TF/s",
                          flush=True)
                except Exception as e:
                    print(f"SWEEP fwd D={D} causal={causal} cfg={cfg}: FAIL {type(e).__name__} "
                          f"{str(e)[:100]}")
            attention_fwd.attention_forward_launch(q, k, v, None, None, 0.0, scale, -1, wr, False, out, lse)
            dout = torch.randn_like(out)
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            bwd_flops = 2.5 * flops
            base = attention_bwd.default_configs(D, 0.0, False)
            cands = [(c, base[1]) for c in dkdv_cands[D]]
            cands += [(base[0], c) for c in dq_cands[D] if c != base[1]]
            if "bwd" not in args.sweep_modes:
                cands = []
            for cfg in cands:
                if time.time() > t_end:
                    print("sweep: out of time")
                    return
                try:
                    ms = graph_ms(functools.partial(
                        attention_bwd.attention_backward_launch, dout, q, k, v, out, lse, None, None, 0.0,
                        scale, -1, wr, False, dq, dk, dv, None, config=cfg))
                    print(f"SWEEP bwd D={D} causal={causal} dkdv={cfg[0]} dq={cfg[1]}: "
                          f"{bwd_flops / ms / 1e9:.0f} TF/s ({ms:.3f} ms)", flush=True)
                except Exception as e:
                    print(f"SWEEP bwd D={D} causal={causal} cfg={cfg}: FAIL {type(e).__name__} "
                          f"{str(e)[:100]}")


DROPOUT_ROWS = [  # (B, H, S, D, causal): GPT-2 small's attention, and two of the grid's shapes
    (16, 12, 1024, 64, True),
    (8, 16, 2048, 64, False),
    (4, 16, 4096, 128, True),
]


def run_dropout(args):
    """Attention dropout p=0.1 (training): ours against the SDPA backends that take dropout, and our own
    p=0 time, so the table shows what dropout costs each. Writes bench/results/attention_dropout.json."""
    res = Results("attention_dropout")
    table = []
    for B, H, S, D, causal in DROPOUT_ROWS:
        q, k, v, _ = _inputs(B, H, H, S, D, None)
        flops = 4 * B * H * S * S * D / (2 if causal else 1)
        case = dict(B=B, Hq=H, Hkv=H, S=S, D=D, causal=causal, dropout_p=0.1, dtype="bf16")
        impls = {"ours": functools.partial(flash_attention, q, k, v, dropout_p=0.1, is_causal=causal),
                 "ours_p0": functools.partial(flash_attention, q, k, v, is_causal=causal)}
        for name, backend in SDPA_BACKENDS.items():
            impls[name] = functools.partial(_sdpa_dropout, backend, q, k, v, causal)
        row = {}
        for mode in ("fwd", "fwd+bwd"):
            _time_impls(impls, q, k, v, mode, flops, case, res, row)
            ours = row.get(("ours", mode))
            best = max((row[(n, mode)] for n in SDPA_BACKENDS if (n, mode) in row), default=None)
            table.append([f"{B},{H},{S},{D}", "yes" if causal else "no", mode, ours,
                          row.get(("ours_p0", mode)), row.get(("cudnn", mode)), row.get(("fa2", mode)),
                          row.get(("efficient", mode)), f"{ours / best:.2f}" if ours and best else "-"])
        del q, k, v
    path = res.write()
    print(f"\nwrote {path}\n")
    print(markdown_table(["B,H,S,D", "causal", "mode", "ours p=0.1 TF/s", "ours p=0", "cudnn", "fa2",
                          "efficient", "x best sdpa"], table, float_fmt=".0f"))


def _sdpa_dropout(backend, q, k, v, causal):
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=causal)


def run_overhead(args):
    """Host time per call (no sync) against device time: says when a small case is launch-bound."""
    for causal in (False, True):
        q, k, v, _ = _inputs(16, 16, 16, 1024, 64, None)
        for name, fn in (("ours", functools.partial(flash_attention, q, k, v, is_causal=causal)),
                         ("cudnn", functools.partial(_sdpa, SDPBackend.CUDNN_ATTENTION, q, k, v, None, causal,
                                                     False))):
            out = fn()
            dout = torch.randn_like(out)
            for mode in ("fwd", "fwd+bwd"):
                def step(fn=fn, mode=mode, dout=dout, inputs=(q, k, v)):
                    o = fn()
                    if mode == "fwd+bwd":
                        torch.autograd.grad(o, inputs, dout)
                for _ in range(10):
                    step()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(50):
                    step()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                host_us, wall_us = (t1 - t0) / 50 * 1e6, (t2 - t0) / 50 * 1e6
                print(f"OVERHEAD 16,16,1024,64 causal={causal} {name} {mode}: host {host_us:.0f} us/call, "
                      f"wall {wall_us:.0f} us/call, do_bench {bench_ms(step) * 1e3:.0f} us", flush=True)


# (B, H, S, D, causal, dropout_p) and the atomic dK/dV launch shapes tried at that head_dim
ATOMIC_DQ_ROWS = [
    (64, 12, 197, 64, False, 0.0),  # ViT-base
    (32, 12, 512, 64, False, 0.0),  # BERT-base
    (32, 12, 512, 64, False, 0.1),
    (16, 12, 1024, 64, True, 0.0),  # GPT-2 small
    (16, 12, 1024, 64, True, 0.1),
    (8, 16, 2048, 64, False, 0.1),
    (2, 16, 4096, 64, True, 0.1),
    (8, 16, 2048, 64, True, 0.0),
    (8, 16, 1024, 128, False, 0.0),
    (8, 16, 1024, 128, False, 0.1),
    (4, 16, 4096, 128, True, 0.1),
    (2, 16, 2048, 256, False, 0.1),
]
ATOMIC_DQ_CANDIDATES = {64: [(64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 2), (64, 128, 8, 2)],
                        128: [(64, 64, 4, 2), (32, 128, 8, 2), (64, 128, 8, 2)],
                        256: [(32, 32, 4, 2), (32, 64, 8, 2)]}


def run_atomic_dq(args):
    """GPU time (CUDA-graph replay, no launch overhead) of the backward launcher with the dQ kernel against
    the atomic dQ accumulation, the evidence behind attention_bwd.use_atomic_dq."""
    from flash_backend.kernels import attention_bwd, attention_fwd

    print(f"env {env_info()}", flush=True)
    for B, H, S, D, causal, p in ATOMIC_DQ_ROWS:
        q, k, v = (t.detach() for t in _inputs(B, H, H, S, D, None)[:3])
        out, lse = torch.empty_like(q), torch.empty(B, H, S, device="cuda")
        seed = torch.randint(0, 2**62, (1,), device="cuda") if p else None
        fwd_args = (None, seed, p, D ** -0.5, -1, 0 if causal else -1, False)
        attention_fwd.attention_forward_launch(q, k, v, *fwd_args, out, lse)
        dout = torch.randn_like(q)
        grads = [torch.empty_like(t) for t in (q, k, v)]
        bwd = functools.partial(attention_bwd.attention_backward_launch, dout, q, k, v, out, lse, *fwd_args,
                                *grads, None)
        flops = 2.5 * 4 * B * H * S * S * D / (2 if causal else 1)
        base_ms = graph_ms(bwd)
        picked = attention_bwd.use_atomic_dq(D, p, False, False)
        print(f"ATOMIC_DQ {B},{H},{S},{D} causal={causal} p={p}: dQ kernel {base_ms * 1e3:.0f} us "
              f"({flops / base_ms / 1e9:.0f} TF/s); use_atomic_dq={picked}", flush=True)
        ref = [g.clone() for g in grads]
        for cfg in ATOMIC_DQ_CANDIDATES[D]:
            step = functools.partial(bwd, atomic_dq=True, config=(cfg, attention_bwd.DQ_CONFIGS[D]))
            step()
            err = max(((g.float() - r.float()).abs().max() / r.float().abs().max()).item()
                      for g, r in zip(grads, ref, strict=True))
            ms = graph_ms(step)
            print(f"ATOMIC_DQ   atomic {cfg}: {ms * 1e3:.0f} us ({flops / ms / 1e9:.0f} TF/s), "
                  f"{base_ms / ms:.2f}x the dQ kernel, max rel diff {err:.1e}", flush=True)
        del q, k, v, out, lse, dout, grads, ref
        torch.cuda.empty_cache()


# (B, H, S, D, shortest live length / S, mask, dropout p): the padding-mask A/B of run_mask_switches. BERT's
# e2e step pads each sequence to between S/2 and S and reaches the kernel with a bool (B, 1, 1, S) row
# (transformers' mask, split by fx_passes/attention._split_keep); the grid's padding row is additive, padded
# to between 3S/4 and S; "tile" is that padding as a full (B, 1, S, S) bool mask with 10 % more holes.
MASK_SWITCH_ROWS = [
    (32, 12, 512, 64, 0.5, "bool", 0.1),
    (32, 12, 512, 64, 0.5, "bool", 0.0),
    (8, 16, 2048, 64, 0.75, "additive", 0.0),
    (8, 16, 2048, 64, 0.75, "tile", 0.0),
]
# forward configs timed with each switch combination (padding rows; "tile" rows time the default only)
MASK_SWITCH_CONFIGS = [(128, 64, 8, 3), (64, 64, 4, 3), (64, 128, 4, 2)]
MASK_SWITCHES = ("NARROW_PADDING_KEYS", "PREFETCH_MASK_ROWS", "PREFETCH_MASK_TILES")
MASK_SWITCH_COMBOS = [(False, False, False), (False, True, True), (True, False, False), (True, True, True)]


def run_mask_switches(args):
    """GPU time of the forward (per config) and backward launchers under each combination of attention_fwd's
    mask switches (key-range narrowing, mask prefetch), CUDA graphs timed in interleaved rounds. Every
    variant must give bitwise the baseline's outputs and gradients. One PICK line per row: the fastest
    forward variant, and the backward's fastest switch combination."""
    from flash_backend.kernels import attention_bwd, attention_fwd

    print(f"env {env_info()}", flush=True)
    saved = [getattr(attention_fwd, n) for n in MASK_SWITCHES]
    try:
        for B, H, S, D, shortest, kind, p in MASK_SWITCH_ROWS:
            q, k, v = (t.detach() for t in _inputs(B, H, H, S, D, None)[:3])
            dout = torch.randn_like(q)
            mask = _padding_mask(B, S, shortest, kind)
            seed = torch.randint(0, 2**62, (1,), device="cuda") if p else None
            fwd_args = (mask, seed, p, D ** -0.5, -1, -1, False)
            out, lse = torch.empty_like(q), torch.empty(B, H, S, device="cuda")
            grads = [torch.empty_like(t) for t in (q, k, v)]
            configs = [None] if kind == "tile" else MASK_SWITCH_CONFIGS
            fwd_graphs, bwd_graphs, base = {}, {}, None
            for combo in MASK_SWITCH_COMBOS:
                for name, value in zip(MASK_SWITCHES, combo, strict=True):
                    setattr(attention_fwd, name, value)
                for cfg in configs:
                    fwd = functools.partial(attention_fwd.attention_forward_launch, q, k, v, *fwd_args, out,
                                            lse, config=cfg)
                    fwd()
                    got = [out.clone(), lse.clone()]
                    bwd = functools.partial(attention_bwd.attention_backward_launch, dout, q, k, v, out, lse,
                                            *fwd_args, *grads, None)
                    bwd()
                    got += [g.clone() for g in grads]
                    if base is None:
                        base = got
                    elif not all(torch.equal(a, b) for a, b in zip(got, base, strict=True)):
                        print(f"MASKSW DIFFERS: {cfg} switches {combo}", flush=True)
                    fwd_graphs[(cfg, combo)] = capture_graph(fwd)
                bwd_graphs[combo] = capture_graph(bwd)
            fwd_us = interleaved_graph_us(fwd_graphs)
            bwd_us = interleaved_graph_us(bwd_graphs)
            label = f"{B},{H},{S},{D} {kind} p={p}"
            base_us = fwd_us[(configs[0], MASK_SWITCH_COMBOS[0])]
            for (cfg, combo), us in sorted(fwd_us.items(), key=lambda kv: kv[1]):
                print(f"MASKSW {label} fwd {cfg} switches={''.join(str(int(c)) for c in combo)}: {us:.1f} us "
                      f"({base_us / us:.2f}x baseline)", flush=True)
            for combo, us in bwd_us.items():
                print(f"MASKSW {label} bwd switches={''.join(str(int(c)) for c in combo)}: {us:.1f} us",
                      flush=True)
            (cfg, combo), _ = min(fwd_us.items(), key=lambda kv: kv[1])
            print(f"PICK {label} fwd config={cfg} switches={combo}; bwd {min(bwd_us, key=bwd_us.get)}",
                  flush=True)
            del q, k, v, dout, fwd_graphs, bwd_graphs
            torch.cuda.empty_cache()
    finally:
        for name, value in zip(MASK_SWITCHES, saved, strict=True):
            setattr(attention_fwd, name, value)


# (label, B, H, S, D, causal, padding (shortest live length / S) or None, dropout p): the attention calls of
# bench_e2e's steps, where the grid's tile tables were never timed. The backward sweeps the dK/dV kernel's
# config (with atomic dQ where use_atomic_dq takes it, else with each dQ config too).
E2E_CONFIG_ROWS = [
    ("bert", 32, 12, 512, 64, False, 0.5, 0.1),
    ("gpt2", 16, 12, 1024, 64, True, None, 0.1),
    ("vit", 64, 12, 197, 64, False, None, 0.0),
]
E2E_FWD_CANDIDATES = [(128, 64, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2), (64, 128, 4, 2), (128, 128, 8, 3),
                      (64, 32, 4, 3), (128, 32, 4, 3)]
E2E_BWD_CANDIDATES = [(64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 2), (32, 64, 4, 3), (64, 128, 8, 2),
                      (128, 64, 8, 2), (64, 64, 8, 2), (32, 128, 4, 2), (32, 32, 4, 2), (64, 32, 4, 2)]


def _checked_graph(what: str, step, outputs: list, ref: list):
    """step captured in a CUDA graph if it runs and its outputs (filled in place) match ref within 2e-2
    relative; else None, with the reason printed (a config that does not compile or fit is skipped)."""
    try:
        step()
    except Exception as e:  # noqa: BLE001
        print(f"E2ECFG {what}: failed {type(e).__name__}: {str(e)[:120]}", flush=True)
        return None
    err = max_rel_diff(outputs, ref)
    if err > 2e-2:
        print(f"E2ECFG {what}: WRONG, max rel diff {err:.1e}", flush=True)
        return None
    return capture_graph(step)


def run_e2e_configs(args):
    """GPU time (CUDA graphs, interleaved rounds) of forward and backward tile configs at the attention
    shapes of bench_e2e's models; every candidate is checked against the default config's result."""
    from flash_backend.kernels import attention_bwd, attention_fwd

    print(f"env {env_info()}", flush=True)
    for label, B, H, S, D, causal, shortest, p in E2E_CONFIG_ROWS:
        q, k, v = (t.detach() for t in _inputs(B, H, H, S, D, None)[:3])
        dout = torch.randn_like(q)
        mask = _padding_mask(B, S, shortest, "bool") if shortest is not None else None
        seed = torch.randint(0, 2**62, (1,), device="cuda") if p else None
        fwd_args = (mask, seed, p, D ** -0.5, -1, 0 if causal else -1, False)
        out, lse = torch.empty_like(q), torch.empty(B, H, S, device="cuda")
        grads = [torch.empty_like(t) for t in (q, k, v)]
        fwd = functools.partial(attention_fwd.attention_forward_launch, q, k, v, *fwd_args, out, lse)
        fwd()
        ref_fwd = [out.clone()]
        fwd_graphs = {}
        for cfg in E2E_FWD_CANDIDATES:
            graph = _checked_graph(f"{label} fwd {cfg}", functools.partial(fwd, config=cfg), [out], ref_fwd)
            if graph is not None:
                fwd_graphs[cfg] = graph
        fwd()  # the default's out and lse feed every backward
        atomic = attention_bwd.use_atomic_dq(D, p, False, False)
        default = attention_bwd.default_configs(D, p, atomic)
        bwd = functools.partial(attention_bwd.attention_backward_launch, dout, q, k, v, out, lse, *fwd_args,
                                *grads, None, atomic_dq=atomic)
        bwd()
        ref_bwd = [g.clone() for g in grads]
        # each dK/dV candidate with the default dQ config; without atomics, each dQ candidate with the default
        # dK/dV config too
        pairs = [(cfg, default[1]) for cfg in E2E_BWD_CANDIDATES]
        if not atomic:
            pairs += [(default[0], cfg) for cfg in E2E_BWD_CANDIDATES if cfg != default[1]]
        bwd_graphs = {}
        for cfg, dq_cfg in pairs:
            step = functools.partial(bwd, config=(cfg, dq_cfg))
            graph = _checked_graph(f"{label} bwd {cfg} dq {dq_cfg}", step, grads, ref_bwd)
            if graph is not None:
                bwd_graphs[(cfg, dq_cfg)] = graph
        fwd_graphs["default"] = capture_graph(fwd)
        bwd_graphs["default"] = capture_graph(bwd)
        print(f"E2ECFG {label} defaults: bwd {default}, atomic dQ {atomic}", flush=True)
        for mode, graphs in (("fwd", fwd_graphs), ("bwd", bwd_graphs)):
            us = interleaved_graph_us(graphs)
            for cfg, t in sorted(us.items(), key=lambda kv: kv[1]):
                print(f"E2ECFG {label} {mode} {cfg}: {t:.1f} us ({us['default'] / t:.2f}x the default)",
                      flush=True)
        del q, k, v, dout, out, lse, grads, fwd_graphs, bwd_graphs
        torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--sweep-seconds", type=float, default=240)
    p.add_argument("--sweep-head-dims", default="64,128,256", help="head_dims the sweep runs")
    p.add_argument("--sweep-modes", default="fwd,bwd", help="fwd, bwd or both: what the sweep times")
    p.add_argument("--quick", action="store_true", help="skip the largest rows")
    p.add_argument("--no-flex", action="store_true")
    p.add_argument("--overhead", action="store_true", help="host vs device time per call, small case")
    p.add_argument("--dropout", action="store_true", help="attention dropout p=0.1 against SDPA's backends")
    p.add_argument("--atomic-dq", action="store_true", help="backward: dQ kernel vs atomic dQ, GPU time")
    p.add_argument("--e2e-configs", action="store_true",
                   help="tile configs at the attention shapes of bench_e2e's models, GPU time")
    p.add_argument("--mask-switches", action="store_true",
                   help="padding-mask switches of attention_fwd (narrowing, prefetch), GPU time")
    args = p.parse_args()
    if args.e2e_configs:
        run_e2e_configs(args)
    elif args.mask_switches:
        run_mask_switches(args)
    elif args.overhead:
        run_overhead(args)
    elif args.atomic_dq:
        run_atomic_dq(args)
    elif args.dropout:
        run_dropout(args)
    elif args.sweep:
        run_sweep(args)
    else:
        run_grid(args)


if __name__ == "__main__":
    main()
