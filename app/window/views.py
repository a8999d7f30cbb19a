"""The widgets the presenters drive, built by the window and handed to them as one value: a presenter calls their
public methods and holds no other reference to the window."""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtWidgets import QLineEdit

from app.history.sidebar import HistorySidebar
from app.inspector.inspector import Inspector
from app.window.chat_view import ChatView
from app.window.composer import Composer
from app.window.menus import WindowMenus
from app.window.notice_bar import NoticeBar
from app.window.status_items import StatusItems
from app.window.think_switch import ThinkSwitch


@dataclass(frozen=True)
class WindowViews:
    chat: ChatView
    composer: Composer
    think_switch: ThinkSwitch
    system_prompt: QLineEdit
    notice: NoticeBar
    sidebar: HistorySidebar
    inspector: Inspector
    menus: WindowMenus
    status: StatusItems
