"""The planner against worked figures, the schedule timelines, the resize hook and `elastic plan`."""

from __future__ import annotations

import json
import sys

import pytest

from elastic.cli import main
from elastic.config import load_config
from elastic.layout import Layout, LayoutError
from elastic.planning import choose_layout, model_inputs
from strategies.planner import (
    Hardware,
    ModelProfile,
    StepOptions,
    bubble_fraction,
    evaluate,
    group_is_intra_node,
    model_state_bytes,
    plan,
)
from strategies.schedule_timeline import idle_fraction, render, timeline

GB = 1e9


# --------------------------------------------------------------------------- memory
def test_plain_dp_7b_on_8_gpus_holds_112_gb_each():
    assert model_state_bytes(7e9, "dp", 8) == pytest.approx(112 * GB)
    entry = evaluate(Layout(dp_replicate=8), ModelProfile.from_params(7e9), Hardware(gpus=8))
    assert entry.state_bytes == pytest.approx(112 * GB)
    assert entry.model_state["dp"] == pytest.approx(112 * GB)
    assert not entry.fits  # more than an 80 GB GPU before any activation


def test_zero3_7_5b_on_64_gpus_is_about_1_9_gb():
    assert model_state_bytes(7.5e9, "zero3", 64) == pytest.approx(1.875e9)
    entry = evaluate(Layout(dp_shard=64), ModelProfile.from_params(7.5e9), Hardware(gpus=64))
    assert entry.model_state["zero3"] == pytest.approx(1.875e9)
    assert entry.state_bytes == pytest.approx(1.875e9)
    assert round(entry.state_bytes / GB, 1) == 1.9


@pytest.mark.parametrize("n", [1, 8, 64])
def test_zero1_and_zero2_formulas(n):
    psi = 7.5e9
    assert model_state_bytes(psi, "zero1", n) == pytest.approx(4 * psi + 12 * psi / n)
    assert model_state_bytes(psi, "zero2", n) == pytest.approx(2 * psi + 14 * psi / n)
    # every stage collapses to plain DP on one rank
    assert model_state_bytes(psi, "zero3", 1) == model_state_bytes(psi, "dp", 1) == 16 * psi


def test_hsdp_divides_state_by_the_shard_group_only():
    entry = evaluate(Layout(dp_replicate=8, dp_shard=8), ModelProfile.from_params(7.5e9), Hardware(gpus=64))
    assert entry.model_state["hsdp"] == pytest.approx(16 * 7.5e9 / 8)
    assert entry.model_state["zero3"] == pytest.approx(16 * 7.5e9 / 64)
    assert entry.state_bytes == entry.model_state["hsdp"]


def test_tp_and_pp_divide_parameters_before_data_parallel_sharding():
    model = ModelProfile.from_params(8e9)
    entry = evaluate(Layout(pp=2, tp=4), model, Hardware(gpus=8))
    assert entry.gpu_params == pytest.approx(8e9 / 8)
    assert entry.state_bytes == pytest.approx(16e9)


def test_model_profile_counts_the_built_in_transformer_exactly():
    from elastic.model import build_model

    cfg = load_config(data={"model": {"vocab_size": 96, "dim": 32, "n_layers": 3, "n_heads": 4, "ffn_dim": 80}})
    profile, _ = model_inputs(cfg, seq_len=16, micro_batch=2)
    assert profile.params == sum(p.numel() for p in build_model(cfg.model).parameters())
    assert (profile.n_layers, profile.dim, profile.ffn_dim, profile.vocab_size) == (3, 32, 80, 96)
    assert profile.embed_params == 96 * 32 and profile.head_params == 96 * 32 + 32


def test_activation_checkpointing_shrinks_activations():
    model = ModelProfile.from_params(7e9, seq_len=4096)
    entry = evaluate(Layout(dp_shard=8), model, Hardware(gpus=8))
    assert entry.activation_bytes_ckpt < entry.activation_bytes / 5
    with_ac = evaluate(Layout(dp_shard=8), model, Hardware(gpus=8), StepOptions(activation_checkpointing=True))
    assert with_ac.total_bytes < entry.total_bytes


