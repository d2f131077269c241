"""H200: does a torch.compile in the process (FlexAttention, forward and backward, as bench_attention runs it)
slow our host-bound eager step (8,16,2048,64 causal fwd+bwd) afterwards? Also with gc.freeze() and a 1 ms
switch interval. Prints do_bench's median (three times) and the Python threads at each point.

    PYTHONPATH=. python bench/probes/eager_after_compile_probe.py
"""

import gc
import sys
import threading
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from bench._common import bench_ms
from flash_backend.ops.attention import flash_attention

B, H, S = 8, 16, 2048


def main():
    q, k, v = (torch.randn(B, H, S, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)

    def step():
        torch.autograd.grad(flash_attention(q, k, v, is_causal=True), (q, k, v), dout)

    def report(label):
        times = [round(bench_ms(step) * 1e3) for _ in range(3)]
        threads = [t.name for t in threading.enumerate()]
        print(f"{label}: do_bench us {times}  threads {threads}", flush=True)

    report("fresh")
    block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device="cuda")
    flex = torch.compile(flex_attention, dynamic=False)
    out = flex(q, k, v, block_mask=block_mask)
    torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    report("after flex compile")
    time.sleep(5)
    report("after flex compile + 5 s")
    gc.collect()
    gc.freeze()
    report("after gc.freeze")
    sys.setswitchinterval(1e-3)
    report("switchinterval 1 ms")


if __name__ == "__main__":
    main()
