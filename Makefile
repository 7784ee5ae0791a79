# Two commands on a fresh machine: `make run` and `make test`.
# Both create .venv and install on first use, from requirements.lock (re-installs
# when the lock or pyproject.toml changes).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONFIG ?= config.toml
PYTEST_ARGS ?=
# pytest-xdist workers of `make test` (files whole, the long ones first: tests/conftest.py).
TEST_WORKERS ?= 3

.PHONY: run test lock lock-upgrade lint typecheck unit bench soak java jar delta-jars config-delta-jars clean
# Optional: the Hadoop file system class of the CDC staging writes (jvm/src;
# scripts/build-jar.sh skips it when javac is missing).
JAR := daemon/spark/jars/eventplane-hadoop.jar

# requirements.lock pins every runtime and dev dependency with its hashes;
# requirements-setup.lock the few that install it (pip, setuptools, wheel, uv),
# so nothing unpinned is fetched, not even a build backend; requirements-runtime.lock
# the same versions without the dev tools, for a production venv (docs/operating.md).
# `make lock` writes all three.
LOCKS := requirements.lock requirements-setup.lock requirements-runtime.lock
UV := $(BIN)/uv
LOCK_ARGS := --universal --python-version 3.11 --generate-hashes --quiet

$(STAMP): pyproject.toml $(LOCKS)
	@$(PY) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "eventplane needs Python 3.11+, found " + sys.version.split()[0])'
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --require-hashes --no-deps -r requirements-setup.lock
	$(UV) pip sync --quiet --python $(BIN)/python --require-hashes --no-build-isolation requirements.lock
	$(UV) pip install --quiet --python $(BIN)/python --no-build-isolation --no-deps -e .
	@bash scripts/build-jar.sh $(BIN)/python
	@touch $(STAMP)

# `make lock` after editing pyproject.toml: adds and removes what it changed and
# keeps every other pin; `make lock-upgrade` takes the newest release each range
# allows. Then `make test`: a new release enters only through a commit that moves
# the lock.
lock: $(STAMP)
	$(UV) pip compile pyproject.toml --extra dev --group pyproject.toml:setup $(LOCK_ARGS) \
		$(UPGRADE) -o requirements.lock
	$(UV) pip compile --group pyproject.toml:setup $(LOCK_ARGS) -c requirements.lock \
		-o requirements-setup.lock
	$(UV) pip compile pyproject.toml $(LOCK_ARGS) -c requirements.lock -o requirements-runtime.lock

lock-upgrade: UPGRADE := --upgrade
lock-upgrade: lock

# Rebuilt when a Java source is newer than the jar (or the jar is missing).
jar: $(STAMP)
	@bash scripts/build-jar.sh $(BIN)/python

# Delta Lake's jars, for the Delta streams that Spark writes (variant = true, a
# Spark append), fetched with mvn once (daemon/spark/deltajars.py): `make test`
# always, `make run` only when a stream of $(CONFIG) needs them. Offline it says
# so and the rest works.
delta-jars: $(STAMP)
	@$(BIN)/python -m daemon.spark.deltajars

config-delta-jars: $(STAMP)
	@$(BIN)/python -m daemon.spark.deltajars --config $(CONFIG)

java:
	@bash scripts/check-java.sh

run: $(STAMP) java jar config-delta-jars
	$(BIN)/eventplane run --config $(CONFIG)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

test: $(STAMP) java jar delta-jars lint typecheck
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

bench: $(STAMP) java jar delta-jars
	$(BIN)/python -m bench

soak: $(STAMP) java jar delta-jars
	$(BIN)/pytest --soak -m soak $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(JAR) var .pytest_cache .mypy_cache .ruff_cache
