# `make test` and `make train` set up everything they need on a fresh clone.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0

.PHONY: install test test-unit train clean

install: $(VENV)/.installed

# torch is installed pinned first: an unpinned requirement would pull the newest
# CUDA build (several GB); with 2.13.0 present, `torch>=2.13` is already satisfied.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[test,train]'
	touch $@

test: install
	$(PY) -m pytest -q tests

test-unit: install
	$(PY) -m pytest -q tests/unit

# The default pretraining job: 4 CPU ranks as 2 (dp) x 2 (tp), a small Llama on Python's
# standard-library sources; writes runs/debug_cpu/{metrics.jsonl,checkpoints/,loss.png}.
TRAIN_CONFIG ?= configs/debug_cpu.toml
train: install
	$(VENV)/bin/fsdp2d train --config $(TRAIN_CONFIG) $(ARGS)
	$(VENV)/bin/fsdp2d plot runs/$(notdir $(basename $(TRAIN_CONFIG)))

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# `make bench`: fsdp2d against torch's native 2D path (DTensor TP + FSDP2) on a 2x2 gloo
# mesh of 4 CPU ranks, for each run in BENCH_RUNS (model-size); prints a markdown table.
# Each run takes 1-3 minutes on a 2-core machine; logs and JSON land in runs/bench/.
BENCH_RUNS ?= gpt2-small llama-small gpt2-medium llama-medium
BENCH_STEPS ?= 20
.PHONY: bench
bench: install
	@mkdir -p runs/bench
	@for run in $(BENCH_RUNS); do \
	  echo "bench $$run: $$(uptime)"; \
	  OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node 4 benchmarks/compare_torch.py \
	    --model $${run%-*} --size $${run#*-} --steps $(BENCH_STEPS) --json runs/bench/$$run.json \
	    > runs/bench/$$run.log 2>&1 || { cat runs/bench/$$run.log; exit 1; }; \
	done
	@echo "done: $$(uptime)"
	@$(PY) benchmarks/compare_torch.py --table $(BENCH_RUNS:%=runs/bench/%.json)

# `make bench-fsdp1`: torch's FSDP1 against fsdp2d.fsdp1 (the same script, imports switched)
# and fsdp2d's fully_shard, on the 2x2 (FSDP1 + TP) and 4x1 (dp=4) meshes, per BENCH_FSDP1_RUNS.
BENCH_FSDP1_RUNS ?= llama-small gpt2-small llama-medium
.PHONY: bench-fsdp1
bench-fsdp1: install
	@mkdir -p runs/bench
	@for run in $(BENCH_FSDP1_RUNS); do for mesh in 2x2 4x1; do \
	  echo "bench-fsdp1 $$run $$mesh: $$(uptime)"; \
	  OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node 4 benchmarks/compare_torch.py \
	    --mode fsdp1 --mesh $$mesh --model $${run%-*} --size $${run#*-} --steps $(BENCH_STEPS) \
	    --json runs/bench/fsdp1-$$run-$$mesh.json > runs/bench/fsdp1-$$run-$$mesh.log 2>&1 \
	    || { cat runs/bench/fsdp1-$$run-$$mesh.log; exit 1; }; \
	done; done
	@echo "done: $$(uptime)"
	@$(PY) benchmarks/compare_torch.py --table $(foreach r,$(BENCH_FSDP1_RUNS),runs/bench/fsdp1-$(r)-2x2.json runs/bench/fsdp1-$(r)-4x1.json)
