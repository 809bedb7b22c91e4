"""`from dptrain.tagi import DDPSequential, DDPConfig` (pytagi's line, issue 29) works, and
`import dptrain.tagi` still does not load the data-parallel wrapper: the names are PEP 562 lazy
attributes (docs/design.md, Layers: only `tagi/ddp.py` of the engine touches the process group).
"""

from __future__ import annotations

import subprocess
import sys

import dptrain.tagi
from tests.unit.test_import_layers import LAYERS, ROOT, imports, layer, module_names


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_names_are_bound_on_first_use_not_at_import():
    """`import dptrain` loads the learners, which use the wrapper, so what is checked is that
    the engine package binds the names only when asked (and that its own source imports
    neither the wrapper nor the process-group code, below)."""
    out = _run("import dptrain.tagi as t\n"
               "print('DDPSequential' in vars(t), 'DDPConfig' in vars(t))\n"
               "from dptrain.tagi import DDPSequential, DDPConfig\n"
               "import dptrain.tagi.ddp as d\n"
               "print(DDPSequential is d.DDPSequential, DDPConfig is d.DDPConfig,"
               " 'DDPSequential' in vars(t))")
    assert out.splitlines() == ["False False", "True True True"]


def test_the_engine_package_source_imports_no_wrapper_and_no_process_group_code():
    found = imports(module_names(ROOT, "dptrain"), "dptrain")
    assert not [i for i in found if i.importer == "dptrain.tagi"
                and (i.target.startswith("dptrain.runtime") or i.target == "dptrain.tagi.ddp")]


def test_the_seeds_default_is_kept_sum_mode():
    from dptrain.tagi import DDPConfig, DDPSequential, Linear, Sequential
    net = DDPSequential(Sequential(Linear(2, 1)), DDPConfig(backend="gloo"))
    assert net.average is False
    assert "DDPSequential" in dir(dptrain.tagi) and "DDPSequential" in dptrain.tagi.__all__


def test_an_unknown_name_is_still_an_attribute_error():
    try:
        dptrain.tagi.DDPSequentail  # noqa: B018
    except AttributeError as err:
        assert "DDPSequentail" in str(err)
    else:
        raise AssertionError("a misspelt name must raise AttributeError")


def test_lazy_names_point_into_the_engine_layer():
    """The AST scan of test_import_layers cannot see a lazy import by string: check it here."""
    for name, module in dptrain.tagi._LAZY.items():
        assert layer(module) == LAYERS.index("tagi"), (name, module)
