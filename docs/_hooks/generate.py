"""MkDocs hook: write the generated parts of the docs into their pages at build time.

A page asks for a generated part with a marker on a line of its own,

    <!-- generate: options train -->

and `expand` replaces it with Markdown made from the code itself: the option tables from the
real argument parsers (the source `--help` prints), the bad-input table from the end-to-end
test's own table of cases, the exit statuses from `dptrain.errors`, the model and dataset lists
from their registries, and the benchmark tables from `bench/results/*.json`. So no option, exit
status or measured figure is written twice by hand. An unknown marker fails the build. The
tests call `expand` too, to check the pages as a reader sees them.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import re
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!-- generate: ([a-z-]+)((?: [\w.-]+)*) -->$", re.MULTILINE)

if str(REPO / "src") not in sys.path:  # a build from a checkout without the package installed
    sys.path.insert(0, str(REPO / "src"))


# ------------------------------------------------------------------------------ Markdown helpers
def cell(text: object) -> str:
    """A table cell: one line, pipes escaped."""
    return re.sub(r"\s+", " ", str(text)).strip().replace("|", "\\|")


def prose(text: object) -> str:
    """Help text as Markdown shows it literally: no tags from "<class>", no emphasis from
    "*.png"."""
    return (str(text).replace("\\", "\\\\").replace("*", "\\*").replace("<", "&lt;")
            .replace(">", "&gt;"))


def code(text: object) -> str:
    return f"`{text}`" if str(text) else ""


def table(header: list[str], rows: list[list[object]], align: str = "") -> str:
    align = align or "|".join("---" for _ in header)
    lines = ["| " + " | ".join(header) + " |", f"|{align}|"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------ option tables
def subparsers() -> dict[str, argparse.ArgumentParser]:
    """`dptrain`'s subcommand parsers, exactly as `dptrain SUBCOMMAND --help` builds them."""
    from dptrain.cli.main import build_parser

    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _fields(command: str) -> dict[str, dataclasses.Field]:
    """The option dataclass fields behind a subcommand's flags, by name (train, tune)."""
    from dptrain.train.options import TrainOptions

    out = {f.name: f for f in dataclasses.fields(TrainOptions)} if command in ("train",
                                                                               "tune") else {}
    if command == "tune":
        from dptrain.tune.options import TuneOptions

        out.update({f.name: f for f in dataclasses.fields(TuneOptions)})
    return out


def _owner(command: str, name: str) -> type:
    from dptrain.train.options import TrainOptions

    if command == "tune":
        from dptrain.tune.options import TuneOptions

        if name in {f.name for f in dataclasses.fields(TuneOptions)}:
            return TuneOptions
    return TrainOptions


