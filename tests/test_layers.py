"""No import runs back up a layer (docs: WORKTREE/REFACTOR notes, README's Layout).

Lowest first: ``rollbox.runtime`` and ``rollbox.snapshots``; then ``functions.config`` and
``functions.contract``; ``functions.recording``; ``functions.durable``; ``functions.handlers``;
``functions.service``; ``functions.cli``. A module may import its own layer and those below it.
``functions.analysis`` uses config, contract and recording only (and the runtime, which replay runs
on); ``functions.client`` uses contract only (and ``rollbox.runtime.spec``, whose records the contract
reuses). Every import counts, the lazy ones inside functions and those under ``TYPE_CHECKING`` too: each
is a dependency a reader has to follow. The source is read with ``ast`` (nothing is imported).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"runtime": "rollbox.runtime", "snapshots": "rollbox.snapshots", "functions": "rollbox.functions"}

# layer -> rank (lower ranks may not import higher ones)
RANK = {
    "rollbox.runtime": 0, "rollbox.snapshots": 0,
    "rollbox.functions.config": 1, "rollbox.functions.contract": 1,
    "rollbox.functions.recording": 2,
    "rollbox.functions.durable": 3,
    "rollbox.functions.handlers": 4,
    "rollbox.functions.service": 5,
    "rollbox.functions.cli": 6,
}
# side layers: what they may use, whatever its rank
ONLY = {
    "rollbox.functions.analysis": {"rollbox.runtime", "rollbox.snapshots", "rollbox.functions.config",
                                   "rollbox.functions.contract", "rollbox.functions.recording",
                                   "rollbox.functions.analysis"},
    "rollbox.functions.client": {"rollbox.functions.contract", "rollbox.functions.client"},
}
# modules a side layer may use beyond its layers: the runtime's records, which the contract reuses as
# they are (``SandboxInfo``, ``ExecResult``, ``Usage``, ``Limits``): a trainer's client needs no more
SHARED = {"rollbox.runtime.spec"}


def _layer(module: str) -> str | None:
    """The layer of a rollbox module ('rollbox.functions.service.app' -> 'rollbox.functions.service')."""
    parts = module.split(".")
    if parts[:1] != ["rollbox"] or len(parts) < 2:
        return None
    if parts[1] != "functions":
        return ".".join(parts[:2])
    return ".".join(parts[:3]) if len(parts) >= 3 else "rollbox.functions"


def _modules() -> list[tuple[str, Path]]:
    found = []
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found.append((".".join([package, *parts]), path))
    return found


def _imports(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, imported module) of every import in ``path``, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            out.append((node.lineno, base))
            # ``from rollbox.functions import service`` imports the subpackage
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if _layer(base) == base
                    and _layer(f"{base}.{alias.name}") != base]
    return out


def _allowed(importer: str, imported: str) -> bool:
    if importer == imported:
        return True
    if importer in ONLY:
        return imported in ONLY[importer]
    if imported in ONLY:  # a side layer: used only from above the layers it uses (the CLI)
        return RANK.get(importer, 0) >= RANK["rollbox.functions.cli"]
    return RANK[imported] <= RANK[importer]


def test_the_layer_table_knows_every_package() -> None:
    layers = {_layer(m) for m, _ in _modules()} - {"rollbox.functions"}
    assert layers <= set(RANK) | set(ONLY), sorted(layers - set(RANK) - set(ONLY))


def test_no_import_runs_back_up_a_layer() -> None:
    bad = []
    for module, path in _modules():
        importer = _layer(module)
        if importer is None or importer == "rollbox.functions":
            continue
        for line, name in _imports(module, path):
            imported = _layer(name)
            if imported is None or imported == "rollbox.functions":
                continue
            if not _allowed(importer, imported) and not (importer in ONLY and name in SHARED):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {importer} imports {name}")
    assert not bad, "imports back up a layer:\n" + "\n".join(bad)


@pytest.mark.parametrize(("importer", "imported", "ok"), [
    ("rollbox.functions.service", "rollbox.functions.durable", True),
    ("rollbox.functions.durable", "rollbox.functions.handlers", False),
    ("rollbox.functions.handlers", "rollbox.functions.service", False),
    ("rollbox.runtime", "rollbox.functions.contract", False),
    ("rollbox.functions.client", "rollbox.functions.contract", True),
    ("rollbox.functions.client", "rollbox.runtime", False),
    ("rollbox.functions.analysis", "rollbox.functions.durable", False),
    ("rollbox.functions.cli", "rollbox.functions.analysis", True),
])
def test_the_rule(importer: str, imported: str, ok: bool) -> None:
    """The rule itself, so the walk above cannot pass by allowing everything."""
    assert _allowed(importer, imported) is ok
