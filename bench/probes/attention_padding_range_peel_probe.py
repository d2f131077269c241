"""Probe (H100 / H200): the padding forward's pure-row key loop without masking code (PEEL_RANGE, session 33)
against the module before (argv[1], HEAD's kernels/attention_fwd_hopper.py written to a file) and cuDNN.

Why: a pure padding row (the mask is just a live key range [key_lo, key_hi)) ran the KEYS_RANGE loop with
its edge blocks' masking inside, which ptxas compiled as predicated selects on every block (64 FSEL an
iteration at head_dim 64: 598 instructions against 513 for the unmasked loop); the padding forward cost
~11 % more than the unmasked one at 8,16,2048,64 with every key live (370 against 327 us, session 32).
PEEL_RANGE gives pure rows partitions of their own (the kernel branches once between two warp_specialize
calls), their key blocks end at key_hi (the first one may start before key 0: TMA fills those rows with
zeros), so only the first block, already out of the loop, masks: the loop is 481 instructions at head_dim
64 (419 with RAW_SCORES), no spills (sm_90 SASS, tests/test_attention_hopper_padding.py). Every consumer's
Q tile now loads before the partitions (loaded in the worker consumers, ptxas spilled the copy's operands).

Variants, each with the padding mask at its routed configuration but where said:
  old      argv[1]'s module
  new      this tree's (PEEL_RANGE on)
  nopeel   this tree's with PEEL_RANGE off (a copy of its source, written to /tmp): the old loop in the
           new code around it, which should time as old
  new_raw  this tree's with RAW_SCORES (the FMA softmax) for the pure rows' loop, head_dim 64 only
           (routed_config keeps it off with a mask: the candidate next default if it wins here)
  range128 head_dim 128 only: this tree's with RANGE_LOOP_HEAD_DIMS (64, 128) (a copy of its source in
           /tmp), pure rows in the peeled loop at 128 too (session 27's unpeeled second loop lost there:
           483 -> 552 us); sm_90 SASS: 0 spills, pure loop 521 instructions against the bias loop's 544
Every variant's output and logsumexp are checked against fp32 first (batches 0 and B - 1: the shortest and
the longest row; out error at most 2x bf16 PyTorch's plus 1e-2, logsumexp 1e-4, +inf where no key is
live), the check-only cases first (odd lengths, rows shorter than a block, left / middle ranges, a row
with no live key); then GPU time of back-to-back eager calls in interleaved rounds (medians), cuDNN's
forward with the same mask as the anchor (a bool mask given to it as 0 / -inf). Not CUDA graphs (see
attention_fwd_peel_probe.py).

    git show HEAD:flash_backend/kernels/attention_fwd_hopper.py > /tmp/fwd_before.py
    PYTHONPATH=. python bench/probes/attention_padding_range_peel_probe.py /tmp/fwd_before.py
"""
# ruff: noqa: B023  (each closure is timed inside the iteration that defines it)

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from attention_fwd_peel_probe import interleaved_us, load  # noqa: E402

from flash_backend.kernels import attention_fwd_hopper as new  # noqa: E402
from flash_backend.ops.attention import attention_reference  # noqa: E402

# (B, H, S, D, mask): mask = (kind, side, keep): kind "add" (bf16 0 / -inf, (B, 1, 1, S)) or "bool"; side
# "right" (keys [0, len)), "left" (keys [S - len, S)) or "middle" (a run inside); the rows of the batch
# run from keep * S long to S (a row with no live key where keep is 0: batch 0's).
SHAPES = [
    (8, 16, 2048, 64, ("add", "right", 0.75)),
    (8, 16, 2048, 64, ("add", "right", 1.0)),  # every key live: against the unmasked forward's 327 us
    (4, 16, 4096, 64, ("bool", "right", 0.5)),
    (8, 16, 2048, 64, ("bool", "left", 0.75)),
    (2, 16, 8192, 64, ("add", "right", 0.5)),
    (8, 16, 2048, 128, ("add", "right", 0.75)),
    (4, 16, 4096, 128, ("bool", "right", 0.5)),
]
# checked only
CHECK_ONLY = [
    (3, 4, 1000, 64, ("add", "right", 0.3)), (3, 4, 1000, 64, ("bool", "left", 0.1)),
    (4, 4, 777, 64, ("add", "middle", 0.2)), (3, 4, 130, 64, ("bool", "right", 0.0)),
    (2, 4, 333, 64, ("add", "middle", 0.0)), (2, 3, 2048, 64, ("bool", "middle", 0.05)),
    (3, 4, 1000, 128, ("add", "left", 0.3)), (2, 4, 700, 128, ("bool", "middle", 0.0)),
]
NOPEEL_LINE = "PEEL_RANGE = triton.language.constexpr(True)"
RANGE_DIMS_LINE = "RANGE_LOOP_HEAD_DIMS = (64,)"


def load_edited(line, replacement, name):
    """This tree's module with one line of its source replaced: a copy (its own kernels and cache entries)."""
    source = Path(new.__file__).read_text()
    assert source.count(line) == 1, f"{line!r} moved: update the probe"
    path = Path(tempfile.gettempdir()) / f"{name}_s33.py"
    path.write_text(source.replace(line, replacement))
    return load(path, name)


