"""Batched sampling over the logits of a whole step.

Random draws use the exponential race (argmax of probs / Exp(1) noise is a sample from probs), so
each seeded request draws exactly one noise vector per token from its own generator: the same
tokens whatever else shares the batch and however the prompt was chunked.
"""

from __future__ import annotations

import torch

from pagedserve.core.sampling_params import SamplingParams


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_ids: tuple[str, ...] | list[str]) -> None:
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    def _generator(self, request_id: str, seed: int) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            gen = self._generators[request_id] = torch.Generator().manual_seed(seed)
        return gen

    def __call__(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> list[int]:
        """logits: fp32 [num_sampled, vocab] -> one token id per row."""
        greedy = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not random_rows:
            return greedy.tolist()
        rows = torch.tensor(random_rows, device=logits.device)
        temps = torch.tensor([params[i].temperature for i in random_rows], device=logits.device)
        probs = torch.softmax(logits[rows] / temps[:, None], dim=-1)
        noise = torch.empty_like(probs)
        unseeded = []
        for j, i in enumerate(random_rows):
            seed = params[i].seed
            if seed is None:
                unseeded.append(j)
            else:  # CPU generator: the draw does not depend on the device the engine runs on
                noise[j] = torch.empty(probs.shape[1]).exponential_(generator=self._generator(request_ids[i], seed))
        if unseeded:
            idx = torch.tensor(unseeded, device=logits.device)
            noise[idx] = torch.empty(len(unseeded), probs.shape[1], device=logits.device).exponential_()
        sampled = (probs / noise).argmax(dim=-1)
        greedy[rows] = sampled
        return greedy.tolist()
