"""The Hugging Face Llama example (`examples/hf_llama.py`) on real gloo ranks against plain `transformers`.

- dp_shard=2, tp=2 with sequence parallel, pp=2, and pp=2 x tp=2 with sequence
  parallel (a later stage receives a sequence shard) train like a single-process
  `LlamaForCausalLM`: per-step losses and gradient norms within 1e-5, weights
  loosely (tensors with near-zero gradients drift ~1e-4 relative under any
  change of reduction order, so weights are a weak check, losses the strict one);
- `init_from` a `save_pretrained` directory gives the reference's first loss;
- a checkpoint trained at tp=2, exported with `elastic ckpt export`, loads with
  `AutoModelForCausalLM.from_pretrained` and gives the same logits;
- `strategies.hf.causal_lm_spec` serves another family as is: a Qwen3 (per-head
  q/k norms, whose gradients tp must sum) at tp=2 with sequence parallel.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

import storage  # noqa: E402
from distributed import run_distributed  # noqa: E402
from elastic.cli import main  # noqa: E402
from elastic.config import ModelConfig, ParallelConfig  # noqa: E402
from elastic.layout import Layout  # noqa: E402
from examples.hf_llama import build  # noqa: E402
from strategies import initial_state, token_loss_sum  # noqa: E402
from test_strategies_equivalence import GLOBAL_BATCH, SEQ, STEPS, TOL, make_batches, merge_ranks, reference_train, rel_err, train_layout  # noqa: E402

ARGS = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
BUILDER = ModelConfig(builder="examples.hf_llama:build", args=ARGS)
LAYOUTS = {
    "dp_shard2": (Layout(dp_shard=2), ParallelConfig(dp_shard=2), 2),
    "tp2_sp": (Layout(tp=2), ParallelConfig(tp=2, sequence_parallel=True), 4),
    "pp2": (Layout(pp=2), ParallelConfig(pp=2, pp_schedule="1f1b"), 4),
}
PP_TP = (Layout(pp=2, tp=2), ParallelConfig(pp=2, tp=2, pp_schedule="1f1b"), 4)
WEIGHT_TOL = 1e-3


def _meta():
    with torch.device("meta"):
        return build(**ARGS)


def _meta_model():
    return _meta()[0]


SPEC = _meta()[1]


def build_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from strategies.hf import causal_lm_spec

    model = Qwen3ForCausalLM(Qwen3Config(**{**ARGS, "head_dim": 8}))
    return model, causal_lm_spec(model)


def _meta_qwen3():
    with torch.device("meta"):
        return build_qwen3()[0]


def _logits(model, inputs):
    return model(input_ids=inputs, use_cache=False).logits


def _tp2(rank: int):
    from strategies import parallelize

    pm = parallelize(_meta_model(), Layout(tp=2).build_mesh("cpu"), ParallelConfig(tp=2), micro_batch=GLOBAL_BATCH, spec=SPEC)
    pm.materialize("cpu")
    return pm


def _first_loss_from_pretrained(rank: int, pretrained: str) -> torch.Tensor:
    pm = _tp2(rank)
    storage.load_pretrained(pretrained, pm.model_parts, checkpoint_key=SPEC.checkpoint_key)
    inputs, labels = make_batches(ARGS["vocab_size"])
    return pm.forward_backward(inputs[0], labels[0], loss_scale=1.0)


def _train_save_and_predict(rank: int, uri: str) -> torch.Tensor:
    """STEPS steps at tp=2, a committed checkpoint of them, and the trained model's logits on the first batch."""
    from strategies import clip_grad_norm, init_weights

    from test_strategies_equivalence import make_optimizer

    pm = _tp2(rank)
    init_weights(pm, _meta_model(), seed=0)
    opt = make_optimizer(pm.parameters())
    inputs, labels = make_batches(ARGS["vocab_size"])
    for step in range(STEPS):
        pm.forward_backward(inputs[step], labels[step], loss_scale=1.0 / (GLOBAL_BATCH * SEQ))
        clip_grad_norm(pm, 1.0)
        opt.step()
        opt.zero_grad()
    rows = storage.write_shards(uri, STEPS, rank, storage.snapshot(storage.state_tensors(pm.model_parts, opt)), generation=1)
    storage.gather_and_commit(uri, STEPS, rows, generation=1, layout=Layout(tp=2).as_dict(),
                              train_state={"step": STEPS, "model": BUILDER.model_dump(mode="json")})
    with torch.no_grad():
        return pm.model_parts[0](inputs[0])


