"""Registries: `-` names, `_`/case-insensitive lookup, clear errors, plugins from a file."""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from ernie_serve.parsers import (ReasoningParser, ToolParser, get_reasoning_parser, get_tool_parser,
                                 list_reasoning_parsers, list_tool_parsers, load_parser_plugin,
                                 register_reasoning_parser, register_tool_parser)
from ernie_serve.parsers.registry import REASONING_PARSERS, TOOL_PARSERS


FLAGS_DOC = Path(__file__).resolve().parents[2] / "docs" / "flags.md"


def test_builtin_names():
    """FastDeploy's names: both kinds for ernie-x1 and ernie-45-vl-thinking; ernie-45-vl only reasons."""
    assert {"ernie-x1", "ernie-45-vl", "ernie-45-vl-thinking", "qwen3"} <= set(list_reasoning_parsers())
    assert {"ernie-x1", "ernie-45-vl-thinking", "qwen3", "hermes"} <= set(list_tool_parsers())


def test_every_parser_name_the_flags_doc_lists_is_registered():
    listed: dict[str, set[str]] = {"--reasoning-parser": set(), "--tool-call-parser": set()}
    for line in FLAGS_DOC.read_text().splitlines():
        cells = line.split("|")
        if not line.startswith("|") or len(cells) < 4:
            continue
        for flag, names in listed.items():
            if f"`{flag}`" in cells[1]:
                names.update(re.findall(r"`([a-z0-9_-]+)`", cells[3]))
    assert listed["--reasoning-parser"] and listed["--tool-call-parser"], "docs/flags.md has no parser rows"
    assert listed["--reasoning-parser"] <= set(list_reasoning_parsers())
    assert listed["--tool-call-parser"] <= set(list_tool_parsers())


def test_lookup_normalizes_underscore_and_case():
    assert get_reasoning_parser("ernie_x1") is get_reasoning_parser("ernie-x1")
    assert get_reasoning_parser("ERNIE_45_VL_Thinking") is get_reasoning_parser("ernie-45-vl-thinking")
    assert get_tool_parser(" Ernie_X1 ") is get_tool_parser("ernie-x1")


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown reasoning parser 'nope'.*ernie-x1"):
        get_reasoning_parser("nope")
    with pytest.raises(ValueError, match=r"unknown tool parser 'nope'.*hermes"):
        get_tool_parser("nope")


@pytest.fixture
def clean_registries():
    saved = dict(REASONING_PARSERS._classes), dict(TOOL_PARSERS._classes)
    yield
    REASONING_PARSERS._classes.clear(), REASONING_PARSERS._classes.update(saved[0])
    TOOL_PARSERS._classes.clear(), TOOL_PARSERS._classes.update(saved[1])


def test_duplicate_name_needs_force(clean_registries):
    class Mine(get_reasoning_parser("qwen3")):
        pass
    with pytest.raises(ValueError, match="already registered"):
        register_reasoning_parser("QWEN3")(Mine)
    assert register_reasoning_parser("qwen3", force=True)(Mine) is Mine
    assert get_reasoning_parser("qwen3") is Mine


def test_register_under_several_names(clean_registries):
    @register_tool_parser(["my_tools", "my-tools-2"])
    class MyTools(get_tool_parser("hermes")):
        pass
    assert get_tool_parser("my-tools") is MyTools and get_tool_parser("my_tools_2") is MyTools


def test_registering_a_non_parser_is_a_type_error(clean_registries):
    with pytest.raises(TypeError, match="not a reasoning parser"):
        register_reasoning_parser("plain")(object)
    with pytest.raises(TypeError, match="not a tool parser"):
        register_tool_parser("wrong-kind")(get_reasoning_parser("qwen3"))
    with pytest.raises(TypeError):
        register_tool_parser("not-a-class")(lambda t: None)


def test_plugin_file_registers_parsers(tmp_path, clean_registries, tok):
    plugin = tmp_path / "my_plugin.py"
    plugin.write_text(textwrap.dedent("""
        from ernie_serve.parsers import ExtractedToolCallInformation, ToolParser, register_tool_parser
        from ernie_serve.parsers.tool_parsers import ToolCallStream

        @register_tool_parser("my_plugin_parser")
        class MyPluginParser(ToolParser):
            def extract_tool_calls(self, model_output, request=None):
                return ExtractedToolCallInformation(False, [], model_output.upper())
            def new_stream(self):
                return ToolCallStream()
    """))
    module = load_parser_plugin(str(plugin))
    cls = get_tool_parser("my-plugin-parser")
    assert cls is module.MyPluginParser and issubclass(cls, ToolParser)
    assert cls(tok).extract_tool_calls("hi").content == "HI"
    assert load_parser_plugin(plugin) is module  # loading twice is harmless


def test_plugin_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_parser_plugin(tmp_path / "missing.py")
    txt = tmp_path / "plugin.txt"
    txt.write_text("")
    with pytest.raises(ValueError, match=r"\.py"):
        load_parser_plugin(txt)
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')")
    with pytest.raises(RuntimeError, match="boom"):
        load_parser_plugin(broken)


def test_base_classes_are_what_the_registry_checks():
    assert issubclass(get_reasoning_parser("ernie-x1"), ReasoningParser)
    assert issubclass(get_tool_parser("ernie-x1"), ToolParser)
