"""Writes tests/seeds/control_body/: the control API's bodies, named ``<expected>-<what>`` (fuzz_control_body).

Run: .venv/bin/python tests/fuzz/make_control_body_seeds.py
"""

from __future__ import annotations

import json
from pathlib import Path

from seed_dir import write_seeds

OUT = Path(__file__).resolve().parent.parent / "seeds" / "control_body"
ARM = {"uds": "/run/vm/c1.vsock", "exit": "a"}
FULL_ARM = {**ARM, "policy": {"rules": ["deny tcp any 25", "allow udp 8.8.8.8/32 53"], "default_allow": False},
            "limits": {"byte_rate": 12500000, "packet_rate": 1000.5, "byte_burst": 1e6, "packet_burst": 10,
                       "quota_bytes": 10000000000}}
STATE = {"id": "c1", "address": "100.64.0.2", "exit": "a", "uds": "/run/vm/c1.vsock", "enabled": False,
         "quota_used": 12345}


def j(value: object) -> bytes:
    return json.dumps(value).encode()


SEEDS: dict[str, bytes] = {
    "ok-arm-minimal": b"A" + j(ARM),
    "ok-arm-full": b"A" + j(FULL_ARM),
    "ok-arm-unicode-exit": b"A" + j({**ARM, "exit": "\u00e9xit"}),
    "ok-exit": b"E" + j({"exit": "b"}),
    "ok-import": b"I" + j(STATE),
    "ok-import-full": b"I" + j({**STATE, **FULL_ARM, "uds": "/x"}),
    "ok-claim-id": b"Cc1.a_b:c-d",
    "too_long-arm-64-kib-plus-one": b"A" + b" " * (64 * 1024 - len(j(ARM)) + 1) + j(ARM),
    "ok-arm-exactly-64-kib": b"A" + b" " * (64 * 1024 - len(j(ARM))) + j(ARM),
    "not_utf8-arm": b"A" + b'{"uds": "/\xff", "exit": "a"}',
    "not_json-arm-truncated": b"A" + j(ARM)[:-1],
    "not_json-arm-nan": b"A" + b'{"uds": "/x", "exit": "a", "limits": {"byte_rate": NaN}}',
    "not_json-arm-infinity": b"A" + b'{"uds": "/x", "exit": "a", "limits": {"byte_rate": Infinity}}',
    "not_json-arm-huge-float": b"A" + b'{"uds": "/x", "exit": "a", "limits": {"byte_rate": 1e999}}',
    "not_json-arm-duplicate-key": b"A" + b'{"uds": "/x", "exit": "a", "exit": "b"}',
    "not_json-arm-deep": b"A" + b"[" * 20000 + b"]" * 20000,
    "not_json-empty": b"A",
    "not_object-arm-list": b"A" + j([ARM]),
    "not_object-exit-string": b"E" + j("b"),
    "unknown_field-arm-address": b"A" + j({**ARM, "address": "100.64.0.9"}),
    "unknown_field-arm-id": b"A" + j({**ARM, "id": "c2"}),
    "unknown_field-arm-nested": b"A" + j({**ARM, "limits": {"colour": 1}}),
    "unknown_field-exit-extra": b"E" + j({"exit": "b", "x": 1}),
    "missing_field-arm-uds": b"A" + j({"exit": "a"}),
    "missing_field-import-address": b"I" + j({k: v for k, v in STATE.items() if k != "address"}),
    "missing_field-exit": b"E" + j({}),
    "bad_field-arm-relative-uds": b"A" + j({**ARM, "uds": "vm.sock"}),
    "bad_field-arm-dot-uds": b"A" + j({**ARM, "uds": "/."}),
    "bad_field-arm-dotdot-uds": b"A" + j({**ARM, "uds": "/run/../etc/x"}),
    "bad_field-arm-trailing-slash-uds": b"A" + j({**ARM, "uds": "/run/vm/"}),
    "bad_field-arm-long-uds": b"A" + j({**ARM, "uds": "/" + "x" * 100}),
    "bad_field-arm-nul-uds": b"A" + j({**ARM, "uds": "/x\u0000y"}),
    "bad_field-arm-rate-string": b"A" + j({**ARM, "limits": {"byte_rate": "100"}}),
    "bad_field-arm-rate-bool": b"A" + j({**ARM, "limits": {"byte_rate": True}}),
    "bad_field-arm-rate-zero": b"A" + j({**ARM, "limits": {"byte_rate": 0}}),
    "bad_field-arm-quota-float": b"A" + j({**ARM, "limits": {"quota_bytes": 1.5}}),
    "bad_field-arm-bad-rule": b"A" + j({**ARM, "policy": {"rules": ["permit all"]}}),
    "bad_field-arm-default-allow-string": b"A" + j({**ARM, "policy": {"default_allow": "yes"}}),
    "bad_field-arm-exit-empty": b"A" + j({**ARM, "exit": ""}),
    "bad_field-import-address-v6": b"I" + j({**STATE, "address": "::1"}),
    "bad_field-import-address-int": b"I" + j({**STATE, "address": 1681915906}),
    "bad_field-import-quota-negative": b"I" + j({**STATE, "quota_used": -1}),
    "bad_field-import-quota-over-int64": b"I" + j({**STATE, "quota_used": 2**63}),
    "bad_field-import-enabled-int": b"I" + j({**STATE, "enabled": 1}),
    "bad_field-import-bad-id": b"I" + j({**STATE, "id": "c 1"}),
    "bad_field-exit-number": b"E" + j({"exit": 7}),
    "bad_claim_id-space": b"Cc 1",
    "bad_claim_id-empty": b"C",
    "bad_claim_id-slash": b"Cc/1",
    "bad_claim_id-too-long": b"C" + b"c" * 129,
    "bad_claim_id-latin1": b"Cc\xe9",
}


def main() -> None:
    write_seeds(OUT, SEEDS)


if __name__ == "__main__":
    main()
