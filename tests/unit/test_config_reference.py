"""One source for options: every config field has a docstring, docs/config.md is what the code generates, `--help`
lists every key, and no field is only validated: each is read somewhere outside the config modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from moerl.train_args import config_sections
from moerl.config import MoerlConfig
from moerl.config_docs import all_fields, attribute_docs, reference_markdown

REPO = Path(__file__).resolve().parents[2]
CONFIG_MODULES = {"moerl/config.py", "moerl/config_loader.py", "moerl/config_docs.py", "moerl/train/config.py"}


def test_every_field_has_a_description():
    missing = [f.key for f in all_fields(MoerlConfig) if not f.doc]
    assert not missing, f"fields without a docstring (the string right under the field): {missing}"


def test_the_checked_in_reference_is_the_generated_one():
    want = reference_markdown(MoerlConfig)
    got = (REPO / "docs" / "config.md").read_text()
    assert got == want, "docs/config.md differs from the code: run `moerl config --reference --out docs/config.md`"


def test_help_lists_every_key():
    text = config_sections()
    for f in all_fields(MoerlConfig):
        section, name = f.key.rsplit(".", 1)
        assert f"  [{section}]" in text and f"    {name} = " in text, f.key


def _attributes_read_outside_the_config() -> set[str]:
    """Every attribute name read (`x.name`, `getattr(x, "name")`) in moerl/ outside the config modules, and inside
    them in a section's methods other than `validate` (`rollout.inflight_groups()` reads max_inflight_groups for
    its callers)."""
    names: set[str] = set()
    for path in (REPO / "moerl").rglob("*.py"):
        tree = ast.parse(path.read_text())
        if str(path.relative_to(REPO)) in CONFIG_MODULES:
            tree = ast.Module([f for c in tree.body if isinstance(c, ast.ClassDef) for f in c.body
                               if isinstance(f, ast.FunctionDef) and f.name != "validate"], [])
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
                names.add(str(node.args[1].value))
    return names


def test_every_field_is_read_outside_the_config_modules():
    """A field that is only declared and validated changes nothing (`launch.trainer_capacity` was so until the
    launch plan read it)."""
    read = _attributes_read_outside_the_config()
    unread = [f.key for f in all_fields(MoerlConfig) if f.key.rsplit(".", 1)[1] not in read]
    assert not unread, f"config fields never read outside the config modules: {unread}"


def test_attribute_docs_reads_the_string_under_each_field():
    from dataclasses import dataclass

    @dataclass
    class Section:
        a: int = 1
        """first line
        second line"""
        b: str = "x"
        c: float = 0.0
        """after c"""

    assert attribute_docs(Section) == {"a": "first line second line", "b": "", "c": "after c"}


@pytest.mark.parametrize("argv", [["config", "--reference"]])
def test_the_reference_command_prints_it(argv, capsys):
    from moerl.cli import main

    assert main(argv) == 0
    assert capsys.readouterr().out == reference_markdown(MoerlConfig)
