"""Triton kernels too large to live in their op module (see flash_backend/ops)."""
