"""llama.cpp (llama-cpp-python) as `bench decode`'s peer, in a process of its own that the bench drives line by line.

Why a process of its own: PyTorch and llama.cpp load the same OpenMP runtime (soname libgomp.so.1), and the engine
sets PyTorch's wait policy (engine/__init__.py); in our process llama.cpp would run under that policy too (its
2-thread decode fell from 153 to 45 tok/s when we tried), in its own it runs with the environment the user gave,
as it does on its own. The child runs this file as a script, so it never imports `engine`; it needs only the
standard library, numpy and llama_cpp.

Protocol: one JSON object per line each way. Requests: {"op": "load", "path", "n_ctx", "threads", "n_batch"},
{"op": "measure", "ids", "n_decode"}, {"op": "last_logits", "ids"}, {"op": "peak_rss"}, {"op": "generate", "ids", "max_tokens",
"sampling", "seed", "stop_ids"} (`bench answers`: llama.cpp's own sampler chain at the given settings); replies: {"ok": true, ...} or
{"ok": false, "error": "one sentence"}.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


class PeerError(Exception):
    """The peer process failed or answered an error (one sentence)."""


class LlamaCppPeer:
    """The parent's handle on the peer process: each method is one request and its reply."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
        )

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except OSError as exc:
            raise PeerError(f"the llama.cpp peer process stopped ({exc})") from None
        if not line:
            try:
                code: int | None = self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                code = None
            how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited (code {code})"
            raise PeerError(f"the llama.cpp peer process {how}")
        reply: dict[str, Any] = json.loads(line)
        if not reply.get("ok"):
            raise PeerError(str(reply.get("error", "the llama.cpp peer failed")))
        return reply

    def load(self, path: Path, n_ctx: int, threads: int, n_batch: int) -> str:
        """Open the GGUF; returns llama-cpp-python's version."""
        reply = self._ask({"op": "load", "path": str(path), "n_ctx": n_ctx, "threads": threads, "n_batch": n_batch})
        return str(reply["version"])

    def measure(self, ids: list[int], n_decode: int) -> dict[str, Any]:
        """Prefill `ids`, then greedy-decode: {"prefill_tps", "decode_tps", "tokens"}."""
        reply = self._ask({"op": "measure", "ids": ids, "n_decode": n_decode})
        return {k: reply[k] for k in ("prefill_tps", "decode_tps", "tokens")}

    def peak_rss_bytes(self) -> int:
        """The peer process's peak resident set so far."""
        return int(self._ask({"op": "peak_rss"})["bytes"])

    def last_logits(self, ids: list[int]) -> np.ndarray:
        """The logits (V,) float32 after reading `ids` from an empty context."""
        reply = self._ask({"op": "last_logits", "ids": ids})
        return np.frombuffer(base64.b64decode(reply["logits"]), dtype=np.float32).copy()

    def generate(
        self, ids: list[int], max_tokens: int, sampling: dict[str, Any], seed: int, stop_ids: list[int]
    ) -> list[int]:
        """Sample up to `max_tokens` after `ids` with llama.cpp's sampler (`sampling`: temperature, top_p, top_k,
        min_p, repeat_penalty; temperature 0 is greedy), seeded; the ids before the first of `stop_ids`."""
        request = {"op": "generate", "ids": ids, "max_tokens": max_tokens, "sampling": sampling, "seed": seed}
        reply = self._ask({**request, "stop_ids": stop_ids})
        return [int(t) for t in reply["tokens"]]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


# -- the child -------------------------------------------------------------------------------------------------


def _last_logits(llm: Any) -> np.ndarray:
    """The last evaluated token's logits (V,): read from the context, since `Llama.scores` is only filled with
    logits_all=True (which would make llama.cpp compute the LM head for every prompt token)."""
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))


def _measure(llm: Any, ids: list[int], n_decode: int) -> dict[str, Any]:
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    tok = int(np.argmax(_last_logits(llm)))
    t_first = time.perf_counter()
    tokens = [tok]
    for _ in range(n_decode - 1):
        llm.eval([tok])
        tok = int(np.argmax(_last_logits(llm)))
        tokens.append(tok)
    t_end = time.perf_counter()
    return {
        "prefill_tps": len(ids) / (t_first - t0),
        "decode_tps": (n_decode - 1) / (t_end - t_first),
        "tokens": tokens,
    }


def _generate(llm: Any, req: dict[str, Any]) -> dict[str, Any]:
    s = req["sampling"]
    stop = {int(t) for t in req["stop_ids"]}
    llm.reset()
    llm.set_seed(int(req["seed"]))
    tokens: list[int] = []
    for tok in llm.generate(
        [int(i) for i in req["ids"]],
        top_k=int(s["top_k"]),
        top_p=float(s["top_p"]),
        min_p=float(s["min_p"]),
        temp=float(s["temperature"]),
        repeat_penalty=float(s["repeat_penalty"]),
        reset=True,
    ):
        if int(tok) in stop:
            break
        tokens.append(int(tok))
        if len(tokens) >= int(req["max_tokens"]):
            break
    return {"tokens": tokens}


def _serve() -> None:
    try:
        import llama_cpp
    except ImportError:
        llama_cpp = None
    llm: Any = None
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if llama_cpp is None:
                reply: dict[str, Any] = {"ok": False, "error": "llama-cpp-python is not installed"}
            elif req["op"] == "load":
                llm = llama_cpp.Llama(
                    req["path"],
                    n_ctx=int(req["n_ctx"]),
                    n_threads=int(req["threads"]),
                    n_threads_batch=int(req["threads"]),
                    n_batch=int(req["n_batch"]),
                    verbose=False,
                )
                reply = {"version": llama_cpp.__version__}
            elif req["op"] == "measure":
                reply = _measure(llm, [int(i) for i in req["ids"]], int(req["n_decode"]))
            elif req["op"] == "generate":
                reply = _generate(llm, req)
            elif req["op"] == "last_logits":
                llm.reset()
                llm.eval([int(i) for i in req["ids"]])
                logits = np.asarray(_last_logits(llm), dtype=np.float32)
                reply = {"logits": base64.b64encode(logits.tobytes()).decode("ascii")}
            elif req["op"] == "peak_rss":
                import resource  # ru_maxrss: KiB on Linux, bytes on macOS

                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                reply = {"bytes": peak if sys.platform == "darwin" else peak * 1024}
            else:
                reply = {"ok": False, "error": f"unknown request {req['op']!r}"}
        except Exception as exc:  # any failure is one reply line; the parent decides
            reply = {"ok": False, "error": f"llama.cpp failed: {exc}"}
        reply.setdefault("ok", True)
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    if llm is not None:
        llm.close()


def peer_environment(user_omp_wait_policy: str | None) -> dict[str, str]:
    """Our environment with OpenMP's wait policy as the user had it before `engine` set PyTorch's."""
    env = dict(os.environ)
    if user_omp_wait_policy is None:
        env.pop("OMP_WAIT_POLICY", None)
    else:
        env["OMP_WAIT_POLICY"] = user_omp_wait_policy
    return env


if __name__ == "__main__":
    _serve()
