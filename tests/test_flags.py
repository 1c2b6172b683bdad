"""The CLI's flag help has one source, each config field's docstring, and docs/flags.md is generated from it."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

import pytest

from engine.core.config import EngineConfig, FaultPlan, ModelShape
from gateway.cli import REGENERATE, add_engine_flags, build_parser, engine_kwargs, field_docs, flag_reference
from gateway.config import GatewayConfig

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("cls", [EngineConfig, GatewayConfig, ModelShape, FaultPlan])
def test_every_config_field_has_a_docstring(cls):
    docs = field_docs(cls)
    assert [f.name for f in fields(cls) if not docs.get(f.name)] == []


def test_flag_page_is_generated():
    page = (ROOT / "docs" / "flags.md").read_text()
    assert page == flag_reference(), f"docs/flags.md is stale: regenerate it with `{REGENERATE}`"


def test_flag_help_is_the_field_docstring():
    [serve] = [a.choices["serve"] for a in build_parser()._actions if a.dest == "command"]
    helps = {a.dest: a.help for a in serve._actions}
    assert helps["block_size"] == "tokens per KV cache block (default: 16)"
    assert (
        helps["routing"].startswith("which replica serves a request") and "(default: cache-aware)" in helps["routing"]
    )
    for cls, name in [(EngineConfig, "speculative_row_cost"), (GatewayConfig, "max_queued_tokens")]:
        assert " ".join(field_docs(cls)[name].split()[1:6]) in helps[name]


def parser():
    p = argparse.ArgumentParser(prog="orcinus serve")
    add_engine_flags(p)
    return p


def test_scheduling_level_and_its_deprecated_spelling(capsys):
    new = parser().parse_args(["--scheduling-level", "request"])
    assert capsys.readouterr().err == ""
    old = parser().parse_args(["--scheduling", "request"])
    assert "--scheduling is deprecated; use --scheduling-level" in capsys.readouterr().err
    assert engine_kwargs(old) == engine_kwargs(new) == {"scheduling": "request"}
    assert EngineConfig(**engine_kwargs(old)) == EngineConfig(scheduling="request")
    with pytest.raises(SystemExit):  # the old spelling keeps its choices
        parser().parse_args(["--scheduling", "token"])


def test_deprecated_spelling_is_not_in_help():
    text = parser().format_help()
    assert "--scheduling-level" in text and "--scheduling " not in text and "--scheduling\n" not in text
