"""The old name of `dptrain.runtime`, kept importable for one release.

The package was renamed because a folder named `dist` is what Python's build tools, the common
`.gitignore` templates and several analysers treat as build output: a contributor with the usual
`.gitignore` would silently leave the runtime out of their commits. `import dptrain.dist` and
`from dptrain.dist.env import ...` still work, with a DeprecationWarning.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import warnings

import dptrain.runtime as _runtime
from dptrain.runtime import *  # noqa: F403
from dptrain.runtime import __all__  # noqa: F401

warnings.warn("dptrain.dist is now dptrain.runtime; the old name goes away in the next release",
              DeprecationWarning, stacklevel=2)

# `import dptrain.dist.env` finds the submodule in sys.modules under its old name.
for _info in pkgutil.iter_modules(_runtime.__path__):
    sys.modules[f"{__name__}.{_info.name}"] = importlib.import_module(
        f"dptrain.runtime.{_info.name}")
    globals()[_info.name] = sys.modules[f"{__name__}.{_info.name}"]
