import pytest

from solver import BudgetParseError, format_bytes, parse_bytes


@pytest.mark.parametrize("text,expected", [
    ("8GiB", 8 * 2**30), ("8GB", 8 * 10**9), ("8 gib", 8 * 2**30), ("1.5MiB", 3 * 2**19),
    ("123", 123), ("123B", 123), ("2KB", 2000), ("2KiB", 2048), (4096, 4096), ("0.5GB", 5 * 10**8),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["-1GiB", "eight", "8XB", "", "GiB", -5, True, None, float("nan")])
def test_bad_budgets_say_what_is_expected(bad):
    with pytest.raises(BudgetParseError, match="expected|cannot parse"):
        parse_bytes(bad)


def test_format_bytes_names_its_unit():
    assert format_bytes(8 * 2**30) == "8.00 GiB"
    assert format_bytes(3 * 2**20 // 2) == "1.50 MiB"
    assert format_bytes(12) == "12 B"
