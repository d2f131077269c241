"""H200: where the padding-mask forward's time goes beyond the same call without a mask
(kernels/attention_fwd_hopper.py). Graph replay in interleaved rounds, forward only, every key live (so the
masked and unmasked calls do the same blocks):

- nomask: flash_attention without a mask;
- pure: with an all-zero additive row (pure padding: the KEYS_RANGE launch computes it, the KEYS_BIAS
  launch returns at once);
- impure: a row of random finite values (the KEYS_BIAS launch computes it);
- prep: mask_key_ranges(..., bias_len) alone (the Triton launch that prepares the rows);
- kernel_only: the Gluon forward given the prepared rows (padding_mask_args answered from a cache).
Run: PYTHONPATH=. python bench/probes/attention_padding_overhead_probe.py"""

# ruff: noqa: B023  (each closure is captured in a graph inside the iteration that defines it)

import torch

from bench._common import capture_graph, interleaved_graph_us
from flash_backend.kernels import attention_fwd_hopper as hopper
from flash_backend.ops.attention import flash_attention

SHAPES = [(8, 16, 2048, 64), (4, 16, 4096, 64), (8, 16, 2048, 128)]


def _graph(fn):
    def step():
        with torch.no_grad():
            fn()

    return capture_graph(step)


def main():
    torch.manual_seed(0)
    names = ("nomask", "pure", "impure", "prep", "kernel_only")
    print(f"{'B,H,S,D':>14} | " + " ".join(f"{n:>14}" for n in names), flush=True)
    for B, H, S, D in SHAPES:
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        pure = torch.zeros(B, 1, 1, S, device="cuda", dtype=torch.bfloat16)
        impure = torch.randn(B, 1, 1, S, device="cuda", dtype=torch.bfloat16)
        graphs = {
            "nomask": _graph(lambda: flash_attention(q, k, v)),
            "pure": _graph(lambda: flash_attention(q, k, v, attn_mask=pure)),
            "impure": _graph(lambda: flash_attention(q, k, v, attn_mask=impure)),
        }
        graphs["prep"] = _graph(lambda: hopper.padding_mask_args(pure, S, q))
        prepared = hopper.padding_mask_args(pure, S, q)
        original = hopper.padding_mask_args
        hopper.padding_mask_args = lambda mask, seq_k, dummy: prepared if mask is pure else original(
            mask, seq_k, dummy)
        graphs["kernel_only"] = _graph(lambda: flash_attention(q, k, v, attn_mask=pure))
        hopper.padding_mask_args = original
        us = interleaved_graph_us(graphs, rounds=9, reps=20)
        print(f"{f'{B},{H},{S},{D}':>14} | " + " ".join(f"{us[n]:14.1f}" for n in names), flush=True)


if __name__ == "__main__":
    main()
