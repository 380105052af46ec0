#!/usr/bin/env bash
# Chromium for tests/docs/test_browser.py (the built docs site in a headless browser): Debian's
# package, installed with apt when `chromium` is not on PATH (needs root). `tox -e docs` runs this
# before its tests; when it cannot install, it says why here, and the test then fails under CI=true
# (skips elsewhere) naming this script.
set -euo pipefail

die() { echo "chromium.sh: $*" >&2; exit 1; }

command -v chromium >/dev/null && exit 0
[ "$(id -u)" = 0 ] || die "chromium is not installed and this is not root: run \
'apt-get install chromium' as root (or put a Chromium binary named chromium on PATH)"
command -v apt-get >/dev/null || die "chromium is not installed and there is no apt-get here: \
install Chromium yourself (a binary named chromium on PATH)"
log=${TMPDIR:-/tmp}/redco-chromium-apt.log
# DPkg::Lock::Timeout: wait for an apt run of another environment (`tox p`: slurm.sh) to end.
apt=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends
     -o DPkg::Lock::Timeout=600 chromium)
"${apt[@]}" >"$log" 2>&1 || {  # (a fresh machine may have no package lists yet)
    apt-get update -q >>"$log" 2>&1 || true
    "${apt[@]}" >>"$log" 2>&1
} || die "apt-get install chromium failed: see $log"
command -v chromium >/dev/null || die "apt-get installed chromium but it is not on PATH"
