"""`bench serve`: throughput and time to first token of our OpenAI-compatible server at 1, 8 and 32 concurrent
streaming chat clients, beside llama.cpp's server (llama-cpp-python[server]) on the same weights, same run.

Both servers run as their own processes on loopback with the same thread count; the load generator (this
process, asyncio + httpx) is the same for both. Levels are interleaved (ours at 1, llama.cpp at 1, ours at 8, ...)
so background load on a shared machine hits both alike. Every request is a distinct prompt through the chat
template, with a fixed reply length (our `ignore_eos`, llama.cpp's `min_tokens`), so both produce the same number
of tokens. Our persistent prefix cache is off (`--no-prefix-cache`): distinct cold prompts, as llama.cpp's server
runs with its cache off by default. Throughput = tokens streamed / wall time of the level; TTFT is measured by the
client from sending to the first content chunk.

Our server also serves a second model by name (`--second-model`, default the same weights under another name, so
loading it costs what loading the first did), at most two resident. `switch_ms` is the time to the first token of a
request for the resident model sent while the second one loads (a request names it just before): what a client of
one model waits while another model comes in; `switch_load_ms` is that loading request's own time to first token.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from engine.errors import SparkError
from engine.loading.model_files import resolve_model_path
from engine.openai.service import served_name

LEVELS = (1, 8, 32)
TOPICS = ("a lighthouse", "a red bicycle", "the moon", "a library", "a small robot", "the ocean", "a garden", "a train")
START_TIMEOUT_S = 600.0
SWITCH_DELAY_S = 0.05  # between the request that loads the second model and the one for the resident model
REQUEST_TIMEOUT_S = 600.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Peer:
    name: str
    url: str  # .../v1
    model: str
    extra: dict[str, Any]  # request fields that fix the reply length
    usage: bool  # whether it reports usage in a stream (else tokens = content chunks, one per token)


@contextlib.contextmanager
def server_process(cmd: list[str], health: str, log: Path) -> Iterator[None]:
    """Run a server until the block ends; wait until `health` answers 200 (or the process dies)."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
                raise SparkError(f"The server `{' '.join(cmd[:4])} ...` exited before it was ready: {tail[0]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(health, timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SparkError(
                    f"The server `{' '.join(cmd[:4])} ...` did not come up within {START_TIMEOUT_S:.0f} s."
                )
            time.sleep(0.5)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def prompt(k: int) -> list[dict[str, str]]:
    return [
        {
            "role": "user",
            "content": f"Story {k}: write a few sentences about {TOPICS[k % len(TOPICS)]} and the number {k}.",
        }
    ]


async def one_request(client: httpx.AsyncClient, peer: Peer, k: int, max_tokens: int) -> tuple[float, int]:
    """Stream one chat reply; (ttft_s, tokens)."""
    body = {
        "model": peer.model,
        "messages": prompt(k),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        **peer.extra,
    }
    if peer.usage:
        body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    try:
        return await _stream(client, peer, body, t0)
    except httpx.HTTPError as exc:
        raise SparkError(f"{peer.name}'s server broke a streamed reply ({type(exc).__name__}: {exc}).") from None


async def _stream(client: httpx.AsyncClient, peer: Peer, body: dict[str, Any], t0: float) -> tuple[float, int]:
    ttft, chunks, usage = None, 0, None
    async with client.stream("POST", peer.url + "/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise SparkError(f"{peer.name} answered {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - t0
    return (ttft if ttft is not None else time.perf_counter() - t0), (usage if usage is not None else chunks)


async def switch(resident: Peer, loading: Peer, first: int) -> dict[str, Any]:
    """A request for `loading` (not resident: it loads), then one for `resident` while it loads; their TTFTs."""
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        load = asyncio.create_task(one_request(client, loading, first, 4))
        await asyncio.sleep(SWITCH_DELAY_S)  # the load has begun
        ttft, _ = await one_request(client, resident, first + 1, 4)
        load_ttft, _ = await load
    return {
        "switch_ms": round(ttft * 1000, 1),
        "switch_load_ms": round(load_ttft * 1000, 1),
        "served_while_loading": ttft + SWITCH_DELAY_S < load_ttft,
    }


async def level(peer: Peer, clients: int, per_client: int, max_tokens: int, first: int) -> dict[str, Any]:
    """`clients` concurrent clients, each sending `per_client` requests one after another."""
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:

        async def run_client(c: int) -> list[tuple[float, int]]:
            return [await one_request(client, peer, first + c * per_client + j, max_tokens) for j in range(per_client)]

        t0 = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(run_client(c) for c in range(clients))) for r in rs]
        wall = time.perf_counter() - t0
    ttfts = sorted(t for t, _ in results)
    tokens = sum(n for _, n in results)
    return {
        "requests": len(results),
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "throughput_tps": round(tokens / wall, 2),
        "ttft_p50_s": round(statistics.median(ttfts), 4),
        "ttft_p99_s": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 4),
    }