# --------------------------------------------------------------------------- bubble and timelines
def test_bubble_worked_figures():
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert round(bubble_fraction(4, 8), 2) == 0.27
    assert bubble_fraction(8, 8) == pytest.approx(7 / 15)
    assert round(bubble_fraction(8, 8), 2) == 0.47
    assert bubble_fraction(4, 8, virtual=2) == pytest.approx(3 / 19)
    assert bubble_fraction(1, 8) == 0


def _labels(grid, chunks=1):
    return [[None if op is None else op.label(chunks) for op in row] for row in grid]


def test_gpipe_timeline_slots():
    rows = _labels(timeline("gpipe", 2, 2))
    assert rows[0] == ["F0", "F1", None, None, "B0", "B1"]
    assert rows[1] == [None, "F0", "F1", "B0", "B1", None]
    rows = _labels(timeline("gpipe", 4, 8))
    assert rows[3][3:11] == [f"F{i}" for i in range(8)]  # the last stage starts after 3 slots of fill
    assert rows[3][11] == "B0" and rows[0][14] == "B0"  # backward of micro-batch 0 walks back one stage a slot


def test_1f1b_timeline_slots():
    rows = _labels(timeline("1f1b", 4, 8))
    assert rows[0][:4] == ["F0", "F1", "F2", "F3"]  # warm-up fills the pipe
    assert rows[3][3:7] == ["F0", "B0", "F1", "B1"]  # the last stage alternates at once
    assert rows[0][7:10] == ["B0", "F4", "B1"]  # steady state: one forward, one backward
    assert rows[0][-1] == "B7"
    rows = _labels(timeline("1f1b", 2, 3))
    assert rows == [["F0", "F1", None, "B0", "F2", "B1", None, "B2"], [None, "F0", "B0", "F1", "B1", "F2", "B2", None]]


def test_1f1b_keeps_fewer_microbatches_in_flight_than_gpipe():
    def peak_in_flight(row):
        live = peak = 0
        for op in row:
            live += (op is not None and op.kind == "F") - (op is not None and op.kind == "B")
            peak = max(peak, live)
        return peak

    assert peak_in_flight(timeline("gpipe", 4, 8)[0]) == 8
    assert peak_in_flight(timeline("1f1b", 4, 8)[0]) == 4


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_timeline_idle_share_is_the_bubble(schedule, stages):
    grid = timeline(schedule, stages, 8)
    assert idle_fraction(grid) == pytest.approx(bubble_fraction(stages, 8))
    # every stage runs each forward and backward exactly once, forwards of a micro-batch before its backward
    for row in grid:
        ops = [op for op in row if op is not None]
        assert sorted((op.kind, op.microbatch) for op in ops) == sorted((k, i) for k in "FB" for i in range(8))


def test_interleaved_timeline_matches_the_interleaved_bubble():
    grid = timeline("interleaved_1f1b", 4, 8, virtual=2)
    assert idle_fraction(grid) == pytest.approx(bubble_fraction(4, 8, virtual=2))
    rows = _labels(grid, chunks=2)
    assert rows[0][:5] == ["F0.0", "F1.0", "F2.0", "F3.0", "F0.1"]
    with pytest.raises(ValueError, match="multiple of 4 stages"):
        timeline("interleaved_1f1b", 4, 6)


def test_render_aligns_stages():
    text = render(timeline("gpipe", 2, 2))
    assert text.splitlines() == ["stage 0: F0 F1 .  .  B0 B1", "stage 1: .  F0 F1 B0 B1 ."]


# --------------------------------------------------------------------------- ranking and links
def test_plan_lists_only_valid_layouts_and_ranks_fits_first():
    cfg = load_config(data={"model": {"vocab_size": 96, "dim": 48, "n_heads": 6, "ffn_dim": 96, "n_layers": 3}})
    model, check = model_inputs(cfg, seq_len=16, micro_batch=1)
    entries = plan(model, Hardware(gpus=12, gpus_per_node=4, gpu_mem_bytes=1e9), check=check)
    assert entries
    for e in entries:
        assert e.layout.world_size == 12
        assert 4 % e.layout.tp == 0 and 6 % e.layout.tp == 0  # node-local, splits the heads
        assert e.layout.pp <= 3
    fits = [e.fits for e in entries]
    assert fits == sorted(fits, reverse=True)
    tight = plan(ModelProfile.from_params(7e9), Hardware(gpus=8, gpu_mem_bytes=40e9))
    assert tight[0].fits and not tight[-1].fits
    assert all(not e.fits for e in tight if e.layout.dp_replicate == 8)


