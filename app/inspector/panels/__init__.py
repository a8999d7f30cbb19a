"""The inspector's detail panels (behind its "Details" disclosure); they show plain data handed to their slots."""

from app.inspector.panels.cache import CachePanel
from app.inspector.panels.memory import MemoryPanel
from app.inspector.panels.performance import PerformancePanel
from app.inspector.panels.session import SessionPanel
from app.inspector.panels.thermal import ThermalPanel

__all__ = ["CachePanel", "MemoryPanel", "PerformancePanel", "SessionPanel", "ThermalPanel"]
