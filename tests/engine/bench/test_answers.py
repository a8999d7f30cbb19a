"""`bench answers`' question set and its judge: 40 questions with answers, whole-word matching, prompt ids from the
chat template (what both engines read)."""

from __future__ import annotations

from engine.bench.answers import acceptable, load_questions, prompt_ids
from engine.loading.tokenizer import Tokenizer
from tests.helpers.real_model import real_gguf


def test_the_question_set() -> None:
    questions = load_questions()
    assert len(questions) == 40 and len({q.question for q in questions}) == 40
    assert {q.kind for q in questions} == {"capital", "arithmetic", "fact", "conversion"}
    assert all(q.accept and all(a.strip() == a and a for a in q.accept) for q in questions)


def test_acceptable_is_whole_word() -> None:
    assert acceptable("The capital of France is Paris.", ["Paris"])
    assert acceptable("paris", ["Paris"])
    assert not acceptable("Parisian cafés", ["Paris"])
    assert acceptable("2 + 2 = 4.", ["4", "four"]) and not acceptable("It is 42.", ["4"])
    assert acceptable("Water freezes at 0°C.", ["0", "zero"])
    assert acceptable("Its symbol is Au.", ["Au"]) and not acceptable("au revoir", ["Au"])
    assert acceptable("There are 1,000 meters.", ["1000", "1,000"])


def test_prompt_ids_follow_the_chat_template() -> None:
    tokenizer = Tokenizer.load(real_gguf())
    ids = prompt_ids(tokenizer, "What is the capital of France?")
    text = tokenizer.decode(ids, skip_special=False)
    assert text == tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
