"""``sbxnet certs``: mint the certificates a deployment needs, and print SPKI pins."""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="certs_cmd", metavar="ACTION", required=True)
    ca = sub.add_parser("ca", help="mint a CA (ca.crt, ca.key)")
    ca.add_argument("--dir", type=Path, required=True, help="output directory")
    ca.add_argument("--name", default="sbxnet CA", help="CA common name")
    ca.add_argument("--days", type=float, default=3650)

    fw = sub.add_parser("forwarder", help="mint a forwarder certificate signed by the CA (server for the link, "
                        "client with a URI SAN for the idle feed)")
    fw.add_argument("--dir", type=Path, required=True, help="directory holding ca.crt/ca.key; output too")
    fw.add_argument("--name", default="forwarder", help="file stem and common name")
    fw.add_argument("--dns", action="append", default=[], help="DNS SAN (repeatable)")
    fw.add_argument("--ip", action="append", default=[], help="IP SAN (repeatable)")
    fw.add_argument("--trust-domain", default="sbxnet.local", help="SPIFFE trust domain")
    fw.add_argument("--uri", action="append", default=[],
                    help="URI SAN, its identity in the idle feed (default spiffe://<td>/forwarder/<name>)")
    fw.add_argument("--days", type=float, default=365)

    sc = sub.add_parser("scheduler", help="mint a scheduler server certificate signed by the CA")
    sc.add_argument("--dir", type=Path, required=True, help="directory holding ca.crt/ca.key; output too")
    sc.add_argument("--name", default="scheduler", help="file stem and common name")
    sc.add_argument("--dns", action="append", default=[], help="DNS SAN (repeatable)")
    sc.add_argument("--ip", action="append", default=[], help="IP SAN (repeatable)")
    sc.add_argument("--days", type=float, default=365)

    gw = sub.add_parser("gateway", help="mint a gateway client certificate (URI SAN) signed by the CA")
    gw.add_argument("--dir", type=Path, required=True, help="directory holding ca.crt/ca.key; output too")
    gw.add_argument("--name", default="gateway", help="file stem and common name")
    gw.add_argument("--trust-domain", default="sbxnet.local", help="SPIFFE trust domain")
    gw.add_argument("--uri", action="append", default=[], help="URI SAN (default spiffe://<td>/gateway)")
    gw.add_argument("--days", type=float, default=365)

    pin = sub.add_parser("pin", help="print the SPKI pin (base64 SHA-256) of a PEM certificate")
    pin.add_argument("cert", type=Path)

    tok = sub.add_parser("token", help="make a bearer token file (0600), or hash one: prints the admin_token_sha256 "
                         "to configure", description="make a bearer token file (0600), or hash an existing one, and "
                         "print its SHA-256 as the scheduler's admin_token_sha256 wants it (the file's trailing "
                         "newline is not part of the token)")
    made = tok.add_mutually_exclusive_group(required=True)
    made.add_argument("--out", type=Path, help="write a fresh token to this file (refused if it exists)")
    made.add_argument("--hash", type=Path, metavar="FILE", help="hash the token already in FILE")

    dev = sub.add_parser("dev", help="mint a CA, forwarder (localhost), gateway and scheduler (localhost) "
                         "certificates and a scheduler admin token")
    dev.add_argument("--dir", type=Path, required=True)
    dev.add_argument("--trust-domain", default="sbxnet.local")
    _configure_rotation(sub)