def _run(rank: int, world: int, pretrained: str, uri: str) -> dict:
    out = {name: train_layout(rank, layout, parallel, _meta_model, SPEC, micro) for name, (layout, parallel, micro) in LAYOUTS.items()}
    with torch.device("meta"):
        qwen_spec = build_qwen3()[1]
    out["qwen3_tp2_sp"] = train_layout(rank, Layout(tp=2), ParallelConfig(tp=2), _meta_qwen3, qwen_spec, 4)
    out["pretrained_loss"] = _first_loss_from_pretrained(rank, pretrained)
    out["trained_logits"] = _train_save_and_predict(rank, uri)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    released = build(**ARGS)[0]  # Hugging Face's own initialisation: what a released model would be
    released.save_pretrained(root / "pretrained")
    full = initial_state(_meta_model(), SPEC, seed=0)
    ref = reference_train(build(**ARGS)[0], {k: v.clone() for k, v in full.items()}, forward=_logits)
    with torch.device("meta"):
        qwen_meta, qwen_spec = build_qwen3()
    qwen_full = initial_state(qwen_meta, qwen_spec, seed=0)
    qwen_ref = reference_train(build_qwen3()[0], {k: v.clone() for k, v in qwen_full.items()}, forward=_logits)
    ranks = run_distributed(_run, 2, str(root / "pretrained"), str(root / "ckpt"))
    pp_tp = run_distributed(_run_pp_tp, 4)
    return {"ref": ref, "initial": full, "ranks": ranks, "pp_tp": pp_tp, "root": root, "released": released, "qwen3": (qwen_ref, qwen_full)}


def _run_pp_tp(rank: int, world: int) -> dict:
    return train_layout(rank, *PP_TP[:2], _meta_model, SPEC, PP_TP[2])


@pytest.mark.parametrize("name", [*LAYOUTS, "pp2_tp2_sp", "qwen3_tp2_sp"])
def test_layout_matches_transformers(name, results):
    ref, initial = results["qwen3"] if name == "qwen3_tp2_sp" else (results["ref"], results["initial"])
    layout = {"qwen3_tp2_sp": Layout(tp=2), "pp2_tp2_sp": PP_TP[0]}.get(name) or LAYOUTS[name][0]
    ranks = [r[name] for r in results["ranks"]] if name != "pp2_tp2_sp" else results["pp_tp"]
    got = merge_ranks(ranks, layout)
    for key in ("losses", "norms"):
        assert rel_err(got[key], ref[key]) < TOL, f"{name} {key}: {got[key].tolist()} vs {ref[key].tolist()}"
    assert set(got["params"]) == set(ref["params"])
    moved = rel_err(torch.cat([p.flatten() for p in ref["params"].values()]), torch.cat([initial[k].flatten() for k in ref["params"]]))
    assert moved > 100 * WEIGHT_TOL, "the reference barely trained: the weight check could not fail"
    bad = {k: e for k in ref["params"] if (e := rel_err(got["params"][k], ref["params"][k])) > WEIGHT_TOL}
    assert not bad, f"{name}: weights differ: {bad}"


def test_llama_pipeline_stages_keep_hugging_face_names(results):
    stage0, stage1 = (set(r["pp2"]["params"]) for r in results["ranks"])
    assert not stage0 & stage1
    assert "model.embed_tokens.weight" in stage0 and {"lm_head.weight", "model.norm.weight"} <= stage1
    assert {n.split(".")[2] for n in stage0 if n.startswith("model.layers.")} == {"0", "1"}


def test_init_from_pretrained_gives_the_reference_first_loss(results):
    inputs, labels = make_batches(ARGS["vocab_size"])
    with torch.no_grad():
        want = token_loss_sum(_logits(results["released"], inputs[0]), labels[0])
    for rank in results["ranks"]:  # every tp rank computes the whole loss
        assert rel_err(rank["pretrained_loss"], want) < TOL, (rank["pretrained_loss"].item(), want.item())


def test_export_loads_with_from_pretrained_and_predicts_the_same(results, capsys):
    from transformers import AutoModelForCausalLM

    root = results["root"]
    out = root / "exported"
    assert main(["ckpt", "export", str(root / "ckpt"), str(out), "--max-shard-gb", "0.00002"]) == 0
    assert "config.json" in capsys.readouterr().out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)  # sharded: one file per ~20 kB
    assert not [k for k in index["weight_map"] if k.startswith("optim")]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM" and next(model.parameters()).dtype == torch.float32
    inputs, _ = make_batches(ARGS["vocab_size"])
    with torch.no_grad():
        logits = _logits(model, inputs[0])
    trained = results["ranks"][0]["trained_logits"]
    assert rel_err(logits, trained) < TOL
    assert rel_err(logits, _logits(build(**ARGS)[0], inputs[0]).detach()) > 0.01  # the trained weights, not a fresh model's


