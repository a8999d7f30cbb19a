"""The Info.plist the spec hands to BUNDLE, and the entitlements sign.sh uses."""

from __future__ import annotations

import plistlib
import tomllib

from engine.paths import APP_NAME
from engine.session.file import SESSION_SUFFIX
from tests.packaging.loader import REPO, load

plist = load("plist")
VERSION = plist.project_version(REPO / "pyproject.toml")


def test_version_comes_from_pyproject() -> None:
    with (REPO / "pyproject.toml").open("rb") as f:
        assert tomllib.load(f)["project"]["version"] == VERSION
    info = plist.info_plist(VERSION)
    assert info["CFBundleShortVersionString"] == info["CFBundleVersion"] == VERSION


def test_bundle_keys() -> None:
    info = plist.info_plist(VERSION)
    assert info["CFBundleIdentifier"] == "com.mlot.spark"
    assert info["CFBundleName"] == APP_NAME
    assert info["LSMinimumSystemVersion"] == "15.0"
    assert info["NSHighResolutionCapable"] is True
    assert info["NSSupportsAutomaticGraphicsSwitching"] is True
    assert info["CFBundleIconFile"] == "spark.icns"
    assert "LSUIElement" not in info  # the app keeps its Dock icon: sessions are dropped on it


def test_session_document_type_matches_exported_uti() -> None:
    info = plist.info_plist(VERSION)
    (doc,) = info["CFBundleDocumentTypes"]
    (uti,) = info["UTExportedTypeDeclarations"]
    assert doc["LSItemContentTypes"] == [uti["UTTypeIdentifier"]] == ["com.mlot.spark.session"]
    assert doc["LSHandlerRank"] == "Owner"
    assert doc["CFBundleTypeRole"] == "Editor"
    assert "public.data" in uti["UTTypeConformsTo"]
    # The extension Finder maps to our UTI is the one the engine writes.
    assert uti["UTTypeTagSpecification"]["public.filename-extension"] == [SESSION_SUFFIX.lstrip(".")]
    assert doc["CFBundleTypeIconFile"] == uti["UTTypeIconFile"] == info["CFBundleIconFile"]


def test_serialises_as_xml_plist() -> None:
    info = plist.info_plist(VERSION)
    assert plistlib.loads(plistlib.dumps(info)) == info


def test_entitlements_for_python_and_torch() -> None:
    ents = plistlib.loads((REPO / "resources" / "packaging" / "entitlements.plist").read_bytes())
    assert ents == {
        "com.apple.security.cs.allow-jit": True,
        "com.apple.security.cs.allow-unsigned-executable-memory": True,
        "com.apple.security.cs.disable-library-validation": True,
    }
