"""No tracked file sits where common tooling assumes build output, and the runtime's old name
still imports (with a warning) for a release.

A folder named `dist/` (or `build/`, `lib/`, ...) is ignored by the usual Python `.gitignore`
template and skipped by several analysers: a contributor who adds that template would silently
stop committing whatever lives there. The template's directory patterns are checked against every
tracked path with `git check-ignore`, so a new folder with such a name fails here.
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# The directory and file patterns of the common Python .gitignore template (the ones that can
# match source folders; editor and OS files are left out).
PYTHON_GITIGNORE = """\
__pycache__/
*.py[cod]
*.so
.Python
build/
develop-eggs/
dist/
downloads/
eggs/
.eggs/
lib/
lib64/
parts/
sdist/
var/
wheels/
share/python-wheels/
*.egg-info/
.installed.cfg
*.egg
MANIFEST
*.manifest
*.spec
pip-log.txt
htmlcov/
.tox/
.nox/
.coverage
.cache
coverage.xml
*.cover
.hypothesis/
.pytest_cache/
instance/
.webassets-cache
.scrapy
docs/_build/
target/
.ipynb_checkpoints
profile_default/
celerybeat-schedule
*.sage.py
.env
.venv
env/
venv/
ENV/
env.bak/
venv.bak/
.spyderproject
.ropeproject
site/
.mypy_cache/
.dmypy.json
.pyre/
.pytype/
cython_debug/
"""


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(),
                    reason="needs a git checkout")
def test_the_common_python_gitignore_ignores_no_tracked_file(tmp_path):
    template = tmp_path / "python.gitignore"
    template.write_text(PYTHON_GITIGNORE)
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True,
                             capture_output=True).stdout
    ignored = subprocess.run(
        ["git", "-c", f"core.excludesFile={template}", "check-ignore", "--no-index", "-z",
         "--stdin"], cwd=REPO, input=tracked, capture_output=True)
    assert ignored.returncode in (0, 1), ignored.stderr.decode()
    assert ignored.stdout.decode().split("\0")[:-1] == []


def test_the_old_runtime_name_imports_with_a_deprecation_warning():
    for name in [m for m in sys.modules if m == "dptrain.dist" or m.startswith("dptrain.dist.")]:
        del sys.modules[name]
    with pytest.warns(DeprecationWarning, match="dptrain.runtime"):
        old = importlib.import_module("dptrain.dist")
    import dptrain.runtime
    import dptrain.runtime.env
    assert old.init_distributed is dptrain.runtime.init_distributed
    assert importlib.import_module("dptrain.dist.env") is dptrain.runtime.env
    from dptrain.dist.env import resolve_env
    assert resolve_env is dptrain.runtime.env.resolve_env
