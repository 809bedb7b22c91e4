"""cuTAGI main's own unit tests of its newest layers (test/py_unit/test_attention.py and
test_rmsnorm.py at commit ef69219, MIT) run on dptrain.pytagi with only their import lines
rewritten (rewrite.py), as the pytagi 0.2.1 programs are (test_pytagi_programs.py).

The files are cuTAGI's and not shipped here: they are read from $DPTRAIN_CUTAGI_MAIN_TESTS (a
folder holding test/py_unit/) or from a cutagi-main checkout beside the repository's parent,
and the tier skips in one line where neither exists (get them from cuTAGI at ef69219).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests._cli import PYTHON, REPO, base_env, run
from tests.pytagi_programs.rewrite import rewrite_source

pytestmark = pytest.mark.e2e

NAMED = os.environ.get("DPTRAIN_CUTAGI_MAIN_TESTS")
SOURCE = Path(NAMED) if NAMED else REPO.parent / "shared" / "cutagi-main"


@pytest.mark.parametrize("name", ["test_attention", "test_rmsnorm"])
def test_cutagi_main_unit_test_passes(name, tmp_path):
    source = SOURCE / "test" / "py_unit" / f"{name}.py"
    if not source.is_file():
        pytest.skip(f"cuTAGI main's {name}.py not found under {SOURCE}: set "
                    "DPTRAIN_CUTAGI_MAIN_TESTS to a checkout of cuTAGI at ef69219")
    text = source.read_text()
    ported = rewrite_source(text)
    changed = [(a, b) for a, b in zip(text.split("\n"), ported.split("\n")) if a != b]
    assert changed and all("pytagi" in a and "dptrain.pytagi" in b for a, b in changed)
    (tmp_path / f"{name}.py").write_text(ported)
    result = run([PYTHON, "-m", "unittest", "-v", name], cwd=tmp_path, env=base_env(),
                 timeout_s=300)
    assert result.returncode == 0 and "\nOK" in result.stderr, result.stderr[-3000:]
