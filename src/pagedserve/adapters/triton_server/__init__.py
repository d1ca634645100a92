"""Triton Inference Server adapter: a decoupled streaming Python-backend model (see model_repository/)."""
