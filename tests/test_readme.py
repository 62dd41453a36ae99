"""The README keeps the two newcomer commands and the op table generated from the registry."""
import os

from minigraph.testing.optable import markdown_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_has_the_two_commands_and_a_current_op_table():
    text = open(os.path.join(ROOT, "README.md")).read()
    assert "pip install -e . && .venv/bin/minigraph run delta-net" in text
    assert "pip install -e '.[test]' && .venv/bin/python -m pytest -q" in text
    assert markdown_table() in text, "regenerate the README's op table: python -m minigraph.testing.optable"
