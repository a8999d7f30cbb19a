"""Serving many requests on the one loaded model: `batch` (rows of one slot table, each running the generation loop
of engine.generation.loop), `scheduler` (continuous batching: requests join and leave the running batch), and the
OpenAI-compatible HTTP server (`python -m engine serve`) on top: `protocol` parses and shapes the JSON, `service`
runs requests on the scheduler, `metrics` counts them, `app` is the ASGI application, `server` runs it with uvicorn.
Only `app` and `server` import the ASGI stack."""
