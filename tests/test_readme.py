"""The README cannot drift from the code: the configuration reference (docs/configuration.md) is the generated
one, the README's batch table is
what `pretrain.batch_plan` computes, every `make TARGET` it shows is a Makefile target and every
`python -m MODULE` it shows imports and answers `--help`."""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from finetune.config import FinetuneConfig
from pretrain.batch_plan import feasible_pairs, nearest_feasible_globals
from pretrain.config import reference_markdown

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CONFIGURATION = ROOT / "docs" / "configuration.md"


def section(name: str, text: str = README, where: str = "README.md") -> str:
    match = re.search(rf"<!-- {name}:start -->\n(.*?)<!-- {name}:end -->", text, re.S)
    assert match, f"{where} has no <!-- {name}:start/end --> section"
    return match.group(1)


def code_text() -> str:
    """Everything the README shows as code: fenced blocks and inline `spans`."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", README, re.S)
    without_blocks = re.sub(r"```.*?```", "", README, flags=re.S)
    return "\n".join(blocks + re.findall(r"`([^`\n]+)`", without_blocks))


def test_configuration_reference_is_generated_from_the_config_dataclasses() -> None:
    reference = reference_markdown()
    assert section("config-reference", CONFIGURATION.read_text(), str(CONFIGURATION)) == reference + "\n", (
        "docs/configuration.md is out of date: run `python -m pretrain.config --update-reference`")
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


def test_every_python_module_in_the_readme_runs_with_help() -> None:
    modules = sorted(set(re.findall(r"python -m ([\w.]+)", code_text())))
    assert "tools.demo" in modules and "tools.bench_all" in modules

    def help_exit(module: str) -> tuple[str, int, str]:
        done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                              env=dict(os.environ, DS_ACCELERATOR="cpu"), timeout=300)
        return module, done.returncode, done.stderr[-500:]

    with ThreadPoolExecutor(max_workers=2) as pool:
        failures = [(m, code, err) for m, code, err in pool.map(help_exit, modules) if code != 0]
    assert not failures, f"`python -m MODULE --help` failed for: {failures}"
