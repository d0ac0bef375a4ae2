"""The product's key library cannot hand key material to Python: the entry points that read keys back
(and the other test-only ones) exist only in the test build, ``native._tls_keys_test``."""

from __future__ import annotations

import ctypes

import pytest

TEST_ONLY = ("tk_export_for_test", "tk_set_ciphersuites", "tk_key_update")
# Shared by tls_keys.c and tls_keys_test.c with hidden visibility: in no dynamic symbol table.
INTERNAL = ("tk_check_and_build", "tk_done_with_keys")


@pytest.mark.parametrize("name", TEST_ONLY + INTERNAL)
def test_product_library_has_no_test_entry_point(name: str) -> None:
    import native._tls_keys as product

    assert not hasattr(product.lib, name)
    assert not hasattr(ctypes.CDLL(product.__file__), name)  # dlsym: not even outside the binding


@pytest.mark.parametrize("name", TEST_ONLY)
def test_test_build_has_them(name: str) -> None:
    import native._tls_keys_test as test_build

    assert hasattr(test_build.lib, name)


@pytest.mark.parametrize("name", INTERNAL)
def test_internals_stay_hidden_in_the_test_build(name: str) -> None:
    import native._tls_keys_test as test_build

    assert not hasattr(ctypes.CDLL(test_build.__file__), name)
