"""Triton kernels of flash::linear_cross_entropy (flash_backend/ops/cross_entropy.py holds the op).

Both kernels are memory-bound passes over the (M, V) logits, which at language-model sizes are the largest
tensor of the step (BERT-base: 16384 x 30522 bf16 = 1 GB). The forward reads them once, the backward reads
them once and writes the gradient once; nothing else of size M x V is touched. Rows whose target is
ignore_index (padding) are not read at all: their loss and gradient are 0 whatever the logits hold.

Forward: one program per row streams the row in BLOCK_V chunks, keeping per lane a running maximum and a
sum of exponentials rescaled to it (lanes are merged once, after the loop, so the loop has no cross-lane
reduction), the row's sum of logits when label smoothing needs it, and gathers the target's logit.
Backward: one program per (group of rows, BLOCK_V chunk) recomputes the softmax from the saved logsumexp
row by row, writes zeros into the rows' padding so that the GEMMs can read the padded rows whole, and sums
its columns for the bias gradient.
Arithmetic is fp32; exponentials are base 2 on logits pre-scaled by log2(e).
"""

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def _cross_entropy_fwd_kernel(
    LOGITS,  # (M, V), the logits' dtype; row stride stride_logits (rows may be padded)
    TARGET,  # (M,) integer class indices
    LOSS,  # (M,) fp32 out: the row's loss; 0 where ignored, NaN where the target is outside [0, V)
    LSE,  # (M,) fp32 out: logsumexp of the row (natural log), kept for the backward; 0 where ignored
    stride_logits,  # row stride of LOGITS
    V,  # classes
    ignore_index,
    label_smoothing,
    BLOCK_V: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,  # cdiv(V, BLOCK_V): a compile-time trip count (the vocabulary is fixed)
    HAS_SMOOTHING: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(TARGET + row).to(tl.int64)
    if target == ignore_index:
        # An ignored row's loss is the constant 0 and its gradient 0 (the backward never reads its logits
        # or logsumexp): its logits are not read at all. Padding rows are 30 % of BERT's MLM batch.
        tl.store(LOSS + row, 0.0)
        tl.store(LSE + row, 0.0)
        return
    row_start = LOGITS + row * stride_logits
    cols = tl.arange(0, BLOCK_V)
    lane_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK_V], tl.float32)
    lane_total = tl.zeros([BLOCK_V], tl.float32)
    for chunk in range(NUM_CHUNKS):
        start = chunk * BLOCK_V
        in_row = start + cols < V
        z = tl.load(row_start + start + cols, mask=in_row, other=float("-inf")).to(tl.float32)
        z2 = z * LOG2E
        new_max = tl.maximum(lane_max, z2)
        # A lane that has seen only -inf (padding, or -inf logits) keeps the maximum -inf; rescaling by
        # exp2(-inf - -inf) would make its sum NaN, so it rescales against 0 instead (its sum stays 0).
        pivot = tl.where(new_max == float("-inf"), 0.0, new_max)
        lane_sum = lane_sum * tl.exp2(lane_max - pivot) + tl.exp2(z2 - pivot)
        lane_max = new_max
        if HAS_SMOOTHING:
            lane_total += tl.where(in_row, z, 0.0)
    row_max = tl.max(lane_max, 0)
    pivot = tl.where(row_max == float("-inf"), 0.0, row_max)
    # All -inf: log2(0) = -inf, and the loss below becomes NaN, as PyTorch's log_softmax gives.
    lse = (pivot + tl.log2(tl.sum(lane_sum * tl.exp2(lane_max - pivot), 0))) * LN2

    in_range = (target >= 0) & (target < V)
    target_logit = tl.load(row_start + target, mask=in_range, other=0.0).to(tl.float32)
    # Label smoothing eps: the target distribution is (1 - eps) one-hot + eps / V uniform, so
    # loss = lse - (1 - eps) * z_target - eps * mean(z).
    loss = lse - (1.0 - label_smoothing) * target_logit
    if HAS_SMOOTHING:
        loss -= label_smoothing * (tl.sum(lane_total, 0) / V)
    loss = tl.where(in_range, loss, float("nan"))  # PyTorch raises; a kernel cannot, NaN is never silent
    tl.store(LOSS + row, loss)
    tl.store(LSE + row, lse)


