"""H200: the illegal memory access attention_fwd_small_configs_probe.py hit in 4 of its 5 runs, always in
interleaved_graph_us and never in the first shape of a process, after each graph had replayed cleanly
three times on its own.

The cause was the probe's: each candidate's out / lse lived only as default arguments of its step closure,
and the next candidate rebound them, so a captured graph went on writing into freed blocks; the next
capture (torch.cuda.graph empties the allocator's cache first) could hand those segments back to the
driver, and the replay faulted. `keep` holds every captured buffer now. Modes:

    PYTHONPATH=. python bench/probes/graph_replay_fault_probe.py ours      # our forward's graphs only
    PYTHONPATH=. python bench/probes/graph_replay_fault_probe.py cudnn     # a cuDNN graph before each shape
    PYTHONPATH=. python bench/probes/graph_replay_fault_probe.py ours drop # buffers dropped, as the probe did
"""

# ruff: noqa: B023  (each closure is captured inside the iteration that defines it)

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench._common import bench_ms, capture_graph, interleaved_graph_us
from flash_backend.kernels import attention_fwd


def main(with_cudnn: bool, drop_buffers: bool):
    torch.manual_seed(0)
    keep = []  # every buffer a captured graph writes, alive as long as the graphs replay
    for rep in range(3):
        for S in (64, 128, 197, 256, 320, 384):
            q, k, v = (torch.randn(64, 12, S, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            if with_cudnn:
                def cudnn():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        F.scaled_dot_product_attention(q, k, v)

                bench_ms(capture_graph(cudnn).replay)
            graphs = {}
            for cfg in ((128, 64, 8, 3), (128, 32, 4, 3)):
                out = torch.empty_like(q)
                lse = torch.empty(64, 12, S, device="cuda", dtype=torch.float32)

                def step(out=out, lse=lse, cfg=cfg):
                    attention_fwd.attention_forward_launch(q, k, v, None, None, 0.0, 0.125, -1, -1, False,
                                                           out, lse, config=cfg)

                graphs[cfg] = capture_graph(step)
                if not drop_buffers:
                    keep.append((out, lse))
            us = interleaved_graph_us(graphs, rounds=7, reps=20)
            print(f"{'cudnn' if with_cudnn else 'ours'} rep {rep} S={S}: ok "
                  + ", ".join(f"{c} {t:.1f} us" for c, t in us.items()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1] == "cudnn", "drop" in sys.argv[2:])
