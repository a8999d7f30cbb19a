"""Where the app keeps its files: engine.paths decides caches and data (so the CLI and the app agree), Qt names the
organisation/application for QSettings and provides the user's documents folder for save dialogs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QCoreApplication, QStandardPaths

from engine import paths

ORGANIZATION = "MLoT"
ORGANIZATION_DOMAIN = "mlot.dev"


def init_application_names() -> None:
    """Must run before the first QSettings is created so settings land in the app's own domain/plist."""
    QCoreApplication.setOrganizationName(ORGANIZATION)
    QCoreApplication.setOrganizationDomain(ORGANIZATION_DOMAIN)
    QCoreApplication.setApplicationName(paths.APP_NAME)


@dataclass(frozen=True)
class StandardDirs:
    cache: Path  # persistent KV tier, Core ML conversions
    data: Path  # stored conversations, crash log
    documents: Path  # where Save/Open dialogs start

    @classmethod
    def from_platform(cls) -> StandardDirs:
        docs = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.DocumentsLocation) or str(Path.home())
        return cls(cache=paths.default_cache_dir(), data=paths.default_data_dir(), documents=Path(docs))

    @property
    def conversations(self) -> Path:
        """Every conversation's stored file and the history's index."""
        return self.data / "conversations"

    @property
    def models(self) -> Path:
        """Downloaded models (the model library's store): engine.paths.models_dir() beside the platform's data."""
        return paths.models_dir() if self.data == paths.default_data_dir() else self.data / "models"

    @property
    def crash_log(self) -> Path:
        return self.data / "crash.log"

    def ensure(self) -> None:
        for d in (self.cache, self.data):
            d.mkdir(parents=True, exist_ok=True)