def run(args: argparse.Namespace) -> int:
    from cryptography import x509

    from certs.mint import load_issued, mint_ca, mint_leaf, spki_pin, write_issued

    cmd = args.certs_cmd
    if cmd in _ROTATION:
        return _run_rotation(args)
    if cmd == "token":
        return _token(args)
    if cmd == "pin":
        cert = x509.load_pem_x509_certificate(args.cert.read_bytes())
        print(spki_pin(cert))
        return 0
    if cmd in ("ca", "dev"):
        ca = mint_ca(getattr(args, "name", "sbxnet dev CA"), days=getattr(args, "days", 3650))
        write_issued(ca, args.dir, "ca")
        print(f"wrote {args.dir / 'ca.crt'} and {args.dir / 'ca.key'} (0600)")
        if cmd == "ca":
            return 0
        fw_uri = f"spiffe://{args.trust_domain}/forwarder/forwarder"
        fw = mint_leaf(ca, "forwarder", dns=("localhost",), ips=("127.0.0.1", "::1"), uris=(fw_uri,), server=True,
                       client=True)
        write_issued(fw, args.dir, "forwarder")
        gw_uri = f"spiffe://{args.trust_domain}/gateway"
        gw = mint_leaf(ca, "gateway", uris=(gw_uri,), server=False, client=True)
        write_issued(gw, args.dir, "gateway")
        sc = mint_leaf(ca, "scheduler", dns=("localhost",), ips=("127.0.0.1", "::1"), server=True)
        write_issued(sc, args.dir, "scheduler")
        token = args.dir / "admin.token"
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        print(f"wrote forwarder.crt/.key (DNS localhost, IP 127.0.0.1, URI {fw_uri}) pin {spki_pin(fw.cert)}")
        print(f"wrote gateway.crt/.key (URI {gw_uri})")
        print("wrote scheduler.crt/.key (DNS localhost, IP 127.0.0.1)")
        print(f"wrote {token} (0600): the scheduler's admin token")
        return 0
    try:
        ca = load_issued(args.dir, "ca")
    except FileNotFoundError as e:
        print(f"certs: {e.filename} not found: mint a CA first with 'sbxnet certs ca --dir {args.dir}'")
        return 1
    if cmd == "forwarder":
        if not (args.dns or args.ip):
            print("certs: a forwarder certificate needs at least one --dns or --ip")
            return 2
        uris = tuple(args.uri) or (f"spiffe://{args.trust_domain}/forwarder/{args.name}",)
        leaf = mint_leaf(ca, args.name, dns=tuple(args.dns), ips=tuple(args.ip), uris=uris, server=True, client=True,
                         days=args.days)
    elif cmd == "scheduler":
        if not (args.dns or args.ip):
            print("certs: a scheduler certificate needs at least one --dns or --ip")
            return 2
        leaf = mint_leaf(ca, args.name, dns=tuple(args.dns), ips=tuple(args.ip), server=True, days=args.days)
    else:
        uris = tuple(args.uri) or (f"spiffe://{args.trust_domain}/gateway",)
        leaf = mint_leaf(ca, args.name, uris=uris, server=False, client=True, days=args.days)
    cert_path, key_path = write_issued(leaf, args.dir, args.name)
    print(f"wrote {cert_path} and {key_path} (0600); SPKI pin {spki_pin(leaf.cert)}")
    return 0


# -- renewing and rotating a leaf's key (docs/forwarder.md, "Rotating a forwarder's key") ----------------

_ROTATION = ("renew", "next-key", "promote")


