"""`bench decode`'s llama.cpp peer in a process of its own: it runs under the user's OpenMP policy, not the one the
engine sets for PyTorch, answers what llama.cpp in our process would, and fails in one sentence."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.bench.gguf_export import export_gguf
from engine.bench.llamacpp_peer import LlamaCppPeer, PeerError, peer_environment
from engine.process import user_omp_wait_policy
from tests.helpers.tiny import make_tiny_model

HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


def test_the_engine_makes_openmp_workers_sleep_when_it_starts_unless_the_user_chose() -> None:
    probe = (
        "import os; from engine.process import prepare_process, user_omp_wait_policy; prepare_process(); "
        "print(os.environ['OMP_WAIT_POLICY'], user_omp_wait_policy())"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["PASSIVE", "None"]
    env["OMP_WAIT_POLICY"] = "ACTIVE"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["ACTIVE", "ACTIVE"]


def test_the_peer_gets_the_users_environment_back() -> None:
    assert "OMP_WAIT_POLICY" not in peer_environment(None)
    assert peer_environment("ACTIVE")["OMP_WAIT_POLICY"] == "ACTIVE"
    assert peer_environment(None)["PATH"] == os.environ["PATH"]


def test_a_file_the_peer_cannot_open_is_one_sentence(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF not really")
    peer = LlamaCppPeer(peer_environment(None))
    try:
        with pytest.raises(PeerError) as err:
            peer.load(bad, n_ctx=64, threads=1, n_batch=16)
        assert "\n" not in str(err.value)
        assert ("not installed" in str(err.value)) != HAVE_LLAMA_CPP
        with pytest.raises(PeerError):  # nothing loaded: the peer answers, it does not die
            peer.measure([1, 2, 3], 2)
    finally:
        peer.close()
    assert peer.proc.returncode == 0


@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python is the bench extra")
def test_the_peer_answers_as_llama_cpp_in_our_process(tmp_path: Path) -> None:
    import llama_cpp

    path = export_gguf(make_tiny_model(tmp_path / "m", "llama"), tmp_path / "m.gguf", "q8_0")
    ids = [5, 17, 42, 7, 99, 3]
    peer = LlamaCppPeer(peer_environment(user_omp_wait_policy()))
    try:
        assert peer.load(path, n_ctx=32, threads=1, n_batch=len(ids)) == llama_cpp.__version__
        theirs = peer.last_logits(ids)
        run = peer.measure(ids, 4)
    finally:
        peer.close()
    llm = llama_cpp.Llama(str(path), n_ctx=32, n_threads=1, n_batch=len(ids), verbose=False)
    llm.eval(ids)
    ours = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy()
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-4)
    assert run["tokens"][0] == int(np.argmax(ours))
    assert len(run["tokens"]) == 4 and run["prefill_tps"] > 0 and run["decode_tps"] > 0
    llm.close()
