"""docs/reference/ is generated from the code it describes (shim/docgen.py, `make docs`): every
configuration key has its meaning in shim/config.py's KEY_DOCS, and each committed page is what the
generator writes today, so a new key, option or metric without a regenerated page fails here."""

from __future__ import annotations

import argparse

from shim import config, docgen


def test_every_config_key_is_documented() -> None:
    assert not docgen.undocumented_keys(), "add to KEY_DOCS/SECTION_DOCS in shim/config.py"


def test_reference_pages_are_current() -> None:
    assert not docgen.stale(), "stale reference pages: run `make docs`"


def test_config_page_names_every_key_with_its_env_var_and_default() -> None:
    page = docgen.config_md()
    defaults = config.Config()
    for section, keys in config._SCHEMA.items():
        assert f"## [{section}]" in page
        for key, (attr, _) in keys.items():
            row = next(
                line
                for line in page.splitlines()
                if line.startswith(f"| `{key}` |")
                and "PODSHIM_" in line
                and f"PODSHIM_{section}_{key}".upper() in line
            )
            assert f"`{docgen._cell(docgen._toml(getattr(defaults, attr)))}`" in row


def test_cli_page_holds_every_commands_help() -> None:
    from shim import cli
    from shim.kube import plugin

    page = docgen.cli_md()

    def walk(parser: argparse.ArgumentParser) -> None:
        assert docgen._help(parser) in page, parser.prog
        for _, _, sub in docgen._subcommands(parser):
            walk(sub)

    walk(cli.build_parser())
    walk(plugin.build_parser())


def test_metrics_page_lists_every_metric() -> None:
    page = docgen.metrics_md()
    for m in docgen.registered_metrics():
        assert f"| `{m._name}" in page
        for label in m._labelnames:
            assert f"* `{label}`:" in page, (
                f"{m._name}'s label {label}: add it to shim/metrics.py's LABEL_DOCS"
            )
