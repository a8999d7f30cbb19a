"""Held-out text for perplexity and faithfulness measures (the benchmarks and `python -m coreml` read it): the local
Python standard library's pydoc pages, rendered the same on every machine running the same Python."""
