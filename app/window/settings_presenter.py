"""The open conversation's settings: the system prompt, the tool servers, which sampling its replies use (the
app's, the model's own, the conversation's), Reply as JSON with its schema, Think and the prompt's chunk; and what
the inspector, the menu's tick and the composer's chip say of them."""

from __future__ import annotations

from dataclasses import replace

from PySide6.QtCore import QObject, Slot

from app.history.library import ConversationLibrary
from app.settings.json_reply import schema_grammar
from app.settings.preferences import Preferences
from app.settings.sampling_choice import ResolvedSampling, SamplingChoice, resolve, resolved_words
from app.window.dialogs import Dialogs
from app.window.state import WindowState
from app.window.views import WindowViews
from app.worker.client import ConversationClient
from engine import GenerationSettings, GrammarError, ModelSampling

# Tokens per forward while the user waits (see generation_settings): Stop is checked between layers, so a chunk
# costs Stop one layer of it; 128 read the default model's prompts ~1.3x faster than 32 (64: ~1.3x, 256: ~1.2x).
INTERACTIVE_PREFILL_CHUNK = 128


class SettingsPresenter(QObject):
    def __init__(
        self,
        client: ConversationClient,
        state: WindowState,
        library: ConversationLibrary,
        prefs: Preferences,
        dialogs: Dialogs,
        views: WindowViews,
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self._client = client
        self._state = state
        self._library = library
        self._prefs = prefs
        self._dialogs = dialogs
        self._views = views
        client.system_prompt.connect(self._on_restored_system_prompt)

    @Slot()
    def show_current(self) -> None:
        """The open conversation's settings, as it opens."""
        self.show_sampling()
        self.show_reply_json()

    @Slot()
    def system_prompt_edited(self) -> None:
        self._client.set_system_prompt(self._views.system_prompt.text().strip())

    @Slot(str)
    def system_prompt_typed(self, text: str) -> None:
        self._prefs.set_system_prompt(text.strip())  # a cleared prompt stays cleared after a restart
        if not text:  # the clear button emits no editingFinished
            self._client.set_system_prompt("")

    @Slot()
    def apply_tool_servers(self) -> None:
        self._client.set_tool_servers(self._prefs.tool_servers())

    def generation_settings(self, resolved: ResolvedSampling | None = None) -> GenerationSettings:
        """The user's settings with the sampling `resolved` (default: the app's choice, as the quick prompt uses), and
        the prompt read in chunks of at most INTERACTIVE_PREFILL_CHUNK: Stop (and Quit) acts between two layers of a
        chunk, so a long paste stops within one layer's time of a chunk."""
        settings = self._prefs.generation()
        sampling = (resolved or self.resolved_sampling(None)).sampling
        return replace(
            settings,
            sampling=sampling,
            prefill_chunk=min(settings.prefill_chunk, INTERACTIVE_PREFILL_CHUNK),
            think=self._views.think_switch.think(),
        )

    def resolved_sampling(self, override: SamplingChoice | None) -> ResolvedSampling:
        return resolve(self._prefs.sampling_choice(), override, self._model_sampling())

    def _model_sampling(self) -> ModelSampling | None:
        # A server's model samples as the user's values say: its own defaults are the server's business.
        return self._state.model_sampling if self._state.remote is None else None

    @Slot()
    def show_sampling(self) -> None:
        """The inspector says which settings the open conversation's replies use, and whose choice they are."""
        resolved = self.resolved_sampling(self._library.sampling_for(self._state.current_id))
        self._views.inspector.show_sampling(f"Replies use {resolved_words(resolved)}.")

    @Slot()
    def edit_conversation_sampling(self) -> None:
        cid = self._state.current_id
        edit = self._dialogs.edit_conversation_sampling(
            self._library.sampling_for(cid), self._prefs.sampling_choice(), self._model_sampling()
        )
        if edit is not None:
            self._library.set_sampling(cid, edit.choice)
            self.show_sampling()

    @Slot(bool)
    def set_reply_json(self, on: bool) -> None:
        """Reply as JSON, on or off in the open conversation only (kept with it in the library). Turned on where
        it has no schema yet: asked for one, starting from the last one given (cancelled: it stays off)."""
        cid = self._state.current_id
        schema = ""
        if on:
            schema = self._library.reply_schema(cid) or self._ask_schema(self._prefs.last_reply_schema())
        self._library.set_reply_schema(cid, schema)
        self.show_reply_json()

    @Slot()
    def edit_reply_schema(self) -> None:
        """Chat ▸ JSON Schema…: the open conversation's schema; accepting it turns Reply as JSON on there."""
        cid = self._state.current_id
        schema = self._ask_schema(self._library.reply_schema(cid) or self._prefs.last_reply_schema())
        if schema:
            self._library.set_reply_schema(cid, schema)
        self.show_reply_json()

    def _ask_schema(self, start: str) -> str:
        schema = self._dialogs.edit_schema(start) or ""
        if schema:
            self._prefs.set_last_reply_schema(schema)
        return schema

    def show_reply_json(self) -> None:
        """The menu's tick and the composer's "JSON replies" chip follow the open conversation."""
        on = bool(self._library.reply_schema(self._state.current_id))
        self._views.menus.reply_json_action.setChecked(on)
        self._views.composer.json_chip.setVisible(on)

    def reply_settings(self) -> GenerationSettings:
        """The main chat's settings: the user's, constrained to the "Reply as JSON" schema when that is on (a schema
        edited by hand into the settings file and refused by the engine is said, and the reply goes unconstrained).
        The conversation's own sampling, where it has one, wins over the app's; the inspector says which was used."""
        resolved = self.resolved_sampling(self._library.sampling_for(self._state.current_id))
        settings = self.generation_settings(resolved)
        self._views.inspector.show_sampling(f"The last reply used {resolved_words(resolved)}.")
        schema = self._library.reply_schema(self._state.current_id)
        if not schema:
            return settings
        try:
            return replace(settings, grammar=schema_grammar(schema))
        except GrammarError as exc:
            self._views.notice.show_message(f"Reply as JSON is off for this reply: {exc}", error=True)
            return settings

    @Slot(str)
    def _on_restored_system_prompt(self, text: str) -> None:
        field = self._views.system_prompt
        field.blockSignals(True)  # the conversation's own prompt, not an edit to send back
        field.setText(text)
        field.blockSignals(False)
