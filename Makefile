# Two set-up commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
export QT_QPA_PLATFORM ?= $(if $(filter Darwin,$(shell uname -s)),,$(if $(DISPLAY),,offscreen))

.PHONY: run test install dev test-packaging app bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.dev-installed: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed
dev: $(VENV)/.dev-installed

run: install
	$(PY) -m app

test: dev
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest -q -m "not slow" -p no:cacheprovider

test-packaging: dev
	$(PY) -m pip install -q -e '.[packaging]'
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest -q -m slow tests/packaging

app: dev
	$(PY) -m pip install -q -e '.[packaging]'
	$(if $(filter Darwin,$(shell uname -s)),$(PY) packaging/build_coreml.py,)
	$(PY) -m PyInstaller --noconfirm --clean --distpath dist --workpath build packaging/spark.spec

bench: dev
	$(PY) -m engine bench decode --json

clean:
	rm -rf build dist .pytest_cache
