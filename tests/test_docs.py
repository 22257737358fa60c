"""The docs show what the code does: their commands run here as shown, their figures are the committed results.

Nothing here copies a doc's text: every check reads the markdown itself, so
keeping the docs true is all a change has to do.

Commands (README.md and deploy/README.md):
- Every `elastic ...` command line, in a code block or in inline code, parses
  with the real CLI parser (`[...]` and `...` are read as optional parts; a
  bare `elastic plan` is a name, and only has to be a subcommand).
- An `elastic` command in a code block runs here, unless it needs what this
  machine does not have: `run` starts a job (it runs only when the doc shows
  it failing with `elastic: error:`, which happens before any worker starts),
  `report` needs a run directory, a `s3://`/`gs://` URI needs a bucket. The
  skipped ones are listed with their reason (`pytest -rs`). Commands that
  are not `elastic` (ray, kubectl, make, docker) are not run.
- A `$ ` line in a block is a command and the lines up to the next `$ ` its
  output, stdout then stderr. They must match line for line after these
  normalisations: runs of spaces are one space (column widths follow the
  values), `YYYY-MM-DD HH:MM:SS` times and `crc32=...` values are not
  compared (the test's checkpoint is written now, from random data), and the
  test's temp directory stands for the doc's path. Exit code 2 is expected
  when the output shows `elastic: error:`, 1 when it shows `: FAILED`, else 0.
- `elastic ckpt` commands run on a checkpoint the test writes with
  `storage.write_shards` + `storage.commit` from the doc's own samples: the
  steps of its `ckpt list` output, the layout, train state and tensors (key,
  dtype, shape) of its `ckpt inspect` output. A `# after flipping one bit of
  step N` comment on a command flips the first bit of that step's first data
  file before it runs. The train state shown must have the keys a job's
  checkpoint has (the controller writes one in `test_controller_steps`).

Benchmarks (bench/README.md, Makefile):
- Every table a `bench/NAME.py` prints (its functions named `*table`) for the
  committed `bench/results/NAME.json` is in bench/README.md as printed.
- `make bench` runs every `bench-*` target, bench/README.md names each one,
  and a Makefile comment's `~N min` is within a factor of 2 of the last run's
  wall time in its JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import storage
from elastic.cli import build_parser, main as cli_main
from storage.format import data_file, step_dir
from storage.state import DTYPES

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "deploy" / "README.md"]
ELASTIC = ("elastic", ".venv/bin/elastic")
PROMPT = "$ "
_FENCE = re.compile(r"^```(\S*)\s*$")
_INLINE = re.compile(r"`([^`]+)`")
_TIME = re.compile(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}")
_CRC = re.compile(r"crc32=[0-9a-f]{8}")
_FLIP = re.compile(r"flipping one bit of step (\d+)")
_TENSOR = re.compile(r"(\S+)\s+(\w+)\[([\d, ]*)\]")


# --------------------------------------------------------------------------- reading the markdown
@dataclass
class DocCommand:
    """One `elastic` command of a doc: where it is, its words, the output the doc shows (None: none shown)."""

    doc: Path
    line: int
    argv: list[str]
    comment: str = ""
    expected: list[str] | None = None
    in_block: bool = True

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.argv)}"


def _blocks(doc: Path) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of every fenced code block."""
    out, lines, start = [], None, 0
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        if _FENCE.match(line.strip()):
            if lines is None:
                lines, start = [], number + 1
            else:
                out.append((start, lines))
                lines = None
        elif lines is not None:
            lines.append(line)
    return out


def _logical_lines(start: int, lines: list[str]) -> list[tuple[int, str]]:
    """Shell lines with `\\` continuations joined, numbered by their first line."""
    out, pending, first = [], "", 0
    for number, line in enumerate(lines, start):
        if not pending:
            first = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((first, pending + line))
        pending = ""
    return out


