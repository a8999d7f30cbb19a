"""`python -m engine models list|search QUERY|download REPO [--file NAME]|remove NAME|recommend [--json]` — the
model library (engine.library) on the command line. A listed name works wherever `--model` does."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from engine.hw.memory import format_bytes
from engine.untrusted import shown


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("models", help="list, search, download, remove and recommend models")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = actions.add_parser("list", help="the downloaded models (and the default model)")
    search = actions.add_parser("search", help="search the Hugging Face Hub for GGUF models")
    search.add_argument("query")
    search.add_argument("--limit", type=int, default=20, help="at most this many repos (default 20)")
    download = actions.add_parser("download", help="download a GGUF model from the Hub (resumes, verifies)")
    download.add_argument("repo", help="owner/name of a Hub repo holding GGUF files")
    download.add_argument("--file", default=None, help="which GGUF file of the repo (default: the catalog's pick)")
    remove = actions.add_parser("remove", help="delete a downloaded model")
    remove.add_argument("name")
    recommend = actions.add_parser("recommend", help="the catalog's models that suit this machine")
    for sub in (listing, search, download, remove, recommend):
        sub.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.library.library import Library

    lib = Library.from_env()
    result: Any
    if args.action == "list":
        result = _list(lib)
    elif args.action == "search":
        if args.limit < 1:
            from engine.errors import SparkError

            raise SparkError("--limit must be 1 or more.")
        result = {"query": args.query, "repos": [vars(r) for r in lib.hub.search(args.query, args.limit)]}
    elif args.action == "download":
        result = {"model": _download(lib, args.repo, args.file, quiet=args.json).as_json()}
    elif args.action == "remove":
        result = {"removed": lib.store.remove(args.name).as_json()}
    else:
        result = _recommend(lib)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print(args.action, result)
    return 0


def _list(lib: Any) -> dict[str, Any]:
    from engine.loading.gguf import GGUFModel
    from engine.loading.model_files import DEFAULT_MODEL_NAME, default_model_path

    models = [m.as_json() for m in lib.store.models()]
    default = default_model_path()
    models.insert(
        0,
        {
            "name": DEFAULT_MODEL_NAME,
            "path": str(default),
            "size_bytes": default.stat().st_size,
            "family": GGUFModel(default).architecture,
            "default": True,
        },
    )
    partial = [
        {"repo": p.source.repo, "file": p.source.file, "done_bytes": p.done_bytes, "size_bytes": p.source.size_bytes}
        for p in lib.store.partials()
    ]
    return {"models": models, "partial_downloads": partial, "models_dir": str(lib.store.root)}


def _download(lib: Any, repo: str, file: str | None, *, quiet: bool) -> Any:
    from engine.library.download import DownloadProgress, Phase

    bar: Any = None
    use_tqdm = not quiet and sys.stderr.isatty()
    resumed_at = 0
    started = False

    def progress(p: DownloadProgress) -> None:
        # Nothing is printed before the first byte arrives, so a refusal (gated, missing, no space) is its one line.
        nonlocal bar, resumed_at, started
        if p.phase is Phase.CONNECTING:
            resumed_at = p.done_bytes
        elif p.phase is Phase.DOWNLOADING and not quiet:
            if not started:
                started = True
                resumed = f", resuming at {format_bytes(resumed_at)}" if resumed_at else ""
                print(f"downloading {shown(p.file)} ({format_bytes(p.total_bytes)}{resumed})", file=sys.stderr)
            if use_tqdm:
                if bar is None:
                    from tqdm import tqdm

                    bar = tqdm(
                        total=p.total_bytes, initial=resumed_at, unit="B", unit_scale=True, desc=shown(p.file, 40)
                    )
                bar.update(p.done_bytes - bar.n)
        elif p.phase is Phase.VERIFYING and not quiet:
            if bar is not None:
                bar.close()
            print(f"verifying {shown(p.file)} (sha256, GGUF header)…", file=sys.stderr)

    try:
        return lib.downloader().download(repo, file, progress=progress)
    finally:
        if bar is not None:
            bar.close()


def _recommend(lib: Any) -> dict[str, Any]:
    from engine.library.recommend import recommend, this_machine

    machine = this_machine()
    rows = recommend(lib.catalog, machine)
    return {
        "total_bytes": machine.total_bytes,
        "budget_bytes": machine.budget_bytes,
        "backends": list(machine.backends),
        "first_pick": next((r.model.id for r in rows if r.first_pick), None),
        "models": [r.as_json() for r in rows],
    }


def _print(action: str, result: dict[str, Any]) -> None:
    if action == "list":
        for m in result["models"]:
            mark = (" (default)" if m.get("default") else "") + (" (sees images)" if m.get("mmproj") else "")
            print(f"{shown(m['name']):<40} {format_bytes(m['size_bytes']):>9}  {shown(m['family'])}{mark}")
        for p in result["partial_downloads"]:
            print(
                f"  partial: {shown(p['repo'])} {shown(p['file'])} {format_bytes(p['done_bytes'])} of "
                f"{format_bytes(p['size_bytes'])}"
            )
    elif action == "search":
        for r in result["repos"]:
            gated = "  (gated)" if r["gated"] else ""
            print(f"{shown(r['id']):<60} {r['downloads']:>10} downloads{gated}")
        if not result["repos"]:
            print(f"No GGUF repos match {shown(result['query'])!r}.")
    elif action == "download":
        m = result["model"]
        print(f"{shown(m['name'])} is ready ({format_bytes(m['size_bytes'])}): --model {shown(m['name'])}")
    elif action == "remove":
        print(f"removed {shown(result['removed']['name'])}")
    else:
        print(f"memory {format_bytes(result['total_bytes'])}, backends {', '.join(result['backends'])}")
        for m in result["models"]:
            pick = "  ← pick first" if m["first_pick"] else ""
            approx = "~" if m["size_approximate"] else ""
            print(
                f"{m['name']:<14} {m['quantization']:<7} {approx}{format_bytes(m['size_bytes']):>9}  "
                f"needs {format_bytes(m['memory_4k_bytes'])} at 4k  {m['fit']}{pick}"
            )
