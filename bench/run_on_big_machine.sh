#!/usr/bin/env bash
# sbxnet bench's full table on a larger machine (16 cores, say) with kernel TLS, from this checkout alone:
# sets itself up (scripts/setup.sh: the packages, the venv, the C extensions), loads the kernel's TLS module,
# runs the full mode within 8 minutes and leaves everything to bring back under one directory.
#
#   bench/run_on_big_machine.sh [OUT_DIR]      (default: bench-results-<host>-<UTC time>)
#
# OUT_DIR then holds bench.md (the tables), bench.json (every trial, the machine), bench.png (the chart),
# machine.txt (lscpu, the kernel's ULPs, versions), splice-threads-N.txt (the splice pump on plain TCP with 1
# and with nproc pump threads) and run.log (this script's whole output).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench-results-$(hostname -s)-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$out"
exec > >(tee "$out/run.log") 2>&1
echo "== setup"
scripts/setup.sh
echo "== kernel TLS"
modprobe tls 2>/dev/null || echo "modprobe tls failed: the kTLS arms will say why they did not run"
{
    date -u
    uname -a
    echo "nproc $(nproc)"
    lscpu
    echo "ULPs: $(cat /proc/sys/net/ipv4/tcp_available_ulp 2>/dev/null || echo none)"
    .venv/bin/python -c 'import ssl, sys; print(sys.version); print(ssl.OPENSSL_VERSION)'
    nginx -v 2>&1; haproxy -v | head -1; h2load --version | head -1; curl --version | head -1
    uptime
} > "$out/machine.txt" 2>&1
echo "== sbxnet bench --full"
# 1 GiB per bulk trial: at a few GB/s a smaller one is over before the CPU clock (10 ms ticks) says much.
# --budget: no trial starts after 450 s, so the table is done within 8 minutes; what was left is listed.
rc=0
.venv/bin/sbxnet bench --full --mib 1024 --budget 450 --out "$out" || rc=$?
# The plain-TCP splice on 8 tunnels with 1 pump thread and with one per core (issue 11; seconds each).
for threads in 1 "$(nproc)"; do
    echo "== splice_vs_haproxy --threads $threads"
    .venv/bin/python bench/splice_vs_haproxy.py --mib 1024 --rounds 2 --threads "$threads" \
        > "$out/splice-threads-$threads.txt" 2>&1 || rc=$?
done
echo "== done (sbxnet bench exit $rc): $out"
ls -l "$out"
exit "$rc"
