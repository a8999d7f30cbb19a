"""`bench documents`' corpus (engine.bench.documents): its size follows --tokens, every fact is planted once, and a
paraphrased question shares only the fact's name with it."""

from __future__ import annotations

import argparse

import pytest

from engine.bench.documents import DOCUMENTS, FACTS_PER_DOCUMENT, corpus, question, run
from engine.errors import SparkError


def test_the_corpus_grows_with_tokens_and_holds_each_fact_once() -> None:
    small, facts = corpus(6_000)
    large, same = corpus(48_000)
    assert same == facts and len(facts) == DOCUMENTS * FACTS_PER_DOCUMENT
    assert len({n for n, _, _ in facts}) == len(facts)
    ratio = sum(len(t) for _, t in large) / sum(len(t) for _, t in small)
    assert 7 < ratio < 9
    text = "\n".join(t for _, t in large)
    for name, key, _ in facts:
        assert text.count(f"pass key of the {name} is {key}.") == 1


def test_a_paraphrased_question_shares_only_the_name() -> None:
    asked = question("red harbour", paraphrased=True)
    assert "red" in asked and "harbour" in asked and "pass key" not in asked and "red harbour" not in asked
    assert "pass key of the red harbour" in question("red harbour", paraphrased=False)


def test_a_corpus_size_out_of_bounds_is_refused_in_one_sentence() -> None:
    args = argparse.Namespace(tokens=10, model=None, threads=None, quick=False, backend="cpu", quantize="auto")
    with pytest.raises(SparkError, match="--tokens must be between"):
        run(args)