def padding_mask(B, S, mask, device):
    kind, side, keep = mask
    lengths = torch.linspace(keep, 1.0, B, device=device).mul(S).long().clamp(0, S)
    keys = torch.arange(S, device=device)[None, :]
    if side == "right":
        live = keys < lengths[:, None]
    elif side == "left":
        live = keys >= (S - lengths)[:, None]
    else:  # middle: centred runs
        start = (S - lengths) // 2
        live = (keys >= start[:, None]) & (keys < (start + lengths)[:, None])
    live = live[:, None, None, :]
    if kind == "bool":
        return live
    return torch.where(live, 0.0, float("-inf")).to(torch.bfloat16)


def variants(mods, D, S):
    """name -> (module, config) of the variants for this head_dim (a padding mask throughout)."""
    out = {}
    for name, mod in mods.items():
        if name == "range128" and D != 128:
            continue
        out[name] = (mod, mod.routed_config(D, S, False, True))
    if D in new.RANGE_LOOP_HEAD_DIMS:
        config = new.routed_config(D, S, False, True)
        out["new_raw"] = (new, (*config[:4], True, config[5]))
    return out


def run(mod, config, q, k, v, mask, out, lse):
    mod.attention_forward_hopper_launch(q, k, v, q.shape[-1] ** -0.5, False, out, lse, config=config,
                                        attn_mask=mask)


def check(out, lse, q, k, v, mask):
    """(ok, worst out error) over batches 0 and B - 1 against the fp32 reference."""
    ok, worst = True, 0.0
    for b in sorted({0, q.shape[0] - 1}):
        s = slice(b, b + 1)
        m = mask[s]
        ref_out, ref_lse = attention_reference(q[s], k[s], v[s], m, None, 0.0, None, -1, -1, False)
        low_out, _ = attention_reference(q[s], k[s], v[s], m, None, 0.0, None, -1, -1, False, upcast=False)
        ref_lse = ref_lse.float()
        err_low = (low_out.float() - ref_out.float()).abs().max().item()
        err = (out[s].float() - ref_out.float()).abs().max().item()
        same = lse[s] == ref_lse  # +inf on both sides where no key is live
        lse_err = torch.where(same, 0.0, (lse[s] - ref_lse).abs()).max().item()
        ok &= err <= 2 * err_low + 1e-2 and lse_err < 1e-4 and bool(torch.isfinite(out[s]).all())
        worst = max(worst, err)
    return ok, f"{worst:.1e}{'' if ok else ' WRONG'}"


def main():
    mods = {"old": load(sys.argv[1], "fwd_old"), "new": new,
            "nopeel": load_edited(NOPEEL_LINE, NOPEEL_LINE.replace("True", "False"), "fwd_nopeel"),
            "range128": load_edited(RANGE_DIMS_LINE, "RANGE_LOOP_HEAD_DIMS = (64, 128)", "fwd_range128")}
    torch.manual_seed(0)
    all_ok = True
    rows = []
    for B, H, S, D, mask_spec in CHECK_ONLY + SHAPES:
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        mask = padding_mask(B, S, mask_spec, q.device)
        kind, side, keep = mask_spec
        shape = f"{B},{H},{S},{D} {kind} {side} {keep}..1"
        fns, checks = {}, []
        for name, (mod, config) in variants(mods, D, S).items():
            out = torch.full_like(q, float("nan"))
            lse = torch.full(q.shape[:3], float("nan"), device=q.device, dtype=torch.float32)
            run(mod, config, q, k, v, mask, out, lse)
            ok, verdict = check(out, lse, q, k, v, mask)
            all_ok &= ok
            checks.append(f"{name} {verdict}")
            fns[name] = lambda mod=mod, config=config, out=out, lse=lse: run(mod, config, q, k, v, mask, out,
                                                                             lse)
        if (B, H, S, D, mask_spec) in CHECK_ONLY:
            print(f"{shape:<36} check only: {', '.join(checks)}", flush=True)
            continue
        additive = mask if mask.dtype != torch.bool else torch.where(mask, 0.0, float("-inf")).to(q.dtype)

        def cudnn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                F.scaled_dot_product_attention(q, k, v, attn_mask=additive)

        fns["cudnn"] = cudnn
        us = interleaved_us(fns)
        ratios = " ".join(f"{n} {us['old'] / us[n]:.3f}" for n in us if n not in ("old", "cudnn"))
        line = (f"{shape:<36} " + " ".join(f"{n} {t:7.1f}" for n, t in us.items())
                + f" | x old: {ratios} | x cudnn: old {us['cudnn'] / us['old']:.3f} new "
                f"{us['cudnn'] / us['new']:.3f} | {', '.join(checks)}")
        rows.append((shape, us))
        print(line, flush=True)
    print("\n" + f"{'shape':<36} {'old':>8} {'new':>8} {'x old':>7} {'nopeel':>8} {'new_raw':>8} "
          f"{'range128':>8} {'cudnn':>7} {'new x cudnn':>11}")
    for shape, us in rows:
        extra = " ".join(f"{us[n]:8.1f}" if n in us else f"{'-':>8}" for n in ("new_raw", "range128"))
        print(f"{shape:<36} {us['old']:8.1f} {us['new']:8.1f} {us['old'] / us['new']:7.3f} "
              f"{us['nopeel']:8.1f} {extra} {us['cudnn']:7.1f} {us['cudnn'] / us['new']:11.3f}")
    print("ALL CHECKS OK" if all_ok else "SOME CHECK FAILED", flush=True)


if __name__ == "__main__":
    main()