def test_link_classes_follow_rank_order():
    layout = Layout(pp=2, dp_shard=4, tp=8)  # 64 ranks on 8-GPU nodes
    assert group_is_intra_node(layout, "tp", 8)
    assert not group_is_intra_node(layout, "dp_shard", 8)
    assert not group_is_intra_node(layout, "pp", 8)
    assert group_is_intra_node(Layout(pp=2, dp_shard=4), "pp", 8)  # the whole world is one node
    entry = evaluate(layout, ModelProfile.from_params(7e9), Hardware(gpus=64))
    links = {t.kind: t.link for t in entry.traffic}
    assert links == {"tp": "intra", "fsdp": "inter", "pp": "inter"}


def test_fsdp_traffic_counts_gathers_per_microbatch():
    model = ModelProfile.from_params(1e9)
    hw = Hardware(gpus=8)
    one = evaluate(Layout(dp_shard=8), model, hw, StepOptions(global_batch=8))
    two = evaluate(Layout(dp_shard=8), model, hw, StepOptions(global_batch=16))
    # 2 bf16 gathers + 1 fp32 reduce-scatter of 1e9 params over 8 ranks, each 7/8 of the full size
    assert one.intra_bytes == pytest.approx((2 * 2 + 4) * 1e9 * 7 / 8)
    assert two.intra_bytes == pytest.approx((4 * 2 + 4) * 1e9 * 7 / 8)


# --------------------------------------------------------------------------- resize hook
def _job(**parallel):
    return load_config(data={"parallel": parallel, "scaling": {"num_workers": 16}, "model": {"n_layers": 4},
                             "training": {"global_batch": 48, "micro_batch": 2}})


def test_choose_layout_keeps_tp_and_pp_on_shrink():
    cfg = _job(tp=2, pp=2)
    layout, reason = choose_layout(16, cfg)
    assert layout == Layout(pp=2, dp_shard=4, tp=2)
    assert "kept tp=2 pp=2" in reason
    layout, reason = choose_layout(14, cfg, previous=layout)
    assert (layout.tp, layout.pp) == (2, 2) and layout.world_size == 12  # 14 is no multiple of tp*pp=4
    assert "2 of 14 workers idle" in reason and "dp 3 x 8 micro-batches of 2" in reason


def test_choose_layout_keeps_global_batch_divisible():
    cfg = _job(tp=2)
    for world in range(1, 17):
        layout, _ = choose_layout(world, cfg)
        assert layout.world_size <= world
        assert cfg.training.global_batch % layout.dp == 0
    assert choose_layout(10, cfg)[0] == Layout(dp_shard=4, tp=2)  # dp 5 would not divide 48


def test_choose_layout_keeps_or_folds_dp_replicate():
    cfg = _job(tp=2, dp_replicate=2)
    assert choose_layout(16, cfg)[0] == Layout(dp_replicate=2, dp_shard=4, tp=2)
    layout, reason = choose_layout(6, cfg)  # dp 3: replicas of 2 do not divide it
    assert layout == Layout(dp_shard=3, tp=2)
    assert "folded dp_replicate" in reason


def test_choose_layout_without_hardware_ignores_memory():
    cfg = load_config(data={"model": {"dim": 4096, "n_heads": 32, "ffn_dim": 11008, "vocab_size": 32000, "n_layers": 32}})
    assert choose_layout(4, cfg)[0] == Layout(dp_shard=4)


