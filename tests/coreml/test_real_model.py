"""The real default model (the shipped GGUF) at its Core ML geometry (the cascade's slot table fitted to
CoreMLBackend.max_slots): the conversion's targets, the runtime finding the bundle `make app` builds, and the
reference interpreter's parity with the torch fp16 path. Slow (a conversion of the real model, cached under the
cache dir), marked `slow`, and skipped when the model is absent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coreml.check import run_checks
from coreml.convert import cached_bundle, expected_bytes
from coreml.reference import InterpreterBackend
from engine.backends.coreml.bundle import Bundle
from engine.backends.coreml.programs import ANE_MAX_SLOTS, DEFAULT_QUANTIZE
from engine.backends.coreml.runtime import CoreMLBackend
from engine.loading.tokenizer import Tokenizer
from engine.memory.cascade import CascadeConfig, CascadeMemory
from engine.session.engine import memory_factory_for
from tests.helpers.coreml_bundles import op_types, run_greedy, torch_fp16_with_package_weights
from tests.helpers.fake_coreml import FakeLoader

# Slow: each interpreter step copies the whole (30, 3, 2048, 64) KV state per layer (slice_update), so 3 prompts
# x 32 tokens took over 10 minutes on a loaded 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]
PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
)
TOKENS = 32


@pytest.fixture(scope="module")
def real_bundle(real_gguf_model: Path) -> Path:
    # What packaging/build_coreml.py ships: default compression, units and geometry; converted once per cache.
    return cached_bundle(real_gguf_model)


@pytest.fixture(scope="module")
def cascade(real_gguf_model: Path, real_bundle: Path) -> CascadeConfig:
    """The cascade the engine lays out over a CoreMLBackend of the default model (engine.session.engine's factory), after
    checking that the backend finds the bundle build_coreml.py makes: same slot count, no second conversion."""
    backend = CoreMLBackend(real_gguf_model, cache_dir=real_bundle.parent, loader=FakeLoader())
    memory = memory_factory_for(real_gguf_model, prefix_cache=False)(backend)
    assert isinstance(memory, CascadeMemory) and backend.path == real_bundle
    bundle = Bundle.open(real_bundle)
    assert memory.cfg.num_slots == bundle.slots == ANE_MAX_SLOTS < bundle.config.max_position_embeddings
    return memory.cfg


def test_default_conversion_meets_its_targets(real_bundle: Path, cascade: CascadeConfig) -> None:
    bundle = Bundle.open(real_bundle)
    assert bundle.quantize == DEFAULT_QUANTIZE and bundle.units == "CPU_AND_NE"
    assert bundle.slots == cascade.num_slots
    assert bundle.weight_bytes() <= 1.05 * expected_bytes(bundle.config, bundle.quantize)
    assert not op_types(bundle).keys() & {"constexpr_blockwise_shift_scale", "gather"}
    lines = list(run_checks(real_bundle))
    assert all(line.ok for line in lines), [str(line) for line in lines if not line.ok]


def _greedy_tokens(backend, ids: list[int], config: CascadeConfig, forced: list[int] | None = None):
    return run_greedy(backend, CascadeMemory(backend, config), ids, TOKENS, forced=forced, chunk=len(ids))


def test_interpreter_greedy_tokens_equal_the_torch_fp16_path(
    real_gguf_model: Path, real_bundle: Path, cascade: CascadeConfig, tmp_path: Path
) -> None:
    """32 greedy tokens per prompt: the interpreter, teacher-forced on the torch fp16 path's tokens (the bundle's own
    dequantized weights), picks the same token at every step where torch's top-2 margin exceeds TIE; the steps
    before the first disagreement are exactly what a free-running interpreter would generate."""
    interp = InterpreterBackend(real_bundle)
    torch_be = torch_fp16_with_package_weights(real_bundle, tmp_path / "dequantized")
    torch_be.allocate(1, cascade.num_slots)
    tok = Tokenizer.load(real_gguf_model)
    for prompt in PROMPTS:
        ids = tok.encode_chat([{"role": "user", "content": prompt}])
        ref_logits, want = _greedy_tokens(torch_be, ids, cascade)
        interp.allocate(1, cascade.num_slots)
        _, got = _greedy_tokens(interp, ids, cascade, forced=want)
        same = next((i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w), TOKENS)
        margins = [float(r[-1].float().topk(2).values.diff().abs()) for r in ref_logits[:-1]]
        flips = [(i, round(margins[i], 3)) for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
        print(
            f"{prompt!r}: {same}/{TOKENS} tokens equal before any disagreement; disagreements (step, torch top-2 margin): {flips}"
        )
        assert all(m < TIE for _, m in flips), f"{prompt!r}: {tok.decode(got)!r} != {tok.decode(want)!r}"


TIE = 0.1  # logits; a top-2 margin below this is a tie at fp16 precision (the logits span ~[-20, 30])


def test_fp16_accumulation_bounds_the_drift(real_gguf_model: Path, real_bundle: Path, cascade: CascadeConfig) -> None:
    """The ANE-pessimistic interpreter (fp16 sums) teacher-forced on the default path's tokens: the logits drift by
    at most DRIFT and the top token agrees on nearly every step."""
    wide, narrow = InterpreterBackend(real_bundle), InterpreterBackend(real_bundle, accumulate="fp16")
    ids = Tokenizer.load(real_gguf_model).encode_chat([{"role": "user", "content": PROMPTS[0]}])
    ref_logits, ref_tokens = _greedy_tokens(wide, ids, cascade)
    got_logits, _ = _greedy_tokens(narrow, ids, cascade, forced=ref_tokens)
    drift = max(float((g[-1] - r[-1]).abs().max()) for g, r in zip(got_logits, ref_logits, strict=True))
    same = sum(int(g[-1].argmax()) == int(r[-1].argmax()) for g, r in zip(got_logits, ref_logits, strict=True)) / len(
        ref_logits
    )
    print(f"fp16 accumulation: max logit drift {drift:.3f}, same top token {same:.1%} over {len(ref_logits)} steps")
    assert torch.isfinite(torch.stack([g[-1] for g in got_logits])).all()
    assert drift < DRIFT and same >= 0.9


DRIFT = 2.0  # logits of this model span ~[-20, 30]; measured drift: README "Core ML"
