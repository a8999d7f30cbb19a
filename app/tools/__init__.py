"""Tools for the conversation: MCP servers (`mcp_host`), the user's consent per call (`consent`), and the
toolbox the conversation worker uses (`toolbox`). No Qt here: the worker calls it on its own thread."""
