"""What people read: byte sizes and counts switch unit where the rounded figure reaches the next
one (issue 27: "1,057.0 MB", gemma-3-1b's "1,000 M")."""

import pytest

from kvlab.units import fmt_bytes, fmt_count, plural


@pytest.mark.parametrize("n, text", [
    (512, "512 B"), (1_500, "1.5 KB (1.5 KiB)"), (999_999, "1.0 MB (1.0 MiB)"),
    (2**20, "1.0 MB (1.0 MiB)"), (1_057_000_000, "1.06 GB (0.98 GiB)"), (42.95e9, "42.95 GB (40.00 GiB)"),
])
def test_bytes_take_the_unit_of_their_rounded_size(n, text):
    assert fmt_bytes(n) == text


@pytest.mark.parametrize("n, text", [
    (999_885_952, "1.0 B"), (99_960_000, "100 M"), (134_515_008, "135 M"), (3_900_000, "3.9 M"),
    (70.6e9, "70.6 B"), (671e9, "671 B"), (999, "999"),
])
def test_counts_take_the_unit_of_their_rounded_size(n, text):
    assert fmt_count(n) == text


def test_plural():
    assert (plural(1, "user"), plural(16, "user"), plural(2048, "sequence")) == ("1 user", "16 users", "2,048 sequences")
