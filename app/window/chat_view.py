"""The transcript view: messages in a centred reading column, replies as Markdown, and a view that follows the stream.

Streamed text is appended at the end of the document with a cursor (no re-layout of earlier messages); at most a
few times a second, and when the reply ends, that one message is rendered again as Markdown (app.window.markdown:
tables, lists, inline code, code blocks coloured, each with its own Copy link). The user's messages sit on the right
in soft rounded bubbles (painted under the text: Qt's rich text has no rounded frames), as wide as their text;
replies run the column's width under a small "Spark". Copy, Branch and (on the last reply) Regenerate show as icons
while the pointer is over a message (app.window.message_actions); the anchors `copy:N` / `branch:N` (N = the
message's index in the conversation) do the same. While a prompt is read, the reply shows how far the reading got. The view stays at the newest text unless the user
scrolled up; then a "↓ New text" pill says more came, and takes them back down. An empty conversation shows a
greeting with example prompts (anchors `example:K`); a long paste shows its first lines and "Show all". A reply that
drew on attached documents or recalled conversations lists them under it (anchors `cite:K`: the passage's text).
"""

from __future__ import annotations

import html
import time
from collections.abc import Sequence

from PySide6.QtCore import QEvent, QPoint, QRectF, Qt, QTimer, QUrl, Signal, Slot
from PySide6.QtGui import (
    QColor,
    QContextMenuEvent,
    QDesktopServices,
    QFont,
    QFontDatabase,
    QGuiApplication,
    QMouseEvent,
    QPainter,
    QPaintEvent,
    QPalette,
    QResizeEvent,
    QTextBlockFormat,
    QTextCharFormat,
    QTextCursor,
    QTextDocument,
    QTextFrame,
    QTextFrameFormat,
    QTextImageFormat,
)
from PySide6.QtWidgets import QMenu, QPushButton, QTextBrowser, QWidget

from app.misc import theme
from app.window.markdown import MarkdownRenderer, Palette, open_fence
from app.window.message_actions import MessageActions
from app.window.pictures import BUBBLE_SIDE, show_picture, thumbnail
from app.window.thinking import Thoughts
from app.window.tool_cards import Card, card_html, segments
from app.worker.tool_turns import RESPONSE_CLOSE, display_messages
from app.worker.types import CitationView, MessageView
from engine import IMAGE_TOKEN
from engine.tools.calls import CLOSE as TOOL_CALL_CLOSE
from engine.tools.calls import OPEN as TOOL_CALL_OPEN

ROLE_LABELS = {"user": "You", "assistant": "Spark", "system": "System"}
ROLE_PROPERTY = 0x100000  # QTextFormat.UserProperty: marks each message frame with its role
INDEX_PROPERTY = 0x100001  # ...and with its index in the conversation
COLUMN_MAX = theme.READING_COLUMN_PX  # px: the reading column's widest; wider windows centre it
BUBBLE_PADDING = 12  # px inside a message
BUBBLE_TINT = 0.16  # of the accent in a user's bubble
BUBBLE_SHARE = 0.8  # of the column: the widest a user's bubble grows
MESSAGE_GAP = 12  # px above and below each message (24 between two)
LIVE_RENDER_S = 0.25  # a streaming reply is rendered as Markdown at most this often
PASTE_LINES = 14  # a user message longer than this (or PASTE_CHARS) shows its first lines and "Show all"
PASTE_CHARS = 1500
PASTE_PREVIEW_LINES = 6  # ...of which a collapsed paste shows this much
PASTE_PREVIEW_CHARS = 480
COPIED_MS = 1500  # a Copy link reads "Copied ✓" this long after a click
COPIED = "Copied ✓"


def _mix(a: QColor, b: QColor, t: float) -> QColor:
    ca, cb = (a.redF(), a.greenF(), a.blueF()), (b.redF(), b.greenF(), b.blueF())
    return QColor.fromRgbF(*(x + (y - x) * t for x, y in zip(ca, cb, strict=True)))


