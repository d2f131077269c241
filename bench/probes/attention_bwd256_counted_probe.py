"""Probe (H200): the head_dim 256 Gluon backward (kernels/attention_bwd_hopper_256.py) with the GQA head and
query block of an iteration counted in the loop (session 34) against the module before (argv[1]: HEAD's
file written to /tmp) and cuDNN's backward.

Why: each iteration derived its head and query block from the iteration index (`it // n_q_blocks`,
`it % n_q_blocks`: a 32-bit division in both consumer warpgroups and the producer, and one more for the next
block's query statistics). Counted instead, the sm_90 loops are 607 -> 560 (warpgroup 0) and 720 -> 708
(warpgroup 1) instructions causal, 531 -> 514 and 677 -> 665 non-causal, with ~30 more bytes of spills
(session 33's check, repeated in session 34). Every gradient is checked against fp32 first (at most 2x bf16
PyTorch's error, plus 1e-2 of the largest); then GPU time of back-to-back eager launches in interleaved
rounds (medians), cuDNN's backward as fwd+bwd minus fwd.

    git show HEAD:flash_backend/kernels/attention_bwd_hopper_256.py > /tmp/bwd256_before.py
    PYTHONPATH=. python bench/probes/attention_bwd256_counted_probe.py /tmp/bwd256_before.py
"""
# ruff: noqa: B023  (each closure is timed inside the iteration that defines it)

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attention_bwd_acc_init_probe import grads, load  # noqa: E402
from attention_bwd_peel_probe import run_shapes  # noqa: E402

from flash_backend.kernels import attention_bwd_hopper as bwd  # noqa: E402
from flash_backend.kernels import attention_bwd_hopper_256 as new_256  # noqa: E402

N = None
SHAPES = [  # (B, H, Hkv, S, D, causal, padding: none at head_dim 256)
    (2, 16, 16, 4096, 256, False, N), (2, 16, 16, 4096, 256, True, N), (4, 16, 4, 2048, 256, True, N),
    (1, 16, 16, 16384, 256, False, N), (1, 16, 16, 16384, 256, True, N), (8, 16, 16, 1024, 256, False, N),
]
# checked only: odd lengths, GQA (several heads a CTA visits in turn), a single query block
CHECK_ONLY = [(2, 4, 4, 333, 256, True, N), (1, 6, 3, 700, 256, False, N), (1, 6, 2, 517, 256, True, N),
              (2, 4, 1, 129, 256, False, N), (1, 8, 2, 64, 256, True, N), (3, 2, 2, 1000, 256, False, N)]


def main():
    torch.manual_seed(0)
    mods = {"old": load(sys.argv[1], "bwd256_before"), "new": new_256}
    run_shapes(CHECK_ONLY, SHAPES, {name: (lambda args, causal, mask, m=module: grads(bwd, m, args, causal))
                                    for name, module in mods.items()}, big_scores=2**38)


if __name__ == "__main__":
    main()
