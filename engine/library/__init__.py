"""The model library the CLI (`python -m engine models …`) and the app's "Get Models…" share: the curated catalog
(`catalog`), a recommendation for this machine (`recommend`), Hub search and file lists (`hub`), resumable verified
downloads (`download`), the local store of models (`store`), the checks a Hub name passes before use (`names`),
and all of them wired together (`library`).

It sits above `loading` (it validates downloads with the GGUF reader) and `hw` (memory for recommendations); the
loader finds a stored model by name through `engine.paths.models_dir()` alone, so no arrow runs back up here.
Importing this package imports nothing: `store` is light (the app's model menu reads it at start-up), `hub` brings
huggingface_hub only where the network is used.

    from engine.library.library import Library
    lib = Library.from_env()
    lib.downloader().download("unsloth/Qwen3-4B-GGUF", progress=print)
    [m.name for m in lib.store.models()]
"""
