"""Compute kernels: Triton kernels beside plain-torch references."""
