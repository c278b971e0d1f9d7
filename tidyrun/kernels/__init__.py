"""Triton kernels for the GPU path. Imported only when a CUDA runner is built (or by the
interpreter tests): the CPU path never needs Triton."""