def _type_name(hint: object) -> str:
    given = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    if isinstance(hint, types.UnionType) and len(given) == 1:
        hint = given[0]  # an option that may be unset: the flag takes the type's values
    if typing.get_origin(hint) is typing.Literal:
        return " | ".join(code(v) for v in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        return "repeatable"
    return getattr(hint, "__name__", str(hint))


def _form(actions: list[argparse.Action], field: dataclasses.Field | None,
          owner: type | None) -> str:
    """What the flag takes: a switch, a choice, or a value of a type (with its metavar)."""
    first = actions[0]
    if len(actions) == 2:
        return "on/off pair"
    if first.nargs == 0:
        return "switch"
    if first.choices:
        return " | ".join(code(c) for c in first.choices)
    if field is not None and owner is not None:
        kind = _type_name(typing.get_type_hints(owner)[field.name])
    else:
        kind = getattr(first.type, "__name__", "str")
    if first.nargs == argparse.REMAINDER:
        return "the rest of the line"
    return f"{kind} ({code(first.metavar)})" if first.metavar else kind


def _default(actions: list[argparse.Action], field: dataclasses.Field | None) -> str:
    if field is not None:
        value = field.default if field.default is not dataclasses.MISSING else (
            field.default_factory() if field.default_factory is not dataclasses.MISSING else "")
    else:
        value = actions[0].default
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None or value == "" or value == () or value == argparse.SUPPRESS:
        return "—"
    return code(value)


def _help(actions: list[argparse.Action], field: dataclasses.Field | None, command: str) -> str:
    """The help `--help` prints; for a dataclass option its field's docstring, which is that
    help without the "(default ...)" the default column shows."""
    if field is not None:
        from dptrain.options import field_docs

        return field_docs(_owner(command, field.name))[field.name]
    text = (actions[0].help or "").replace("%%", "%")
    return text


def option_rows(command: str) -> list[dict[str, str]]:
    """One row per option of `dptrain COMMAND` (an on/off pair is one row), in --help's order:
    name, form, default, help, and for train and tune whether it defines the run."""
    parser = subparsers()[command]
    fields = _fields(command)
    by_dest: dict[str, list[argparse.Action]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        by_dest.setdefault(action.dest, []).append(action)
    rows = []
    for dest, actions in by_dest.items():
        field = fields.get(dest)
        owner = _owner(command, dest) if field is not None else None
        names = [s for a in actions for s in a.option_strings] or [actions[0].metavar or dest]
        row = {"name": " ".join(code(n) for n in names), "dest": dest,
               "form": _form(actions, field, owner), "default": _default(actions, field),
               "help": prose(_help(actions, field, command))}
        if fields:
            from dptrain.options import defines_run

            row["defines"] = ("yes" if defines_run(field) else "no") if field else "—"
        rows.append(row)
    return rows


def options(command: str, *only: str) -> str:
    """The option table of `dptrain COMMAND`; `only` keeps the options of those names (a
    feature's page shows its own), and for tune `own` leaves out the train options it shares
    (they have their own table). A name that is no option fails the build."""
    rows = option_rows(command)
    if command == "tune" and only == ("own",):
        from dptrain.tune.options import TuneOptions

        only = tuple({f.name for f in dataclasses.fields(TuneOptions)} | {"config"})
    if only:
        unknown = sorted(set(only) - {r["dest"] for r in rows})
        if unknown:
            raise ValueError(f"dptrain {command} has no option(s) {unknown}")
        rows = [r for r in rows if r["dest"] in only]
    header = ["option", "takes", "default", "defines the run" if command == "train" else
              "defines the study", "help"] if "defines" in rows[0] else \
        ["option", "takes", "default", "help"]
    keys = ["name", "form", "default", "defines", "help"] if "defines" in rows[0] else \
        ["name", "form", "default", "help"]
    return table(header, [[r[k] for k in keys] for r in rows])


def usage(command: str) -> str:
    """The usage line and description `dptrain COMMAND --help` starts with."""
    parser = subparsers()[command]
    return f"```text\n{parser.format_usage().strip()}\n```\n\n{parser.description or ''}"


# ------------------------------------------------------------------------------ errors
BAD_INPUTS = REPO / "tests" / "e2e" / "test_bad_inputs.py"


def bad_input_cases() -> list[tuple[str, int, str]]:
    """(name, exit status, the line printed) of every row of the bad-input test's tables,
    read from its source (the test runs each row through the real CLI)."""
    tree = ast.parse(BAD_INPUTS.read_text(encoding="utf-8"))
    cases = []
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                and node.targets[0].id in ("CASES", "RESUME_CASES")):
            for key, value in zip(node.value.keys, node.value.values):
                status, line = (ast.literal_eval(a) for a in value.args[1:3])
                cases.append((key.value, status, line))
    return cases


def bad_inputs() -> str:
    from dptrain import errors

    kinds = {c.exit_code: c.__name__ for c in vars(errors).values()
             if isinstance(c, type) and issubclass(c, errors.DptrainError)}
    kinds[0] = "(resumes)"
    rows = [[name.replace("-", " "), status, kinds.get(status, ""),
             code(line.replace("{tmp}", "DATA").replace("{out}", "RUN").replace(
                 "{busy}", "PORT"))]
            for name, status, line in bad_input_cases()]
    return table(["bad input", "exit", "error", "the line it prints (part)"], rows,
                 "---|---:|---|---")


def exit_statuses() -> str:
    from dptrain import errors

    classes = sorted((c for c in vars(errors).values()
                      if isinstance(c, type) and issubclass(c, errors.DptrainError)),
                     key=lambda c: c.exit_code)
    rows = [[0, "", "the job finished (also: a node that joins an elastic job that has ended)"]]
    rows += [[c.exit_code, code(c.__name__), prose((c.__doc__ or "").strip().split("\n\n")[0])]
             for c in classes]
    rows += [[130, "", "interrupted (Ctrl-C): every worker stopped"],
             [143, "", "terminated (SIGTERM): every worker stopped"]]
    return table(["status", "error", "meaning"], rows, "---:|---|---")


# ------------------------------------------------------------------------------ registries
def models() -> str:
    from dptrain.models import MODELS

    rows = [[code(s.name), s.kind, prose(s.summary),
             ", ".join(f"{code('--' + k.replace('_', '-'))} {v}" for k, v in s.defaults.items())
             or "—"] for s in MODELS.values()]
    return table(["model", "kind", "what it is", "defaults it changes"], rows)


def datasets() -> str:
    from dptrain.data.datasets import registry

    lines = registry.__doc__.split("Spellings", 1)[1].splitlines()[1:]
    rows = []
    for line in lines:
        parts = re.split(r"\s{2,}", line.strip())
        if len(parts) >= 2:
            rows.append([code(parts[0]), prose(parts[1]), code(parts[2]) if len(parts) > 2 else ""])
    return table(["`--dataset`", "what it is", "loader"], rows)


# ------------------------------------------------------------------------------ the hook
def _results_tables() -> types.ModuleType:
    """docs/_hooks/results_tables.py, loaded by path (MkDocs loads a hook as a file, not as
    part of a package)."""
    path = Path(__file__).with_name("results_tables.py")
    spec = importlib.util.spec_from_file_location("dptrain_docs_results_tables", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _generators() -> dict[str, Callable[..., str]]:
    results_tables = _results_tables()

    return {"options": options, "usage": usage, "bad-inputs": bad_inputs,
            "exit-statuses": exit_statuses, "models": models, "datasets": datasets,
            "results": results_tables.render}


def expand(markdown: str) -> str:
    """`markdown` with every generate marker replaced by what it names."""
    generators = _generators()

    def one(match: re.Match) -> str:
        kind, args = match.group(1), match.group(2).split()
        if kind not in generators:
            raise ValueError(f"unknown generate marker {match.group(0)!r}; known: "
                             f"{', '.join(generators)}")
        return generators[kind](*args)

    return MARKER.sub(one, markdown)


def on_page_markdown(markdown: str, **_: object) -> str:
    return expand(markdown)