def test_choose_layout_replans_when_the_model_no_longer_fits():
    # ~168M parameters at 8192 tokens: 2.7 GB of state, ~3.8 GB of activations and logits on one GPU
    cfg = load_config(data={"model": {"dim": 1024, "n_heads": 16, "ffn_dim": 2816, "vocab_size": 32000, "n_layers": 8, "max_seq_len": 8192},
                            "data": {"seq_len": 8192}, "training": {"global_batch": 16, "micro_batch": 1}})
    assert choose_layout(2, cfg, hardware=Hardware(gpus=2, gpu_mem_bytes=8e9))[0] == Layout(dp_shard=2)
    hw = Hardware(gpus=2, gpus_per_node=8, gpu_mem_bytes=4e9)
    layout, reason = choose_layout(2, cfg, hardware=hw)  # sharding does not shrink activations; tp=2 halves them
    assert layout == Layout(tp=2)
    assert "replanned to tp=2 pp=1" in reason and "dp_shard=2 needs 5.2 GB per GPU, more than 4.0 GB" in reason
    with pytest.raises(LayoutError, match="needs 6.4 GB per GPU, more than 4.0 GB"):
        choose_layout(1, cfg, hardware=hw)


def test_choose_layout_replans_when_no_kept_world_splits_the_batch():
    cfg = load_config(data={"model": {"n_layers": 4}, "scaling": {"num_workers": 6, "min_workers": 6},
                            "training": {"global_batch": 16, "micro_batch": 1}})
    layout, reason = choose_layout(6, cfg)
    assert layout.world_size == 6 and 16 % layout.dp == 0
    assert "does not divide the global batch 16" in reason


def test_choose_layout_raises_with_a_reason_when_nothing_fits():
    cfg = load_config(data={"parallel": {"tp": 2}, "model": {"n_layers": 2},
                            "scaling": {"num_workers": 4, "min_workers": 3}, "training": {"global_batch": 32, "micro_batch": 4}})
    with pytest.raises(LayoutError, match=r"multiple of tp\*pp \(2\)"):
        choose_layout(3, cfg)


