"""The Info.plist keys of `MLoT Spark.app`, as a plain dict (no PyInstaller), so tests can check them.

packaging/ is deliberately not a Python package: a package named `packaging` would shadow the PyPI `packaging`
that pip, setuptools and PyInstaller import. The spec and the tests load this file by path.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

APP_NAME = "MLoT Spark"  # matches engine.paths.APP_NAME (a test checks)
BUNDLE_ID = "com.mlot.spark"
ICON_FILE = "spark.icns"  # BUNDLE copies the icon into Contents/Resources under this name
# Core ML stateful models (KV as ct.StateType) need macOS 15.
MIN_MACOS = "15.0"
SESSION_EXTENSION = "spark"  # matches engine.session.file.SUFFIX (a test checks)
SESSION_UTI = "com.mlot.spark.session"
SESSION_TYPE_NAME = "MLoT Spark Session"
SESSION_MIME = "application/x-mlot-spark-session"


def project_version(pyproject: Path) -> str:
    """`[project] version` from pyproject.toml: the single place the version is written."""
    with pyproject.open("rb") as f:
        return str(tomllib.load(f)["project"]["version"])


def session_document_type() -> dict[str, Any]:
    # Owner rank: Finder opens .spark files with us and draws our icon on them; Editor: we also save them.
    return {
        "CFBundleTypeName": SESSION_TYPE_NAME,
        "CFBundleTypeRole": "Editor",
        "LSHandlerRank": "Owner",
        "LSItemContentTypes": [SESSION_UTI],
        "CFBundleTypeIconFile": ICON_FILE,
    }


def session_exported_type() -> dict[str, Any]:
    # We define the .spark format, so the UTI is exported (not imported); public.data: it is an opaque binary file.
    return {
        "UTTypeIdentifier": SESSION_UTI,
        "UTTypeDescription": SESSION_TYPE_NAME,
        "UTTypeConformsTo": ["public.data"],
        "UTTypeIconFile": ICON_FILE,
        "UTTypeTagSpecification": {
            "public.filename-extension": [SESSION_EXTENSION],
            "public.mime-type": [SESSION_MIME],
        },
    }


def info_plist(version: str) -> dict[str, Any]:
    """Keys merged over PyInstaller's BUNDLE defaults (which add CFBundleExecutable and CFBundlePackageType)."""
    return {
        "CFBundleName": APP_NAME,
        "CFBundleDisplayName": APP_NAME,
        "CFBundleIdentifier": BUNDLE_ID,
        "CFBundleShortVersionString": version,
        "CFBundleVersion": version,
        "CFBundleIconFile": ICON_FILE,
        "LSMinimumSystemVersion": MIN_MACOS,
        "LSApplicationCategoryType": "public.app-category.productivity",
        # Qt needs NSApplication as the principal class for Retina scaling and a proper menu bar.
        "NSPrincipalClass": "NSApplication",
        "NSHighResolutionCapable": True,
        # Follow the system's dark mode even though the bootloader may be linked against an older SDK.
        "NSRequiresAquaSystemAppearance": False,
        # Inference runs on the ANE / GPU through Core ML and MPS; let laptops stay on the integrated GPU.
        "NSSupportsAutomaticGraphicsSwitching": True,
        # No LSUIElement: the menu-bar quick prompt is an extra, the app keeps its Dock icon so sessions can be
        # dropped on it and its window reached with Cmd-Tab.
        "CFBundleDocumentTypes": [session_document_type()],
        "UTExportedTypeDeclarations": [session_exported_type()],
    }
