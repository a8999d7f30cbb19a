"""`bench memory`: what the engine really holds (resident set size, RSS) in the set-ups people run, each measured
in a process of its own so one does not inherit another's allocations.

- `fresh_chat_rss_mb`: `generate`'s set-up (hardware policy, cascade memory, prefix cache in a scratch dir) after
  one short chat reply; `fresh_chat_peak_rss_mb` is the peak over the process's life (loading included).
- `app_idle_rss_mb`: the app's engine set-up (app/engine_factory.py, without Qt: recommended threads, the policy,
  the cascade) with its first conversation open, idle.
- `server_idle_rows_rss_mb` / `server_one_row_rss_mb`: `serve`'s set-up (engine.openai.service.ModelService on the
  same engine) with 8 rows and with 1, idle after loading.

The child of each measurement is this module run with `--child KIND`; it prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

MB = 1024 * 1024
SERVER_ROWS = 8
GOAL_FRESH_CHAT_MB = 600
GOAL_ROWS_RATIO = 1.3


def peak_rss_bytes() -> int:
    """This process's peak resident set (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def rss_bytes() -> int:
    return int(psutil.Process().memory_info().rss)


def _child(kind: str, model: str | None, threads: int | None) -> dict[str, Any]:
    from engine.generation.loop import GenerationSettings
    from engine.generation.sampling import SamplingSettings
    from engine.hw import this_machine_policy, use_recommended_threads
    from engine.session.engine import Engine, memory_factory_for

    use_recommended_threads(threads)
    policy = this_machine_policy()
    with tempfile.TemporaryDirectory(prefix="spark-bench-memory-") as cache:
        factory = memory_factory_for(model, cache_dir=Path(cache) / "kv", policy=policy)
        engine = Engine.load(model, "cpu", memory_factory=factory, policy=policy, quantize="auto")
        out: dict[str, Any] = {"model": str(engine.model_dir.name), "backend": engine.choice.explain()}
        if kind == "fresh-chat":
            session = engine.new_session()
            settings = GenerationSettings(max_tokens=16, sampling=SamplingSettings(greedy=True))
            list(session.chat("hi", settings))
            out["kv_resident_bytes"] = session.backend.kv_resident_bytes()
        elif kind == "app-idle":
            session = engine.new_session()
            out["kv_resident_bytes"] = session.backend.kv_resident_bytes()
        else:
            from engine.openai.service import ModelService, ServeConfig

            rows = int(kind.removeprefix("server-"))
            service = ModelService(
                engine.locked_fork(), engine.tokenizer, engine.memory_factory, ServeConfig("bench", max_batch=rows)
            )
            time.sleep(0.5)  # the scheduler thread has started and gone idle
            out["kv_resident_bytes"] = service.scheduler.backend.kv_resident_bytes()
            service.close()
        out["rss_bytes"] = rss_bytes()
        out["peak_rss_bytes"] = peak_rss_bytes()
        return out


def measure(kind: str, model: Path | None, threads: int | None) -> dict[str, Any]:
    """Run one child measurement; its JSON line as a dict."""
    cmd = [sys.executable, "-m", "engine.bench.memory", "--child", kind]
    if model is not None:
        cmd += ["--model", str(model)]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ))
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise RuntimeError(f"the {kind} measurement failed: {last}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model
    kinds = ["fresh-chat", "app-idle", "server-1", f"server-{SERVER_ROWS}"]
    got = {kind: measure(kind, model, args.threads) for kind in kinds}
    fresh, app, one, rows = (got[k] for k in kinds)
    result: dict[str, Any] = {
        "model": fresh["model"],
        "backend": fresh["backend"],
        "fresh_chat_rss_mb": round(fresh["rss_bytes"] / MB, 1),
        "fresh_chat_peak_rss_mb": round(fresh["peak_rss_bytes"] / MB, 1),
        "fresh_chat_kv_mb": round(fresh["kv_resident_bytes"] / MB, 2),
        "app_idle_rss_mb": round(app["rss_bytes"] / MB, 1),
        "server_one_row_rss_mb": round(one["rss_bytes"] / MB, 1),
        "server_idle_rows_rss_mb": round(rows["rss_bytes"] / MB, 1),
        "server_rows": SERVER_ROWS,
        "server_idle_rows_kv_mb": round(rows["kv_resident_bytes"] / MB, 2),
    }
    result["server_rows_ratio"] = round(rows["rss_bytes"] / one["rss_bytes"], 3)
    result["goals"] = {
        "fresh_chat_rss_mb_at_most": GOAL_FRESH_CHAT_MB,
        "server_rows_ratio_at_most": GOAL_ROWS_RATIO,
        "met": result["fresh_chat_rss_mb"] <= GOAL_FRESH_CHAT_MB and result["server_rows_ratio"] <= GOAL_ROWS_RATIO,
    }
    return result


def _main() -> None:
    p = argparse.ArgumentParser(prog="engine.bench.memory")
    p.add_argument("--child", required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args()
    print(json.dumps(_child(a.child, a.model, a.threads)))


if __name__ == "__main__":
    _main()
