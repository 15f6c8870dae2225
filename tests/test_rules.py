"""Every gradient rule, through the one checker: a table of ops x attributes x broadcast patterns."""
import importlib
import pkgutil

import pytest

import cases
from gradcheck import check_case

ALL_CASES = [c for m in pkgutil.iter_modules(cases.__path__)
             for c in importlib.import_module(f"cases.{m.name}").CASES]


@pytest.mark.parametrize("case", ALL_CASES, ids=str)
def test_rule(case):
    check_case(case)