def _configure_rotation(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    renew = sub.add_parser("renew", help="re-issue <name>.crt for the key it has (same SPKI pin, same SANs), "
                           "signed by the CA; <name>.key is not touched")
    nxt = sub.add_parser("next-key", help="mint the next key ahead: <name>.next.crt/.key beside the current "
                         "ones (same SANs, not installed), and print its SPKI pin for the routes")
    promote = sub.add_parser("promote", help="install <name>.next.crt/.key as <name>.crt/.key, keeping the "
                             "current pair as <name>.prev.crt/.key (then SIGHUP the process)")
    for p in (renew, nxt, promote):
        p.add_argument("--dir", type=Path, required=True, help="directory holding ca.crt/ca.key and the leaf")
        p.add_argument("--name", default="forwarder", help="the leaf's file stem")
    for p in (renew, nxt):
        p.add_argument("--days", type=float, default=365)


def _run_rotation(args: argparse.Namespace) -> int:
    from cryptography.exceptions import InvalidSignature

    from certs.mint import Issued, load_issued, reissue, spki_pin, write_cert, write_issued

    d, name = args.dir, args.name
    try:
        ca = load_issued(d, "ca")
        if args.certs_cmd == "promote":
            fresh = load_issued(d, f"{name}.next")
        else:
            current = load_issued(d, name)
    except FileNotFoundError as e:
        hint = f"mint it with 'sbxnet certs next-key --dir {d} --name {name}'" if args.certs_cmd == "promote" \
            else "mint it first"
        print(f"certs: {e.filename} not found: {hint}")
        return 1
    except ValueError as e:
        print(f"certs: cannot read {d}/{name}: {e}")
        return 1

    def matches(pair: Issued, stem: str) -> bool:
        if pair.cert.public_key() == pair.key.public_key():
            return True
        print(f"certs: {d / stem}.crt is not the certificate of {d / stem}.key; nothing written")
        return False

    if args.certs_cmd == "renew":
        if not matches(current, name):
            return 1
        renewed = reissue(ca, current.cert, current.key, days=args.days)
        cert_path = write_cert(renewed.cert, d, name)
        print(f"renewed {cert_path} keeping its key: SPKI pin {spki_pin(renewed.cert)} (unchanged); "
              f"valid to {renewed.cert.not_valid_after_utc:%Y-%m-%d}. SIGHUP the process that uses it")
        return 0
    if args.certs_cmd == "next-key":
        for suffix in ("crt", "key"):
            there = d / f"{name}.next.{suffix}"
            if there.exists():
                print(f"certs: {there} exists already (its pin may be in routes): promote it with 'sbxnet certs "
                      f"promote --dir {d} --name {name}', or remove {d / name}.next.crt and .key first")
                return 1
        if not matches(current, name):
            return 1
        nxt = reissue(ca, current.cert, None, days=args.days)
        cert_path, key_path = write_issued(nxt, d, f"{name}.next")
        print(f"wrote {cert_path} and {key_path} (0600), not installed; the current key stays in use")
        print(f"next SPKI pin {spki_pin(nxt.cert)} (current {spki_pin(current.cert)}): add it to the routes of "
              f"this forwarder (spki_pins: [current, next]), then 'sbxnet certs promote --dir {d} --name {name}' "
              f"and SIGHUP")
        return 0
    # promote
    if not matches(fresh, f"{name}.next"):
        return 1
    try:
        fresh.cert.verify_directly_issued_by(ca.cert)
    except (ValueError, TypeError, InvalidSignature) as e:
        print(f"certs: {d / name}.next.crt is not issued by {d / 'ca.crt'} ({type(e).__name__}); nothing moved")
        return 1
    was = None
    if (d / f"{name}.crt").exists() or (d / f"{name}.key").exists():
        try:
            old = load_issued(d, name)
        except (FileNotFoundError, ValueError) as e:
            print(f"certs: cannot keep the current {d / name}.crt/.key as {name}.prev ({e}); nothing moved")
            return 1
        write_issued(old, d, f"{name}.prev")
        was = spki_pin(old.cert)
    # Key first, then certificate: each rename is atomic; the pair is whole again after the second, and the
    # process reads them only when told to (SIGHUP) or when it starts.
    os.replace(d / f"{name}.next.key", d / f"{name}.key")
    os.replace(d / f"{name}.next.crt", d / f"{name}.crt")
    kept = f" (was {was}, kept as {d / name}.prev.crt/.key)" if was else ""
    print(f"installed {d / name}.crt and {d / name}.key: SPKI pin {spki_pin(fresh.cert)}{kept}. SIGHUP the "
          f"forwarder; once it has reloaded, the routes may drop the old pin")
    return 0


def _token(args: argparse.Namespace) -> int:
    from certs.tokens import TokenFileError, new_token, read_token_file, token_sha256, write_token_file

    if args.hash is not None:
        try:
            token = read_token_file(args.hash)
        except TokenFileError as e:
            print(f"certs token: {e}", file=sys.stderr)
            return 2
        print(f"admin_token_sha256 = {token_sha256(token)}")
        return 0
    token = new_token()
    try:
        write_token_file(args.out, token)
    except FileExistsError:
        print(f"certs token: {args.out} exists; remove it first, or hash it with --hash {args.out}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"certs token: cannot write {args.out}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} (0600): the token, on one line")
    print(f"admin_token_sha256 = {token_sha256(token)}")
    return 0
