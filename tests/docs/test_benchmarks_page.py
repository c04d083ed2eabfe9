"""docs/benchmarks.md is generated from benchmarks/results/*.json by scripts/render_benchmarks.py: the page must be
what the files render, and a JSON file of another shape in that folder is skipped, saying so, not rendered."""
from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _renderer():
    spec = importlib.util.spec_from_file_location("render_benchmarks", ROOT / "scripts" / "render_benchmarks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _result(**overrides) -> dict:
    result = {"title": "t", "commit": "abc1234", "cpu": "some CPU", "command": "python x.py", "date": "2026-01-02",
              "columns": ["a", "b"], "rows": [[1, "x"]], "notes": "n"}
    result.update(overrides)
    return result


def test_benchmarks_page_is_what_the_result_files_render():
    render = _renderer()
    page = render.render_page(render.load_results(log=io.StringIO()))
    assert (ROOT / "docs" / "benchmarks.md").read_text() == page, (
        "docs/benchmarks.md is out of date with benchmarks/results/: run .venv/bin/python scripts/render_benchmarks.py")


def test_every_readme_result_file_has_the_schema():
    render = _renderer()
    files = sorted((ROOT / "benchmarks" / "results").glob("readme_*.json"))
    assert files
    for path in files:
        assert render.schema_problem(json.loads(path.read_text())) is None, path.name


def test_other_json_is_skipped_with_a_line_and_left_off_the_page(tmp_path):
    render = _renderer()
    (tmp_path / "good.json").write_text(json.dumps(_result(title="Kept result")))
    (tmp_path / "raw_output.json").write_text(json.dumps({"tok_s": 12.5}))
    (tmp_path / "short_row.json").write_text(json.dumps(_result(rows=[[1]])))
    log = io.StringIO()
    results = render.load_results(tmp_path, log=log)
    assert [name for name, _ in results] == ["good.json"]
    assert "skipping raw_output.json" in log.getvalue() and "missing keys" in log.getvalue()
    assert "skipping short_row.json" in log.getvalue() and "row 0 has 1 cells for 2 columns" in log.getvalue()
    page = render.render_page(results)
    assert "## Kept result" in page and "raw_output" not in page


def test_results_render_newest_first_with_command_commit_and_cpu(tmp_path):
    render = _renderer()
    (tmp_path / "a.json").write_text(json.dumps(_result(title="Older", date="2025-05-01")))
    (tmp_path / "b.json").write_text(json.dumps(_result(title="Newer", date="2026-05-01", command="python y.py --z")))
    page = render.render_page(render.load_results(tmp_path, log=io.StringIO()))
    assert page.index("## Newer") < page.index("## Older")
    assert "python y.py --z" in page and "commit `abc1234`" in page and "some CPU" in page


def test_check_mode_fails_on_a_stale_page(tmp_path):
    render = _renderer()
    (tmp_path / "r.json").write_text(json.dumps(_result()))
    page = tmp_path / "page.md"
    assert render.main(["--results", str(tmp_path), "--out", str(page)]) == 0
    assert render.main(["--check", "--results", str(tmp_path), "--out", str(page)]) == 0
    page.write_text(page.read_text() + "edited by hand\n")
    assert render.main(["--check", "--results", str(tmp_path), "--out", str(page)]) == 1
