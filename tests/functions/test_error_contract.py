"""One error contract: ``contract.models.ErrorCode`` carries each code's HTTP status, whether a retry
may succeed and the client's exception class; the service's replies, the client and README's error
table follow it, and every exception the server side raises has one root (``RollboxError``)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest
import rollbox.functions
from rollbox.functions.client import http as client
from rollbox.functions.contract.events import ReplyError
from rollbox.functions.contract.models import ErrorCode
from rollbox.functions.service.app import ERROR_TABLE, _runtime_error
from rollbox.runtime.errors import RollboxError

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_error_table(text: str) -> dict[str, int]:
    """code -> status, from the README's table whose header names ``status`` and ``code`` (the one
    under **Errors**; found by its header wherever it sits). A row's statuses pair with its codes
    in order, or one status goes with all of them."""
    def header(line: str) -> bool:
        cells = [c.strip().strip("`").lower() for c in line.strip().strip("|").split("|")]
        return line.lstrip().startswith("|") and cells[:2] == ["status", "code"]

    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if header(line)), None)
    assert start is not None, "README.md has no table with a 'status | code' header"
    table: dict[str, int] = {}
    for row in lines[start + 2:]:
        if not row.lstrip().startswith("|"):
            break
        status_cell, code_cell = row.strip().strip("|").split("|")[:2]
        statuses = [int(s) for s in re.findall(r"\b\d{3}\b", status_cell)]
        codes = re.findall(r"`([a-z_]+)`", code_cell)
        assert statuses and codes, row
        assert len(statuses) in (1, len(codes)), f"statuses and codes do not pair: {row}"
        for code, status in zip(codes, statuses * len(codes) if len(statuses) == 1 else statuses, strict=True):
            assert code not in table, f"{code} is in the table twice"
            table[code] = status
    return table


def test_readme_error_table_is_the_enum() -> None:
    table = readme_error_table(README.read_text())
    assert table == {c.value: c.status for c in ErrorCode}, set(table.items()) ^ {(c.value, c.status) for c in ErrorCode}


def test_the_table_parser_catches_a_wrong_row() -> None:
    """The check above can fail: a status changed, a code missing, a code twice."""
    good = "**Errors**\n\n| status | `code` | when |\n|---|---|---|\n| 404, 405 | `not_found`, `method_not_allowed` | x |\n"
    assert readme_error_table(good) == {"not_found": 404, "method_not_allowed": 405}
    assert readme_error_table(good.replace("404, 405", "404"))["method_not_allowed"] == 404
    with pytest.raises(AssertionError):
        readme_error_table(good.replace("404, 405", "404, 405, 409"))
    with pytest.raises(AssertionError):
        readme_error_table(good + "| 400 | `not_found` | again |\n")
    with pytest.raises(AssertionError):
        readme_error_table("| a | b |\n|---|---|\n")


def test_the_client_classes_are_the_enums() -> None:
    assert set(client.ERROR_CLASSES) == {c.value for c in ErrorCode}
    for code in ErrorCode:
        cls = client.ERROR_CLASSES[code]
        assert cls.__name__ == code.client_class and cls.retryable is code.retryable, code


def test_replies_take_their_status_from_the_code() -> None:
    for code in ErrorCode:
        assert ReplyError(code, "x").status == code.status
    for cls, maps in ERROR_TABLE:
        err = _runtime_error(cls("x"))
        assert (err.status, err.code) == (maps.code.status, maps.code), cls
        # Retry-After is sent only with what a retry may fix
        assert err.retry_after_s is None or maps.code.retryable, cls


def _functions_modules() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(rollbox.functions.__path__, "rollbox.functions."):
        # the client's own tree has its root (ClientError); a __main__ runs the command when imported
        if not info.name.startswith("rollbox.functions.client") and not info.name.endswith("__main__"):
            names.append(info.name)
    return names


def test_every_exception_of_the_server_side_has_one_root() -> None:
    """Every exception class defined in ``rollbox.functions`` (but the client, whose root is
    ``ClientError``: what a trainer catches) is a ``RollboxError``."""
    outside = []
    for name in _functions_modules():
        module = importlib.import_module(name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if obj.__module__ == name and issubclass(obj, BaseException) and not issubclass(obj, RollboxError):
                outside.append(f"{name}.{obj.__qualname__}")
    assert not outside, outside