@triton.jit
def _cross_entropy_bwd_kernel(
    GRAD,  # (M, VP) out, the logits' dtype; row stride stride_grad; columns [V, VP) get 0
    DBIAS_PARTIAL,  # (row groups, VP) fp32 out: each group's column sums of GRAD (HAS_DBIAS)
    LOGITS,  # (M, V); row stride stride_logits
    LSE,  # (M,) fp32, from the forward
    TARGET,  # (M,) integer class indices
    GRAD_LOSS,  # (M,) fp32: gradient of each row's loss; stride stride_grad_loss (0 when broadcast)
    GRAD_LOGITS,  # (M, V): gradient reaching the logits output itself (HAS_GRAD_LOGITS)
    stride_grad,  # row stride of GRAD
    stride_logits,  # row stride of LOGITS
    stride_grad_loss,  # stride of GRAD_LOSS
    stride_grad_logits,  # row stride of GRAD_LOGITS
    M,  # rows
    V,  # classes
    VP,  # padded classes written to GRAD (>= V)
    ignore_index,
    label_smoothing,
    rows_per_group,
    BLOCK_V: tl.constexpr,
    CHUNKS_PER_ROW: tl.constexpr,  # cdiv(VP, BLOCK_V)
    HAS_GRAD_LOGITS: tl.constexpr,
    HAS_DBIAS: tl.constexpr,
):
    # A 1-D grid of (row group, column chunk) programs, the chunks of a group on consecutive programs. A
    # program walks its group's rows in one column chunk, so the bias gradient (the column sums) stays in
    # registers: no second pass over the (M, V) gradient for it.
    pid = tl.program_id(0)
    group = pid // CHUNKS_PER_ROW
    cols = (pid % CHUNKS_PER_ROW) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_row = cols < V
    dbias = tl.zeros([BLOCK_V], tl.float32)
    row = group * rows_per_group
    row_end = tl.minimum(row + rows_per_group, M)
    while row < row_end:  # a runtime bound: the interpreter cannot range() over one
        row64 = row.to(tl.int64)
        target = tl.load(TARGET + row64).to(tl.int64)
        ignored = target == ignore_index
        # an ignored row's logits are not read (masked lanes move no memory): its gradient is 0 below
        z = tl.load(LOGITS + row64 * stride_logits + cols, mask=in_row & ~ignored, other=0.0).to(tl.float32)
        lse = tl.load(LSE + row64)
        grad_loss = tl.load(GRAD_LOSS + row64 * stride_grad_loss)
        # d loss / d z_j = softmax_j - (1 - eps) [j == target] - eps / V
        onehot = tl.where(cols == target, 1.0 - label_smoothing, 0.0)
        grad = tl.exp2((z - lse) * LOG2E) - label_smoothing / V - onehot
        # An ignored row's loss is the constant 0: its gradient is exactly 0 (not 0 * NaN where lse is -inf).
        grad = tl.where(ignored, 0.0, grad * grad_loss)
        if HAS_GRAD_LOGITS:
            grad += tl.load(GRAD_LOGITS + row64 * stride_grad_logits + cols, mask=in_row,
                            other=0.0).to(tl.float32)
        grad = tl.where(in_row, grad, 0.0).to(GRAD.dtype.element_ty)
        tl.store(GRAD + row64 * stride_grad + cols, grad, mask=cols < VP)
        if HAS_DBIAS:
            dbias += grad.to(tl.float32)  # the rounded values: the bias gradient of the gradient stored
        row += 1
    if HAS_DBIAS:
        tl.store(DBIAS_PARTIAL + group.to(tl.int64) * VP + cols, dbias, mask=cols < VP)
