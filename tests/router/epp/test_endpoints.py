"""Endpoint addresses and subset hints as the endpoint-picker protocol writes them (router.epp.endpoints)."""

from __future__ import annotations

import pytest

from router.epp.endpoints import address_of, in_subset, parse_subset


@pytest.mark.parametrize(
    ("url", "address"),
    [
        ("http://10.0.0.7:8000", "10.0.0.7:8000"),
        ("http://10.0.0.7:8000/", "10.0.0.7:8000"),
        ("http://10.0.0.7", "10.0.0.7:80"),
        ("https://10.0.0.7", "10.0.0.7:443"),
        ("http://[fd00::7]:8000", "[fd00::7]:8000"),
    ],
)
def test_address_of(url: str, address: str) -> None:
    assert address_of(url) == address


@pytest.mark.parametrize(
    ("hint", "entries"),
    [
        ("10.0.0.1:8000,10.0.0.2", {"10.0.0.1:8000", "10.0.0.2"}),
        (" 10.0.0.1:8000 , ,10.0.0.2 ", {"10.0.0.1:8000", "10.0.0.2"}),
        (["10.0.0.1:8000", "10.0.0.2,10.0.0.3"], {"10.0.0.1:8000", "10.0.0.2", "10.0.0.3"}),
        ("", set()),
        ([], set()),
    ],
)
def test_parse_subset(hint: str | list[str], entries: set[str]) -> None:
    assert parse_subset(hint) == entries


def test_in_subset_by_address_or_by_host() -> None:
    subset = parse_subset("10.0.0.1:8000,10.0.0.2,fd00::9")
    assert in_subset("10.0.0.1:8000", subset)
    assert not in_subset("10.0.0.1:8001", subset)  # another port (DP rank) of a pod named with its port
    assert in_subset("10.0.0.2:8000", subset) and in_subset("10.0.0.2:8001", subset)
    assert in_subset("[fd00::9]:8000", subset)
    assert not in_subset("10.0.0.3:8000", subset)
