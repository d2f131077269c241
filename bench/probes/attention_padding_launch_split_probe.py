"""H200: the two-launch padding forward of 69d505c (reverted), launch by launch, to find where a pure row's
time goes (bench/NOTES_attention.md, session 27). Forward GPU time, graph replay in interleaved rounds,
every key live (an all-zero additive (B, 1, 1, S) row: pure padding), prepared rows computed once:

- nomask: the Gluon forward without a mask (this tree's kernel);
- single: this tree's padding forward (one launch, the loop chosen per row at head_dim 64);
- range_only: 69d505c's KEYS_RANGE launch alone (computes every row: the unmasked loop plus the row's range
  read before the first K / V load);
- bias_only_empty: 69d505c's KEYS_BIAS launch alone (every CTA reads its flag and returns);
- both: the two launches.

Run: git show 69d505c:flash_backend/kernels/attention_fwd_hopper.py > /tmp/fwd_two_launch.py, then
PYTHONPATH=. python bench/probes/attention_padding_launch_split_probe.py /tmp/fwd_two_launch.py"""

# ruff: noqa: B023  (each closure is captured in a graph inside the iteration that defines it)

import importlib.util
import sys

import torch

from bench._common import capture_graph, interleaved_graph_us
from flash_backend._fast_launch import fast_kernel
from flash_backend.kernels import attention_fwd_hopper as hopper
from flash_backend.ops.attention import _alloc_forward

SHAPES = [(8, 16, 2048, 64), (8, 16, 2048, 128)]


def _load(path):
    spec = importlib.util.spec_from_file_location("fwd_two_launch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    two = _load(sys.argv[1])
    torch.manual_seed(0)
    names = ("nomask", "single", "range_only", "bias_only_empty", "both")
    print(f"{'B,H,S,D':>14} | " + " ".join(f"{n:>15}" for n in names), flush=True)
    for B, H, S, D in SHAPES:
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        pure = torch.zeros(B, 1, 1, S, device="cuda", dtype=torch.bfloat16)
        out, lse = _alloc_forward(q, v)
        bias, ranges, flags, ints, _ = two.padding_mask_args(pure, S, lse)
        block_n, stages, pingpong, consumers = two.CONFIGS[(D, False)]
        maxnreg, regs = two._REGS[consumers]
        grid = (-(-S // (consumers * two.BLOCK_M)), B * H)
        descs = (two._descriptor(q, two.BLOCK_M), two._descriptor(k, block_n), two._descriptor(v, block_n),
                 two._descriptor(out, two.BLOCK_M))

        def launch(keys):
            fast_kernel(two._attention_fwd_hopper_kernel)[grid](
                *descs, lse, bias, ranges, flags, S, S, H, 1, D ** -0.5 * two.LOG2E, *ints,
                CONSUMERS=consumers, STAGES=stages, CAUSAL=False, PINGPONG=pingpong, KEYS=keys,
                PRODUCER_REGS=two._PRODUCER_REGS, CONSUMER_REGS=regs, num_warps=4, maxnreg=maxnreg)

        graphs = {
            "nomask": capture_graph(lambda: hopper.attention_forward_hopper_launch(q, k, v, D ** -0.5, False,
                                                                                   out, lse)),
            "single": capture_graph(lambda: hopper.attention_forward_hopper_launch(q, k, v, D ** -0.5, False,
                                                                                   out, lse, attn_mask=pure)),
            "range_only": capture_graph(lambda: launch(1)),
            "bias_only_empty": capture_graph(lambda: launch(2)),
            "both": capture_graph(lambda: (launch(1), launch(2))),
        }
        us = interleaved_graph_us(graphs, rounds=9, reps=20)
        print(f"{f'{B},{H},{S},{D}':>14} | " + " ".join(f"{us[n]:15.1f}" for n in names), flush=True)


if __name__ == "__main__":
    main()
