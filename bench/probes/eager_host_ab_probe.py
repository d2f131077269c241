"""H200: eager fwd+bwd step wall time of bench_attention's host-bound rows with whichever flash_backend
PYTHONPATH selects; run it once per package, alternating, to A/B two commits on one machine.

    PYTHONPATH=/path/to/old/tree python bench/probes/eager_host_ab_probe.py old
Log: bench/logs/eager_host_ab_s25_h200.log."""

import sys
import time

import torch

from flash_backend.ops.attention import flash_attention

ROWS = [(64, 12, 197, 64, False, False), (16, 16, 1024, 64, True, False), (32, 12, 512, 64, False, True)]


def step_us(fn, inputs, dout, n=200):
    for _ in range(20):
        torch.autograd.grad(fn(), inputs, dout)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        torch.autograd.grad(fn(), inputs, dout)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main():
    res = []
    for B, H, S, D, causal, pad in ROWS:
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn_like(q)
        mask = None
        if pad:  # BERT-style: each sequence keeps a random prefix of at least half its keys
            keep = torch.arange(S, device="cuda")[None, :] < torch.randint(S // 2, S, (B, 1), device="cuda")
            mask = torch.zeros(B, 1, 1, S, device="cuda", dtype=torch.bfloat16)
            mask = mask.masked_fill(~keep[:, None, None, :], float("-inf"))

        def fn(q=q, k=k, v=v, mask=mask, causal=causal):
            return flash_attention(q, k, v, attn_mask=mask, is_causal=causal)

        label = f"{B},{H},{S},{D}{' c' if causal else ''}{' pad' if pad else ''}"
        res.append(f"{label}: {step_us(fn, (q, k, v), dout):7.1f}")
    print(sys.argv[1] if len(sys.argv) > 1 else "", " | ".join(res), flush=True)


if __name__ == "__main__":
    main()
