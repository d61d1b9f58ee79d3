"""Templates: the shipped ones load, and every mistake is reported naming the file and field."""

from __future__ import annotations

from pathlib import Path

import pytest
from rollbox.runtime.errors import InvalidRequest
from rollbox.runtime.snapshot import STDLIB_WARM
from rollbox.snapshots.template import OciBase, load_template

SHIPPED = Path(__file__).resolve().parents[2] / "snapshots" / "templates"


def test_shipped_templates_load() -> None:
    py, _ = load_template(SHIPPED / "python.yaml")
    assert py.name == "python" and py.base == "host" and py.packages == ()
    assert py.warm.imports == STDLIB_WARM  # a built python snapshot warms what the built-in one does
    sci, _ = load_template(SHIPPED / "python-sci.yaml")
    assert sci.packages == ("numpy", "pandas") and sci.warm.imports == ("numpy", "pandas")
    assert sci.limits.memory_max_bytes == 1 << 30


BAD = {
    "missing name": ("base: host\n", r"name: Field required"),
    "bad name": ("name: Not Valid\n", r"name: Value error, invalid snapshot name 'Not Valid'"),
    "unknown field": ("name: x\npackagez: [numpy]\n", r"packagez: Extra inputs are not permitted"),
    "bad base": ("name: x\nbase: docker\n", r"base: Value error, 'docker': expected 'host', \{dir: PATH\}"),
    "relative file": ("name: x\nfiles: {etc/motd: {content: hi}}\n",
                      r"files: Value error, 'etc/motd' must be an absolute"),
    "file with both": ("name: x\nfiles: {/etc/motd: {content: hi, source: ./m}}\n",
                       r"files\./etc/motd: Value error, exactly one of 'content' or 'source'"),
    "pip option as package": ("name: x\npackages: [--pre]\n",
                              r"packages: Value error, '--pre' is not a requirement"),
    "bad limit": ("name: x\nlimits: {memory_max_bytes: 10}\n",
                  r"limits\.memory_max_bytes: Input should be greater"),
    "bad import": ("name: x\nwarm: {imports: [numpy-2]}\n",
                   r"warm\.imports: Value error, 'numpy-2' is not a module"),
    "dir base without python": ("name: x\nbase: {dir: ./root}\n", r"a dir/oci base needs 'python'"),
    "host with python": ("name: x\npython: /usr/bin/python3\n", r"'python' is only for dir/oci bases"),
    "not a mapping": ("- name: x\n", r"must be a YAML mapping"),
    "bad yaml": ("name: x\n  base: [host\n", r"is not valid YAML at line 2"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_invalid_templates_name_the_field(case: str, tmp_path: Path) -> None:
    text, message = BAD[case]
    path = tmp_path / "t.yaml"
    path.write_text(text)
    with pytest.raises(InvalidRequest, match=message) as info:
        load_template(path)
    assert str(path) in info.value.message


def test_missing_file_and_oci_base_parse(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="cannot read template"):
        load_template(tmp_path / "nope.yaml")
    path = tmp_path / "t.yaml"
    path.write_text("name: x\nbase: {oci: ./layout, image: demo}\npython: /usr/local/bin/python3\n")
    t, where = load_template(path)
    assert t.base == OciBase(oci="./layout", image="demo") and where == tmp_path
