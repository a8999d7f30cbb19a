# Sourced by the macOS-only packaging scripts: shared paths and the platform check.
# shellcheck shell=bash

PACKAGING_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(dirname "$PACKAGING_DIR")"
APP_NAME="MLoT Spark"
DEFAULT_APP="$REPO_ROOT/dist/$APP_NAME.app"
ENTITLEMENTS="$REPO_ROOT/resources/packaging/entitlements.plist"

die() {
  echo "$(basename "$0"): $*" >&2
  exit 1
}

# codesign, notarytool, stapler and hdiutil exist only on macOS: stop before doing anything half-way.
require_macos() {
  local tool
  [[ "$(uname -s)" == Darwin ]] || {
    echo "$(basename "$0"): needs macOS (this is $(uname -s)); nothing was done." >&2
    exit 2
  }
  for tool in "$@"; do
    command -v "$tool" >/dev/null || die "needs '$tool' (install the Xcode command-line tools: xcode-select --install)"
  done
}

require_app() {
  [[ -d "$1/Contents/MacOS" ]] || die "no app bundle at '$1'; build it first with 'make app'"
}
