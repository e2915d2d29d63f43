"""docs/plugins.md says which attribute fills the tables' config columns and that the plugin must be importable for
``report``; both are checked here on a plugin-like method (registered for the test only)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sparse_eval.methods import METHODS, Method, MethodConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"


@dataclass
class _StridedConfig(MethodConfig):
    name: str = "strided_doc"
    stride: int = 2
    budget: float = 0.1


class _Strided(Method):
    name = "strided_doc"
    config_class = _StridedConfig
    display_name = "Strided"
    headline_options = ("stride",)
    budget_field = "budget"


def test_the_plugin_page_names_the_config_attributes_and_the_import():
    text = DOC.read_text(encoding="utf-8")
    for needle in ("headline_options", "`label(params)`", "budget_field", "display_name", "SPARSE_EVAL_PLUGINS"):
        assert needle in text, needle
    assert "must be importable" in text and "python -m sparse_eval.report" in text


def test_headline_options_fill_the_run_tables_config_column(monkeypatch):
    from sparse_eval.results.terminal_table import method_text
    from sparse_eval.results.results_table import short_config

    params = {"name": "strided_doc", "stride": 3, "budget": 0.1, "sink": 4}
    assert short_config(params) == ""  # unknown here: an empty config column
    monkeypatch.setitem(METHODS, "strided_doc", _Strided)
    assert short_config(params) == "stride=3"
    assert method_text({"method": "strided_doc", "method.stride": 3.0}) == "strided_doc stride=3"


def test_report_labels_a_plugin_run_only_when_the_plugin_is_imported(monkeypatch):
    from sparse_eval.report.load import config_label, method_display

    row = {"method": "strided_doc", "method_config": "strided_doc-stride=3-budget=0.1", "method.budget": 0.1}
    assert method_display(row) == "strided_doc" and config_label(row) == "strided_doc-stride=3-budget=0.1"
    monkeypatch.setitem(METHODS, "strided_doc", _Strided)
    assert method_display(row) == "Strided" and config_label(row) != row["method_config"]
