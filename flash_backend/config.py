"""Switches for rewrites that are correct but measured slower than what the graph would run otherwise (and
for one that measured faster only recently, so that it can be turned off).

On CUDA a rewrite pays only where our kernel beats the kernel it replaces. Where it does not (H200,
bench/results/*.json), by default the subgraph is left alone and reported as a near miss:

- ``F.scaled_dot_product_attention`` calls already run a fused kernel (cuDNN on the H200). Our
  flash_attention reaches 0.53-0.95x of cuDNN (attention.json, commit 2f44f6e). Routing every SDPA call
  to it measured (e2e.json, commit ebc142f): ViT-base 1.44x Inductor (1.02x without), but GPT-2 0.98x
  and BERT 0.94x (1.02x / 0.98x without). What ViT showed: under torch.compile SDPA picks its backend on
  fake tensors, and for ViT's call it picked the unfused math path (fp32, S x S scores in memory) where
  eager picks cuDNN. So by default a call is routed exactly when SDPA, asked on the traced inputs as
  Inductor asks, would run math (fx_passes/attention.py, _sdpa_backend_when_traced); the switch routes
  every call. Hand-written attention is always rewritten: there the alternative is the unfused
  matmul-softmax-matmul (GPT-2 eager attention: 1.28x Inductor).
- Linear + bias + GELU in a graph that needs its backward: **on by default since 58762ca** (the switch
  turns it off). The op's backward does GELU' and the bias gradient in one Triton pass (1.17-1.35x aten's
  GELU backward + column sum, bench/results/dense_gelu_backward.json). In whole training steps it measured
  both ways while the ops were opaque custom ops: BERT-base 32.04 -> 31.53 ms and GPT-2 36.50 -> 36.39 ms
  with it (0150b1a, one process), BERT-base 33.21 -> 32.83 ms (6ef84e6), but once 40.2 ms against 32.6
  without (8e20162 / 12cc7ca, separate runs). A profile of BERT's step (bench/logs/
  profile_e2e_bert_dense_h200.log) then showed the GPU side 0.74 ms shorter with the rewrite and custom_op's
  Python dispatch costing ~0.24 ms of host time per call (26 calls a step): the rewrite's gain depended on
  the host. The ops are triton_ops since 58762ca, traced into Inductor's graph; BERT-base then measured
  35.95 (Inductor) / 31.98 / 31.58 ms (flash without / with it, one process,
  bench/logs/e2e_bert_dense_ab_triton_op_h200.log). Inference graphs were always rewritten (the forward alone
  0.96-1.57x Inductor).

On the CPU the fused ops run their plain-PyTorch reference, where speed is not the point: everything is
rewritten there, so CI exercises the whole pipeline. Set a switch to True (or its environment
variable to 1) to rewrite on CUDA anyway, e.g. to test the kernels inside a model.
"""

from __future__ import annotations

import os


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value is None else value.strip().lower() in ("1", "true", "yes", "on")


route_sdpa_calls_on_cuda: bool = _env_flag("FLASH_BACKEND_ROUTE_SDPA", False)
dense_training_on_cuda: bool = _env_flag("FLASH_BACKEND_DENSE_TRAINING", True)
# F.cross_entropy over a Linear's logits (fx_passes/cross_entropy.py). On by default because it measured
# faster on the H200: the head alone 1.03-1.37x Inductor forward+backward (cross_entropy.json, 89d71bf),
# BERT-base's training step 1.07x -> 1.12x Inductor (e2e.json, 5310b0c).
cross_entropy_on_cuda: bool = _env_flag("FLASH_BACKEND_CROSS_ENTROPY", True)

# Not a rewrite switch: flash::attention_forward runs the Gluon forward for Hopper where it applies
# (kernels/attention_fwd_hopper.py: sm_90, head_dim 128 / 256 / 64 non-causal, no mask / dropout / window):
# 1.06-1.32x the Triton forward on the H200 (bench/logs/attention_gluon_probe*_h200.log). Off
# (FLASH_BACKEND_HOPPER_ATTENTION=0): every call takes the Triton forward.
hopper_attention_forward: bool = _env_flag("FLASH_BACKEND_HOPPER_ATTENTION", True)
# Likewise flash::attention_backward and the Gluon backward (kernels/attention_bwd_hopper.py: sm_90, head_dim
# 64 / 128 / 256, no mask / dropout / window, not under deterministic algorithms): 1.06-1.36x the Triton
# backward on the H200 (bench/logs/attention_gluon_bwd_probe_h200.log, attention_gluon_bwd256_probe_s26_h200
# .log). FLASH_BACKEND_HOPPER_ATTENTION=0 turns both off; FLASH_BACKEND_HOPPER_ATTENTION_BACKWARD decides the
# backward alone.
hopper_attention_backward: bool = _env_flag("FLASH_BACKEND_HOPPER_ATTENTION_BACKWARD",
                                            hopper_attention_forward)

# Not a rewrite switch: eager calls of flash_attention / add_dropout_norm on plain CUDA tensors skip the
# dispatcher (flash_backend/ops/_eager.py); off sends every call through the registered torch.ops.flash ops.
eager_direct_calls: bool = _env_flag("FLASH_BACKEND_EAGER_DIRECT", True)

# Not a rewrite switch either: one Inductor heuristic the flash backend turns off in the graphs it compiles.
# Inductor's coalescing tiling analysis (torch._inductor.config.triton.coalesce_tiling_analysis) tiled
# BERT's embedding backward (a sum over the batch for the position embedding, fused with the scatter-adds
# of the word and token-type embeddings) as (positions, hidden, batch) with the batch innermost, so the 32
# lanes of a warp atomically add into the same token-type row: 2.1 ms of a 37 ms training step on an H200
# where Inductor's own graph, whose LayerNorm backward shapes that kernel, spends 0.23 ms. The kernel
# appears once our fused LayerNorm op takes the embedding's LayerNorm. Micro-benchmark (BERT-base
# embeddings + LayerNorm fwd+bwd, B=32, S=512, bf16, H200): flash 2563 -> 861 us with the analysis off,
# Inductor 866 -> 761 us. Set True (or FLASH_BACKEND_INDUCTOR_COALESCE_TILING=1) for Inductor's default.
inductor_coalesce_tiling_analysis: bool = _env_flag("FLASH_BACKEND_INDUCTOR_COALESCE_TILING", False)

# Not a rewrite switch: a Linear output that a training graph returns and also uses (the logits next to
# the loss) is returned detached, its gradient taken outside the compiled graph, so that an unused logits
# output costs no (M, V) zeros in the backward (flash_backend/returned_linear.py). Off: AOTAutograd's
# default (FLASH_BACKEND_DETACH_RETURNED_LOGITS=0).
detach_returned_logits: bool = _env_flag("FLASH_BACKEND_DETACH_RETURNED_LOGITS", True)

# Not a rewrite switch: our Triton kernels are handed to Inductor's compile workers as soon as Inductor's
# codegen writes them, instead of when the generated module is loaded, so their compiles overlap the rest of
# code generation (flash_backend/_early_kernel_compile.py). Off: Inductor's default
# (FLASH_BACKEND_EARLY_KERNEL_COMPILE=0).
early_kernel_compile: bool = _env_flag("FLASH_BACKEND_EARLY_KERNEL_COMPILE", True)
