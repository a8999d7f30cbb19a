"""A model's own sampling defaults as the app's tests use them: temperature 0.2, top-p 0.9, top-k 40, min-p 0.05,
repetition penalty 1.1 over 64 tokens (a catalog entry's values), from the sources named."""

from __future__ import annotations

from engine import ModelSampling


def model_sampling(*sources: str) -> ModelSampling:
    return ModelSampling(
        temperature=0.2,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        repetition_window=64,
        greedy=False,
        sources=sources,
    )
