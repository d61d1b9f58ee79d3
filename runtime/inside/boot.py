"""How a stdlib-only helper starts: ``python -I -S -c BOOT fd RUNTIME_DIR MODULE ARGS...``.

``BOOT`` loads ``rollbox.runtime`` from the files in RUNTIME_DIR (not the caller's path) and calls
``rollbox.runtime.inside.<MODULE>.main(fd, *ARGS)``. The supervisor starts zygotes with it; a zygote
of a snapshot whose interpreter is inside its root re-executes itself with it (zygote.py).
"""

BOOT = """
import importlib.util, sys, types
rt = sys.argv[2]
pkg = types.ModuleType('rollbox'); pkg.__path__ = []; sys.modules['rollbox'] = pkg
spec = importlib.util.spec_from_file_location('rollbox.runtime', rt + '/__init__.py',
                                              submodule_search_locations=[rt])
mod = importlib.util.module_from_spec(spec); sys.modules['rollbox.runtime'] = mod
spec.loader.exec_module(mod)
from importlib import import_module
import_module('rollbox.runtime.inside.' + sys.argv[3]).main(int(sys.argv[1]), *sys.argv[4:])
"""
