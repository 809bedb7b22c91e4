"""The port a pytagi user makes: `pytagi` -> `dptrain.pytagi` in import statements, nothing else,
over a tree of pytagi's programs, for pytagi/pytagi_tutorials_vs_wheel.py. The same rewrite as
the tests' (tests/pytagi_programs/rewrite.py), copied so that no bench file depends on tests/.

    import pytagi                    -> import dptrain.pytagi as pytagi
    import pytagi.metric as metric   -> import dptrain.pytagi.metric as metric
    from pytagi.nn import (...)      -> from dptrain.pytagi.nn import (...)

Notebooks (.ipynb) become scripts of their code cells in order (IPython magics and shell lines
dropped), rewritten the same way.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

_IMPORT = re.compile(r"^(\s*)import pytagi(\.[\w.]+)?(\s+as\s+\w+)?\s*$")
_FROM = re.compile(r"^(\s*)from pytagi(\.[\w.]+)?(\s+import\b.*)$")


def rewrite_line(line: str) -> str:
    if match := _FROM.match(line):
        indent, sub, rest = match.groups()
        return f"{indent}from dptrain.pytagi{sub or ''}{rest}"
    if match := _IMPORT.match(line):
        indent, sub, alias = match.groups()
        alias = alias or (" as pytagi" if not sub else "")
        return f"{indent}import dptrain.pytagi{sub or ''}{alias}"
    return line


def rewrite_source(text: str) -> str:
    return "\n".join(rewrite_line(line) for line in text.split("\n"))


def notebook_script(path: Path, rewrite: bool = True) -> str:
    cells = json.loads(path.read_text())["cells"]
    lines = []
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        for line in "".join(cell["source"]).split("\n"):
            lines.append("" if line.lstrip().startswith(("%", "!")) else line)
        lines.append("")
    script = "\n".join(lines)
    return rewrite_source(script) if rewrite else script


def port_tree(source: Path, target: Path, *, rewrite: bool = True) -> None:
    """Copy pytagi's examples, unit tests, data and tutorials with their imports rewritten
    (`rewrite=False`: unchanged, notebooks still made scripts, to run on the wheel)."""
    convert = rewrite_source if rewrite else (lambda text: text)
    for path in source.rglob("*"):
        rel = path.relative_to(source)
        out = target / rel
        if path.is_dir():
            out.mkdir(parents=True, exist_ok=True)
        elif path.suffix == ".py":
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(convert(path.read_text()))
        elif path.suffix == ".ipynb":
            out.parent.mkdir(parents=True, exist_ok=True)
            out.with_suffix(".py").write_text(notebook_script(path, rewrite))
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(path.read_bytes())
