#!/usr/bin/env bash
# Installs everything the project needs on a Debian 12 machine, as root, idempotently:
# the system packages (compiler, iproute2, nftables, qemu + a stock Debian kernel for the kTLS tests,
# haproxy, nginx (with its stream module) and h2load for the benchmarks, chromium and openssh for the
# gateway's real-client tests) and a
# virtual environment in .venv with the project installed editable.
set -euo pipefail
cd "$(dirname "$0")/.."

need_pkgs=(build-essential python3-dev python3-venv pkg-config libssl-dev
           iproute2 nftables curl tcpdump ca-certificates postgresql
           qemu-system-x86 linux-image-amd64 busybox-static haproxy
           chromium openssh-server openssh-client nginx libnginx-mod-stream nghttp2-client)
missing=()
for p in "${need_pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    if [[ $(id -u) -ne 0 ]]; then
        echo "setup: missing system packages: ${missing[*]} (run as root, or install them)" >&2
        exit 1
    fi
    echo "setup: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

py=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
    "$py" -m venv .venv
fi
stamp=.venv/.sbxnet-installed
if [[ ! -f $stamp || pyproject.toml -nt $stamp || setup.py -nt $stamp \
      || -n $(find native -newer "$stamp" \( -name '*.c' -o -name '*.h' -o -name 'build_*.py' -o -name '_cdef.py' \) 2>/dev/null) ]]; then
    # pip's output goes to a log, shown only when the install fails.
    # The test extensions (native/build_*_test.py: key export for the kTLS tests) are built here only;
    # a plain `pip install .` of the product leaves them out.
    if ! { .venv/bin/pip install -q --upgrade pip \
           && SBXNET_BUILD_TEST_EXTENSIONS=1 .venv/bin/pip install -q -e '.[test]'; } \
            >.venv/pip.log 2>&1; then
        cat .venv/pip.log >&2
        echo "setup: pip install failed (log above, also in .venv/pip.log)" >&2
        exit 1
    fi
    touch "$stamp"
fi
