"""Triton kernels: each file holds a kernel, its launcher and a plain-PyTorch reference."""
