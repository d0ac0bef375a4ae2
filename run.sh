#!/usr/bin/env bash
# The two entry points of the README:
#   ./run.sh demo   set everything up, then run the loopback demo and print what happened
#   ./run.sh test   set everything up, then run the whole test suite (lint, types, tests, kTLS VM tests)
set -euo pipefail
cd "$(dirname "$0")"
cmd=${1:-}
case "$cmd" in
    demo) shift; scripts/setup.sh; exec .venv/bin/sbxnet demo "$@" ;;
    test) shift; scripts/setup.sh; exec scripts/test.sh "$@" ;;
    *) echo "usage: ./run.sh demo|test" >&2; exit 2 ;;
esac