def _elastic_argv(shell: str) -> tuple[list[str], str] | None:
    """The `elastic ...` words of a shell line (also after `ray job submit ... --`) and its comment, or None."""
    text, _, comment = shell.partition(" #")
    try:
        words = shlex.split(text, comments=True)
    except ValueError:
        return None
    for i, word in enumerate(words):
        if word in ELASTIC and (i == 0 or words[i - 1] == "--"):
            return ["elastic", *words[i + 1 :]], comment.strip()
    return None


def doc_commands(doc: Path) -> list[DocCommand]:
    """Every `elastic` command of the doc's code blocks, with the output the doc shows after a `$ ` prompt."""
    out = []
    for start, lines in _blocks(doc):
        prompted = any(line.startswith(PROMPT) for line in lines)
        current = None
        for number, line in _logical_lines(start, lines):
            if prompted and not line.startswith(PROMPT):
                if current is not None:
                    current.expected.append(line)
                continue
            found = _elastic_argv(line[len(PROMPT):] if prompted else line)
            current = None
            if found:
                current = DocCommand(doc, number, found[0], found[1], [] if prompted else None)
                out.append(current)
    return out


def inline_commands(doc: Path) -> list[DocCommand]:
    """`elastic ...` in inline code (spans may wrap lines): optional parts `[...]` and `...` read as given."""
    fenced = {n for start, lines in _blocks(doc) for n in range(start - 1, start + len(lines) + 1)}
    without_blocks = "\n".join("" if n in fenced else line for n, line in enumerate(doc.read_text().splitlines(), 1))
    out = []
    for match in _INLINE.finditer(without_blocks):
        span = " ".join(match.group(1).split()).replace("[", "").replace("]", "").replace("...", "")
        found = _elastic_argv(span)
        if found and len(found[0]) > 1:  # a bare `elastic` is the project's name
            line = without_blocks.count("\n", 0, match.start()) + 1
            out.append(DocCommand(doc, line, found[0], found[1], None, in_block=False))
    return out


ALL_BLOCK_COMMANDS = [c for doc in DOCS for c in doc_commands(doc)]
ALL_COMMANDS = ALL_BLOCK_COMMANDS + [c for doc in DOCS for c in inline_commands(doc)]


# --------------------------------------------------------------------------- every documented command line parses
def _subcommand_names() -> set[tuple[str, ...]]:
    """Every subcommand path of the CLI: ("run",), ("ckpt", "list"), ..."""
    names: set[tuple[str, ...]] = set()

    def walk(parser, prefix):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    names.add((*prefix, name))
                    walk(sub, (*prefix, name))

    walk(build_parser(), ())
    return names


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=str)
def test_documented_command_line_parses(command: DocCommand) -> None:
    args = command.argv[1:]
    if not command.in_block and tuple(args) in _subcommand_names():
        return  # a name in the text (`elastic plan`), not a command line
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            build_parser().parse_args(args)
        except SystemExit as exc:
            assert exc.code == 0, f"{command}: the CLI refuses it: {err.getvalue().strip()}"


# --------------------------------------------------------------------------- documented examples run as shown
def _skip_reason(command: DocCommand) -> str | None:
    args = command.argv[1:]
    if any(a.startswith(("s3://", "gs://", "gcs://", "az://")) for a in args):
        return "needs object storage"
    if args[:1] == ["run"] and not any(line.startswith("elastic: error:") for line in command.expected or []):
        return "starts a training job"
    if args[:1] == ["report"]:
        return "needs a run directory"
    if args[:2] == ["data", "prepare"]:
        return "needs the user's text files and tokenizer"
    if "-o" in args or "--output" in args:
        return "writes a file of the repository"
    return None


def _normalise(lines: list[str], path: str | None, doc_path: str | None) -> list[str]:
    out = []
    for line in lines:
        if path and doc_path:
            line = line.replace(path, doc_path)
        line = _CRC.sub("crc32=<crc>", _TIME.sub("<time>", line))
        out.append(" ".join(line.split()))
    while out and not out[-1]:
        out.pop()
    return out


