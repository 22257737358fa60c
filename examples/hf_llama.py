"""A Hugging Face `LlamaForCausalLM` as an elastic model: the whole adapter.

Name it in a job YAML (run from the repository root, which is then the job's
working directory and so on every rank's import path)::

    model:
      builder: examples.hf_llama:build
      args: {hidden_size: 2048, num_hidden_layers: 16, ...}     # LlamaConfig fields
      # or start from a released model: its config, then its weights
      # args: {config: s3://bucket/Llama-3.2-1B, tie_word_embeddings: false}
      # init_from: s3://bucket/Llama-3.2-1B

`strategies.hf.causal_lm_spec` derives the rest from the model: the TP plan
(column/row-wise attention and MLP, sequence parallel on the norms), the
pipeline order (embedding | decoder layers | norm and head, balanced by
parameter count or cut at `split_points`), the stage forward with rotary
position embeddings, the initialiser, and the files `elastic ckpt export`
writes so that `AutoModelForCausalLM.from_pretrained` loads the result.
Needs the `hf` extra: `pip install -e '.[hf]'`.
"""

from __future__ import annotations


def build(config: str = "", split_points: list[str] | None = None, **fields):
    """`LlamaForCausalLM` from `LlamaConfig` fields, over the `config.json` at `config` (a directory, local or fsspec) if given."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from strategies.hf import causal_lm_spec, read_config

    llama_config = LlamaConfig.from_dict({**(read_config(config) if config else {}), **fields})
    model = LlamaForCausalLM(llama_config)
    return model, causal_lm_spec(model, split_points=split_points)
