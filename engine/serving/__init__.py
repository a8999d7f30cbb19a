"""The OpenAI-compatible HTTP server (`python -m engine serve`): requests run through the engine's scheduler with
continuous batching on the one loaded model. `protocol` parses and shapes the JSON, `service` runs requests,
`metrics` counts them, `app` is the ASGI application, `server` runs it with uvicorn."""
