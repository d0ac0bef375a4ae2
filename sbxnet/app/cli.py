"""``sbxnet``: one console script, one subcommand per component.

Each subcommand lives in its own module exposing ``configure(parser)`` and ``run(args) -> int``;
modules are imported only when their subcommand runs, so one component's import cost (or a missing
optional system feature) never affects another's.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from sbxnet.errors import ConfigError

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "forwarder": ("forwarder.ingress.cli", "run the ingress forwarder on a sandbox host"),
    "gateway": ("gateway.cli", "run the TLS front end: route each request to its sandbox over the forwarder link"),
    "scheduler": ("scheduler.cli", "run the reference scheduler: routes, idle timers, holds, wakes (and `status`)"),
    "certs": ("certs.cli", "mint a CA, forwarder and gateway certificates; print SPKI pins"),
    "egress": ("forwarder.egress.router.cli", "run the egress router: guest streams to VXLAN exits and back"),
    "tap": ("forwarder.taps.cli", "set up or remove a VM tap: fixed MAC, permanent guest neighbour entry"),
    "demo": ("sbxnet.app.demo", "the loopback demo: scheduler, forwarder, gateway and sample sandboxes, narrated"),
    "demo-forwarder": ("sbxnet.app.demo_forwarder",
                       "the link-level demo: a forwarder and a sample app driven by a gateway-like client"),
    "bench": ("sbxnet.app.bench.cli", "the staged throughput benchmark: L7 two hops, L4 userspace, L4 kTLS, ..."),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sbxnet", description="Network edge of a sandbox platform.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        sp.set_defaults(_module=module_name)
        # configure() must stay import-light: heavy imports happen inside run().
        importlib.import_module(module_name).configure(sp)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args) or 0)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
