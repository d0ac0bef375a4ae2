"""``sbxnet tap ensure|remove``: set up or remove a VM tap (fixed MAC, pinned guest neighbour).

Prints what changed (or "unchanged"). Exit status: 0 done, 2 invalid input (nothing touched),
1 the host refused (namespace missing, the name is taken by something that is not ours, netlink error);
the message names the fix.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from forwarder.taps.spec import TapSpec


def _add_ref_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", required=True, help="tap interface name (at most 15 bytes), e.g. tap0")
    p.add_argument("--netns", help="named network namespace (as in `ip netns list`); default: host namespace")
    p.add_argument("--owner", type=int, help="owner uid of the tap (TUNSETOWNER): the user the VMM runs as")
    p.add_argument("--group", type=int, help="owner gid of the tap (TUNSETGROUP)")
    p.add_argument("--allow-attached", action="store_true",
                   help="accept a tap a process holds open (only when that process is this VM's own VMM)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="tap_command", metavar="ACTION", required=True)
    e = sub.add_parser("ensure", help="create or adopt a tap and make it match (idempotent)",
                       description="Create or adopt a persistent tap with a fixed MAC, an address and a "
                       "PERMANENT neighbour entry for the guest. Running it again changes nothing.")
    _add_ref_args(e)
    e.add_argument("--host-addr", required=True, help="the tap's address with prefix, e.g. 172.16.0.1/30")
    e.add_argument("--guest-ip", required=True,
                   help="the guest's IPv4 address on that prefix, e.g. 172.16.0.2")
    e.add_argument("--tap-mac", help="the tap's fixed MAC (default: derived from --stable-id)")
    e.add_argument("--guest-mac", help="the guest NIC's MAC (default: derived from --stable-id)")
    e.add_argument("--stable-id", help="id the MACs are derived from when not given: what the snapshot "
                   "carries across restore (its lineage id), or a platform-wide constant")
    e.add_argument("--mtu", type=int, help="tap MTU (default: leave the kernel's)")
    r = sub.add_parser("remove", help="delete a tap set up by `tap ensure`",
                       description="Delete the tap; refuses interfaces that are not ours.")
    _add_ref_args(r)


def _spec(args: argparse.Namespace) -> TapSpec:
    from forwarder.taps.netlink import TapSpec, TapSpecError, derive_mac

    macs: dict[str, str] = {}
    for field, role in (("tap_mac", "tap"), ("guest_mac", "guest")):
        value = getattr(args, field)
        if value is None:
            if not args.stable_id:
                flag = "--" + field.replace("_", "-")
                raise TapSpecError("mac_missing", f"no {flag} given and no --stable-id to derive it from",
                                   f"pass {flag} MAC or --stable-id ID")
            value = derive_mac(args.stable_id, role)
        macs[field] = value
    return TapSpec.parse(name=args.name, host_addr=args.host_addr, guest_ip=args.guest_ip, netns=args.netns,
                         owner_uid=args.owner, owner_gid=args.group, mtu=args.mtu, **macs)


def run(args: argparse.Namespace) -> int:
    from forwarder.taps.netlink import TapError, TapRef, TapSpecError, ensure_tap, remove_tap

    try:
        if args.tap_command == "ensure":
            result = ensure_tap(_spec(args), allow_attached=args.allow_attached)
            payload = {"name": result.name, "netns": result.netns, "ifindex": result.ifindex,
                       "mac": result.mac, "created": result.created, "changed": result.changed,
                       "changes": [c.describe() for c in result.changes]}
            lines = result.lines()
        else:
            ref = TapRef(args.name, args.netns, args.owner, args.group)
            removed = remove_tap(ref, allow_attached=args.allow_attached)
            payload = {"name": removed.name, "netns": removed.netns, "removed": removed.removed}
            lines = removed.lines()
    except TapSpecError as e:
        print(f"sbxnet tap {args.tap_command}: {e}", file=sys.stderr)
        return 2
    except TapError as e:
        print(f"sbxnet tap {args.tap_command}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(payload) if args.json else "\n".join(lines))
    return 0
