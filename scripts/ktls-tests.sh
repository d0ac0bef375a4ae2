#!/usr/bin/env bash
# The kernel-TLS tests (pytest -m ktls tests/ingress/planes). On a kernel that can attach the TLS ULP they run
# directly. Otherwise they run inside Debian's stock kernel (linux-image-amd64, CONFIG_TLS=m) booted
# with virtme-ng under QEMU software emulation: the host's root is shared read-only, results come back
# through a --rwdir, and this script exits with the tests' exit code. If the VM cannot start or the
# tests do not report, this FAILS with the reason: a kTLS test is never skipped silently.
#   KTLS_VM_TIMEOUT  seconds for the whole VM run (default 480)
#   KTLS_XFER_MIB    MiB each way for the large transfer tests (default 64; the issue needs >= 64)
#   KTLS_TAKEOVER    1: also run tests/ingress/planes/test_ktls_takeover.py (9-13 minutes more in the VM:
#                    set KTLS_VM_TIMEOUT=1800)
#   KTLS_TAKEOVER_TUNNELS, KTLS_TAKEOVER_TICK_S  that test's long tunnels and arrival interval (its defaults if unset)
# The takeover test's processes' logs and steps are kept in /tmp/sbxnet-ktls-last-trace/ (written as they
# come, so a run cut short by the time limit shows where it was).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
py=$root/.venv/bin/python
export PATH="$root/.venv/bin:$PATH" PYTHONDONTWRITEBYTECODE=1
pytest_args=(-p no:cacheprovider -m ktls tests/ingress/planes -q -rs)

if "$py" -c 'import sys; from forwarder.ingress.planes.ktls_keys import probe; sys.exit(0 if probe().ok else 1)' 2>/dev/null; then
    echo "kTLS: the running kernel attaches the TLS ULP; running the kTLS tests directly"
    exec "$py" -m pytest "${pytest_args[@]}" "$@"
fi

fail() { echo "kTLS tests: FAILED: $*" >&2; exit 1; }
kernel=$(ls /boot/vmlinuz-*-amd64 2>/dev/null | sort -V | tail -n 1)
[[ -n $kernel ]] || fail "no kernel here has TLS and no Debian kernel to boot (apt-get install linux-image-amd64; scripts/setup.sh does)"
command -v vng >/dev/null || fail "virtme-ng (vng) is not installed in .venv (run scripts/setup.sh)"
command -v qemu-system-x86_64 >/dev/null || fail "qemu-system-x86_64 is missing (apt-get install qemu-system-x86)"

results=$(mktemp -d /tmp/sbxnet-ktls.XXXXXX)
extra=$(printf '%q ' "${pytest_args[@]}" "$@")
trap 'rm -rf "$results"' EXIT
# Inside the VM: /work/main and .venv are read-only; /tmp is a writable tmpfs; only $results comes back.
cat >"$results/inner.sh" <<INNER
cd '$root' || exit 90
ip link set lo up 2>/dev/null
if ! modprobe tls; then echo "modprobe tls failed inside the VM" >'$results/error'; echo 91 >'$results/rc'; exit 91; fi
export PYTHONDONTWRITEBYTECODE=1 HOME=/tmp TMPDIR=/tmp KTLS_XFER_MIB='${KTLS_XFER_MIB:-64}' SBXNET_IN_VM=1 KTLS_TAKEOVER='${KTLS_TAKEOVER:-}'
export KTLS_TRACE_DIR='$results/trace'
[ -n '${KTLS_TAKEOVER_TUNNELS:-}' ] && export KTLS_TAKEOVER_TUNNELS='${KTLS_TAKEOVER_TUNNELS:-}'
[ -n '${KTLS_TAKEOVER_TICK_S:-}' ] && export KTLS_TAKEOVER_TICK_S='${KTLS_TAKEOVER_TICK_S:-}'
mkdir -p "\$KTLS_TRACE_DIR"
'$py' -m pytest $extra --basetemp=/tmp/pytest --junitxml='$results/junit.xml' >'$results/pytest.log' 2>&1
echo \$? >'$results/rc'
INNER

echo "kTLS: no TLS in the running kernel ($(uname -r)); booting $(basename "$kernel") under QEMU (software emulation)"
echo "kTLS: figures printed inside the VM are emulated: functional checks only, never performance"
start=$SECONDS
timeout "${KTLS_VM_TIMEOUT:-480}" vng --disable-kvm --cpus 2 --memory 2G --run "$kernel" \
    --rwdir "$results" --exec "sh $results/inner.sh" </dev/null >"$results/vm.log" 2>&1
vm_rc=$?
if [[ -f $results/pytest.log ]]; then
    cat "$results/pytest.log"
    cp "$results/pytest.log" "${TMPDIR:-/tmp}/sbxnet-ktls-last.log" 2>/dev/null || true
fi
trace_keep=${TMPDIR:-/tmp}/sbxnet-ktls-last-trace
if [[ -n $(ls -A "$results/trace" 2>/dev/null) ]]; then
    rm -rf "$trace_keep" && cp -r "$results/trace" "$trace_keep" 2>/dev/null || true
fi
echo "kTLS: VM run took $((SECONDS - start)) s (vng exit $vm_rc)"
if [[ ! -f $results/rc ]]; then
    tail -n 30 "$results/vm.log" >&2
    [[ $vm_rc -eq 124 ]] && fail "the VM run exceeded ${KTLS_VM_TIMEOUT:-480} s"
    fail "the VM did not start or did not report a result (vng exit $vm_rc; its log is above)"
fi
rc=$(cat "$results/rc")
[[ -f $results/error ]] && fail "$(cat "$results/error")"
exit "$rc"
