#!/usr/bin/env bash
# Install Debian's chromium + chromium-driver for the report's headless-browser test
# (tests/test_report.py). Idempotent: does nothing when both binaries are already there.
#
#   scripts/install_browser.sh            # as root, or with sudo available
set -euo pipefail

if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    echo "chromium and chromedriver already installed: $(command -v chromium), $(command -v chromedriver)"
    exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null 2>&1; then
    SUDO="sudo"
else
    echo "error: installing chromium needs root (run this script as root or install sudo)" >&2
    exit 1
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "error: apt-get not found; install chromium and chromedriver with your system's package manager" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends chromium chromium-driver

chromium --version
chromedriver --version
