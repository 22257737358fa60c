"""`elastic config`: the JSON schema, the validator, and the committed reference generated from the schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import BaseModel

from elastic.cli import main
from elastic.commands.config import REFERENCE_PATH, render_reference
from elastic.config import JobConfig

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "deploy" / "examples" / "demo.yaml"


def _fields() -> list[tuple[str, str]]:
    """(dotted name, description) of every leaf field of the job config."""
    out = []
    for name, info in JobConfig.model_fields.items():
        section = info.annotation
        if isinstance(section, type) and issubclass(section, BaseModel):
            out += [(f"{name}.{sub}", sub_info.description) for sub, sub_info in section.model_fields.items()]
        else:
            out.append((name, info.description))
    return out


def test_schema_is_the_job_config_schema(capsys) -> None:
    assert main(["config", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema == JobConfig.model_json_schema()
    assert {"model", "data", "parallel", "scaling", "training", "checkpoint", "fault"} <= set(schema["properties"])


def test_every_field_has_a_description() -> None:
    missing = [name for name, description in _fields() if not description]
    assert not missing, f"fields without a description: {missing}"


def test_validate_prints_ok(capsys) -> None:
    assert main(["config", "validate", str(DEMO), "--set", "training.steps=200"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "layout dp_shard=4 on 4 workers (kept tp=1 pp=1); global batch 32 = dp 4 x 1 micro-batches of 8", "OK"]


@pytest.mark.parametrize("args, message", [
    (["--set", "parallel.tp=3", "--set", "scaling.workers_per_node=6"], "model.n_heads (4) must be divisible by parallel.tp (3)"),
    (["--set", "scaling.num_wrokers=2"], "scaling.num_wrokers: unknown field; did you mean scaling.num_workers?"),
    (["--set", "training.steps"], "expected key=value"),
])
def test_validate_reports_one_line_and_exits_2(capsys, args, message) -> None:
    assert main(["config", "validate", str(DEMO), *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err and captured.err.count("\n") == 1


def test_validate_a_missing_or_broken_file(tmp_path: Path, capsys) -> None:
    assert main(["config", "validate", str(tmp_path / "nope.yaml")]) == 2
    assert "no such config file" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {dim: [\n")
    assert main(["config", "validate", str(bad)]) == 2
    assert "invalid YAML" in capsys.readouterr().err


def test_reference_lists_every_section_and_field() -> None:
    text = render_reference(JobConfig.model_json_schema())
    for name, description in _fields():
        row = next((line for line in text.splitlines() if line.startswith(f"| `{name}` |")), None)
        assert row is not None, f"{name} missing from the reference"
        assert description.replace("|", "\\|") in row
    for section in ("model", "data", "parallel", "scaling", "training", "checkpoint", "fault"):
        assert f"## `{section}`" in text
    assert "| `parallel.pp_schedule` | `\"gpipe\"` \\| `\"1f1b\"` \\| `\"interleaved_1f1b\"` | `\"1f1b\"` |" in text
    assert "| `scaling.num_workers` | int ≥ 1, ≤ 65536 | `4` |" in text
    assert "| `fault.inject` | list of string | `[]` |" in text


def test_committed_reference_is_up_to_date(capsys) -> None:
    """docs/config-reference.md must be what the schema generates: run `elastic config reference -o docs/config-reference.md`."""
    committed = ROOT / REFERENCE_PATH
    assert committed.is_file(), f"{REFERENCE_PATH} is missing"
    assert committed.read_text() == render_reference(JobConfig.model_json_schema()), (
        f"{REFERENCE_PATH} is stale: regenerate it with `elastic config reference -o {REFERENCE_PATH}`")
    assert main(["config", "reference", "--check", str(committed)]) == 0


def test_reference_check_and_output(tmp_path: Path, capsys) -> None:
    out = tmp_path / "docs" / "ref.md"
    assert main(["config", "reference", "-o", str(out)]) == 0
    assert main(["config", "reference", "--check", str(out)]) == 0
    out.write_text(out.read_text().replace("Hidden size.", "Hidden size (edited by hand)."))
    assert main(["config", "reference", "--check", str(out)]) == 1
    assert "out of date" in capsys.readouterr().out
    assert main(["config", "reference"]) == 0
    assert capsys.readouterr().out == render_reference(JobConfig.model_json_schema())