# --------------------------------------------------------------------------- CLI
def test_cli_prints_a_ranked_table(capsys):
    assert main(["plan", "--params", "7e9", "--gpus", "8", "--gpu-mem-gb", "80", "--top", "5"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "7B parameters" in lines[0]
    assert lines[1].split()[:2] == ["#", "pp"]
    assert [line.split()[0] for line in lines[2:]] == ["1", "2", "3", "4", "5"]


def test_cli_table_with_rich_on_a_terminal(capsys, monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setenv("COLUMNS", "220")
    assert main(["plan", "--params", "7B", "--gpus", "16", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "┃" in out and "pp x rep x shard x tp" in out and "7B parameters" in out
    assert "│ 1 │               2x1x1x8 │  yes │" in out


def test_cli_json_and_timeline(capsys):
    assert main(["plan", "--params", "7.5e9", "--gpus", "64", "--json", "--top", "200", "--timeline", "1f1b", "--stages", "2", "--microbatches", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    zero3 = [e for e in data["layouts"] if e["layout"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 64, "tp": 1}]
    assert zero3[0]["model_state"]["zero3"] == pytest.approx(1.875e9)
    assert data["timeline"]["rows"] == [["F0", "F1", None, "B0", None, "B1"], [None, "F0", "B0", "F1", "B1", None]]


def test_cli_timeline_only(capsys):
    assert main(["plan", "--timeline", "gpipe", "--stages", "2", "--microbatches", "2"]) == 0
    assert "stage 0: F0 F1 .  .  B0 B1" in capsys.readouterr().out


def test_cli_with_a_job_config(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("model: {dim: 64, n_heads: 4, n_layers: 4}\nscaling: {num_workers: 8}\n")
    assert main(["plan", "--config", str(job), "--gpus-per-node", "4"]) == 0
    assert "8 GPUs (4/node" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["plan"],
        ["plan", "--params", "7e9"],
        ["plan", "--config", "/no/such/job.yaml"],
        ["plan", "--params", "7e9", "--gpus", "8", "--gpu-mem-gb", "0"],
        ["plan", "--timeline", "interleaved_1f1b", "--stages", "4", "--microbatches", "6"],
    ],
)
def test_cli_bad_input_exits_2(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("elastic: error:") and err.count("\n") == 1


@pytest.mark.parametrize("argv", [["plan", "--params", "seven", "--gpus", "8"], ["plan", "--params", "7e9", "--gpus", "0"]])
def test_cli_bad_values_exit_2(argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2


def test_plan_states_the_utilisation_it_assumes_and_labels_what_the_runtime_cannot_run(capsys):
    argv = ["plan", "--params", "7e9", "--gpus", "16", "--gpus-per-node", "8", "--gpu-mem-gb", "80", "--top", "1", "--json"]
    assert main(argv) == 0
    at_40 = json.loads(capsys.readouterr().out)
    assert main(argv + ["--mfu", "0.2"]) == 0
    at_20 = json.loads(capsys.readouterr().out)
    assert at_40["hardware"]["mfu"] == 0.4 and at_20["hardware"]["mfu"] == 0.2
    assert at_20["layouts"][0]["compute_s"] == pytest.approx(2 * at_40["layouts"][0]["compute_s"])
    assert at_40["hardware"]["peak_flops"] == 312e12 and at_40["hardware"]["flops"] == pytest.approx(0.4 * 312e12)
    assert at_40["runnable"] == {"dp": False, "zero1": False, "zero2": True, "zero3": True, "hsdp": True}
    assert at_40["runnable"].keys() == at_40["layouts"][0]["model_state"].keys()
    assert main(argv[:-1]) == 0
    table = capsys.readouterr().out
    assert "compute at 40% of 312 TFLOP/s peak" in table and "DP*" in table and "Z1*" in table
    assert "for comparison only" in table
    assert main(argv[:-1] + ["--mfu", "1.5"]) == 2


def test_the_library_default_assumes_a_realistic_utilisation_not_the_peak():
    """`Hardware` without `mfu` is what `elastic plan` assumes without `--mfu`: 0.4 of an A100's peak, stated apart."""
    hw = Hardware(gpus=8)
    assert (hw.peak_flops, hw.mfu, hw.flops) == (312e12, 0.4, pytest.approx(0.4 * 312e12))
    model = ModelProfile.from_params(7e9, seq_len=2048)
    entry = evaluate(Layout(dp_shard=8), model, hw, StepOptions(global_batch=8))
    assert entry.compute_s == pytest.approx(6 * model.params * 8 * 2048 / (8 * 0.4 * 312e12))
    for mfu in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="mfu"):
            Hardware(gpus=8, mfu=mfu)


@pytest.mark.parametrize("count, text", [(1e12, "1T"), (1.5e12, "1.5T"), (999.9e9, "1T"), (7e9, "7B"), (350e6, "350M"), (1e15, "1e+15")])
def test_human_count_writes_counts_as_people_do(count, text):
    from elastic.commands.plan import human_count, parse_count

    assert human_count(count) == text
    assert parse_count(text) == pytest.approx(float(f"{count:.3g}"))


def test_a_guessed_shape_has_heads_that_tp_divides_and_tp_is_constrained_by_them():
    from elastic.commands.plan import _guessed_heads_check
    from strategies.planner import HEAD_DIM

    for params in (125e6, 7e9, 70e9, 405e9):
        model = ModelProfile.from_params(params)
        heads = model.dim // HEAD_DIM
        assert heads % 8 == 0 and abs(model.params - params) < 1e-6 * params, (params, heads)
    check = _guessed_heads_check(ModelProfile(n_layers=4, dim=20 * HEAD_DIM, ffn_dim=8192, layer_params=1e8))
    assert check(Layout(tp=8)) == "tp=8 does not divide the 20 attention heads of the guessed shape"
    assert check(Layout(tp=4)) is None


def test_plan_of_a_grouped_query_attention_model_counts_it_exactly_and_keeps_tp_within_its_kv_heads(capsys):
    pytest.importorskip("transformers")
    from elastic.config import load_config
    from elastic.recipe import build_model

    cfg = load_config("examples/hf-llama-1b.yaml")
    model, _ = build_model(cfg.model)
    exact = sum(p.numel() for p in model.parameters())
    assert main(["plan", "--config", "examples/hf-llama-1b.yaml", "--gpus", "64", "--gpus-per-node", "16", "--top", "100", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["params"] == exact  # 8 kv heads of 32: a model config without GQA would count 4x the k/v weights
    assert {e["layout"]["tp"] for e in out["layouts"]} <= {1, 2, 4, 8}  # tp=16 would split a kv head
