"""Tool calling, below the session and the server: what a tool and a call are (calls), the constraint that holds a
call to its tools' schemas (grammar), tools and tool turns in the chat template (template), and calls read back out
of a reply as it streams (calls). `Session.chat(..., tools=)` and the server's routes both use these; see DESIGN.md,
"Tools"."""
