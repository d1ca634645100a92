"""Kernel tests: without a GPU the Triton kernels run under the interpreter (TRITON_INTERPRET=1).

Triton reads the variable when a kernel is decorated, so it is set here, before any test module
imports pagedserve.kernels.triton.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
