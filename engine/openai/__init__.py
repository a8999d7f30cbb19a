"""The OpenAI-compatible side of the engine, both directions. Serving (`python -m engine serve`) runs on
engine.generation's batch and scheduler: `protocol` parses and shapes OpenAI's JSON (shared with the client),
`tools` reads a request's tool fields (tool calling itself is engine.tools', shared with the session), `service` runs requests
on the scheduler, `beams` runs beam requests beside it, `ollama` answers Ollama's `/api/chat` over the same service,
`metrics` counts them, `errors` words failures, `asgi` is the ASGI application and `server` runs it with uvicorn.
`client` talks to remote OpenAI-compatible servers as a chat backend. Only `asgi` and `server` import the ASGI
stack."""
