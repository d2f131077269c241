"""H200 probe (python bench/probes/ops_contracts_cuda_check_s26.py): session 26's op-contract fixes on CUDA:
varlen with the cu_seqlens device checks (eager and compiled), dense / cross-entropy with K or N = 0 (the
cuBLASLt route skipped), attention with Sk = 0. Log: bench/logs/ops_contracts_cuda_check_s26_h200.log."""
import torch
import torch.nn.functional as F

import flash_backend  # noqa: F401
from flash_backend.ops.attention import attention_varlen_reference, flash_attention, flash_attention_varlen
from flash_backend.ops.cross_entropy import linear_cross_entropy
from flash_backend.ops.dense import linear_bias, linear_bias_gelu

dev, bf = "cuda", torch.bfloat16
torch.manual_seed(0)
ok = True


def report(name, cond, extra=""):
    global ok
    ok &= bool(cond)
    print(f"{name:<48} {'OK' if cond else 'WRONG'} {extra}", flush=True)


# varlen: three sequences, GQA, causal; eager and compiled against the fp32 reference
lens = [37, 100, 5]
cu = torch.tensor([0, 37, 137, 142], dtype=torch.int32, device=dev)
q = torch.randn(142, 4, 64, device=dev, dtype=bf)
k = torch.randn(142, 2, 64, device=dev, dtype=bf)
v = torch.randn(142, 2, 64, device=dev, dtype=bf)
ref, _ = attention_varlen_reference(q.float(), k.float(), v.float(), cu, cu, window_right=0)
for mode in ("eager", "compiled"):
    fn = flash_attention_varlen if mode == "eager" else torch.compile(flash_attention_varlen, fullgraph=True)
    out = fn(q, k, v, cu, cu, 100, 100, is_causal=True)
    if dev == "cuda":
        torch.cuda.synchronize()
    err = (out.float() - ref).abs().max().item()
    report(f"varlen {mode}", err < 3e-2, f"err {err:.2e}")

# dense with K = 0 or N = 0: F.linear's answer, and the backward runs
for K, N in ((0, 64), (64, 0)):
    x = torch.randn(33, K, device=dev, dtype=bf, requires_grad=True)
    w = torch.randn(N, K, device=dev, dtype=bf, requires_grad=True)
    b = torch.randn(N, device=dev, dtype=bf, requires_grad=True)
    for name, fn, eager in (("linear_bias", linear_bias, F.linear),
                            ("linear_bias_gelu", linear_bias_gelu,
                             lambda x, w, b: F.gelu(F.linear(x, w, b)))):
        out = fn(x, w, b)
        want = eager(x, w, b)
        out.float().sum().backward()
        grads = [t.grad.clone() for t in (x, w, b)]
        for t in (x, w, b):
            t.grad = None
        want.float().sum().backward()
        same = torch.allclose(out.float(), want.float(), atol=1e-2) and all(
            torch.allclose(g.float(), t.grad.float(), atol=1e-2)
            for g, t in zip(grads, (x, w, b), strict=True))
        for t in (x, w, b):
            t.grad = None
        report(f"{name} K={K} N={N}", same, f"shape {tuple(out.shape)}")

# cross-entropy with K = 0 (logits = bias)
x = torch.randn(9, 0, device=dev, dtype=bf)
w = torch.randn(50, 0, device=dev, dtype=bf)
b = torch.randn(50, device=dev, dtype=bf)
t = torch.randint(0, 50, (9,), device=dev)
loss, _ = linear_cross_entropy(x, w, b, t)
want = F.cross_entropy(F.linear(x, w, b).float(), t)
# the loss comes in x's dtype (loss_dtype's default): compare with the fp32 value rounded to it
report("linear_cross_entropy K=0", torch.equal(loss, want.to(loss.dtype)),
       f"{loss.item():.4f} vs {want.item():.4f}")

# attention with no keys: 0 out, zero gradients, finite
qa = torch.randn(2, 4, 33, 64, device=dev, dtype=bf, requires_grad=True)
ka = torch.randn(2, 4, 0, 64, device=dev, dtype=bf, requires_grad=True)
va = torch.randn(2, 4, 0, 64, device=dev, dtype=bf, requires_grad=True)
oa = flash_attention(qa, ka, va)
oa.float().sum().backward()
report("flash_attention Sk=0", bool((oa == 0).all()) and bool((qa.grad == 0).all()), f"{tuple(oa.shape)}")
print("ALL OK" if ok else "SOMETHING WRONG")
