"""Kernel tests: without a GPU the Triton kernels run under the interpreter (TRITON_INTERPRET=1).

Triton reads the variable when a kernel is decorated, so it is set here, before any test module
imports pagedserve.kernels.triton.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """Runs a test on one thread and on two (the kernels split their column ranges across threads:
    ties and folds that cross a split are only exercised with two), restoring the count after."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