def find_peer_gguf(args: argparse.Namespace, model: Path) -> Path | None:
    """The GGUF llama.cpp runs: --peer-gguf, else --model itself when it is a GGUF, else the one in its folder."""
    if getattr(args, "peer_gguf", None):
        path = Path(args.peer_gguf).expanduser()
        if not path.is_file():
            raise SparkError(f"--peer-gguf {path} is not a file; give the GGUF of the same weights as --model.")
        return path
    if model.suffix == ".gguf" and model.is_file():
        return model
    found = sorted(model.glob("*.gguf")) if model.is_dir() else []
    return found[0] if found else None


def second_model(given: Path | None, model: Path, folder: Path) -> Path:
    """The second model our server serves: the one given, else `model`'s weights linked under another name."""
    if given is not None:
        return resolve_model_path(given)
    link = folder / ("second" + (".gguf" if model.is_file() else ""))
    link.symlink_to(model.resolve())
    return link


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = resolve_model_path(args.model)
    threads = args.threads or os.cpu_count() or 1
    max_tokens = 16 if args.quick else 64
    per_client = {1: 2 if args.quick else 4, 8: 1 if args.quick else 2, 32: 1}
    gguf = find_peer_gguf(args, model)
    note = None
    if gguf is None:
        note = "llama.cpp left out: no GGUF of the same weights (pass --peer-gguf FILE)."
    elif importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("starlette_context") is None:
        note = "llama.cpp left out: llama-cpp-python[server] is not installed (pip install -e '.[bench]')."
        gguf = None
    out: dict[str, Any] = {
        "model": str(model),
        "peer_gguf": str(gguf) if gguf else None,
        "threads": threads,
        "max_tokens": max_tokens,
    }
    if note:
        out["note"] = note
    logs = Path(tempfile.mkdtemp(prefix="bench-serve-"))  # the servers' logs stay for a failed run
    second = second_model(getattr(args, "second_model", None), model, logs)
    out["second_model"] = str(second)
    ports = {"ours": free_port(), "llamacpp": free_port()}
    ours_cmd = [
        sys.executable,
        "-m",
        "engine",
        "serve",
        "--model",
        str(model),
        "--port",
        str(ports["ours"]),
        "--threads",
        str(threads),
    ]
    ours_cmd += [
        "--backend",
        args.backend,
        "--quantize",
        args.quantize,
        "--model-name",
        "bench",
        "--max-batch",
        "32",
        "--no-prefix-cache",
        "--add-model",
        str(second),
        "--max-models",
        "2",
    ]
    peers = [Peer("ours", f"http://127.0.0.1:{ports['ours']}/v1", "bench", {"ignore_eos": True}, True)]
    second_peer = Peer("ours", peers[0].url, served_name(second), {"ignore_eos": True}, True)
    with contextlib.ExitStack() as stack:
        stack.enter_context(server_process(ours_cmd, f"http://127.0.0.1:{ports['ours']}/health", logs / "ours.log"))
        if gguf is not None:
            llama_cmd = [
                sys.executable,
                "-m",
                "llama_cpp.server",
                "--model",
                str(gguf),
                "--port",
                str(ports["llamacpp"]),
                "--host",
                "127.0.0.1",
            ]
            llama_cmd += [
                "--n_threads",
                str(threads),
                "--n_threads_batch",
                str(threads),
                "--n_ctx",
                "2048",
                "--model_alias",
                "bench",
            ]
            llama_cmd += [
                "--interrupt_requests",
                "False",
            ]  # its default ends a running stream when another request comes
            stack.enter_context(
                server_process(llama_cmd, f"http://127.0.0.1:{ports['llamacpp']}/v1/models", logs / "llama.log")
            )
            import llama_cpp

            out["peer"] = f"llama.cpp server (llama-cpp-python {llama_cpp.__version__}), {gguf.name}"
            peers.append(
                Peer("llamacpp", f"http://127.0.0.1:{ports['llamacpp']}/v1", "bench", {"min_tokens": max_tokens}, False)
            )
        for p in peers:  # warm-up: first-request costs (kernels, caches) stay out of the figures
            asyncio.run(level(p, 1, 1, 4, 10_000))
        levels: dict[str, dict[str, Any]] = {}
        for c in LEVELS:
            row: dict[str, Any] = {}
            for p in peers:
                row[p.name] = asyncio.run(level(p, c, per_client[c], max_tokens, first=1000 * c))
            if "llamacpp" in row:
                row["throughput_ratio_vs_llamacpp"] = round(
                    row["ours"]["throughput_tps"] / row["llamacpp"]["throughput_tps"], 3
                )
                row["ttft_p50_ratio_vs_llamacpp"] = round(row["ours"]["ttft_p50_s"] / row["llamacpp"]["ttft_p50_s"], 3)
            levels[str(c)] = row
        out.update(asyncio.run(switch(peers[0], second_peer, 100_000)))
    out["levels"] = levels
    out["throughput_tps"] = {c: levels[c]["ours"]["throughput_tps"] for c in levels}
    out["ttft_p50_s"] = {c: levels[c]["ours"]["ttft_p50_s"] for c in levels}
    out["ttft_p99_s"] = {c: levels[c]["ours"]["ttft_p99_s"] for c in levels}
    return out
