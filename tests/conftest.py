"""The longest test files run first: launch/test.sh hands whole files to two pytest-xdist workers, and a long
file handed out last would leave one worker idle while the other finishes it."""

from __future__ import annotations

import pytest

LONGEST_FIRST = ("test_mode_tp.py", "test_squinch_train.py", "test_train.py", "test_parallel.py", "test_distill.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: file order kept
