"""What an empty conversation offers: a greeting and example prompts that suit the model that is loaded (a small
model gets questions it answers well; a larger or remote one gets writing, code and summaries)."""

from __future__ import annotations

SMALL_MODEL_BYTES = 1_000_000_000  # below about a billion parameters' worth of weights: short factual questions

SMALL_EXAMPLES = (
    "What is the capital of France?",
    "Give me three ideas for a rainy afternoon.",
    "Explain what a rainbow is in two sentences.",
    "Write a short poem about the sea.",
)
LARGE_EXAMPLES = (
    "Summarise the main arguments for and against remote work.",
    "Write a Python function that checks whether a word is a palindrome.",
    "Plan a three-day trip to Lisbon on a small budget.",
    "Explain how a hash table works, with a small example.",
)


def greeting(model_name: str, weight_bytes: int, remote: bool = False) -> tuple[str, tuple[str, ...]]:
    """The greeting line and 4 example prompts for `model_name`."""
    small = not remote and weight_bytes < SMALL_MODEL_BYTES
    where = "on a server" if remote else "on this computer"
    return f"{model_name} is ready, {where}.", SMALL_EXAMPLES if small else LARGE_EXAMPLES
