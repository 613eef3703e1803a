"""One key table: every config key is documented, and the committed examples/tidal.yaml and the key
list in docs/serving.md are exactly what `python -m tidal.config.reference --write` generates."""

from __future__ import annotations

import argparse

import pytest

from tidal.config import reference
from tidal.config.key_docs import KEY_DOCS, SEED_KEYS
from tidal.config.keys import KEYS
from tidal.config.loader import add_cli_arguments


def test_every_key_has_one_entry_in_the_table() -> None:
    assert set(KEYS) - set(KEY_DOCS) == set(), "add the new key to tidal/config/key_docs.py"
    assert set(KEY_DOCS) - set(KEYS) == set(), "the table documents a key that does not exist"
    flags = [doc.flag for doc in KEY_DOCS.values() if doc.flag]
    assert len(flags) == len(set(flags))
    for seed in SEED_KEYS.values():
        assert seed.target is None or seed.target in KEYS


@pytest.mark.parametrize(
    "path", [reference.EXAMPLE_PATH, reference.DOCS_PATH], ids=lambda p: p.name
)
def test_committed_files_match_the_table(path) -> None:
    expected = reference.outputs()[path]
    assert path.read_text(encoding="utf-8") == expected, (
        f"{path.name} is out of date: run python -m tidal.config.reference --write"
    )
    assert reference.main(["--check"]) == 0


def test_the_docs_list_and_the_example_name_every_key() -> None:
    docs = reference.docs_key_list()
    example = reference.example_yaml()
    for full, key in KEYS.items():
        assert f"| `{full}` |" in docs
        assert f"\n  {key.name}: " in example


def test_cli_help_comes_from_the_same_table() -> None:
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    helps = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}
    for full, doc in KEY_DOCS.items():
        if doc.flag:
            assert helps[doc.flag].startswith(doc.text) and f"[{full};" in helps[doc.flag]