def _ckpt_samples(doc: Path, uri: str) -> dict:
    """Steps, layout, train state and tensors of the checkpoint at `uri`, from the doc's own list and inspect output."""
    steps, sample = set(), {}
    for c in doc_commands(doc):
        if c.argv[1:2] != ["ckpt"] or uri not in c.argv or not c.expected:
            continue
        if c.argv[2] == "list":
            steps |= {int(line.split()[0]) for line in c.expected if line.split() and line.split()[0].isdigit()}
        if c.argv[2] == "inspect":
            tensors, in_tensors = {}, False
            for line in c.expected:
                words = line.split()
                if line.startswith("checkpoint "):
                    sample["step"] = int(words[-1])
                elif words[:1] == ["layout"]:
                    sample["layout"] = {k: int(v) for k, v in (w.split("=") for w in words[1:])}
                elif words[:1] == ["train_state"]:
                    sample["train_state"] = json.loads(line.split("train_state", 1)[1])
                elif words[:1] == ["tensors"]:
                    in_tensors = True
                elif in_tensors and _TENSOR.fullmatch(line.strip()):
                    key, dtype, shape = _TENSOR.fullmatch(line.strip()).groups()
                    tensors[key] = (dtype, [int(n) for n in shape.split(",") if n.strip()])
            sample["tensors"] = tensors
    if not {"layout", "train_state", "tensors"} <= sample.keys():
        return {}
    sample["steps"] = sorted(steps | {sample["step"]})
    return sample


def _write_checkpoint(uri: Path, sample: dict) -> None:
    """The doc's checkpoint, for real: one rank writes every tensor (seeded random data), the coordinator commits."""
    gen = torch.Generator().manual_seed(0)
    for step in sample["steps"]:
        tensors = {key: torch.rand(shape, generator=gen).to(DTYPES[dtype]) for key, (dtype, shape) in sample["tensors"].items()}
        rows = storage.write_shards(str(uri), step, 0, tensors, generation=1)
        train_state = {**sample["train_state"], "step": step}
        storage.commit(str(uri), step, rows, generation=1, layout=sample["layout"], train_state=train_state)


