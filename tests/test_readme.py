"""The README cannot drift from the code: the configuration reference (docs/configuration.md) is the generated
one, the README's batch table is
what `pretrain.batch_plan` computes, every `make TARGET` it shows is a Makefile target, every
`python -m MODULE` it shows imports and answers `--help`, and every `--option` of a project command shown in the
README or docs/*.md is one that command's parser accepts."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path
from unittest import mock

from finetune.config import FinetuneConfig
from pretrain.batch_plan import feasible_pairs, nearest_feasible_globals
from tools.config_reference import reference_markdown

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CONFIGURATION = ROOT / "docs" / "configuration.md"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGES = "data_prep|pretrain|finetune|tools"


def section(name: str, text: str = README, where: str = "README.md") -> str:
    match = re.search(rf"<!-- {name}:start -->\n(.*?)<!-- {name}:end -->", text, re.S)
    assert match, f"{where} has no <!-- {name}:start/end --> section"
    return match.group(1)


def code_pieces(text: str) -> list[tuple[int, str]]:
    """(line number, code) for everything a markdown text shows as code: each command of a fenced block (its
    `# comment` dropped, its backslash-continued lines kept as lines) and each inline `span` (which may wrap)."""
    pieces = []
    lines = text.splitlines()
    fenced = [False] * len(lines)
    inside = False
    for number, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            inside, fenced[number] = not inside, True
        elif inside:
            fenced[number] = True
    command, start = None, 0
    for number, line in enumerate(lines):
        if not fenced[number] or line.lstrip().startswith("```"):
            continue
        code = re.sub(r"(^|\s)#.*", "", line).rstrip()
        command, start = (command + "\n" + code, start) if command is not None else (code, number + 1)
        if command.endswith("\\"):
            command = command[:-1]
        else:
            pieces.append((start, command))
            command = None
    prose = "\n".join("" if is_fenced else line for line, is_fenced in zip(lines, fenced))
    for match in re.finditer(r"`([^`]+)`", prose):
        if "\n\n" not in match.group(1):
            pieces.append((prose.count("\n", 0, match.start()) + 1, match.group(1)))
    return sorted(pieces)


def code_text() -> str:
    """Everything the README shows as code, a piece a line."""
    return "\n".join(" ".join(code.split()) for _, code in code_pieces(README))


def project_commands(code: str) -> list[tuple[str, list[tuple[int, str]]]]:
    """(module, its --long-options as (line within the code, option)) for each command of this project in a piece of
    code: `python -m MODULE`, `torchrun ... -m MODULE`, `deepspeed ... PACKAGE/SCRIPT.py`, a launcher's
    `-- PACKAGE/SCRIPT.py` or a bare `MODULE --option` (only what follows the module counts: the launcher's flags are
    the launcher's). Synopsis brackets (`[--flag N]`) and `{a,b}` choices need no care: only the `--word`s are taken."""
    commands = []
    offset = 0
    for command in re.split(r"(;|&&|\|\||\s\|\s|\s--\s)", code):  # after a bare `--`: the launched script's
        match = re.search(rf"\b(?:python3?|torchrun|deepspeed)\b.*?\s-m\s+(?P<module>(?:{PACKAGES})\.\w+)(?=\s|$)"
                          rf"|\b(?:python3?|deepspeed)\b.*?\s(?:\./)?(?P<script>(?:{PACKAGES})/\w+)\.py(?=\s|$)"
                          rf"|^\s*(?P<bare>(?:{PACKAGES})\.\w+)(?=\s+--)"
                          rf"|^\s*(?:\./)?(?P<launched>(?:{PACKAGES})/\w+)\.py(?=\s|$)", command, re.S)
        if match:
            script = match.group("script") or match.group("launched")
            module = match.group("module") or match.group("bare") or script.replace("/", ".")
            options = re.finditer(r"(?:^|[\s\[(])(--[A-Za-z][\w-]*)", command[match.end():])
            commands.append((module, [(code.count("\n", 0, offset + match.end() + option.start(1)), option.group(1))
                                      for option in options]))
        offset += len(command)
    return commands


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


@cache
def accepted_options(module: str) -> frozenset[str]:
    """The option strings of MODULE's command line, from the parser its `main(argv)` builds: stopped where it
    would parse, so nothing runs and no interpreter is started (a `--help` subprocess per module takes seconds)."""
    def stop(parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _Parsed(parser)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", stop):
        try:
            importlib.import_module(module).main([])
        except _Parsed as parsed:
            return frozenset(parsed.parser._option_string_actions)  # argparse has no public list of them
    raise AssertionError(f"{module}.main() never parsed its arguments")


def test_configuration_reference_is_generated_from_the_config_dataclasses() -> None:
    reference = reference_markdown()
    assert section("config-reference", CONFIGURATION.read_text(), str(CONFIGURATION)) == reference + "\n", (
        "docs/configuration.md is out of date: run `python -m tools.config_reference --update`")
    missing = [f.name for f in dataclasses.fields(FinetuneConfig) if f"| `{f.name}` |" not in reference]
    assert not missing, f"the configuration reference lacks fine-tuning keys {missing}"


def test_the_readme_stays_short() -> None:
    assert len(README.encode()) <= 16 * 1024, "README.md is over 16 KB: detail belongs in docs/"


def test_batch_table_matches_the_batch_planner() -> None:
    rows = [line for line in section("batch-table").splitlines() if re.match(r"\| \d", line)]
    assert len(rows) >= 5
    for line in rows:
        gpus, splits, pairs, nearest = (cell.strip() for cell in line.strip("|").split("|"))
        world = int(gpus.split()[0])
        expected = feasible_pairs(330, world)
        assert splits == ("yes" if expected else "no"), line
        assert pairs == (", ".join(f"({m}, {a})" for m, a in expected[:4]) or "—"), line
        assert nearest == ", ".join(map(str, nearest_feasible_globals(330, world))), line


def test_every_make_target_in_the_readme_exists() -> None:
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", (ROOT / "Makefile").read_text(), re.M))
    mentioned = set(re.findall(r"(?:^|[\s;&|(])make ([a-z][a-z0-9-]*)", code_text()))
    assert {"demo", "test", "bench"} <= mentioned
    assert not mentioned - targets, f"README mentions make targets the Makefile lacks: {mentioned - targets}"


_HELP_OF_EACH = r"""
import contextlib, io, runpy, sys
for module in sys.argv[1:]:
    sys.argv = [module, "--help"]
    shown = io.StringIO()
    try:
        with contextlib.redirect_stdout(shown):
            runpy.run_module(module, run_name="__main__", alter_sys=True)  # what `python -m MODULE --help` runs
        code = "returned without exiting"
    except SystemExit as stop:
        code = stop.code
    except BaseException as error:  # noqa: BLE001 -- reported for the module, then the next one
        code = f"{type(error).__name__}: {error}"
    print(f"{module}\t{code}\t{'usage:' in shown.getvalue()}", file=sys.__stdout__, flush=True)
"""


def test_every_python_module_in_the_readme_runs_with_help() -> None:
    """`python -m MODULE --help` of every module the README names, all in one interpreter (runpy runs each as
    `python -m` does; an interpreter per module took 18 s): each prints its usage and exits 0."""
    modules = sorted(set(re.findall(r"python -m ([\w.]+)", code_text())))
    assert "tools.demo" in modules and "tools.bench_all" in modules
    done = subprocess.run([sys.executable, "-c", _HELP_OF_EACH, *modules], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, DS_ACCELERATOR="cpu"), timeout=300)
    outcomes = dict(line.split("\t", 1) for line in done.stdout.splitlines() if "\t" in line)
    assert sorted(outcomes) == modules, done.stderr[-3000:]
    failures = {module: outcome for module, outcome in outcomes.items() if outcome != "0\tTrue"}
    assert not failures, f"`python -m MODULE --help` failed (exit code, usage printed) for: {failures}"


def test_every_option_shown_for_a_project_command_is_accepted_by_it() -> None:
    """A renamed or removed flag in a documented command line would otherwise meet the user as argparse's error.
    Options must be spelt in full: argparse's prefix matching would break as soon as an option were added."""
    checked, unknown = set(), []
    for path in DOCS:
        for line, code in code_pieces(path.read_text()):
            for module, options in project_commands(code):
                checked.add(module)
                unknown += [f"{path.relative_to(ROOT)}:{line + below}: `{module}` has no {option}"
                            for below, option in options if option not in accepted_options(module)]
    assert {"data_prep.build", "finetune.run", "finetune.decode", "pretrain.train"} <= checked
    assert not unknown, "documented options the commands do not accept:\n" + "\n".join(unknown)
