#!/usr/bin/env bash
# Sign dist/MLoT Spark.app (or the bundle given) with the hardened runtime and our entitlements.
#   packaging/sign.sh [APP]
# Identity: $SPARK_SIGN_IDENTITY (e.g. "Developer ID Application: Name (TEAMID)"), else ad hoc ("-"), which runs
# on this Mac but cannot be notarized.
set -euo pipefail
source "$(dirname "$0")/common.sh"
require_macos codesign

APP="${1:-$DEFAULT_APP}"
IDENTITY="${SPARK_SIGN_IDENTITY:--}"
require_app "$APP"
[[ -f "$ENTITLEMENTS" ]] || die "missing $ENTITLEMENTS"

# A secure timestamp is required for notarization, but an ad-hoc signature cannot have one.
if [[ "$IDENTITY" == "-" ]]; then TIMESTAMP=(--timestamp=none); else TIMESTAMP=(--timestamp); fi
SIGN=(codesign --force --sign "$IDENTITY" --options runtime --entitlements "$ENTITLEMENTS" "${TIMESTAMP[@]}")

# --deep gives every nested binary (dylibs, extension modules, Qt frameworks) the same options and
# entitlements as the app. Apple discourages that when nested code needs different rights; ours does not, and it
# is what PyInstaller's own BUNDLE step does, so nested frameworks get signed as bundles, in the right order.
"${SIGN[@]}" --deep "$APP"

codesign --verify --deep --strict --verbose=2 "$APP"
echo "signed '$APP' as '$IDENTITY'"
if [[ "$IDENTITY" == "-" ]]; then
  echo "ad-hoc signature: fine on this Mac; set SPARK_SIGN_IDENTITY to a Developer ID to distribute and notarize"
fi
