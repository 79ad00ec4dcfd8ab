# Everything a fresh machine needs: `make demo` and `make test` create .venv and install first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install demo test lint bench mosquitto faketime websocket prometheus browsers chromium firefox webkit web clean check-install check-aarch64

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The tests run a real Mosquitto; install it when missing and we may (root), else its tests skip with a reason.
# mosquitto-clients gives the third-party mosquitto_pub/mosquitto_sub that the attack tests publish with.
mosquitto:
	@if { command -v mosquitto >/dev/null || [ -x /usr/sbin/mosquitto ]; } && command -v mosquitto_pub >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing mosquitto and mosquitto-clients (Debian packages) for the broker tests"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mosquitto mosquitto-clients >/dev/null) \
		|| echo "could not install mosquitto: its tests will be skipped"; \
	else echo "mosquitto or mosquitto-clients is missing and we are not root: the Mosquitto tests will be skipped"; fi

# The chaos soak (benchmarks/chaos_soak.py, its quick form in the tests) steps the coordinator's clock with Debian's
# libfaketime; without it the soak runs without clock jumps and says so.
faketime:
	@if [ -e /usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1 ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing faketime (Debian package) for the chaos soak's clock jumps"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq faketime >/dev/null) \
		|| echo "could not install faketime: the chaos soak runs without clock jumps"; \
	else echo "faketime is missing and we are not root: the chaos soak runs without clock jumps"; fi

# The web agent's tests reach Mosquitto over WebSockets through websockify, and deploy's path for phones through nginx
# in front of it (Debian packages), installed the same way.
websocket:
	@missing=""; command -v websockify >/dev/null || missing="websockify"; \
	{ command -v nginx >/dev/null || [ -x /usr/sbin/nginx ]; } || missing="$$missing nginx-light"; \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing$$missing (Debian packages) for the WebSocket tests"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing \
			>/dev/null) || echo "could not install$$missing: their tests will be skipped"; \
	else echo "$$missing missing and we are not root: the WebSocket tests that need them will be skipped"; fi

# The metrics test scrapes the coordinator with a real Prometheus server (Debian package), installed the same way.
prometheus:
	@if command -v prometheus >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing prometheus (Debian package) for the metrics test"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus \
			>/dev/null) || echo "could not install prometheus: its test will be skipped"; \
	else echo "prometheus is missing and we are not root: the Prometheus test will be skipped"; fi

# The web agent (web/): npm ci installs its exactly pinned packages (patch-package patches onnxruntime-web at install),
# npm run build writes web/dist/, the page fedper.web.web_root() names. Without npm its node tests are skipped.
web: web/dist/index.html

web/dist/index.html: web/package.json web/package-lock.json web/build.mjs $(wildcard web/src/* web/patches/*)
	@if command -v npm >/dev/null; then npm --prefix web ci --no-audit --no-fund --loglevel=error && npm --prefix web run build; \
	else echo "npm is missing: the web agent is not built and its tests are skipped"; fi

# The web agent's browser tests run the page in every engine a phone may have (Debian packages): chromium and
# firefox-esr (puppeteer-core drives both; Debian ships no geckodriver, none is needed), WebKitGTK through
# webkit2gtk-driver's WebKitWebDriver with xvfb for its display. Installed like mosquitto; a missing one's test skips.
browsers:
	@missing=""; command -v chromium >/dev/null || missing="chromium"; \
	command -v firefox-esr >/dev/null || missing="$$missing firefox-esr"; \
	command -v WebKitWebDriver >/dev/null || missing="$$missing webkit2gtk-driver"; \
	command -v Xvfb >/dev/null || missing="$$missing xvfb"; \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing$$missing (Debian packages) for the web agent's browser tests"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing \
			>/dev/null) || echo "could not install$$missing: the browser tests that need them will be skipped"; \
	else echo "$$missing missing and we are not root: the browser tests that need them will be skipped"; fi

chromium firefox webkit: browsers

demo: install
	$(BIN)/fedper demo

# The suite runs in TEST_JOBS pytest-xdist workers (0: in this process), each with one OpenMP thread: two workers
# whose torch used two threads each on 2 cores spin-waited on one another and ran the suite several times slower.
TEST_JOBS ?= 2

test: install mosquitto faketime websocket prometheus browsers web
	$(BIN)/ruff check .
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(TEST_JOBS) --dist worksteal --durations=15
	@if [ -f web/dist/index.html ]; then node --test web/test/*.test.mjs; else echo "web agent not built: node tests skipped"; fi

# pip's resolver, for every platform tag (Linux x86-64/aarch64, macOS arm64/x86-64) and Python 3.10-3.13:
# `make test` asks for 3.12 and 3.13 only (the two sides of onnxruntime-training's last wheel).
check-install: install
	FEDPER_RESOLVE_ALL=1 $(BIN)/python -m pytest -q tests/test_install_resolve.py

# The agent installed from aarch64 wheels into an emulated aarch64 Python (qemu-user-static, installed when
# missing and root), one round against a coordinator on this machine; minutes, so not part of `make test`.
check-aarch64: install
	$(BIN)/python deploy/aarch64/check_aarch64.py

lint: install
	$(BIN)/ruff check .

bench: install
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache web/node_modules web/dist .aarch64
