"""Documents and earlier conversations as the open conversation's memory, wired between the window's widgets and its
worker's client: the composer's chips (paperclip, drops, pastes), "Recall in Current Conversation" from the
sidebar and Chat ▸ Recall from…, citations under replies and the passage they open, refusals on the notice bar.
Pictures given the same ways are checked here (a model that sees images is loaded; the engine decodes the picture,
refusing a hostile one in one sentence) before their chips wait for the next message.

What a conversation has attached is recorded in its session file (by name and digest: engine.session.types
AttachmentRecord) and found again in the cache folder when the worker opens it, so the chips follow the worker's
memory reports: nothing here records or re-attaches anything."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

from PySide6.QtCore import QObject, Slot
from PySide6.QtWidgets import QInputDialog, QMenu, QWidget

from app.history.library import ConversationLibrary
from app.history.sidebar import HistorySidebar
from app.window.attachments import AttachmentsBar, DocumentDrops, choose_documents
from app.window.chat_view import ChatView
from app.window.composer import Composer
from app.window.passage import show_passage
from app.worker.client import ConversationClient
from app.worker.types import AttachKind, CitationView, LoadedModel, TurnResult, remote_name
from engine import DecodedImage, ImageError, RemoteServer, decode_bytes, decode_file

NO_MODEL_FOR_PICTURES = "No model is loaded yet; load one that sees images, such as SmolVLM, to ask about a picture."


class MemoryControls(QObject):
    """The wiring of documents and recalled conversations between the window's widgets and its client."""

    def __init__(
        self,
        window: QWidget,
        client: ConversationClient,
        composer: Composer,
        chat: ChatView,
        sidebar: HistorySidebar,
        library: ConversationLibrary,
        current_id: Callable[[], str],
        notify: Callable[[str], None],
        documents_dir: Path,
        chat_menu: QMenu | None = None,
    ) -> None:
        super().__init__(window)
        self.window = window
        self.client = client
        self.bar: AttachmentsBar = composer.attachments
        self.chat = chat
        self.library = library
        self.current_id = current_id
        self.notify = notify
        self.documents_dir = documents_dir
        self.passage: QWidget | None = None  # the passage window opened last
        self.drops = DocumentDrops(self.bar.request, self)
        window.installEventFilter(self.drops)
        composer.attach_button.clicked.connect(self.browse)
        self.bar.attach_requested.connect(self._on_attach_requested)
        self.bar.remove_requested.connect(self._on_remove)
        self.bar.pictures_requested.connect(self.add_pictures)
        composer.prompt.image_pasted.connect(self.add_pasted_picture)
        self.pictures_refused = NO_MODEL_FOR_PICTURES  # why a picture is refused now ("": the model sees images)
        client.loaded.connect(self._on_loaded)
        client.remote_ready.connect(self._on_remote)
        client.attaching.connect(self.bar.on_progress)
        client.attach_failed.connect(self._on_failed)
        client.memory.connect(self.bar.on_memory)
        client.finished.connect(self._on_finished)  # after the window's own: the reply is closed first
        chat.citation_opened.connect(self.open_passage)
        sidebar.recall_requested.connect(self.recall)
        if chat_menu is not None:
            chat_menu.addSeparator()
            self.recall_action = chat_menu.addAction("Recall from…", self.choose_recall)
            self.recall_action.setToolTip("Let this conversation draw on what was said in an earlier one")

    # -- asking --------------------------------------------------------------------------------------------------------
    @Slot()
    def browse(self) -> None:
        self.bar.request(choose_documents(self.window, self.documents_dir))

    @Slot(list)
    def add_pictures(self, paths: list[Path]) -> None:
        """Picture files for the next message: refused in one sentence, or decoded and shown as chips."""
        for path in paths:
            if not self._take_picture(partial(decode_file, path), path.name):
                return

    @Slot(bytes)
    def add_pasted_picture(self, data: bytes) -> None:
        self._take_picture(lambda: decode_bytes(data, "The pasted picture"), "Pasted picture")

    def _take_picture(self, decode: Callable[[], DecodedImage], name: str) -> bool:
        if self.pictures_refused:
            self.notify(self.pictures_refused)
            return False
        try:
            picture = decode()
        except ImageError as exc:  # a hostile or damaged picture: the engine's sentence
            self.notify(str(exc))
            return False
        self.bar.add_picture(picture, name)
        return True

    @Slot(str)
    def recall(self, conversation_id: str) -> None:
        """The conversation `conversation_id` joins the open one's memory."""
        entry = self.library.get(conversation_id)
        if entry is None or conversation_id == self.current_id():
            return
        path = self.library.path_for(conversation_id)
        self.client.attach_file(path, AttachKind.CONVERSATION, entry.title)
        self.bar.show_pending(path, entry.title)

    @Slot()
    def choose_recall(self) -> None:
        """Chat ▸ Recall from…: pick one of the other conversations."""
        entries = [e for e in self.library.entries() if e.id != self.current_id()]
        if not entries:
            self.notify("There is no earlier conversation to recall yet.")
            return
        titles = [e.title for e in entries]
        title, ok = QInputDialog.getItem(
            self.window, "Recall from…", "Let this conversation draw on:", titles, 0, False
        )
        if ok and title in titles:
            self.recall(entries[titles.index(title)].id)

    @Slot(object)
    def open_passage(self, citation: CitationView) -> None:
        self.passage = show_passage(self.window, citation)

    @Slot(object)
    def _on_attach_requested(self, path: Path) -> None:
        self.client.attach_file(path, AttachKind.DOCUMENT, "")

    @Slot(object)
    def _on_remove(self, path: Path) -> None:
        self.client.detach(path)

    # -- answers -------------------------------------------------------------------------------------------------------
    @Slot(LoadedModel)
    def _on_loaded(self, loaded: LoadedModel) -> None:
        sees = loaded.info.sees_images
        self.pictures_refused = (
            "" if sees else f"{loaded.info.name} cannot see images; load a model that does, such as SmolVLM."
        )

    @Slot(object)
    def _on_remote(self, server: RemoteServer) -> None:
        self.pictures_refused = (
            ""
            if server.sees_images
            else f"{remote_name(server)} cannot see images here; if it can, add the server again with “Sees images” "
            "ticked, or load a model that does, such as SmolVLM."
        )

    @Slot(str, str)
    def _on_failed(self, path: str, why: str) -> None:
        self.bar.on_failed(path, why)
        if why:
            self.notify(why)

    @Slot(TurnResult)
    def _on_finished(self, result: TurnResult) -> None:
        self.chat.add_citations(result.recalled)
