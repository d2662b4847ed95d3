# dflop-ds: `make demo` and `make test` set up .venv themselves on a fresh clone.
#
# GPU machines: the CPU torch pin is only a default. Keep a CUDA torch you already have with
#   make demo VENV_FLAGS=--system-site-packages TORCH_SPEC=
# or pick another build, e.g. TORCH_SPEC="torch==2.13.0 --index-url <your CUDA wheel index>".

PYTHON     ?= python3
VENV       ?= .venv
VENV_FLAGS ?=
TORCH_SPEC ?= torch==2.13.0
PY         := $(VENV)/bin/python
# DeepSpeed JIT-builds its CPU communication op once per environment, in the environment's own
# folder (two checkouts with two environments would otherwise rebuild it in turn); a
# TORCH_EXTENSIONS_DIR you set wins. dflop_ds.launch.launch_env picks the same folder.
TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions
# DeepSpeed's launcher and its JIT build (ninja) must be found on PATH.
RUN        := PATH="$(abspath $(VENV))/bin:$$PATH" PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR="$(TORCH_EXTENSIONS_DIR)"

.PHONY: setup lint demo test bench bench-partition bench-costmodel bench-plan bench-scale bench-sync bench-e2e bench-dp validate-simulator bench-hf bench-trainer readme-figure gpu-wheels gpu-check test-frameworks framework-envs bench-frameworks clean

# the trl extra (TRL's SFTTrainer for tests/test_hf_trainer_trl.py) pulls no torch of its own: trl,
# datasets, pandas, pyarrow, dill, multiprocess, xxhash (pip install --dry-run, 2026-11-26)
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(if $(strip $(TORCH_SPEC)),$(PY) -m pip install --quiet $(TORCH_SPEC))
	$(PY) -m pip install --quiet -e ".[test,hf,video,trl]"
	$(RUN) $(PY) -c "from dflop_ds.host import build_deepspeed_ops; print(build_deepspeed_ops())"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(RUN) $(PY) examples/demo.py

lint: setup
	$(VENV)/bin/ruff check dflop_ds tests benchmarks examples
	$(VENV)/bin/ruff format --check dflop_ds tests benchmarks examples
	$(VENV)/bin/mypy

# lint first: a type or style error stops CI before the (long) suite runs. Two pytest-xdist workers,
# each running whole test files (tests/xdist_groups.py groups them): a 2-rank launch keeps about 1.4 of 2
# cores busy and the unit tests one, so two at a time fill the cores (more would oversubscribe them)
TEST_WORKERS ?= 2
test: setup lint
	$(RUN) $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS)

bench-partition: setup
	$(PY) -m pip install --quiet -e ".[bench]" || echo "ortools not installable: the DFLOP ILP baseline uses PuLP/CBC"
	$(RUN) $(PY) benchmarks/bench_partition.py

bench-costmodel: setup
	$(RUN) $(PY) benchmarks/bench_costmodel.py

bench-plan: setup
	$(RUN) $(PY) benchmarks/bench_plan.py

bench-scale: setup
	$(RUN) $(PY) benchmarks/bench_scale.py

bench-sync: setup
	$(RUN) $(PY) benchmarks/bench_sync.py

readme-figure: setup
	$(RUN) $(PY) benchmarks/readme_figure.py

bench-e2e: setup
	$(RUN) $(PY) benchmarks/bench_e2e.py

bench-dp: setup
	$(RUN) $(PY) benchmarks/bench_dp.py

bench-hf: setup
	$(RUN) $(PY) benchmarks/bench_hf.py

bench-trainer: setup
	$(RUN) $(PY) benchmarks/bench_trainer.py

validate-simulator: setup
	$(RUN) $(PY) benchmarks/validate_simulator.py

# GPU check (issue 28). No `setup` prerequisite: on a lent GPU machine it runs the system python3
# with its CUDA torch and installs .gpu-wheels/ (made here by `make gpu-wheels`) without network.
GPU_PY ?= $(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,python3)

gpu-wheels:
	PY=$(GPU_PY) bash benchmarks/gpu_wheels.sh .gpu-wheels

gpu-check:
	PYTHONUNBUFFERED=1 $(GPU_PY) benchmarks/gpu_check.py

bench: bench-partition bench-costmodel bench-plan bench-e2e bench-dp

clean:
	rm -rf $(VENV) out runs .pytest_cache *.egg-info

# Training frameworks (issue 37): one environment each, with the versions the framework installs and
# a torch / torchvision / torchaudio set that loads together (benchmarks/framework_envs.sh, ~5 GB each).
# Not part of `make test`: every check launches the framework's own command on 2 ranks (minutes).
.venv-swift/.installed: benchmarks/framework_envs.sh pyproject.toml
	PYTHON=$(PYTHON) bash benchmarks/framework_envs.sh swift .venv-swift

.venv-llamafactory/.installed: benchmarks/framework_envs.sh pyproject.toml
	PYTHON=$(PYTHON) bash benchmarks/framework_envs.sh llamafactory .venv-llamafactory

framework-envs: .venv-swift/.installed .venv-llamafactory/.installed

test-frameworks: framework-envs
	PYTHONUNBUFFERED=1 $(PYTHON) tests/frameworks/run_frameworks.py

# each framework's own sampler and packing against the same run with dflop-ds, ZeRO-3, 2 ranks,
# interleaved rounds (benchmarks/bench_frameworks.py; 23 min on the idle 2-core machine, 29 Nov, start-up dominating)
bench-frameworks: framework-envs
	PYTHONUNBUFFERED=1 nice $(PYTHON) benchmarks/bench_frameworks.py
