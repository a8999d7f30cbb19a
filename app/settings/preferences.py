"""Typed access to the app's QSettings: window layout, models (last, recent, weight precision), generation
settings, system prompt, the conversation open at quit, the kept memory's disk budget, and view choices.

Values that are not plain strings are stored as JSON, because QSettings' INI and plist back ends disagree on types
(an INI file hands every number back as a string).
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields, replace
from pathlib import Path

from PySide6.QtCore import QByteArray, QSettings

from app.settings.sampling_choice import SamplingChoice
from app.tools.mcp_host import McpServerSpec
from engine import DEFAULT_KEPT_BUDGET_BYTES, GenerationSettings, SamplingSettings, Speculation

DEFAULT_MAX_TOKENS = 512


def default_generation() -> GenerationSettings:
    """What replies run with until the user changes Settings: speculation where it is measured to pay
    (Speculation.AUTO: greedy replies on a backend whose verifies are cheap, the same tokens as plain decoding)."""
    return GenerationSettings(max_tokens=DEFAULT_MAX_TOKENS, speculative=Speculation.AUTO)


RECENT_MODELS = 8


class Preferences:
    def __init__(self, settings: QSettings) -> None:
        self._s = settings

    @property
    def settings(self) -> QSettings:
        """The settings file itself, for parts that keep their own keys in it (the remote server list)."""
        return self._s

    # -- window ------------------------------------------------------------------------------------------------------
    def window_geometry(self) -> QByteArray | None:
        value = self._s.value("window/geometry")
        return value if isinstance(value, QByteArray) else None

    def window_state(self) -> QByteArray | None:
        """QMainWindow.saveState(): toolbar and dock (panel) placement and visibility."""
        value = self._s.value("window/state")
        return value if isinstance(value, QByteArray) else None

    def set_window(self, geometry: QByteArray, state: QByteArray) -> None:
        self._s.setValue("window/geometry", geometry)
        self._s.setValue("window/state", state)

    # -- model -------------------------------------------------------------------------------------------------------
    def last_model(self) -> Path | None:
        value = self._s.value("model/last_dir", "")
        return Path(str(value)) if value else None

    def set_last_model(self, path: Path | None) -> None:
        """None: the default model (kept as such, so a later default follows the app, not an old path)."""
        self._s.setValue("model/last_dir", str(path) if path else "")
        if path is not None:
            recent = [p for p in self.recent_models() if p != path]
            self._s.setValue("model/recent", json.dumps([str(p) for p in [path, *recent][:RECENT_MODELS]]))

    def last_remote(self) -> tuple[str, str] | None:
        """(base URL, model) of the remote server chosen last, if the app was left with one."""
        try:
            raw = json.loads(str(self._s.value("model/last_remote", "") or "null"))
        except json.JSONDecodeError:
            return None
        if isinstance(raw, list) and len(raw) == 2 and all(isinstance(x, str) for x in raw):
            return raw[0], raw[1]
        return None

    def set_last_remote(self, url: str | None, model: str = "") -> None:
        self._s.setValue("model/last_remote", json.dumps([url, model]) if url else "")

    def recent_models(self) -> list[Path]:
        try:
            raw = json.loads(str(self._s.value("model/recent", "[]")))
        except ValueError:
            return []
        return [Path(p) for p in raw if isinstance(p, str) and p] if isinstance(raw, list) else []

    def precision(self) -> str:
        """The weight precision the Settings chose (engine QUANTIZE_CHOICES; "auto" by default)."""
        return str(self._s.value("model/precision", "auto")) or "auto"

    def set_precision(self, value: str) -> None:
        self._s.setValue("model/precision", value)

    # -- conversations -------------------------------------------------------------------------------------------------
    def kept_budget_bytes(self) -> int:
        """The disk the kept memory may use (engine.session.kept), as Settings set it; a few GB by default."""
        try:
            value = int(str(self._s.value("memory/kept_budget_bytes", DEFAULT_KEPT_BUDGET_BYTES)))
        except ValueError:
            return DEFAULT_KEPT_BUDGET_BYTES
        return value if value >= 0 else DEFAULT_KEPT_BUDGET_BYTES

    def set_kept_budget_bytes(self, value: int) -> None:
        self._s.setValue("memory/kept_budget_bytes", str(max(0, value)))

    def last_conversation(self) -> str:
        return str(self._s.value("chat/last_conversation", ""))

    def set_last_conversation(self, conversation_id: str) -> None:
        self._s.setValue("chat/last_conversation", conversation_id)

    def inspector_visible(self) -> bool:
        return str(self._s.value("view/inspector", "true")).lower() == "true"

    def set_inspector_visible(self, visible: bool) -> None:
        self._s.setValue("view/inspector", "true" if visible else "false")

    def models_offer_shown(self) -> bool:
        """Whether the first-launch line offering Get Models… was shown (it is shown once)."""
        return str(self._s.value("models/offer_shown", "false")).lower() == "true"

    def set_models_offer_shown(self) -> None:
        self._s.setValue("models/offer_shown", "true")

    def appearance(self) -> str:
        """View ▸ Appearance: "system" (the default: the desktop's light or dark), "light" or "dark"."""
        value = str(self._s.value("view/appearance", "system"))
        return value if value in ("system", "light", "dark") else "system"

    def set_appearance(self, value: str) -> None:
        self._s.setValue("view/appearance", value)

    def sidebar_visible(self) -> bool:
        return str(self._s.value("view/sidebar", "true")).lower() == "true"

    def set_sidebar_visible(self, visible: bool) -> None:
        self._s.setValue("view/sidebar", "true" if visible else "false")

    # -- generation --------------------------------------------------------------------------------------------------
    def generation(self) -> GenerationSettings:
        raw = self._s.value("generation/settings", "")
        try:
            data = json.loads(str(raw)) if raw else {}
            known = {f.name for f in fields(SamplingSettings)}
            sampling = SamplingSettings(**{k: v for k, v in data.get("sampling", {}).items() if k in known})
            sampling.validate()
            return GenerationSettings(
                max_tokens=int(data.get("max_tokens", DEFAULT_MAX_TOKENS)),
                sampling=sampling,
                speculative=Speculation(data.get("speculative", Speculation.AUTO)),
            )
        except (ValueError, TypeError, AttributeError):  # a hand-edited or older file: fall back to the defaults
            return default_generation()

    def set_generation(self, settings: GenerationSettings) -> None:
        self._s.setValue(
            "generation/settings",
            json.dumps(
                {
                    "max_tokens": settings.max_tokens,
                    "sampling": asdict(settings.sampling),
                    "speculative": settings.speculative.value,
                }
            ),
        )

    def use_model_defaults(self) -> bool:
        """Whether replies use the model's own recommended sampling (Settings' switch; on by default)."""
        raw = str(self._s.value("generation/use_model_defaults", "")).lower()
        if raw in ("true", "false"):
            return raw == "true"
        # A file from before the switch: there the generic knobs stood for "the model's own" (seed, greedy aside).
        return replace(self.generation().sampling, seed=None, greedy=False) == SamplingSettings()

    def set_use_model_defaults(self, on: bool) -> None:
        self._s.setValue("generation/use_model_defaults", "true" if on else "false")

    def sampling_choice(self) -> SamplingChoice:
        """The app's sampling: the switch, and the user's own values (kept while the model's defaults answer)."""
        return SamplingChoice(self.use_model_defaults(), self.generation().sampling)

    def system_prompt(self) -> str:
        return str(self._s.value("chat/system_prompt", ""))

    def set_system_prompt(self, text: str) -> None:
        self._s.setValue("chat/system_prompt", text)

    def last_reply_schema(self) -> str:
        """The JSON schema given last ("" when none was): where the schema dialog of another conversation starts.
        Whether replies are JSON is each conversation's own (the library keeps it), never the app's."""
        return str(self._s.value("chat/json_schema", ""))

    def set_last_reply_schema(self, text: str) -> None:
        self._s.setValue("chat/json_schema", text)

    def tool_servers(self) -> list[McpServerSpec]:
        """The MCP stdio servers whose tools the model may call (none by default)."""
        try:
            raw = json.loads(str(self._s.value("tools/servers", "[]")))
        except ValueError:
            return []
        out = []
        for entry in raw if isinstance(raw, list) else []:
            if not isinstance(entry, dict):
                continue
            name, command, args = entry.get("name"), entry.get("command"), entry.get("args", [])
            if isinstance(name, str) and isinstance(command, str) and isinstance(args, list):
                out.append(McpServerSpec(name, command, tuple(str(a) for a in args)))
        return out

    def set_tool_servers(self, specs: list[McpServerSpec]) -> None:
        self._s.setValue(
            "tools/servers", json.dumps([{"name": s.name, "command": s.command, "args": list(s.args)} for s in specs])
        )

    def loaded_once(self) -> bool:
        """A model was loaded before on this machine (the first load also prepares the CPU kernels: slower)."""
        return bool(self._s.value("app/loadedOnce", False, type=bool))

    def set_loaded_once(self) -> None:
        self._s.setValue("app/loadedOnce", True)

    def sync(self) -> None:
        self._s.sync()
