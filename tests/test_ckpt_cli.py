"""`elastic ckpt list|inspect|verify` through `elastic.cli.main`: output and exit codes."""

from __future__ import annotations

import json

import torch

import storage
from elastic.cli import main
from storage.format import data_file, step_dir


def _save(uri: str, step: int) -> None:
    state = {"model.w": torch.arange(12.0).view(3, 4), "optim.w.step": torch.tensor(float(step))}
    rows = storage.write_shards(uri, step, 0, state, generation=1)
    storage.commit(uri, step, rows, layout={"pp": 1, "dp_shard": 4}, train_state={"step": step, "data_cursor": 8 * step}, generation=1)


def test_list_inspect_verify(tmp_path, capsys):
    uri = str(tmp_path)
    assert main(["ckpt", "list", uri]) == 0
    assert "no committed checkpoints" in capsys.readouterr().out
    _save(uri, 10)
    _save(uri, 20)

    assert main(["ckpt", "list", uri]) == 0
    out = capsys.readouterr().out
    assert out.index("        20") < out.index("        10") and "dp_shard=4" in out

    assert main(["ckpt", "inspect", uri]) == 0
    out = capsys.readouterr().out
    assert "step 20" in out and "model.w  float32[3, 4]" in out and '"data_cursor": 160' in out and data_file(0, 1) in out
    assert main(["ckpt", "inspect", uri, "--step", "10", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["train_state"]["step"] == 10

    assert main(["ckpt", "verify", uri, "--all"]) == 0
    assert capsys.readouterr().out.count(": OK") == 2


def test_verify_fails_with_the_file_named(tmp_path, capsys):
    uri = str(tmp_path)
    _save(uri, 10)
    _save(uri, 20)
    path = tmp_path / step_dir(20) / data_file(0, 1)
    raw = bytearray(path.read_bytes())
    raw[5] ^= 1
    path.write_bytes(bytes(raw))
    assert main(["ckpt", "verify", uri]) == 1
    out = capsys.readouterr().out
    assert "step 20: FAILED" in out and "rank_00000.bin" in out and "checksum" in out
    assert main(["ckpt", "verify", uri, "--step", "10"]) == 0
    assert "step 10: OK" in capsys.readouterr().out
    assert main(["ckpt", "verify", uri, "--all", "--json"]) == 1
    assert [r["ok"] for r in json.loads(capsys.readouterr().out)] == [False, True]


def test_bad_usage(tmp_path, capsys):
    assert main(["ckpt", "inspect", str(tmp_path)]) == 2
    assert "no committed checkpoints" in capsys.readouterr().err
    _save(str(tmp_path), 1)
    assert main(["ckpt", "verify", str(tmp_path), "--all", "--step", "1"]) == 2
    assert main(["ckpt", "inspect", str(tmp_path), "--step", "7"]) == 1
    assert "step 7 is not a committed checkpoint" in capsys.readouterr().err


def test_a_path_that_does_not_exist_is_an_error_an_empty_one_is_not(tmp_path, capsys):
    missing = str(tmp_path / "nonexistent")
    for argv in (["list", missing], ["inspect", missing], ["inspect", missing, "--step", "3"], ["verify", missing], ["verify", missing, "--all"]):
        assert main(["ckpt", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err == f"elastic: error: {missing}: no such directory\n", (argv, err)
    assert main(["ckpt", "list", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"no committed checkpoints under {tmp_path}\n"
