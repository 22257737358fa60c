"""The model plug-in in one process: builders by import path, their checks, seeded and pretrained initial weights, schedules."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from elastic.config import ConfigError, load_config
from elastic.recipe import build_model
from elastic.schedule import lr_at

ROOT = Path(__file__).resolve().parents[1]


def test_strategies_and_storage_import_without_elastic():
    """The libraries a user's model meets never import the job manager: every module of them loads with `elastic` unimportable."""
    code = textwrap.dedent(
        """
        import importlib, pkgutil, sys

        class NoElastic:
            def find_spec(self, name, path=None, target=None):
                if name == "elastic" or name.startswith("elastic."):
                    raise ImportError(f"{name} is off limits")

        sys.meta_path.insert(0, NoElastic())
        import storage, strategies
        for pkg in (strategies, storage):
            for info in pkgutil.iter_modules(pkg.__path__):
                importlib.import_module(f"{pkg.__name__}.{info.name}")
        assert not [m for m in sys.modules if m == "elastic" or m.startswith("elastic.")]
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# --------------------------------------------------------------------------- builders
def _cfg(model: dict, **sections):
    return load_config(data={"model": model, "data": {"seq_len": 8}, **sections})


@pytest.mark.parametrize(
    "model, message",
    [
        ({"builder": "no_such_module:build"}, "cannot import no_such_module: ModuleNotFoundError"),
        ({"builder": "elastic.model:no_such_function"}, "elastic.model has no function no_such_function"),
        ({"builder": "not a path"}, "model.builder"),
        ({"builder": "elastic.model:transformer", "args": {"dim": 32}}, "model.args: the built-in transformer takes"),
        ({"builder": "json:loads", "dim": 32}, "model.dim shapes the built-in transformer only"),
        ({"builder": "json:dumps", "args": {"obj": 1}}, "must return (nn.Module, ModelSpec), got str"),
        ({"builder": "test_model_plugin:cpu_builder"}, "built weight on cpu: build on the meta device"),
        ({"builder": "test_model_plugin:unknown_arg_builder", "args": {"width": 3}}, "unexpected keyword argument 'width'"),
    ],
)
def test_bad_builder_is_a_one_line_config_error(model, message):
    with pytest.raises(ConfigError) as err:
        _cfg(model)
    assert message in str(err.value) and "\n" not in str(err.value)


def cpu_builder():
    from strategies import ModelSpec

    with torch.device("cpu"):
        return torch.nn.Linear(2, 2), ModelSpec(blocks="")


def unknown_arg_builder(depth: int = 1):
    raise AssertionError("not reached")


def test_builtin_checks_come_from_its_spec():
    with pytest.raises(ConfigError, match=r"model.ffn_dim \(100\) must be divisible by parallel.tp \(8\)"):
        _cfg({"ffn_dim": 100, "n_heads": 8, "dim": 64}, parallel={"tp": 8})
    with pytest.raises(ConfigError, match=r"data.seq_len \(8\) must be divisible by parallel.tp \(16\) with sequence parallel"):
        _cfg({"ffn_dim": 128, "n_heads": 16, "dim": 64}, parallel={"tp": 16})
    with pytest.raises(ConfigError, match=r"parallel.pp \(2\) x pp_virtual_stages \(2\) pipeline stages exceed the model's 3 blocks"):
        _cfg({"n_layers": 3}, parallel={"pp": 2, "pp_schedule": "interleaved_1f1b"})
    model, spec = build_model(_cfg({}).model)
    assert all(p.is_meta for p in model.parameters()) and spec.vocab_size == 64


# --------------------------------------------------------------------------- initial weights
def test_seeded_weights_are_drawn_per_module_whatever_else_is_drawn():
    from elastic.model import model_spec
    from strategies.init import initial_tensors

    cfg = _cfg({"n_layers": 3}).model
    model, spec = build_model(cfg)
    full = dict(initial_tensors(model, spec, seed=5))
    assert set(full) == {n for n, _ in model.named_parameters()}
    alone = dict(initial_tensors(model, model_spec(cfg), seed=5, wanted={"layers.2.feed_forward.w2.weight"}))
    assert list(alone) == ["layers.2.feed_forward.w2.weight"]  # a stage draws only its own modules ...
    assert torch.equal(alone["layers.2.feed_forward.w2.weight"], full["layers.2.feed_forward.w2.weight"])  # ... and the same values
    assert torch.equal(full["layers.0.attention_norm.weight"], torch.ones(64))
    other = dict(initial_tensors(model, spec, seed=6))
    assert not torch.equal(other["layers.0.attention.wq.weight"], full["layers.0.attention.wq.weight"])


def test_default_initialiser_is_the_modules_own_reset():
    from strategies import ModelSpec
    from strategies.init import initial_tensors

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    full = dict(initial_tensors(model, ModelSpec(blocks=""), seed=0))
    assert full["0.weight"].abs().max() <= 0.5 and full["0.weight"].std() > 0  # kaiming-uniform bound 1/sqrt(4)
    assert torch.equal(full["1.weight"], torch.ones(3)) and torch.equal(full["1.bias"], torch.zeros(3))


# --------------------------------------------------------------------------- safetensors in
def _write_safetensors(directory: Path, tensors: dict[str, torch.Tensor], files: int) -> None:
    """Tensors spread over `files` files written by the safetensors package, with the index when there are several."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for i in range(files):
        rel = f"part-{i}.safetensors"
        mine = {n: tensors[n].contiguous() for n in names[i::files]}
        safetensors_torch.save_file(mine, directory / rel, metadata={"format": "pt"})
        weight_map.update({n: rel for n in mine})
    if files > 1:
        (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


TENSORS = {
    "w2d": torch.arange(12 * 10, dtype=torch.float32).reshape(12, 10),
    "bf3d": torch.randn(4, 5, 6, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16),
    "bias": torch.arange(7, dtype=torch.float16),
    "scalar": torch.tensor(3.5, dtype=torch.float64),
}


@pytest.mark.parametrize("files", [1, 2])
def test_safetensors_boxes_read_only_their_bytes(tmp_path, files):
    from storage import SafetensorsDir
    from storage.boxes import Box

    _write_safetensors(tmp_path / "w", TENSORS, files)
    src = SafetensorsDir(str(tmp_path / "w"))
    assert set(src.entries) == set(TENSORS)
    read = []
    real = src.store.read_into
    src.store.read_into = lambda rel, requests: read.extend(sum(memoryview(b).nbytes for b in bufs) for _, bufs in requests) or real(rel, requests)
    boxes = [
        ("w2d", (3, 0), (4, 10)),   # rows: one run of exactly their bytes
        ("w2d", (0, 6), (12, 4)),   # columns: a run per row
        ("bf3d", (1, 2, 0), (2, 3, 6)),
        ("bf3d", (0, 0, 1), (4, 5, 2)),
        ("bias", (2,), (3,)),
        ("scalar", (), ()),
    ]
    for key, offsets, lengths in boxes:
        read.clear()
        got = src.read(key, Box(offsets, lengths, (0,) * len(offsets)))
        want = TENSORS[key]
        for d, (o, n) in enumerate(zip(offsets, lengths)):
            want = want.narrow(d, o, n)
        assert got.dtype == want.dtype and torch.equal(got, want), key
        assert sum(read) == want.numel() * want.element_size(), (key, read)


def test_pretrained_weights_from_object_storage_fill_a_model(tmp_path):
    """`init_from` over fsspec (memory://): names mapped by the spec's hook, dtypes converted, clear errors."""
    import fsspec

    from storage import CheckpointError, load_pretrained

    model = torch.nn.Sequential(torch.nn.Linear(10, 12), torch.nn.Linear(12, 10, bias=False))
    weights = {"first.weight": torch.randn(12, 10), "first.bias": torch.randn(12), "second.weight": torch.randn(10, 12).to(torch.bfloat16)}
    _write_safetensors(tmp_path / "hf", weights, files=2)
    fs = fsspec.filesystem("memory")
    for f in (tmp_path / "hf").iterdir():
        fs.pipe_file(f"/pretrained/{f.name}", f.read_bytes())
    names = {"0": "first", "1": "second"}
    load_pretrained("memory://pretrained", [model], checkpoint_key=lambda fqn, keys: names[fqn[0]] + fqn[1:])
    assert torch.equal(model[0].weight, weights["first.weight"]) and torch.equal(model[0].bias, weights["first.bias"])
    assert torch.equal(model[1].weight, weights["second.weight"].float())
    with pytest.raises(CheckpointError, match=r"no tensor for 3 parameters \(0.weight, 0.bias, 1.weight\).*ModelSpec.checkpoint_key"):
        load_pretrained("memory://pretrained", [model])
    with pytest.raises(CheckpointError, match=r"'first.weight' is \[12, 10\] there, \[3, 10\] in the model"):
        load_pretrained("memory://pretrained", [torch.nn.Linear(10, 3)], checkpoint_key=lambda fqn, keys: "first." + fqn)
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        load_pretrained(str(tmp_path), [model])


# --------------------------------------------------------------------------- safetensors out
def test_export_streams_a_checkpoint_into_sharded_safetensors(tmp_path, capsys):
    """Any checkpoint's model weights (not its optimizer state) become safetensors shards and an index, in the chosen dtype."""
    import storage
    from elastic.cli import main

    safetensors = pytest.importorskip("safetensors")
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))
    opt = torch.optim.AdamW(model.parameters())
    uri = str(tmp_path / "ckpt")
    rows = storage.write_shards(uri, 7, 0, storage.snapshot(storage.state_tensors([model], opt)), generation=1)
    storage.commit(uri, 7, rows, generation=1, layout={}, train_state={"step": 7})
    out = tmp_path / "out"
    assert main(["ckpt", "export", uri, str(out), "--dtype", "bfloat16", "--max-shard-gb", "0.000001"]) == 0
    assert "exported step 7" in capsys.readouterr().out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert len(set(index["weight_map"].values())) == 4  # 1 kB shards: one tensor each
    assert index["metadata"]["total_size"] == sum(p.numel() * 2 for p in model.parameters())
    for name, param in model.named_parameters():
        with safetensors.safe_open(out / index["weight_map"][name], framework="pt") as f:
            assert torch.equal(f.get_tensor(name), param.detach().to(torch.bfloat16)), name
    assert main(["ckpt", "export", str(tmp_path / "nothing"), str(out)]) == 2


