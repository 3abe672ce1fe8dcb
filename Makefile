# PocketLM: `make demo` runs the whole pipeline on the bundled corpus, `make test` runs the test suite.
PYTHON ?= python3
# The CPU build of torch is pinned when no torch is installed: an unpinned `pip install torch` pulls a
# multi-GB CUDA build. Install a CUDA build yourself first on a GPU machine; it is left alone.
TORCH_VERSION ?= 2.13.0
PIP := $(PYTHON) -m pip install --disable-pip-version-check -q

.PHONY: install install-dev test demo

install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) "torch==$(TORCH_VERSION)"
	$(PIP) -r requirements.txt

install-dev: install
	$(PIP) -r requirements-dev.txt

# pytest exits 5 when it collected no tests; that must fail loudly, never pass as green.
test: install-dev
	@$(PYTHON) -m pytest -q tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: ERROR: no tests were collected or run" >&2; fi; \
	exit $$rc

# The end-to-end pipeline on the bundled corpus; each stage is added as it lands.
demo: install
	$(PYTHON) -m model
