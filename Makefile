# Every target sets up .venv on first use: a fresh machine needs only `make demo` or `make test`.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_USAGE_STATS_ENABLED := 0
export PYTHONUNBUFFERED := 1

.PHONY: setup demo test test-slow chaos bench bench-strategies bench-memory bench-checkpoint bench-recovery bench-s3 bench-data clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test,hf]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/elastic run deploy/examples/demo.yaml --fresh

test: $(STAMP)
	$(PY) -m pytest -q -x --timeout 600

test-slow: $(STAMP)
	$(PY) -m pytest -q --timeout 3600 -m slow

chaos: $(STAMP)
	$(PY) -m pytest -q --timeout 3600 -m chaos

# Every benchmark, one after the other (their times below; bench/README.md). A new bench-* target goes here too.
bench: bench-strategies bench-memory bench-checkpoint bench-recovery bench-s3 bench-data

# Recovery benchmark (elastic vs Ray Train vs plain torch.distributed; ~5 min): bench/results/recovery.json
bench-recovery: $(STAMP)
	$(PY) bench/recovery.py

# Each parallel layout under the manager vs the same Trainer as plain torch.distributed, 6 alternating rounds (~40 min; bench/README.md).
bench-strategies: $(STAMP)
	$(PY) bench/strategies.py --rounds 6 --steps 60

# The memory tier's step cost: each layout on two nodes with checkpoint.memory off and on, 2 alternating rounds, then
# within single runs of 300 steps (a snapshot every other step; 3 passes over the layouts, the median of each reported),
# then 3 layouts so while 2 processes spin on the CPU (~2 h 15 min): bench/results/memory_tier.json
bench-memory: $(STAMP)
	$(PY) bench/memory_tier.py --rounds 2 --steps 50
	$(PY) bench/memory_tier.py --interleaved --repeat 3 --steps 300
	$(PY) bench/memory_tier.py --interleaved --busy 2 --steps 120 --only dp_shard=4 --only "hsdp 2x2" --only "pp=2 interleaved_1f1b"

# Checkpoint benchmark (this storage vs torch DCP vs raw disk, 1.1 GB over 4 processes; ~1.5 min): bench/results/checkpoint.json
bench-checkpoint: $(STAMP)
	$(PY) bench/checkpoint.py

# S3 data path: s3fs vs pyarrow's S3FileSystem against a local moto server (256 MB object; ~1 min): bench/results/s3.json
bench-s3: $(STAMP)
	$(PY) bench/s3.py

# Data path: the tokens source vs plain memmap/pyarrow reads, local and s3 (moto), and vs what the demo and the Hugging Face Llama example train on (~5 min): bench/results/data.json
bench-data: $(STAMP)
	$(PY) bench/data.py

clean:
	rm -rf $(VENV) runs .pytest_cache
