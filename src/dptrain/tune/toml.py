"""A TOML writer for flat tables of options (str, int, float, bool): a trial's options and the
best trial's, which `dptrain train --config` reads back."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def value_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string is a JSON string


def write_toml(path: Path, values: dict[str, Any], header: str = "") -> None:
    """`values` as TOML keys; one that is None (an unset option: TOML has no null) is left
    out, which reads back as unset."""
    lines = [f"# {line}" for line in header.splitlines()]
    lines += [f"{key} = {value_text(values[key])}" for key in values if values[key] is not None]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
