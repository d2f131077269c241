"""H200: the five failures of tests/test_sdpa_backend_review_s24.py's first GPU run (session 25), localised.

expanded inputs (the test saw a wrong dq: its randn_like gradient followed each run's output layout), B = 0 /
head_dim 0 (PyTorch's CUDA SDPA returns None), a causal call with scale <= 0 (PyTorch's cuDNN and FLASH
kernels give NaN). Log: bench/logs/sdpa_review_failures_debug_s25_h200.log."""
import torch
import torch.nn.attention as attention
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_backend.sdpa as sdpa
from flash_backend.ops.attention import flash_attention


def qkv(B=1):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, 4, 200, 64, generator=g).bfloat16().cuda() for _ in range(3)]

q1, k1, _ = qkv()
v = torch.randn(3, 200, 4, 64).bfloat16().cuda().transpose(1, 2)
args = [q1.expand(3, -1, -1, -1), k1.expand(3, -1, -1, -1), v]
dout = torch.randn(3, 4, 200, 64).bfloat16().cuda()

def grads(fn, a):
    leaves = [t.detach().requires_grad_() for t in a]
    o = fn(*leaves)
    gs = torch.autograd.grad(o, leaves, dout.to(o.dtype))
    return [o, *gs], [t.stride() for t in (o, *gs)]

ref, _ = grads(lambda *a: F.scaled_dot_product_attention(*a), [t.float() for t in args])


def err(res):
    return [round((x.float() - r).abs().max().item(), 4) for x, r in zip(res, ref, strict=True)]


for name, fn in [("flash_attention", flash_attention), ("sdpa default", F.scaled_dot_product_attention)]:
    res, st = grads(fn, args)
    print(name, err(res), st)
for be in ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "FLASH_ATTENTION"):
    try:
        with sdpa_kernel(getattr(SDPBackend, be)):
            res, st = grads(F.scaled_dot_product_attention, args)
        print("torch", be, err(res), st)
        attention.activate_flash_attention_impl("flash_backend")
        sdpa.calls.update(flash=0, fallback=0)
        with sdpa_kernel(getattr(SDPBackend, be)):
            res, st = grads(F.scaled_dot_product_attention, args)
        print("ours ", be, err(res), st, dict(sdpa.calls))
    except Exception as e:
        print(be, "raised", type(e).__name__, str(e)[:150])
    finally:
        sdpa.deactivate()
# contiguous inputs through the same override, as a control
cargs = [t.contiguous() for t in args]
attention.activate_flash_attention_impl("flash_backend")
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
    res, st = grads(F.scaled_dot_product_attention, cargs)
print("ours cudnn contiguous", err(res), dict(sdpa.calls))
sdpa.deactivate()
# B = 0, D = 0: what does PyTorch's own SDPA return on CUDA?
for shape in [(0, 4, 200, 64), (2, 4, 200, 0)]:
    t = torch.randn(shape).bfloat16().cuda().requires_grad_()
    try:
        o = F.scaled_dot_product_attention(t, t, t)
        print("empty", shape, "->", None if o is None else (o.shape, o.grad_fn))
    except Exception as e:
        print("empty", shape, "raised", type(e).__name__, str(e)[:150])
# scale <= 0 with is_causal: PyTorch's default kernel vs math vs ours
q, k, vv = qkv(2)
for s in (0.0, -0.3):
    m = F.scaled_dot_product_attention(q.float(), k.float(), vv.float(), is_causal=True, scale=s)
    for be in ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "FLASH_ATTENTION"):
        try:
            with sdpa_kernel(getattr(SDPBackend, be)):
                o = F.scaled_dot_product_attention(q, k, vv, is_causal=True, scale=s)
            print("scale", s, be, "nan", o.isnan().any().item(), "err", (o.float() - m).abs().max().item())
        except Exception as e:
            print("scale", s, be, "raised", str(e)[:100])
    o = flash_attention(q, k, vv, is_causal=True, scale=s)
    print("scale", s, "ours nan", o.isnan().any().item(), "err", (o.float() - m).abs().max().item())
