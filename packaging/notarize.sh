#!/usr/bin/env bash
# Notarize a signed app or DMG with Apple and staple the ticket to it.
#   packaging/notarize.sh [APP_OR_DMG]        (default: dist/MLoT Spark.app)
# Credentials, first found wins:
#   SPARK_NOTARY_PROFILE   a keychain profile made once with `xcrun notarytool store-credentials PROFILE`
#   SPARK_NOTARY_APPLE_ID + SPARK_NOTARY_TEAM_ID + SPARK_NOTARY_PASSWORD (an app-specific password)
set -euo pipefail
source "$(dirname "$0")/common.sh"
require_macos xcrun ditto

TARGET="${1:-$DEFAULT_APP}"
[[ -e "$TARGET" ]] || die "nothing at '$TARGET'; build and sign first ('make app', packaging/sign.sh)"

if [[ -n "${SPARK_NOTARY_PROFILE:-}" ]]; then
  AUTH=(--keychain-profile "$SPARK_NOTARY_PROFILE")
elif [[ -n "${SPARK_NOTARY_APPLE_ID:-}" && -n "${SPARK_NOTARY_TEAM_ID:-}" && -n "${SPARK_NOTARY_PASSWORD:-}" ]]; then
  AUTH=(--apple-id "$SPARK_NOTARY_APPLE_ID" --team-id "$SPARK_NOTARY_TEAM_ID" --password "$SPARK_NOTARY_PASSWORD")
else
  die "no notary credentials: set SPARK_NOTARY_PROFILE, or SPARK_NOTARY_APPLE_ID, SPARK_NOTARY_TEAM_ID and SPARK_NOTARY_PASSWORD"
fi

codesign --verify --strict "$TARGET" 2>/dev/null || die "'$TARGET' is not validly signed; run packaging/sign.sh with SPARK_SIGN_IDENTITY set"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
if [[ "$TARGET" == *.dmg ]]; then
  UPLOAD="$TARGET"
else
  # notarytool takes a zip, dmg or pkg; ditto keeps the bundle's symlinks and extended attributes.
  UPLOAD="$WORK/$(basename "$TARGET").zip"
  ditto -c -k --keepParent "$TARGET" "$UPLOAD"
fi

echo "submitting $(basename "$UPLOAD") (waiting for Apple's verdict; this can take minutes)"
xcrun notarytool submit "$UPLOAD" "${AUTH[@]}" --wait --output-format plist >"$WORK/result.plist"
STATUS="$(/usr/libexec/PlistBuddy -c 'Print :status' "$WORK/result.plist")"
if [[ "$STATUS" != Accepted ]]; then
  ID="$(/usr/libexec/PlistBuddy -c 'Print :id' "$WORK/result.plist")"
  xcrun notarytool log "$ID" "${AUTH[@]}" >&2 || true
  die "notarization finished with status '$STATUS' (log above)"
fi

xcrun stapler staple "$TARGET"
xcrun stapler validate "$TARGET"
echo "notarized and stapled '$TARGET'"