# --------------------------------------------------------------------------- the spec on its own (one process)
def test_spec_from_the_hugging_face_config():
    model, spec = _meta()
    assert (spec.first, spec.blocks, spec.last) == (("model.embed_tokens",), "model.layers", ("model.norm", "lm_head"))
    assert spec.run_parts and model.config._attn_implementation == "sdpa"  # a bare config would select eager attention
    plan = spec.plan(sequence_parallel=True)
    assert {k for k, v in plan.items() if type(v).__name__ == "SequenceGather"} == {"model.layers.*.self_attn", "model.layers.*.mlp"}
    assert {k for k, v in plan.items() if type(v).__name__ == "SequenceParallel"} == {
        "model.norm", "model.layers.*.input_layernorm", "model.layers.*.post_attention_layernorm"}
    assert not [k for k, v in spec.plan(sequence_parallel=False).items() if type(v).__name__ in ("SequenceGather", "SequenceParallel")]


def test_build_over_a_released_config(tmp_path):
    """`build(config=DIR)` starts from a model directory's config.json, local or fsspec; keyword fields override it."""
    import fsspec
    from transformers import LlamaConfig

    from elastic.config import ConfigError
    from elastic.recipe import build_model

    LlamaConfig(**ARGS).save_pretrained(tmp_path / "released")
    memory = fsspec.filesystem("memory")
    memory.pipe("/released/config.json", (tmp_path / "released" / "config.json").read_bytes())
    try:
        for where in (str(tmp_path / "released"), "memory://released"):
            model, spec = build_model(ModelConfig(builder="examples.hf_llama:build", args={"config": where, "num_hidden_layers": 2}))
            got = model.config
            assert (got.hidden_size, got.intermediate_size, got.num_key_value_heads, got.vocab_size) == (32, 64, 2, 32), where  # the file's
            assert len(model.model.layers) == got.num_hidden_layers == 2 and spec.vocab_size == 32  # the override
    finally:
        memory.rm("/released", recursive=True)
    with pytest.raises(ConfigError, match=r"model.builder examples.hf_llama:build: FileNotFoundError"):
        build_model(ModelConfig(builder="examples.hf_llama:build", args={"config": str(tmp_path / "nothing")}))


def test_rotary_buffers_are_recreated_after_materialising():
    model, spec = _meta()
    model.to_empty(device="cpu")
    model.model.rotary_emb.inv_freq.fill_(float("nan"))  # what to_empty may leave
    spec.init_buffers(model)
    assert torch.equal(model.model.rotary_emb.inv_freq, build(**ARGS)[0].model.rotary_emb.inv_freq)
    from strategies.compose import model_problems

    spec.init_buffers = None
    (problem,) = model_problems(_meta_model(), spec, ParallelConfig())
    assert "buffers (model.rotary_emb.inv_freq, model.rotary_emb.original_inv_freq)" in problem and "ModelSpec.init_buffers" in problem


def test_spec_refuses_what_would_train_wrongly():
    from elastic.config import ConfigError, load_config

    def cfg(data=None, **args):
        return load_config(data={"model": {"builder": "examples.hf_llama:build", "args": {**ARGS, **args}}, "data": {"seq_len": 8},
                                 "scaling": {"workers_per_node": 0}, **(data or {})})

    with pytest.raises(ConfigError, match=r"model.args num_key_value_heads \(2\) must be divisible by parallel.tp \(4\)"):
        cfg({"parallel": {"tp": 4}})
    with pytest.raises(ConfigError, match=r"model.embed_tokens.weight = lm_head.weight.*tie_word_embeddings=False"):
        cfg(tie_word_embeddings=True)
    with pytest.raises(ConfigError, match=r"sliding-window attention \(window 4\).*data.seq_len \(8\)"):
        cfg(sliding_window=4, use_sliding_window=True)
    cfg(sliding_window=8, use_sliding_window=True)  # the window covers the sequence: plain causal attention


def test_tied_checkpoints_load_into_an_untied_model():
    keys = frozenset({"model.embed_tokens.weight", "model.norm.weight"})
    assert SPEC.checkpoint_key("lm_head.weight", keys) == "model.embed_tokens.weight"
    assert SPEC.checkpoint_key("lm_head.weight", keys | {"lm_head.weight"}) == "lm_head.weight"
    assert SPEC.checkpoint_key("model.norm.weight", keys) == "model.norm.weight"


def test_the_1b_example_job_plans_onto_an_8_gpu_node():
    from pathlib import Path

    from elastic.config import load_config
    from elastic.planning import choose_layout, model_inputs
    from strategies.planner import Hardware

    cfg = load_config(Path(__file__).resolve().parents[1] / "examples" / "hf-llama-1b.yaml")
    profile, _ = model_inputs(cfg)
    assert 1.4e9 < profile.params < 1.6e9 and profile.n_layers == 16 and profile.vocab_size == 128256
    for world in (8, 2):
        layout, reason = choose_layout(world, cfg, hardware=Hardware(gpus=world, gpus_per_node=8, gpu_mem_bytes=80e9))
        assert (layout.tp, layout.world_size) == (2, world), reason
