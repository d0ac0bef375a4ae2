"""Replays every stored fuzz seed through its fuzz target on every test run, then a short random run.

Seeds live in tests/seeds/<corpus>/ (regenerate with tests/fuzz/make_*_seeds.py). Every seed goes through
its target's ``one_input``, which raises on any broken invariant. Where the corpus names its seeds
``<expected>-<what>``, the target's ``classify`` must also return ``expected`` ("ok" or a refusal
reason). The long runs are bench/fuzz_preamble.py, bench/fuzz_egress.py and bench/egress/fuzz_long.py.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

# The targets are imported by bare name, as pytest puts this directory on sys.path (and the bench
# scripts put it on theirs).
import fuzz_arp
import fuzz_control_body
import fuzz_egress_frames
import fuzz_feed
import fuzz_feed_text
import fuzz_h1_codec
import fuzz_h2_frames
import fuzz_h2_requests
import fuzz_names
import fuzz_preamble
import fuzz_reply
import fuzz_rewrite
import fuzz_routes
import fuzz_segment
import fuzz_vxlan
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

SEEDS = Path(__file__).resolve().parent.parent / "seeds"


@dataclass(frozen=True)
class Corpus:
    name: str  # the directory under tests/seeds/
    target: ModuleType  # tests/fuzz/fuzz_<...>.py: one_input(data), and classify(data) if named_outcome
    min_seeds: int
    required: tuple[str, ...] = ()  # fnmatch patterns: each must match at least one seed's name
    named_outcome: bool = False  # seed names are "<expected>-<what>", checked against target.classify


# The cases the design names (a checksum offset aimed into the IPv4 header, a TCP GSO type on a UDP
# packet) and an ICMP error quoting another claim's packet (issue 12) are required, so the replay fails
# if they go missing.
CORE_CASES = ("csum-offset-into-ip-dst*", "tcp-gso-on-udp*", "icmp-error-quotes-other-claim-*")
# The idle feed's tricky bodies (tests/fuzz/make_feed_seeds.py): each must stay in its corpus.
FEED_CASES = ("duplicate_sandbox-*", "bad_count-negative-*", "bad_seq-zero", "bad_json-nan-idle", "bad_seq-huge",
              "unknown_field-*", "bad_type-*", "ok-golden-*", "bad_length-*", "bad_sandbox_id-tricky-separator-*",
              "bad_count-tricky-19-digits-over", "bad_idle-tricky-13-digits-over", "ok-rows-*", "*-rows-*")
# The HTTP/2 frame size guard's boundaries (tests/fuzz/make_h2_frames_seeds.py): at the limit, one over it,
# nothing judged before a header is whole or inside a client's preface, and a peer speaking SSH.
H2_FRAMES_CASES = ("ok-*-at-limit", "too_large-*-one-over-limit*", "ok-*-half-a-header-*", "ok-*zero-length-frames",
                   "ok-*tiny*", "ok-client-preface-then-*", "ok-client-ssh-banner-inside-the-skipped-preface",
                   "too_large-app-ssh-banner", "ok-empty")
# Every refusal reason routes.py can give for bytes, the golden bodies, and the tricky inputs
# (tests/fuzz/make_routes_seeds.py).
ROUTE_REASONS = ("unknown_field", "missing_field", "bad_type", "bad_sandbox", "bad_incarnation", "bad_address",
                 "bad_pin", "bad_ip", "bad_port", "bad_protocol", "bad_auth", "bad_token_hash", "bad_number",
                 "bad_activity", "bad_state", "no_token", "default_port_not_exposed", "too_long", "not_json",
                 "not_object")
ROUTES_CASES = (*(f"{r}-*" for r in ROUTE_REASONS), "ok-registration-golden-*", "ok-route-golden",
                "not_json-*-nan-*", "not_json-*-infinity-*", "*-duplicate-key-*", "not_json-*-deep-*",
                "too_long-*-64-kib-plus-one", "ok-*-exactly-64-kib", "not_json-*-non-utf8-*")
# The egress control API's bodies (tests/fuzz/make_control_body_seeds.py): every refusal reason and the
# inputs that must not pass (non-finite numbers, duplicate keys, paths a Path would rewrite, bools for numbers).
CONTROL_BODY_CASES = ("too_long-*", "not_utf8-*", "not_json-*-nan", "not_json-*-duplicate-key", "not_json-*-deep",
                      "not_object-*", "unknown_field-arm-address", "missing_field-*", "bad_field-arm-dot-uds",
                      "bad_field-*-bool", "bad_claim_id-*", "ok-arm-exactly-64-kib", "ok-import")
# The inbound flow key (tests/fuzz/make_reply_seeds.py): what may reopen a flow, and quotes that are not the claim's.
REPLY_CASES = ("ok-tcp-ack-resumable", "ok-tcp-syn", "ok-tcp-rst", "ok-tcp-merged-*", "ok-icmp-frag-needed-*",
               "bad_reply-icmp-error-quotes-another", "bad_reply-icmp-error-quote-*")
# The gateway's HTTP/1.1 codec (tests/fuzz/make_h1_codec_seeds.py): the smuggling corpus with the reason
# each refusal is counted under, h11's own refusals, and both sides' framings that pass.
H1_CODEC_CASES = ("content_length_with_transfer_encoding-*", "duplicate_content_length-*", "obs_fold-*",
                  "bad_request-te-obfuscated", "bad_request-nul-in-value", "bad_request-control-in-name",
                  "bad_request-no-host", "header_too_large-*", "upgrade_with_body-*", "truncated-*",
                  "bad_response-*", "ok-pipelined-*", "ok-websocket-upgrade-then-bytes", "ok-head-response-*",
                  "ok-switch-101-then-bytes", "ok-response-ends-by-close", "ok-post-chunked-with-trailers",
                  # issue 22 points 4 and 10: malformed chunked bodies, trailers, Connection naming framing
                  "bad_request-chunk-size-leading-space", "bad_request-chunk-extension-*", "bad_request-trailer-*",
                  "bad_trailer-trailer-*", "bad_request-chunk-size-overlong-hex", "bad_request-chunk-data-*",
                  "truncated-chunked-body-*", "connection_names_framing-*", "ok-connection-names-x-forwarded")
# What of a client's HTTP/2 requests reaches a sandbox (tests/fuzz/make_h2_requests_seeds.py, issue 22 points
# 8 and 9): targets that are not origin-form, malformed heads (each a stream error, h2's old connection errors
# among them), a content-length the DATA breaks after the head went up, malformed trailers.
H2_REQUESTS_CASES = ("ok-get", "ok-options-asterisk", "bad_target-absolute-form-another-sandbox",
                     "bad_target-path-without-slash", "bad_target-asterisk-on-get", "bad_target-fragment",
                     "content_length_mismatch-30-on-end-stream", "bad_method-*", "bad_header-upper-case-name",
                     "bad_header-connection", "bad_header-te-gzip", "bad_header-transfer-encoding",
                     "bad_pseudo_header-*", "host_mismatch-*", "bad_content_length-*", "bad_header-then-ok",
                     "reset_content_length_mismatch-*", "reset_bad_pseudo_header-trailers-*", "reset_bad_trailers-*",
                     "bad_pseudo_header-informational-status",
                     "ok-content-length-whole-then-an-empty-end", "protocol_error-*")
CORPORA = (
    Corpus("preamble", fuzz_preamble, 30),
    Corpus("rewrite", fuzz_rewrite, 30, CORE_CASES),
    Corpus("segment", fuzz_segment, 30, CORE_CASES),
    Corpus("egress_frames", fuzz_egress_frames, 10, ("bad_csum_start-aimed-at-ip*", "gso_proto_mismatch-tcpv4-on-udp",
                                                   "icmp_quote_source-other-claim"),
           named_outcome=True),
    Corpus("vxlan", fuzz_vxlan, 10, named_outcome=True),
    Corpus("arp", fuzz_arp, 10, named_outcome=True),
    Corpus("feed", fuzz_feed, 20, FEED_CASES, named_outcome=True),
    Corpus("feed_text", fuzz_feed_text, 10, ("digits-of-every-length", "int64-bounds", "ages-ties", "ages-nan")),
    Corpus("names", fuzz_names, 20, ("ok-h2-authority-only", "host_mismatch-*", "wrong_port-*", "bad_target-h2-path_*",
                                      "bad_target-h1-target_*", "ok-h1-target_*"), named_outcome=True),
    Corpus("h2_frames", fuzz_h2_frames, 20, H2_FRAMES_CASES, named_outcome=True),
    Corpus("h2_requests", fuzz_h2_requests, 30, H2_REQUESTS_CASES, named_outcome=True),
    Corpus("routes", fuzz_routes, 100, ROUTES_CASES, named_outcome=True),
    Corpus("control_body", fuzz_control_body, 40, CONTROL_BODY_CASES, named_outcome=True),
    Corpus("reply", fuzz_reply, 20, REPLY_CASES, named_outcome=True),
    Corpus("h1_codec", fuzz_h1_codec, 40, H1_CODEC_CASES, named_outcome=True),
)
BY_NAME = {c.name: c for c in CORPORA}


def seeds(corpus: Corpus) -> list[Path]:
    """The corpus's seed files, sorted; none if the directory is missing (test_corpus then fails)."""
    d = SEEDS / corpus.name
    return sorted(d.iterdir()) if d.is_dir() else []


CASES = [(c.name, p) for c in CORPORA for p in seeds(c)]


@pytest.mark.parametrize("corpus", CORPORA, ids=[c.name for c in CORPORA])
def test_corpus(corpus: Corpus) -> None:
    names = [p.name for p in seeds(corpus)]
    assert len(names) >= corpus.min_seeds, f"seed corpus tests/seeds/{corpus.name}: {len(names)} seeds"
    for pattern in corpus.required:
        assert fnmatch.filter(names, pattern), f"no seed in tests/seeds/{corpus.name} matches {pattern!r}"


@pytest.mark.parametrize(("corpus", "path"), CASES, ids=[f"{c}/{p.name}" for c, p in CASES])
def test_seed(corpus: str, path: Path) -> None:
    c = BY_NAME[corpus]
    data = path.read_bytes()
    c.target.one_input(data)
    if c.named_outcome:
        assert c.target.classify(data) == path.name.split("-")[0]


# About 100 random inputs per target.
@settings(max_examples=100 * len(CORPORA), deadline=None)
@given(st.sampled_from(CORPORA), st.binary(max_size=120))
def test_targets_on_random_bytes(corpus: Corpus, data: bytes) -> None:
    corpus.target.one_input(data)
