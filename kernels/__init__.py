"""Triton kernels of the MTP forward, one op per file; they know nothing of models."""
