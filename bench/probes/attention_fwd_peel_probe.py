"""Probe (H200): the Gluon forward with its last key block peeled out of the key loop (session 32) against
the module before (argv[1], HEAD's kernels/attention_fwd_hopper.py written to a file) and cuDNN.

Why: with the last block's masking inside the loop, ptxas predicated its selects onto every block (64 FSEL
and their predicates an iteration at head_dim 64, 128 causal; the sm_90 SASS of every routed configuration,
scratch check of session 32). Variants, each at its routed configuration:
  old      argv[1]'s module
  new      this tree's (interior blocks without masking code, the last block after the loop)
  new_raw  this tree's with RAW_SCORES (the FMA softmax) where the routed configuration has it off
  range    argv[2]'s module, if given: KEYS_RANGE (a padding mask's pure rows) peeled the same way (it
           spills inside its loop at head_dim 64, hence not in the tree); padding-mask shapes only
Every variant's output and logsumexp are checked against fp32 first (error at most 2x bf16 PyTorch's, plus
1e-2); then GPU time of back-to-back eager calls (each >= 300 us of GPU work, well above a call's host time)
in interleaved rounds (medians), cuDNN's forward as the anchor. Not CUDA graphs: this session's scratch
probes that captured graphs case after case met an illegal address in a later case's replays, three
times, with graphs of earlier cases destroyed (not understood; bench_attention, which also captures and
drops graphs row after row, never met it).

    git show HEAD:flash_backend/kernels/attention_fwd_hopper.py > /tmp/fwd_before.py
    PYTHONPATH=. python bench/probes/attention_fwd_peel_probe.py /tmp/fwd_before.py [range_module.py]
"""
# ruff: noqa: B023  (each closure is timed inside the iteration that defines it)

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flash_backend.kernels import attention_fwd_hopper as new  # noqa: E402
from flash_backend.ops.attention import attention_reference  # noqa: E402

# (B, H, S, D, causal, mask): mask None, or the fraction of keys the shortest padding row keeps (rows of
# the batch run from that fraction to all of S, additive bf16 (B, 1, 1, S), as bench_attention's row)
SHAPES = [
    (8, 16, 2048, 64, False, None), (4, 16, 4096, 64, False, None), (2, 16, 8192, 64, False, None),
    (8, 16, 2048, 64, True, None), (4, 16, 4096, 64, True, None), (2, 16, 8192, 64, True, None),
    (8, 16, 2048, 128, False, None), (4, 16, 4096, 128, False, None), (2, 16, 8192, 128, False, None),
    (8, 16, 2048, 128, True, None), (4, 16, 4096, 128, True, None), (2, 16, 8192, 128, True, None),
    (1, 16, 16384, 256, False, None), (1, 16, 16384, 256, True, None),
    (8, 16, 2048, 64, False, 0.75), (8, 16, 2048, 64, False, 1.0), (8, 16, 2048, 128, False, 0.75),
]
# checked only (odd lengths, short rows, a query block with one key block)
CHECK_ONLY = [(2, 4, 333, 64, True, None), (2, 4, 1000, 128, False, None), (2, 3, 200, 256, True, None),
              (3, 4, 130, 64, False, None), (2, 4, 700, 128, True, None), (3, 4, 1000, 64, False, 0.3)]


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def padding_mask(B, S, keep, device):
    lengths = torch.linspace(keep, 1.0, B, device=device).mul(S).long().clamp(1, S)
    live = torch.arange(S, device=device)[None, :] < lengths[:, None]
    bias = torch.where(live, 0.0, float("-inf")).to(torch.bfloat16)
    return bias[:, None, None, :]


def variants(mods, D, S, causal, mask):
    """name -> (module, config) of the variants that apply to this case."""
    out = {}
    for name, mod in mods.items():
        if name == "range" and mask is None:
            continue
        config = mod.routed_config(D, S, causal, mask is not None)
        out[name] = (mod, config)
        if name == "new" and not config[4] and not causal and mask is None:
            out["new_raw"] = (mod, (*config[:4], True, config[5]))
    return out


def run(mod, config, q, k, v, causal, mask, out, lse):
    mod.attention_forward_hopper_launch(q, k, v, q.shape[-1] ** -0.5, causal, out, lse, config=config,
                                        attn_mask=mask)


def interleaved_us(fns: dict, rounds: int = 9, reps: int = 10) -> dict:
    """Median microseconds a call of each function, timed in rounds that visit every one in turn."""
    times = {name: [] for name in fns}
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            start.record()
            for _ in range(reps):
                fn()
            stop.record()
            stop.synchronize()
            times[name].append(start.elapsed_time(stop) * 1e3 / reps)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def check(out, lse, q, k, v, causal, mask):
    right = 0 if causal else -1
    m = None if mask is None else mask[:1]
    ref_out, ref_lse = attention_reference(q[:1], k[:1], v[:1], m, None, 0.0, None, -1, right, False)
    low_out, _ = attention_reference(q[:1], k[:1], v[:1], m, None, 0.0, None, -1, right, False, upcast=False)
    err_low = (low_out.float() - ref_out.float()).abs().max().item()
    err = (out[:1].float() - ref_out.float()).abs().max().item()
    lse_err = (lse[:1] - ref_lse.float()).abs().max().item()
    ok = err <= 2 * err_low + 1e-2 and lse_err < 1e-4 and torch.isfinite(out).all().item()
    return ok, f"{err:.1e}{'' if ok else ' WRONG'}"


def main():
    mods = {"old": load(sys.argv[1], "fwd_old"), "new": new}
    if len(sys.argv) > 2:
        mods["range"] = load(sys.argv[2], "fwd_range")
    torch.manual_seed(0)
    all_ok = True
    for B, H, S, D, causal, keep in CHECK_ONLY + SHAPES:
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        mask = None if keep is None else padding_mask(B, S, keep, q.device)
        shape = f"{B},{H},{S},{D}{' causal' if causal else ''}{'' if keep is None else f' pad {keep}'}"
        fns, checks = {}, []
        for name, (mod, config) in variants(mods, D, S, causal, mask).items():
            out = torch.empty_like(q)
            lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
            run(mod, config, q, k, v, causal, mask, out, lse)
            ok, verdict = check(out, lse, q, k, v, causal, mask)
            all_ok &= ok
            checks.append(f"{name} {verdict}")
            fns[name] = lambda mod=mod, config=config, out=out, lse=lse: run(
                mod, config, q, k, v, causal, mask, out, lse)
        if B * H * S * S < (1 << 28):
            print(f"{shape:<28} check only: {', '.join(checks)}", flush=True)
            continue

        def cudnn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)

        fns["cudnn"] = cudnn
        us = interleaved_us(fns)
        ratios = " ".join(f"{n} {us['old'] / us[n]:.3f}" for n in us if n not in ("old", "cudnn"))
        print(f"{shape:<28} " + " ".join(f"{n} {t:7.1f}" for n, t in us.items())
              + f" | x old: {ratios} | x cudnn: old {us['cudnn'] / us['old']:.3f} new "
              f"{us['cudnn'] / us['new']:.3f} | {', '.join(checks)}", flush=True)
    print("ALL CHECKS OK" if all_ok else "SOME CHECK FAILED", flush=True)


if __name__ == "__main__":
    main()
