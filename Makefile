# Two commands that work on a fresh machine: `make demo` and `make test`.
# Both create .venv if missing, install CPU torch 2.13.0 first when no torch is importable (so pip never pulls a
# multi-GB CUDA build), install dblock with its extras, then run.
PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.dblock-installed
TORCH   ?= torch==2.13.0
JOBS    ?= 2

.PHONY: demo test install notebooks bench clean

$(VPY):
	$(PY) -m venv $(VENV)

$(STAMP): pyproject.toml | $(VPY)
	@$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q "$(TORCH)"
	$(VPY) -m pip install -q -e ".[test,triton,tokenizers,plots,serve,notebooks]"
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dblock demo

test: $(STAMP)
	$(VPY) -m pytest -p no:cacheprovider --timeout=600 --durations=15

notebooks: $(STAMP)
	$(VPY) -m dblock.notebooks_render

bench: $(STAMP)
	$(VPY) benchmarks/epoch_cpu.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
