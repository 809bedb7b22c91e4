"""The documentation site is checked like code: it builds in strict mode, every Python example in
it runs, every `dptrain` command line in it parses, and the generated reference covers every
option of every subcommand.

Conventions the pages follow (docs/contributing.md):
- a fenced `python` block runs; the blocks of one page run in order, in one namespace, in a
  fresh directory. `<!-- no-run: REASON -->` on the line before a block keeps it from running
  (it needs a GPU, a cluster, a download, or the files of a command above it); its syntax is
  still checked.
- `<!-- docs-test-setup: dptrain ... -->` names a command the test runs, through the real
  command line, before the page's blocks (e.g. the run a prediction example loads).
- a `bash` (`sh`, `shell`, `console`) block's `dptrain ...` command lines, also after
  `torchrun -m`, `mpirun`, `srun` or `python -m`, are parsed by the real argument parser.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from dptrain.cli.main import build_parser, main

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_hooks" not in p.parts) + [REPO / "README.md"]
FENCE = re.compile(r"^(?P<indent> *)```(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                   re.MULTILINE | re.DOTALL)
NO_RUN = re.compile(r"<!-- no-run: (.+?) -->\s*$")
SETUP = re.compile(r"<!-- docs-test-setup: (dptrain .+?) -->")
SHELLS = {"bash", "sh", "shell", "console"}


@dataclass
class Block:
    page: Path
    line: int
    language: str
    code: str
    no_run: str | None

    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    found = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").splitlines()
        marked = NO_RUN.search(before[-1]) if before else None
        body = "\n".join(line[len(m.group("indent")):] for line in
                         m.group("body").splitlines())
        found.append(Block(page, text.count("\n", 0, m.start()) + 1,
                           m.group("info").strip().split(" ")[0], body,
                           marked.group(1) if marked else None))
    return found


def _id(page: Path) -> str:
    return str(page.relative_to(REPO))


PYTHON_PAGES = [p for p in PAGES if any(b.language == "python" for b in blocks(p))]


# ------------------------------------------------------------------------------ the build
def test_the_site_builds_in_strict_mode(tmp_path):
    """`make docs`: a broken link or anchor, a page missing from the navigation, a docstring
    reference that does not resolve or an unknown generate marker fails the build."""
    pytest.importorskip("mkdocs", reason="no docs extra: pip install -e '.[docs]'")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=240,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").exists()


# ------------------------------------------------------------------------------ Python examples
@pytest.mark.parametrize("page", PYTHON_PAGES, ids=_id)
def test_python_examples_run(page, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for command in SETUP.findall(page.read_text(encoding="utf-8")):
        assert main(shlex.split(command)[1:] + []) == 0, f"{_id(page)}: setup {command!r}"
    namespace: dict = {"__name__": "__docs__"}
    ran = 0
    for block in blocks(page):
        if block.language != "python":
            continue
        compiled = compile(block.code, block.where(), "exec")  # a SyntaxError names the block
        if block.no_run is None:
            exec(compiled, namespace)
            ran += 1
    capsys.readouterr()
    assert ran or all(b.no_run for b in blocks(page) if b.language == "python")


def test_no_run_blocks_say_why():
    """Every block kept from running gives its reason, and few are kept."""
    kept = [b for p in PAGES for b in blocks(p) if b.language == "python" and b.no_run]
    ran = [b for p in PAGES for b in blocks(p) if b.language == "python" and not b.no_run]
    assert all(len(b.no_run.split()) >= 2 for b in kept), [b.where() for b in kept]
    assert len(ran) > len(kept), "most examples must run"


# ------------------------------------------------------------------------------ shell examples
_LAUNCHERS = {"torchrun", "mpirun", "mpiexec", "srun", "python", "python3"}


def command_lines(code: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments dropped, split at
    `&&`, `||`, `;` and `|`."""
    joined = re.sub(r"\\\n\s*", " ", code)
    commands = []
    for line in joined.splitlines():
        line = line.strip().removeprefix("$ ")
        if not line or line.startswith("#"):
            continue
        words = shlex.split(line, comments=True)
        current: list[str] = []
        for word in words:
            if word in ("&&", "||", ";", "|"):
                commands.append(current)
                current = []
            else:
                current.append(word)
        commands.append(current)
    return [shlex.join(c) for c in commands if c]


