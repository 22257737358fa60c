"""`elastic config`: the job config's JSON schema, a validator, and the generated field reference.

    elastic config schema                      # JSON schema of JobConfig (for editors and CI linters)
    elastic config validate job.yaml --set training.steps=50 [--inject kill:rank=1,step=5]
    elastic config reference -o docs/config-reference.md
    elastic config reference --check docs/config-reference.md

The reference is rendered from the same JSON schema that `schema` prints, so
the documentation cannot drift from the pydantic model: `--check` (run by the
test suite) fails when the committed file is not what the model generates.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from elastic.config import JobConfig, load_config
from elastic.preflight import check_start

REFERENCE_PATH = Path("docs/config-reference.md")
"""Where the committed reference lives, relative to the repository root."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("config", help="print the job config schema, validate a job YAML, generate the field reference",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)

    schema = sub.add_parser("schema", help="print the JSON schema of the job config")
    schema.set_defaults(func=_schema)

    validate = sub.add_parser("validate", help="check a job YAML as `elastic run` would before it starts a worker: "
                                               "print its layout and OK, or exit 2 with the error")
    validate.add_argument("config", help="job YAML")
    validate.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                          help="override a config field, as `elastic run --set` does")
    validate.add_argument("--inject", action="append", default=[], metavar="SPEC", help="a fault spec, as `elastic run --inject` takes it")
    validate.set_defaults(func=_validate)

    reference = sub.add_parser("reference", help="render the Markdown reference of every config field")
    out = reference.add_mutually_exclusive_group()
    out.add_argument("-o", "--output", metavar="PATH", help="write the reference here instead of printing it")
    out.add_argument("--check", metavar="PATH", help="exit 1 if PATH differs from the generated reference")
    reference.set_defaults(func=_reference)


def _schema(args: argparse.Namespace) -> int:
    print(json.dumps(JobConfig.model_json_schema(), indent=2))
    return 0


def _validate(args: argparse.Namespace) -> int:
    """The checks `elastic run` does before it starts a worker, without running anything (a ConfigError becomes `elastic: error: ...`, exit 2).

    `check_start` is the function `elastic.job.prepare` calls: the layout,
    the faults, the model, the checkpoint URI, the data and the initial
    weights are checked as a run checks them. What only a run can find out
    (the run directory and the checkpoint URI free of another job, an
    earlier run's checkpoints, which `--fresh` decides about) is left to it.
    """
    cfg = load_config(args.config, args.overrides)
    print(check_start(cfg, args.inject).job.summary)
    print("OK")
    return 0


def _reference(args: argparse.Namespace) -> int:
    text = render_reference(JobConfig.model_json_schema())
    if args.check:
        path = Path(args.check)
        if not path.is_file() or path.read_text() != text:
            print(f"{path} is out of date; regenerate it with: elastic config reference -o {path}")
            return 1
        print(f"{path} is up to date")
    elif args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text)
    else:
        print(text, end="")
    return 0


# --------------------------------------------------------------------------- rendering
def _type(prop: dict) -> str:
    """A field's type with its bounds, in words a YAML author needs (not JSON-schema jargon)."""
    if "const" in prop:
        return f"`{json.dumps(prop['const'])}`"
    if "enum" in prop:
        return " | ".join(f"`{json.dumps(v)}`" for v in prop["enum"])
    kind = {"integer": "int", "number": "float", "boolean": "bool", "string": "string"}.get(prop.get("type"), prop.get("type", "any"))
    if kind == "array":
        kind = f"list of {_type(prop.get('items', {}))}"
    bounds = []
    for key, sign in (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤"), ("exclusiveMaximum", "<")):
        if key in prop:
            bounds.append(f"{sign} {prop[key]}")
    if "pattern" in prop:
        bounds.append(f"matching `{prop['pattern']}`")
    return " ".join([kind, ", ".join(bounds)]) if bounds else kind


def _default(prop: dict) -> str:
    """The default as it would be written in YAML; a list default comes from a factory, so the schema has none."""
    if "default" in prop:
        return f"`{json.dumps(prop['default'])}`"
    return "`[]`" if prop.get("type") == "array" else "required"


def _cell(text: str) -> str:
    """Escape what would end a Markdown table cell early."""
    return text.replace("|", "\\|").replace("\n", " ")


def _table(prefix: str, props: dict) -> list[str]:
    lines = ["| field | type | default | description |", "|---|---|---|---|"]
    for name, prop in props.items():
        cells = (f"`{prefix}{name}`", _type(prop), _default(prop), prop.get("description", ""))
        lines.append("| " + " | ".join(map(_cell, cells)) + " |")
    return lines


def render_reference(schema: dict) -> str:
    """Markdown for every section and field of the schema, in the model's own field order.

    Top-level scalar fields come first, then one table per section (a property
    that refers to a `$defs` model), each introduced by the section's
    docstring. Field names are written dotted, as `--set` takes them.
    """
    defs = schema.get("$defs", {})
    scalars, sections = {}, {}
    for name, prop in schema["properties"].items():
        ref = prop.get("$ref", "")
        if ref.startswith("#/$defs/"):
            sections[name] = defs[ref.removeprefix("#/$defs/")]
        else:
            scalars[name] = prop
    lines = [
        "# Job config reference",
        "",
        "<!-- Generated by `elastic config reference -o docs/config-reference.md` from the JobConfig schema; do not edit. -->",
        "",
        f"{schema.get('description', '').strip()} A job YAML has the top-level fields below and one mapping per section;",
        "every section rejects unknown keys. Any field can be overridden on the command line with",
        "`--set section.field=value` (the value is parsed as YAML). `elastic config schema` prints the JSON schema",
        "and `elastic config validate job.yaml` checks a file.",
        "",
        "## Top level",
        "",
        *_table("", scalars),
    ]
    for name, section in sections.items():
        lines += ["", f"## `{name}`", "", section.get("description", "").strip(), "", *_table(f"{name}.", section["properties"])]
    return "\n".join(lines) + "\n"
