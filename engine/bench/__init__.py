"""Benchmarks behind `python -m engine bench SUITE`: each module exposes `run(args) -> dict[str, object]`."""
