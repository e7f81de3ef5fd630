"""Triton kernels of the GPU path, each beside the torch reference it is tested against.

Importing a module here imports ``triton``; the CPU path never does. The kernels also run on the
CPU under ``TRITON_INTERPRET=1`` (set before the module is imported), which is how they are tested.
"""
