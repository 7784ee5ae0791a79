# Two commands on a fresh machine: `make run` and `make test`.
# Both create .venv and install on first use (re-installs when pyproject.toml changes).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONFIG ?= config.toml
PYTEST_ARGS ?=

.PHONY: run test lint typecheck unit bench soak java jar delta-jars clean
# Optional: the Hadoop file system class of the CDC staging writes (jvm/src;
# scripts/build-jar.sh skips it when javac is missing).
JAR := daemon/spark/jars/eventplane-hadoop.jar

$(STAMP): pyproject.toml
	@$(PY) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "eventplane needs Python 3.11+, found " + sys.version.split()[0])'
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@bash scripts/build-jar.sh $(BIN)/python
	@touch $(STAMP)

# Rebuilt when a Java source is newer than the jar (or the jar is missing).
jar: $(STAMP)
	@if [ ! -f $(JAR) ] || [ -n "$$(find jvm/src -name '*.java' -newer $(JAR))" ]; then \
		bash scripts/build-jar.sh $(BIN)/python; fi

# Delta Lake's jars for format = "delta" streams, fetched with mvn once
# (daemon/spark/deltajars.py); offline it says so and the rest works.
delta-jars: $(STAMP)
	@$(BIN)/python -m daemon.spark.deltajars

java:
	@bash scripts/check-java.sh

run: $(STAMP) java jar delta-jars
	$(BIN)/eventplane run --config $(CONFIG)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

test: $(STAMP) java jar delta-jars lint typecheck
	$(BIN)/pytest $(PYTEST_ARGS)

bench: $(STAMP) java jar delta-jars
	$(BIN)/python -m bench

soak: $(STAMP) java jar delta-jars
	$(BIN)/pytest --soak -m soak $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(JAR) var .pytest_cache .mypy_cache .ruff_cache
