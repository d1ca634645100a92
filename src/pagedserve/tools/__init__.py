"""Offline commands: the `pagedserve` command line, the engine's flags, `pagedserve tune` (and the
workload replay it measures with) and `pagedserve run-batch`. Tools may drive an LLMEngine
directly on their own thread; adapters serve through AsyncLLMEngine only (docs/design.md)."""