def dptrain_argv(command: str) -> list[str] | None:
    """The arguments after `dptrain` in a command line (directly, or after a launcher, or
    `python -m dptrain`), else None."""
    words = shlex.split(command)
    for i, word in enumerate(words):
        if word == "dptrain" or word.endswith("/dptrain"):
            if i == 0 or words[i - 1] == "-m" or words[0] in _LAUNCHERS or \
                    words[0].endswith("/dptrain"):
                return words[i + 1:]
    return None


SHELL_COMMANDS = [(b.where(), c) for p in PAGES for b in blocks(p) if b.language in SHELLS
                  for c in command_lines(b.code) if dptrain_argv(c) is not None]


def test_the_docs_have_dptrain_command_lines():
    assert len(SHELL_COMMANDS) > 40, len(SHELL_COMMANDS)
    assert {dptrain_argv(c)[0] for _, c in SHELL_COMMANDS if dptrain_argv(c)} >= {
        "train", "run", "predict", "export", "env", "tune"}


@pytest.mark.parametrize("where, command", SHELL_COMMANDS,
                         ids=[f"{w}:{c[:60]}" for w, c in SHELL_COMMANDS])
def test_shell_example_parses(where, command, capsys):
    argv = dptrain_argv(command)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as done:
        if done.code != 0:  # 0: --help or --version
            pytest.fail(f"{where}: `{command}` does not parse:\n{capsys.readouterr().err}")
        return
    assert callable(args.func)


def test_the_shell_parser_finds_what_it_should():
    """The command-line extraction itself, on the forms the docs use."""
    code = ("dptrain train --epochs 2 \\\n    --out runs/x   # a comment\n"
            "torchrun --nnodes 2 -m dptrain train --out y\n"
            "mpirun -np 8 -x A=1 dptrain train\nmake demo && .venv/bin/dptrain env -n 4\n")
    argvs = [dptrain_argv(c) for c in command_lines(code)]
    assert [a for a in argvs if a is not None] == [
        ["train", "--epochs", "2", "--out", "runs/x"], ["train", "--out", "y"], ["train"],
        ["env", "-n", "4"]]


# ------------------------------------------------------------------------------ the reference
def _generate():
    path = DOCS / "_hooks" / "generate.py"
    spec = importlib.util.spec_from_file_location("dptrain_docs_generate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_lists_every_option_of_every_subcommand():
    generate = _generate()
    page = generate.expand((DOCS / "reference" / "cli.md").read_text(encoding="utf-8"))
    parsers = generate.subparsers()
    assert set(parsers) >= {"train", "run", "predict", "env", "tune", "export"}
    for command, parser in parsers.items():
        assert f"## dptrain {command}" in page, f"reference/cli.md has no section for {command}"
        for action in parser._actions:
            for name in action.option_strings:
                if name not in ("-h", "--help"):
                    assert f"`{name}`" in page, f"dptrain {command} {name} is not in the reference"


def test_defines_the_run_column_is_the_option_fields():
    """The column is `defines_run` of the field behind the flag: spot-check both values."""
    rows = {r["dest"]: r for r in _generate().option_rows("train")}
    assert rows["batch_size"]["defines"] == "yes" and rows["model"]["defines"] == "yes"
    assert rows["epochs"]["defines"] == "no" and rows["out"]["defines"] == "no"
    assert rows["augment"]["form"] == "on/off pair" and rows["progress"]["default"] == "on"


def test_an_unknown_marker_fails_the_build():
    with pytest.raises(ValueError, match="unknown generate marker"):
        _generate().expand("<!-- generate: optoins train -->")


def test_a_marker_naming_no_option_fails_the_build():
    with pytest.raises(ValueError, match="no option"):
        _generate().expand("<!-- generate: options train lr sigma_vv -->")