class ChatView(QTextBrowser):
    branch_requested = Signal(int)  # the message's index in the conversation
    regenerate_requested = Signal()  # the last reply's Regenerate icon
    copied = Signal(int)
    example_chosen = Signal(str)  # an example prompt from the greeting
    citation_opened = Signal(object)  # CitationView: a passage under a reply was clicked

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("chatView")
        self.setOpenLinks(False)  # copy:/branch: are ours; web links go to the browser in _on_anchor
        self.anchorClicked.connect(self._on_anchor)
        self.setFrameShape(QTextBrowser.Shape.NoFrame)
        self.document().setDocumentMargin(18)
        body = QFont(self.font())
        body.setPointSizeF(theme.points(self, theme.BODY_PX))
        self.setFont(body)
        self.document().setDefaultFont(body)
        self.actions_bar = MessageActions(self.viewport())
        self.actions_bar.copy_clicked.connect(self.copy_message)
        self.actions_bar.branch_clicked.connect(self.branch_requested.emit)
        self.actions_bar.regenerate_clicked.connect(self.regenerate_requested.emit)
        self.viewport().setMouseTracking(True)
        self._reply: QTextFrame | None = None
        self._reply_text: list[str] = []  # the streamed reply as received (the document would normalise it)
        self._reading = False  # the reply bubble shows reading progress, not text yet
        self._contents: dict[int, str] = {}  # message index -> its text as received (what Copy copies)
        self._pictures: dict[int, tuple[bytes, ...]] = {}  # a user message's index -> its pictures, encoded
        self.picture_window: QWidget | None = None  # the picture enlarged last
        self._next_index = 0
        self._mono = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont)
        self._markdown = MarkdownRenderer()
        self._code_blocks: dict[str, str] = {}  # "message.block" -> the code a block's Copy link copies
        self._citations: list[CitationView] = []  # anchor cite:K -> the passage K
        self._expanded: set[int] = set()  # long pastes the user opened in full
        self.thoughts = Thoughts()  # each reply's thinking (a reasoning model), folded above its answer
        self._last_render = 0.0
        self._greeting: tuple[str, tuple[str, ...]] = ("", ())  # (line, example prompts) while the chat is empty
        self._empty = True
        # Following the stream: on while the view is at the end; the user scrolling up turns it off.
        self._follow = True
        self._scrolling = False  # our own scroll, not the user's
        bar = self.verticalScrollBar()
        bar.rangeChanged.connect(self._on_range)
        bar.valueChanged.connect(self._on_scrolled)
        self.pill = QPushButton("↓ New text", self)
        self.pill.setObjectName("newTextPill")
        self.pill.setCursor(Qt.CursorShape.PointingHandCursor)
        self.pill.clicked.connect(self.scroll_to_end)
        self.pill.hide()
        self._place_column()

    # -- the reading column and following the stream -----------------------------------------------------------------
    def resizeEvent(self, event: QResizeEvent) -> None:
        super().resizeEvent(event)
        self._place_column()
        self._place_pill()

    def _place_column(self) -> None:
        """Wider than COLUMN_MAX, the text keeps that width and sits in the middle (as a page in a reader); the
        greeting of an empty chat sits a quarter down."""
        side = max(18, (self.viewport().width() - COLUMN_MAX) // 2)
        top = max(18, self.viewport().height() // 4) if self._empty else 18
        root = self.document().rootFrame()
        fmt = root.frameFormat()
        if int(fmt.leftMargin()) != side or int(fmt.topMargin()) != top:
            fmt.setLeftMargin(side)
            fmt.setRightMargin(side)
            fmt.setTopMargin(top)
            root.setFrameFormat(fmt)
            for frame in self._frames("user"):
                self._fit_bubble(frame)

    def _column_width(self) -> float:
        root = self.document().rootFrame().frameFormat()
        return max(120.0, self.viewport().width() - root.leftMargin() - root.rightMargin())

    def _fit_bubble(self, frame: QTextFrame) -> None:
        """A user's bubble as wide as its text (at most BUBBLE_SHARE of the column), against the column's right."""
        index = frame.frameFormat().property(INDEX_PROPERTY)
        text = self._contents.get(index, "") if isinstance(index, int) else ""
        metrics = self.fontMetrics()
        lines = text.splitlines()[:PASTE_LINES] or [""]
        natural = max(metrics.horizontalAdvance(line) for line in lines) + 2 * BUBBLE_PADDING + 8
        pictures = self._pictures.get(index, ()) if isinstance(index, int) else ()
        natural = max(natural, len(pictures) * (BUBBLE_SIDE + 6) + 2 * BUBBLE_PADDING + 8)
        column = self._column_width()
        width = min(max(natural, 48.0), column * BUBBLE_SHARE)
        fmt = frame.frameFormat()
        fmt.setLeftMargin(max(0.0, column - width))
        frame.setFrameFormat(fmt)

    def _frame_rect(self, frame: QTextFrame) -> QRectF:
        """The frame's box (inside its margins) on the viewport."""
        f = frame.frameFormat()
        rect = self.document().documentLayout().frameBoundingRect(frame)
        rect = rect.adjusted(f.leftMargin(), f.topMargin(), -f.rightMargin(), -f.bottomMargin())
        return rect.translated(-self.horizontalScrollBar().value(), -self.verticalScrollBar().value())

    def paintEvent(self, event: QPaintEvent) -> None:
        """The user's bubbles, rounded, under the text the document then draws."""
        frames = self._frames("user")
        if frames:
            p = QPainter(self.viewport())
            p.setRenderHint(QPainter.RenderHint.Antialiasing)
            p.setPen(Qt.PenStyle.NoPen)
            p.setBrush(self._bubble_colour())
            for frame in frames:
                rect = self._frame_rect(frame)
                if rect.intersects(QRectF(event.rect())):
                    p.drawRoundedRect(rect, theme.RADIUS_BUBBLE, theme.RADIUS_BUBBLE)
            p.end()
        super().paintEvent(event)

    def mouseMoveEvent(self, event: QMouseEvent) -> None:
        super().mouseMoveEvent(event)
        self._hover(event.position().toPoint())

    def event(self, e: QEvent) -> bool:
        if e.type() == QEvent.Type.Leave and not self.actions_bar.underMouse():
            self.actions_bar.hide()
        return super().event(e)

    def contextMenuEvent(self, event: QContextMenuEvent) -> None:
        """The text's own menu, and the message's actions for whoever cannot hover (the keyboard's menu key)."""
        menu = self.context_menu(event.pos())
        menu.exec(event.globalPos())
        menu.deleteLater()

    def context_menu(self, pos: QPoint) -> QMenu:
        menu = self.createStandardContextMenu(pos)
        found = self._message_at(pos)
        if found is not None:
            frame, role, index = found
            menu.addSeparator()
            menu.addAction("Copy Message", lambda: self.copy_message(index))
            menu.addAction("Branch From Here", lambda: self.branch_requested.emit(index))
            replies = self._frames("assistant")
            if role == "assistant" and replies and frame == replies[-1]:
                menu.addAction("Regenerate", self.regenerate_requested.emit)
        return menu

    def _message_at(self, pos: QPoint) -> tuple[QTextFrame, str, int] | None:
        """The finished message at `pos` on the viewport: (its frame, role, index)."""
        for frame in self.document().rootFrame().childFrames():
            fmt = frame.frameFormat()
            role, index = fmt.property(ROLE_PROPERTY), fmt.property(INDEX_PROPERTY)
            if not isinstance(index, int) or not isinstance(role, str):
                continue
            if self._frame_rect(frame).adjusted(0, 0, 0, MESSAGE_GAP).contains(pos.toPointF()):
                return None if frame == self._reply or role not in ("user", "assistant") else (frame, role, index)
        return None

    def _hover(self, pos: QPoint) -> None:
        """The message under the pointer shows its actions at its lower corner (none on a reply still coming)."""
        found = self._message_at(pos)
        bar = self.actions_bar
        if found is None:
            if not bar.underMouse():
                bar.hide()
            return
        frame, role, index = found
        replies = self._frames("assistant")
        bar.show_for(index, role == "assistant" and bool(replies) and frame == replies[-1])
        rect = self._frame_rect(frame)
        x = rect.right() - bar.width() if role == "user" else rect.left()
        bar.move(int(x), int(rect.bottom() - bar.height() / 2))

    def message_actions_for(self, index: int) -> bool:
        """Whether message `index` offers its actions now (a reply still coming does not)."""
        for frame in self.document().rootFrame().childFrames():
            if frame.frameFormat().property(INDEX_PROPERTY) == index:
                return frame != self._reply
        return False

    def _place_pill(self) -> None:
        self.pill.adjustSize()
        vp = self.viewport().geometry()
        self.pill.move(vp.center().x() - self.pill.width() // 2, vp.bottom() - self.pill.height() - 12)

    def is_empty(self) -> bool:
        """No message shown (the greeting, or nothing)."""
        return self._empty

    def following(self) -> bool:
        return self._follow

    @Slot()
    def scroll_to_end(self) -> None:
        self._follow = True
        self.pill.hide()
        self._scroll_bottom()

    def _scroll_bottom(self) -> None:
        bar = self.verticalScrollBar()
        self._scrolling = True
        bar.setValue(bar.maximum())
        self._scrolling = False

    @Slot(int, int)
    def _on_range(self, _low: int, _high: int) -> None:
        if self._follow:
            self._scroll_bottom()  # the text grew: stay at its end

    @Slot(int)
    def _on_scrolled(self, value: int) -> None:
        if self._scrolling:
            return
        bar = self.verticalScrollBar()
        self._follow = value >= bar.maximum() - 4
        if self._follow:
            self.pill.hide()

    def _more_text(self) -> None:
        """New text arrived: followed, or announced by the pill when the user is reading further up."""
        if self._follow:
            self._scroll_bottom()
        elif not self.pill.isVisible():
            self._place_pill()
            self.pill.show()
            self.pill.raise_()

    # -- the greeting --------------------------------------------------------------------------------------------------
    def set_greeting(self, line: str, examples: Sequence[str]) -> None:
        """What an empty conversation shows: `line`, then `examples` the user can click to send."""
        self._greeting = (line, tuple(examples))
        if self._empty:
            self._show_greeting()

    def _show_greeting(self) -> None:
        self.clear()
        self._place_column()
        line, examples = self._greeting
        if not line:
            return
        pal = self.palette()
        dim = pal.color(QPalette.ColorRole.PlaceholderText).name()
        link = pal.color(QPalette.ColorRole.Link).name()
        items = "".join(
            f'<p style="margin:6px 0"><a style="color:{link}; text-decoration:none" href="example:{k}">'
            f"{html.escape(e)}</a></p>"
            for k, e in enumerate(examples)
        )
        # While the model loads there are no examples yet: no invitation to "try one of these" with none below.
        invite = "Ask anything, or try one of these:" if examples else ""
        self.document().rootFrame().firstCursorPosition().insertHtml(
            f'<div align="center"><p style="font-size:x-large">{html.escape(line)}</p>'
            f'<p style="color:{dim}">{invite}</p>{items}</div>'
        )

    # -- public ------------------------------------------------------------------------------------------------------
    def set_messages(self, messages: Sequence[MessageView], notes: dict[int, str] | None = None) -> None:
        """Show a whole conversation; `notes` are the remarks that were shown under some of its messages."""
        self._citations = []
        self._reply = None
        self._reading = False
        self._contents = {}
        self._pictures = {}
        self._code_blocks = {}
        self._expanded = set()
        self.thoughts = Thoughts()  # a transcript shown again carries answers only
        self._empty = not any(m.role != "system" for m in messages)
        if self._empty:
            self._show_greeting()
            return
        self.clear()
        self._place_column()
        for i, m in display_messages(list(messages)):  # a reply with its tool calls and results is one message
            if m.role == "system":
                continue
            frame = self._add_message(m.role, m.content, i, m.images)
            if notes and notes.get(i):
                self._add_note(frame, notes[i])
            if m.recalled:  # kept with the conversation: a reopened reply still says what it drew on
                self._insert_citations(m.recalled)
        self._next_index = len(messages)
        self.scroll_to_end()

    def restyle(self) -> None:
        """Draw the shown messages again in the palette's colours (the appearance changed); a reply still
        streaming keeps its frame and takes them at its next render."""
        if self._empty:
            self._show_greeting()
            return
        for frame in self.document().rootFrame().childFrames():
            fmt = frame.frameFormat()
            role, index = fmt.property(ROLE_PROPERTY), fmt.property(INDEX_PROPERTY)
            if frame == self._reply or not isinstance(role, str) or not isinstance(index, int):
                continue
            self._clear_frame(frame)
            self._fill(frame, role, self._contents.get(index, ""))

    def last_index(self) -> int:
        """The index of the newest message shown (the reply that just ended)."""
        return self._next_index - 1

    def add_user_message(self, text: str, images: Sequence[bytes] = ()) -> None:
        """The user's message as sent; `images`: the pictures that went with it (thumbnails above its text)."""
        if self._empty:  # the greeting goes with the first message
            self._empty = False
            self.clear()
            self._place_column()
        self._add_message("user", text, self._next_index, images)
        self._next_index += 1
        self.scroll_to_end()  # sending is a choice to see what comes

    def begin_reply(self) -> None:
        self._reply = self._add_message("assistant", "", self._next_index)
        self._next_index += 1
        self._reply_text = []
        self._last_render = time.monotonic()
        self._more_text()

    def show_reading(self, text: str) -> None:
        """While the prompt is read: `text` (tokens read, rate, time left) in the reply bubble, dimmed."""
        if self._reply is None or self._reply_text:
            return
        self._clear_frame(self._reply)
        self._fill(self._reply, "assistant", "")
        self._reply.lastCursorPosition().insertText(text, self._note_format())
        self._reading = True
        self._more_text()

    def append_reasoning(self, text: str) -> None:
        """The reply's thinking as it comes: shown folded above the answer, rendered at most every LIVE_RENDER_S."""
        frame = self._reply
        index = frame.frameFormat().property(INDEX_PROPERTY) if frame is not None else None
        if frame is None or not isinstance(index, int) or self._reply_text:
            return
        first = index not in self.thoughts.texts
        self.thoughts.add(index, text)
        if first or time.monotonic() - self._last_render >= LIVE_RENDER_S:
            self._last_render = time.monotonic()
            self._reading = True  # the bubble holds no answer yet: the first answer text replaces it
            self._clear_frame(frame)
            self._fill(frame, "assistant", "")
            self._more_text()

    def append_reply(self, text: str) -> None:
        if self._reply is None:
            return
        self.thoughts.stop(self._reply.frameFormat().property(INDEX_PROPERTY))
        if self._reading:
            self._clear_frame(self._reply)
            self._fill(self._reply, "assistant", "")
            self._reading = False
        self._reply_text.append(text)
        now = time.monotonic()
        so_far = "".join(self._reply_text)
        # A tool call or result that just closed shows as its card at once (the consent question waits on it);
        # the text of a call still being written is not shown raw between renders.
        card_closed = so_far.rstrip().endswith((TOOL_CALL_CLOSE, RESPONSE_CLOSE))
        if now - self._last_render >= LIVE_RENDER_S or card_closed:  # the reply so far as Markdown (a table, code)
            self._last_render = now
            self._clear_frame(self._reply)
            self._fill(self._reply, "assistant", so_far)
        elif so_far.rfind(TOOL_CALL_OPEN) <= so_far.rfind(TOOL_CALL_CLOSE) and not open_fence(so_far):
            # Between renders, the text as it comes; inside a code block it waits for the next render (appended
            # here it would show as plain text under the block).
            self._reply.lastCursorPosition().insertText(text, self._body_format())
        self._more_text()

    def remove_last_reply(self) -> None:
        """Regenerate: the last answer goes away before the new one streams in."""
        frames = self._frames("assistant")
        if not frames:
            return
        frame = frames[-1]
        index = frame.frameFormat().property(INDEX_PROPERTY)
        cursor = QTextCursor(self.document())
        cursor.setPosition(frame.firstPosition() - 1)
        cursor.setPosition(frame.lastPosition() + 1, QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()
        if isinstance(index, int):
            self._contents.pop(index, None)
            self.thoughts.forget(index)
            self._next_index = index

    def end_reply(self, note: str = "", index: int | None = None) -> None:
        """Re-render the finished reply with code formatting; `note` (e.g. "stopped") goes under it, dimmed.
        `index`: the reply's last message in the conversation (a turn that called tools holds several)."""
        frame = self._reply
        if frame is not None:
            self.thoughts.stop(frame.frameFormat().property(INDEX_PROPERTY))
        if frame is not None and index is not None and index >= 0:
            self.thoughts.renumber(frame.frameFormat().property(INDEX_PROPERTY), index)
            fmt = frame.frameFormat()
            fmt.setProperty(INDEX_PROPERTY, index)
            frame.setFrameFormat(fmt)
            self._next_index = index + 1
        self._reply = None
        self._reading = False
        if frame is None:
            return
        text = "".join(self._reply_text)
        if not text:  # nothing was written (stopped while reading, an error): no empty bubble, the note stays
            self.remove_last_reply()  # the reply frame is the last assistant frame
            frames = self._frames("assistant") + self._frames("user")
            if not note or not frames:
                return
            frame = max(frames, key=lambda f: f.lastPosition())
        else:
            self._clear_frame(frame)
            self._fill(frame, "assistant", text)
            index = frame.frameFormat().property(INDEX_PROPERTY)
            if isinstance(index, int):
                self._contents[index] = text
        if note:  # under the message, outside its frame: a remark about the turn, not part of the reply
            self._add_note(frame, note)
        self._more_text()

    def add_citations(self, citations: Sequence[CitationView]) -> None:
        """Under the last reply: the passages it drew on ("Drew on: notes.md, l. 3-9 · paper.pdf, p. 2, l. 1"),
        each a link to its text."""
        if citations:
            self._insert_citations(citations)
            self._more_text()

    def _insert_citations(self, citations: Sequence[CitationView]) -> None:
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        if cursor.block().length() > 1:  # the reply's note is there: a line of its own
            cursor.insertBlock()
        block = QTextBlockFormat()
        block.setLeftMargin(10)
        cursor.setBlockFormat(block)
        cursor.insertText("Drew on: ", self._note_format())
        for n, c in enumerate(citations):
            if n:
                cursor.insertText("  ·  ", self._note_format())
            key = len(self._citations)
            self._citations.append(c)
            cursor.insertText(c.label, self._link_format(f"cite:{key}", f"Show the passage from {c.label}"))

    def citation_labels(self) -> list[str]:
        return [c.label for c in self._citations]

    def open_citation(self, key: int) -> None:
        if 0 <= key < len(self._citations):
            self.citation_opened.emit(self._citations[key])

    def _add_note(self, frame: QTextFrame, note: str) -> None:
        after = QTextCursor(self.document())
        after.setPosition(frame.lastPosition() + 1)
        block = QTextBlockFormat()
        block.setLeftMargin(10)
        after.setBlockFormat(block)  # the empty block Qt keeps after every frame
        after.insertText(note, self._note_format())

    def reply_text(self) -> str:
        """The text of the last assistant message as written (its Markdown source: what Copy copies); while it is
        still coming, what the bubble shows."""
        frames = self._frames("assistant")
        if not frames:
            return ""
        frame = frames[-1]
        index = frame.frameFormat().property(INDEX_PROPERTY)
        if frame != self._reply and isinstance(index, int) and self._contents.get(index):
            return self._contents[index]
        return self._frame_body(frame)  # a reply still coming (or its reading progress): as shown

    def code_block(self, key: str) -> str:
        """The code of block `key` ("message.block"), as its Copy link copies it."""
        return self._code_blocks.get(key, "")

    def message_text(self, index: int) -> str:
        return self._contents.get(index, "")

    def copy_message(self, index: int) -> None:
        QGuiApplication.clipboard().setText(self._contents.get(index, ""))
        self.actions_bar.index = index
        self.actions_bar.flash_copied()  # "Copied" where it was clicked
        self.copied.emit(index)

    def _flash_copied(self, href: str) -> None:
        """The clicked Copy link says "Copied ✓" for a moment where the user is looking, then "Copy" again."""
        if self._set_link_text(href, COPIED):
            QTimer.singleShot(COPIED_MS, self, lambda: self._set_link_text(href, "Copy"))

    def _set_link_text(self, href: str, text: str) -> bool:
        block = self.document().begin()
        while block.isValid():
            it = block.begin()
            while not it.atEnd():
                fragment = it.fragment()
                fmt = fragment.charFormat()
                if fragment.isValid() and fmt.isAnchor() and fmt.anchorHref() == href:
                    cursor = QTextCursor(self.document())
                    cursor.setPosition(fragment.position())
                    cursor.setPosition(fragment.position() + fragment.length(), QTextCursor.MoveMode.KeepAnchor)
                    cursor.insertText(text, fmt)
                    return True
                it += 1
            block = block.next()
        return False

    @Slot(QUrl)
    def _on_anchor(self, url: QUrl) -> None:
        scheme, _, arg = url.toString().partition(":")
        if scheme in ("copy", "branch") and arg.isdigit():
            (self.copy_message if scheme == "copy" else self.branch_requested.emit)(int(arg))
        elif scheme == "copycode" and arg in self._code_blocks:
            QGuiApplication.clipboard().setText(self._code_blocks[arg])
            self._flash_copied(url.toString())
            self.copied.emit(int(arg.partition(".")[0]))
        elif scheme == "example" and arg.isdigit() and int(arg) < len(self._greeting[1]):
            self.example_chosen.emit(self._greeting[1][int(arg)])
        elif scheme == "expand" and arg.isdigit():
            self._expand(int(arg))
        elif scheme == "think" and arg.isdigit():
            self._toggle_thought(int(arg))
        elif scheme == "cite" and arg.isdigit():
            self.open_citation(int(arg))
        elif scheme == "picture":
            self.open_picture(arg)
        elif url.scheme() in ("http", "https"):
            QDesktopServices.openUrl(url)

    def _clear_frame(self, frame: QTextFrame) -> None:
        cursor = frame.firstCursorPosition()
        cursor.setPosition(frame.lastPosition(), QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()

    def _frames(self, role: str) -> list[QTextFrame]:
        return [f for f in self.document().rootFrame().childFrames() if f.frameFormat().property(ROLE_PROPERTY) == role]

    # -- rendering ---------------------------------------------------------------------------------------------------
    def picture_keys(self) -> list[str]:
        """The thumbnails shown, as "message.picture" keys (what a click on one opens)."""
        return [f"{i}.{k}" for i, shown in sorted(self._pictures.items()) for k in range(len(shown))]

    def open_picture(self, key: str) -> None:
        """A thumbnail was clicked: the picture enlarged in a small window of its own."""
        index, _, k = key.partition(".")
        shown = self._pictures.get(int(index), ()) if index.isdigit() else ()
        if k.isdigit() and int(k) < len(shown):
            self.picture_window = show_picture(self, shown[int(k)])

    def _add_message(self, role: str, content: str, index: int, images: Sequence[bytes] = ()) -> QTextFrame:
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        fmt = QTextFrameFormat()
        fmt.setPadding(BUBBLE_PADDING if role == "user" else 2)
        fmt.setTopMargin(MESSAGE_GAP)
        fmt.setBottomMargin(MESSAGE_GAP)
        fmt.setBorder(0)
        fmt.setProperty(ROLE_PROPERTY, role)
        fmt.setProperty(INDEX_PROPERTY, index)
        frame = cursor.insertFrame(fmt)
        if images:  # the markers that placed the pictures are the engine's; the bubble shows the pictures
            self._pictures[index] = tuple(images)
            content = content.replace(IMAGE_TOKEN, "")
        self._contents[index] = content
        self._fill(frame, role, content)
        if role == "user":
            self._fit_bubble(frame)
        return frame

    def _fill(self, frame: QTextFrame, role: str, content: str) -> None:
        cursor = frame.firstCursorPosition()
        cursor.setBlockFormat(QTextBlockFormat())
        index = frame.frameFormat().property(INDEX_PROPERTY)
        if role != "user":  # the user's bubble needs no name; a reply is headed by a small "Spark"
            cursor.insertText(ROLE_LABELS.get(role, role.title()), self._label_format())
            cursor.insertBlock(QTextBlockFormat(), self._body_format())
        if role == "assistant" and isinstance(index, int):
            self.thoughts.insert(cursor, index, self._link_format, self._note_format())
        if role == "assistant" and content:
            palette = self._palette()
            for n, part in enumerate(segments(content)):  # Markdown, and a card for each tool call
                if isinstance(part, Card):
                    cursor.insertHtml(card_html(part, palette))
                    continue
                prefix = f"{index}." if n == 0 else f"{index}.{n}."
                rendered = self._markdown.render(part, palette, prefix)
                for k, code in enumerate(rendered.code_blocks):
                    self._code_blocks[f"{prefix}{k}"] = code
                cursor.insertHtml(rendered.html)
            return
        if role == "user" and isinstance(index, int) and self._pictures.get(index):
            self._insert_pictures(cursor, index)
            if not content:
                return
            cursor.insertBlock(QTextBlockFormat(), self._body_format())
        if role == "user" and isinstance(index, int) and index not in self._expanded and _is_long(content):
            lines = content.splitlines()
            shown = "\n".join(lines[:PASTE_PREVIEW_LINES])
            if len(shown) > PASTE_PREVIEW_CHARS:
                shown = shown[:PASTE_PREVIEW_CHARS].rsplit(" ", 1)[0]
            cursor.insertText(shown + " …", self._body_format())
            cursor.insertBlock(QTextBlockFormat(), self._body_format())
            n = len(lines)
            rest = f"{n:,} lines, {len(content):,} characters" if n > 1 else f"{len(content):,} characters"
            cursor.insertText(f"Show all ({rest})", self._link_format(f"expand:{index}", "Show the whole message"))
            return
        cursor.insertText(content, self._body_format())

    def _insert_pictures(self, cursor: QTextCursor, index: int) -> None:
        """A user message's pictures as thumbnails, each a link that enlarges it."""
        for k, data in enumerate(self._pictures[index]):
            key = f"{index}.{k}"
            image = thumbnail(data, BUBBLE_SIDE)
            url = QUrl(f"picture:{key}")
            self.document().addResource(QTextDocument.ResourceType.ImageResource, url, image)
            fmt = QTextImageFormat()
            fmt.setName(url.toString())
            fmt.setWidth(image.width())
            fmt.setHeight(image.height())
            fmt.setAnchor(True)
            fmt.setAnchorHref(url.toString())
            fmt.setToolTip("Click to enlarge")
            cursor.insertImage(fmt)
            cursor.insertText(" ", self._body_format())

    def _toggle_thought(self, index: int) -> None:
        """Open or fold a reply's thinking."""
        self.thoughts.toggle(index)
        for frame in self._frames("assistant"):
            if frame.frameFormat().property(INDEX_PROPERTY) == index:
                live = frame == self._reply
                self._clear_frame(frame)
                content = "".join(self._reply_text) if live else self._contents.get(index, "")
                self._fill(frame, "assistant", content)

    def _expand(self, index: int) -> None:
        """A collapsed paste, shown in full."""
        self._expanded.add(index)
        for frame in self._frames("user"):
            if frame.frameFormat().property(INDEX_PROPERTY) == index:
                self._clear_frame(frame)
                self._fill(frame, "user", self._contents.get(index, ""))

    def _bubble_colour(self) -> QColor:
        """The accent washed into the page (theme.Colours.bubble holds the same mix, for the contrast check)."""
        pal = self.palette()
        return _mix(pal.color(QPalette.ColorRole.Base), pal.color(QPalette.ColorRole.Highlight), BUBBLE_TINT)

    def _palette(self) -> Palette:
        pal = self.palette()
        base = pal.color(QPalette.ColorRole.Base)
        dark = base.lightnessF() < 0.5
        code = _mix(base, pal.color(QPalette.ColorRole.Text), 0.06 if not dark else 0.10)
        return Palette(
            pal.color(QPalette.ColorRole.Text).name(),
            pal.color(QPalette.ColorRole.PlaceholderText).name(),
            pal.color(QPalette.ColorRole.Link).name(),
            code.name(),
            _mix(base, pal.color(QPalette.ColorRole.Text), 0.2).name(),
            dark,
        )

    def _frame_body(self, frame: QTextFrame) -> str:
        cursor = frame.firstCursorPosition()
        cursor.setPosition(frame.lastPosition(), QTextCursor.MoveMode.KeepAnchor)
        text = cursor.selectedText().replace("\u2029", "\n")
        return text if frame.frameFormat().property(ROLE_PROPERTY) == "user" else text.partition("\n")[2]

    def _label_format(self) -> QTextCharFormat:
        fmt = QTextCharFormat()
        fmt.setFontWeight(QFont.Weight.DemiBold)
        fmt.setFontPointSize(max(self.font().pointSizeF() - 1, 8))
        fmt.setForeground(self.palette().color(QPalette.ColorRole.PlaceholderText))
        return fmt

    def _link_format(self, href: str, tip: str) -> QTextCharFormat:
        fmt = self._label_format()
        fmt.setFontWeight(QFont.Weight.Normal)
        fmt.setAnchor(True)
        fmt.setAnchorHref(href)
        fmt.setToolTip(tip)
        fmt.setForeground(self.palette().color(QPalette.ColorRole.Link))
        return fmt

    def _body_format(self) -> QTextCharFormat:
        fmt = QTextCharFormat()
        fmt.setFontWeight(QFont.Weight.Normal)
        fmt.setFontPointSize(self.font().pointSizeF())
        fmt.setForeground(self.palette().color(QPalette.ColorRole.Text))
        return fmt

    def _code_format(self) -> QTextCharFormat:
        fmt = QTextCharFormat()
        fmt.setFont(self._mono)
        fmt.setForeground(self.palette().color(QPalette.ColorRole.Text))
        return fmt

    def _note_format(self) -> QTextCharFormat:
        fmt = self._label_format()
        fmt.setFontWeight(QFont.Weight.Normal)
        fmt.setFontItalic(True)
        return fmt


def _is_long(text: str) -> bool:
    return len(text) > PASTE_CHARS or text.count("\n") >= PASTE_LINES
