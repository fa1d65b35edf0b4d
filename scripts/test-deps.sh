#!/usr/bin/env bash
# What `make test` needs besides .venv: promtool (Debian package `prometheus`, for
# tests/ops' `promtool check metrics` / `promtool test rules`) and a headless Chromium with
# its WebDriver (`chromium`, `chromium-driver`, for the dashboard test). No browser is
# downloaded at test time.
#
# All present: exits 0 silently. Missing and root on Debian: installs them with apt-get
# (one progress line; the log goes to test-artifacts/test-deps.log). Missing otherwise:
# one line naming the packages to install, exit 1.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOG="$ROOT/test-artifacts/test-deps.log"

missing=()
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
[ "${#missing[@]}" -eq 0 ] && exit 0

if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "make test needs promtool, chromium and chromedriver: install the Debian packages" \
        "'${missing[*]}' (as root: apt-get install -y ${missing[*]}) and run it again" >&2
    exit 1
fi

mkdir -p "$(dirname "$LOG")"
echo "make test: installing ${missing[*]} with apt-get (once, about a minute; log: ${LOG#"$ROOT"/})"
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -qq && apt-get install -y -qq "${missing[@]}"; } >"$LOG" 2>&1; then
    echo "apt-get failed installing ${missing[*]}; last lines of $LOG:" >&2
    tail -n 20 "$LOG" >&2
    exit 1
fi
for tool in promtool chromium chromedriver; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "installed ${missing[*]} but '$tool' is still not on PATH ($PATH)" >&2
        exit 1
    fi
done
