"""pagedserve: an LLM inference backend for Triton Inference Server and KServe.

`pagedserve.core` is the platform-neutral engine, `pagedserve.kernels` its numerics,
`pagedserve.adapters` the Triton and KServe front ends, and `pagedserve/model_repository` the
Triton model repository shipped as data (docs/design.md). Nothing is imported here, so importing
one subpackage never pays for another.
"""
