"""The MLoT Spark desktop app (PySide6), in packages by responsibility:

- `window`: the main window, its chat view (Markdown), composer, menus, conversation commands and dialogs;
- `history`: the conversation library (every conversation stored as it changes) and its sidebar;
- `inspector`: the side panel (plain words first, the details behind a disclosure) and the hardware monitor;
- `worker`: the QThread worker owning one conversation (local or remote, one protocol) and its client, which
  carries requests in and results out; the GUI talks to the engine only through a client;
- `tray`: the menu-bar item and its quick prompt; `server`: the local OpenAI-compatible server switch;
- `settings`: preferences, the settings dialog, saved remote servers; `misc`: paths, icons, the look, small tools.

The app imports the engine's public face (`engine/__init__.py`) and the packages it documents (engine.hw,
engine.openai for the local server, engine.paths), and never touches tensors.
"""
