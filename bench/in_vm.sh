#!/usr/bin/env bash
# Run one bench command inside Debian's stock kernel (linux-image-amd64, CONFIG_TLS=m) booted with
# virtme-ng under QEMU software emulation: the emulated kernel the kTLS tests use (DESIGN.md), for the
# figures that need a kernel with TLS and do not depend on speed (memory: RSS per tunnel, pipe pages).
# Every timing or throughput figure it prints is emulated: functional only, never compared.
#
#   bench/in_vm.sh OUT_DIR [--memory 4G] [--timeout 1800] -- COMMAND [ARGS...]
#
# COMMAND runs as root in a snapshot of HEAD (git archive, plus the built native modules), so edits in
# the working tree while the VM runs do not leak into it; stdout and stderr go to OUT_DIR/run.log, the
# exit code to OUT_DIR/rc, `uname -a` and the probe to OUT_DIR/machine.txt. $OUT inside the VM is
# OUT_DIR, for files the command writes.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
export PATH="$root/.venv/bin:$PATH"
usage() { echo "usage: bench/in_vm.sh OUT_DIR [--memory 4G] [--timeout 1800] -- COMMAND [ARGS...]" >&2; exit 2; }
[[ $# -ge 3 ]] || usage
out=$1; shift
memory=4G; limit=1800
while [[ $# -gt 0 && $1 != -- ]]; do
    case $1 in
        --memory) memory=$2; shift 2 ;;
        --timeout) limit=$2; shift 2 ;;
        *) usage ;;
    esac
done
[[ ${1:-} == -- ]] || usage
shift
[[ $# -gt 0 ]] || usage

fail() { echo "in_vm: FAILED: $*" >&2; exit 1; }
kernel=$(ls /boot/vmlinuz-*-amd64 2>/dev/null | sort -V | tail -n 1)
[[ -n $kernel ]] || fail "no Debian kernel to boot (apt-get install linux-image-amd64; scripts/setup.sh does)"
command -v "$root/.venv/bin/vng" >/dev/null || fail "virtme-ng (vng) is not installed in .venv (run scripts/setup.sh)"
command -v qemu-system-x86_64 >/dev/null || fail "qemu-system-x86_64 is missing (apt-get install qemu-system-x86)"

mkdir -p "$out" || fail "cannot create $out"
out=$(cd "$out" && pwd)
rm -f "$out/rc" "$out/run.log" "$out/machine.txt" "$out/vm.log"
# Inside the VM /tmp and /var/tmp are its own tmpfs: the snapshot lives in OUT_DIR, which is shared
snap=$out/tree
rm -rf "$snap" && mkdir -p "$snap" || fail "cannot create $snap"
trap 'rm -rf "$snap"' EXIT
git archive HEAD | tar -x -C "$snap" || fail "git archive of HEAD"
cp -p native/*.so "$snap/native/" 2>/dev/null || fail "no built native modules in native/ (run scripts/setup.sh)"
ln -s "$root/.venv" "$snap/.venv"
echo "in_vm: snapshot of $(git rev-parse --short HEAD) in $snap"

cmd=$(printf '%q ' "$@")
cat >"$snap/.in_vm_inner.sh" <<INNER
cd '$snap' || exit 90
ip link set lo up 2>/dev/null
modprobe tls || { echo "modprobe tls failed inside the VM" >'$out/run.log'; echo 91 >'$out/rc'; exit 91; }
export PYTHONDONTWRITEBYTECODE=1 HOME=/tmp TMPDIR=/tmp SBXNET_IN_VM=1 OUT='$out' PYTHONPATH='$snap'
export PATH='$root/.venv/bin':\$PATH
{ uname -a; nproc; grep MemTotal /proc/meminfo; cat /proc/sys/fs/pipe-user-pages-soft;
  '$root/.venv/bin/python' -c 'from forwarder.ingress.planes.ktls_keys import probe; print(probe())'; } >'$out/machine.txt' 2>&1
$cmd >'$out/run.log' 2>&1
echo \$? >'$out/rc'
INNER

echo "in_vm: booting $(basename "$kernel") under QEMU (software emulation, $memory): figures of speed are emulated"
start=$SECONDS
timeout "$limit" "$root/.venv/bin/vng" --disable-kvm --cpus 2 --memory "$memory" --run "$kernel" \
    --rwdir "$out" --exec "sh $snap/.in_vm_inner.sh" </dev/null >"$out/vm.log" 2>&1
vm_rc=$?
echo "in_vm: VM run took $((SECONDS - start)) s (vng exit $vm_rc)"
[[ -f $out/rc ]] || { tail -n 30 "$out/vm.log" >&2; fail "the command did not report (vng exit $vm_rc; limit $limit s)"; }
exit "$(cat "$out/rc")"
