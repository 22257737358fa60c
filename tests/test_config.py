import pytest

from elastic.cli import main
from elastic.config import ConfigError, load_config


def test_demo_config_loads():
    cfg = load_config("deploy/examples/demo.yaml")
    assert cfg.scaling.num_workers == 4 and cfg.scaling.workers_per_node == 2


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["training.global_batch=30", "training.micro_batch=4"], "training.global_batch"),
        (["model.n_heads=3"], "model.dim"),
        (["scaling.min_workers=8"], "scaling.min_workers"),
        (["training.lr=-1"], "training.lr"),
        (["model.bogus=1"], "model.bogus"),
        (["parallel.tp=3"], "parallel.tp"),
        (["parallel.dp_shard=0"], "parallel.dp_shard"),
        (["checkpoint.uri=../../etc"], "checkpoint.uri"),
        (["name=a/b"], "name"),
        (["name=.."], "name"),
        (["parallel.tp=4", "scaling.num_workers=8", "data.seq_len=16"], "scaling.workers_per_node"),
        (["data.seq_len=64"], "data.seq_len"),
    ],
)
def test_bad_config_names_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        load_config("deploy/examples/demo.yaml", overrides)
    assert field in str(err.value)
    assert "\n" not in str(err.value)


def test_invalid_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {dim: 64\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)


def test_cli_bad_config_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("training: {steps: -5}\n")
    assert main(["run", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "training.steps" in err[0]


def test_cli_bad_inject_exit_2(capsys):
    assert main(["run", "deploy/examples/demo.yaml", "--inject", "explode:rank=1"]) == 2
    assert "unknown kind" in capsys.readouterr().err


def test_cli_unwritable_checkpoint_exit_2(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    (tmp_path / "f").write_text("x")
    code = main(["run", "deploy/examples/demo.yaml", "--set", f"checkpoint.uri={tmp_path / 'f' / 'sub'}", "--set", f"run_root={tmp_path}"])
    assert code == 2
    assert "not writable" in capsys.readouterr().err
