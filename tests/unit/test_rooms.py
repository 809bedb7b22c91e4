"""The house grows by rooms (docs/design.md, Layers; contract 16): a model family lives in one
module of `dptrain.models`, and the launcher, the Trainer and the learners ask its spec, so none
of them names a family or a language model's vocabulary, perplexity or bits; no class of the
package is over 600 lines and no function over 60.

Read from the sources with `ast`: identifiers and string literals that are code (an f-string's
text, a compared name), not docstrings.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import dptrain

ROOT = Path(dptrain.__file__).parent
FAMILY_FREE = (
    *sorted((ROOT / "launcher").glob("*.py")),
    *(ROOT / "train" / name for name in ("trainer.py", "state.py", "reporting.py",
                                         "metric_names.py", "extras.py", "config.py",
                                         "steps.py", "progress.py", "writer.py")),
    *(ROOT / "learners" / name for name in ("torch_learner.py", "tagi_learner.py",
                                            "parallelize.py", "torch_state.py",
                                            "protocol.py")),
)
"""The rooms that must not know which family a model is."""
FAMILY_NAMES = re.compile(r"gpt|lstm|resnet|cnn\b|mlp\b|vocab|perplexity|bits_per|"
                          r"tokens_per_sample|takes_tokens", re.IGNORECASE)
MAX_CLASS, MAX_FUNCTION = 600, 60


def _docstrings(tree: ast.Module) -> set[int]:
    """ids of the docstring nodes (module, class, function, and a field's string below it)."""
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for child in body:
            if isinstance(child, ast.Expr) and isinstance(child.value, ast.Constant) \
                    and isinstance(child.value.value, str):
                found.add(id(child.value))
    return found


def code_words(path: Path) -> list[tuple[int, str]]:
    """(line, word) of every identifier, attribute and non-docstring string of `path`."""
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree)
    words = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            words.append((node.lineno, node.attr))
        elif isinstance(node, ast.arg):
            words.append((node.lineno, node.arg))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            words.append((node.lineno, node.name))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in skip:
            words.append((node.lineno, node.value))
    return words


def test_the_scan_sees_what_it_looks_for():
    """The scan is not blind: it finds the family names where they belong."""
    gpt = [w for _, w in code_words(ROOT / "models" / "gpt.py") if FAMILY_NAMES.search(w)]
    assert "tagi-gpt" in gpt and any("perplexity" in w for w in gpt)
    assert all(path.is_file() for path in FAMILY_FREE), "a room moved: update FAMILY_FREE"


@pytest.mark.parametrize("path", FAMILY_FREE, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_launcher_trainer_and_learners_name_no_model_family(path):
    named = [f"{path.relative_to(ROOT)}:{line} {word!r}" for line, word in code_words(path)
             if FAMILY_NAMES.search(word)]
    assert named == []


def test_no_class_over_600_lines_and_no_function_over_60():
    over = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            limit = MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                    and node.end_lineno - node.lineno + 1 > limit:
                over.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} "
                            f"({node.end_lineno - node.lineno + 1} lines)")
    assert over == []


def test_no_module_imports_another_rooms_private_names():
    """A room's underscore names are its own: `from dptrain.x import _y` across packages
    means a name that should be public, or a job in the wrong room."""
    crossing = []
    for path in sorted(ROOT.rglob("*.py")):
        package = path.relative_to(ROOT).parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dptrain."):
                target = node.module.split(".")[1]
                private = [a.name for a in node.names if a.name.startswith("_")
                           and not a.name.startswith("__")]
                if private and target != package:
                    crossing.append(f"{path.relative_to(ROOT)}:{node.lineno} {private}")
    assert crossing == []