def _run(argv: list[str]) -> tuple[int, list[str]]:
    """Exit code and output lines (stdout, then stderr) of `elastic ARGV...`; `run` in its own process."""
    if argv[1] == "run":
        # Its own session: should the documented error not happen, the job it starts goes down with it.
        proc = subprocess.Popen([sys.executable, "-m", "elastic", *argv[1:]], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise AssertionError(f"`{shlex.join(argv)}` was still running after 60 s: the doc shows it failing at once") from None
        return proc.returncode, (stdout + stderr).splitlines()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli_main(argv[1:])
        except SystemExit as exc:
            code = exc.code
    return code, (out.getvalue() + err.getvalue()).splitlines()


@pytest.mark.parametrize("command", ALL_BLOCK_COMMANDS, ids=str)
def test_documented_example_runs_as_shown(command: DocCommand, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reason = _skip_reason(command)
    if reason:
        pytest.skip(reason)
    argv, doc_path, path = list(command.argv), None, None
    if argv[1] == "ckpt":
        doc_path = argv[3]
        sample = _ckpt_samples(command.doc, doc_path)
        if not sample:
            pytest.skip(f"the doc shows no `ckpt list` and `ckpt inspect` of {doc_path} to build it from")
        path = str(tmp_path / "ckpt")
        _write_checkpoint(Path(path), sample)
        argv[3] = path
        flip = _FLIP.search(command.comment)
        if flip:
            target = Path(path) / step_dir(int(flip.group(1))) / data_file(0, 1)
            data = bytearray(target.read_bytes())
            data[0] ^= 1
            target.write_bytes(bytes(data))
    monkeypatch.chdir(ROOT)
    code, output = _run(argv)
    expected = command.expected
    if expected is None:
        assert code == 0, f"{command} exited {code}:\n" + "\n".join(output[-20:])
        return
    want = 2 if any(line.startswith("elastic: error:") for line in expected) else 1 if any(": FAILED" in line for line in expected) else 0
    assert _normalise(output, path, doc_path) == _normalise(expected, path, doc_path), f"{command}: the doc shows other output"
    assert code == want, f"{command} exited {code}, the doc's output means {want}"


def test_documented_train_state_is_what_a_job_writes(tmp_path: Path) -> None:
    """The train state a doc shows has the keys of the checkpoint a controller commits (not a made-up subset)."""
    from test_controller_steps import _run as run_controller, _setup

    ctrl, _, _ = _setup(tmp_path)
    run_controller(ctrl)
    uri = ctrl.cfg.checkpoint.uri
    real = storage.read_manifest(uri, storage.list_checkpoints(uri)[0]["step"])["train_state"]
    shown = {c.where: _ckpt_samples(c.doc, c.argv[3]) for c in ALL_BLOCK_COMMANDS if c.argv[1:3] == ["ckpt", "inspect"]}
    assert shown, "no doc shows `elastic ckpt inspect`: drop this test"
    for where, sample in shown.items():
        assert sample, f"{where}: no train_state line to check"
        assert sorted(sample["train_state"]) == sorted(real), (
            f"{where} shows train_state keys {sorted(sample['train_state'])}; a job's checkpoint has {sorted(real)}")
        assert sample["train_state"]["step"] == sample["step"]


# --------------------------------------------------------------------------- benchmarks
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"


def _bench_module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("result", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_bench_readme_tables_are_the_committed_results(result: Path) -> None:
    """What bench/README.md shows is what the benchmark's script prints for the committed JSON."""
    script = BENCH / f"{result.stem}.py"
    assert script.is_file(), f"{result.name} has no script {script.name}"
    module = _bench_module(result.stem)
    tables = [getattr(module, n) for n in dir(module) if n.endswith("table") and callable(getattr(module, n))]
    if not tables:
        pytest.skip(f"{script.name} prints its table inside main(): give it a `table(result)` function to check it")
    readme = (BENCH / "README.md").read_text()
    data = json.loads(result.read_text())
    for table in tables:
        assert table(data) in readme, f"bench/README.md does not show {script.name}'s {table.__name__} for {result.name}"


def _make_targets() -> dict[str, tuple[list[str], str, str]]:
    """{target: (prerequisites, the comment above it, its recipe)} of the Makefile."""
    targets, comment, lines = {}, "", (ROOT / "Makefile").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("#"):
            comment = line
            continue
        rule = re.match(r"^([\w-]+):(?!=)\s*(.*)$", line)
        if rule:
            recipe = lines[i + 1].strip() if i + 1 < len(lines) and lines[i + 1].startswith("\t") else ""
            targets[rule.group(1)] = (rule.group(2).split(), comment, recipe)
        comment = "" if not line.startswith("\t") else comment
    return targets


def test_make_bench_runs_every_benchmark_and_bench_readme_names_each() -> None:
    targets = _make_targets()
    benches = sorted(t for t in targets if t.startswith("bench-"))
    assert set(targets["bench"][0]) == set(benches), f"`make bench` runs {targets['bench'][0]}, the benchmarks are {benches}"
    readme = (BENCH / "README.md").read_text()
    for target in benches:
        assert f"make {target}" in readme, f"bench/README.md does not say what `make {target}` measures"


def test_makefile_bench_durations_match_the_last_runs() -> None:
    """A `~N min` in a benchmark's comment is within 2x of the wall time its last run recorded."""
    checked = 0
    for target, (_, comment, recipe) in _make_targets().items():
        minutes = re.search(r"~(\d+(?:\.\d+)?) min", comment)
        script = re.search(r"bench/(\w+)\.py", recipe)
        if not (target.startswith("bench-") and minutes and script and (RESULTS / f"{script.group(1)}.json").is_file()):
            continue
        data = json.loads((RESULTS / f"{script.group(1)}.json").read_text())
        wall = data.get("bench_wall_s") or data.get("wall_s")
        assert wall, f"{script.group(1)}.json records no wall time"
        said = float(minutes.group(1)) * 60
        assert said / 2 <= wall <= said * 2, f"Makefile says `make {target}` takes ~{minutes.group(1)} min; its last run took {wall / 60:.1f} min"
        checked += 1
    assert checked, "no benchmark duration found to check"