# --------------------------------------------------------------------------- optimizer and schedule
def _lrs(**training) -> list[float]:
    cfg = load_config(data={"training": {"steps": 10, "warmup_steps": 2, "lr": 1.0, **training}})
    return [lr_at(step, cfg) for step in range(10)]


def test_schedules_after_the_warm_up():
    cosine = _lrs()
    assert cosine[:2] == [0.5, 1.0] and cosine[2] == 1.0 and cosine[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 7 / 8)))
    assert _lrs(schedule="constant")[2:] == [1.0] * 8
    linear = _lrs(schedule="linear", min_lr_ratio=0.0)
    assert linear[2:] == pytest.approx([1 - k / 8 for k in range(8)])
    wsd = _lrs(schedule="wsd", decay_fraction=0.3, min_lr_ratio=0.0)
    assert wsd[:7] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0] and wsd[7:] == pytest.approx([1.0, 2 / 3, 1 / 3])
    assert all(a >= b for a, b in zip(cosine[1:], cosine[2:]))


def test_adamw_takes_its_settings_from_the_config():
    from elastic.recipe import build_optimizer

    cfg = load_config(data={"training": {"betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1, "optimizer_impl": "for_loop"}})
    opt = build_optimizer(torch.nn.Linear(2, 2).parameters(), cfg.training)
    group = opt.param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"], group["foreach"]) == ((0.8, 0.95), 1e-6, 0.1, False)
    with pytest.raises(ConfigError, match=r"training.betas \[0.9, 1.0\] must each be in \[0, 1\)"):
        load_config(data={"training": {"betas": [0.9, 1.0]}})


def test_job_checks_init_from_before_any_worker_starts(tmp_path):
    """`model.init_from` is matched against the model (names and shapes, from the file headers) when the job is prepared."""
    from elastic.job import prepare
    from elastic.model import model_spec
    from strategies import initial_state

    cfg = load_config(data={"run_root": str(tmp_path / "runs"), "model": {"init_from": str(tmp_path / "weights")}, "data": {"seq_len": 8}})
    model, spec = build_model(cfg.model)
    full = initial_state(model, model_spec(cfg.model), seed=1)
    _write_safetensors(tmp_path / "weights", {k: v for k, v in full.items() if k != "output.weight"}, files=1)
    with pytest.raises(ConfigError, match=r"model.init_from: .*no tensor for 1 parameters \(output.weight\)"):
        prepare(cfg)
    _write_safetensors(tmp_path / "weights", full, files=1)
    prepare(cfg)


def test_sequence_parallel_needs_a_divisible_sequence_for_any_model():
    """Not only the built-in transformer's: a user model with a sequence-parallel plan is refused before its ranks hang."""
    from elastic.config import ParallelConfig
    from strategies import ModelSpec
    from strategies.compose import model_problems

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.ModuleList([torch.nn.Linear(4, 4)]))
    spec = ModelSpec(blocks="1", first=("0",), tp_plan=lambda sequence_parallel: {"1.0": __import__("torch").distributed.tensor.parallel.ColwiseParallel()})
    assert model_problems(model, spec, ParallelConfig(tp=2), seq_len=7) == [
        "data.seq_len (7) must be divisible by parallel.tp (2) with sequence parallel"]
    assert model_problems(model, spec, ParallelConfig(tp=2, sequence_parallel=False), seq_len=7) == []
    assert model_problems(model, spec, ParallelConfig(tp=2), seq_len=8) == []
