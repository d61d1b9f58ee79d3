"""`python -m rollbox.functions.cli` is the `rollbox` command."""

from rollbox.functions.cli.main import script

script()
