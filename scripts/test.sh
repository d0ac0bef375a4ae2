#!/usr/bin/env bash
# The whole test suite: lint, types, the host tests, then the kernel-TLS tests (directly on a kernel
# with CONFIG_TLS, otherwise inside a stock Debian kernel under QEMU).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
echo "== ruff"; ruff check --no-cache .  # no cache: what a clean clone sees
echo "== mypy"
mypy  # the `files` in pyproject.toml: the packages, bench/ and tests/, conftest.py files left out
# Each test directory's conftest.py is the top-level module `conftest`, and one mypy run holds one
# module of a name, so each is checked in a run of its own.
find tests -name conftest.py -print0 | sort -z | xargs -0 -n1 mypy
echo "== pytest"
pytest -p no:cacheprovider "$@"
if [[ -x scripts/ktls-tests.sh ]]; then
    echo "== kTLS tests"
    scripts/ktls-tests.sh
fi
