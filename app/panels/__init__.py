"""The inspector's detail panels (behind its "Details" disclosure); they show plain data handed to their slots."""

from app.panels.cache import CachePanel
from app.panels.memory import MemoryPanel
from app.panels.performance import PerformancePanel
from app.panels.session import SessionPanel
from app.panels.thermal import ThermalPanel

__all__ = ["CachePanel", "MemoryPanel", "PerformancePanel", "SessionPanel", "ThermalPanel"]
