#!/usr/bin/env bash
# The whole test suite: lint, types, the host tests, then the kernel-TLS tests (directly on a kernel
# with CONFIG_TLS, otherwise inside a stock Debian kernel under QEMU).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
echo "== ruff"; ruff check .
echo "== mypy"; mypy sbxnet forwarder gateway certs native
echo "== pytest"
pytest -p no:cacheprovider "$@"
if [[ -x scripts/ktls-tests.sh ]]; then
    echo "== kTLS tests"
    scripts/ktls-tests.sh
fi
