#!/usr/bin/env bash
# Build daemon/spark/jars/eventplane-hadoop.jar from jvm/src with the venv's
# pyspark jars on the class path. Optional: without javac (a JRE-only machine)
# it says so and succeeds, and the daemon's staging writes fork `chmod` as
# Hadoop's local file system does (docs/cdc.md, "Step 1's file system").
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-.venv/bin/python}
out=daemon/spark/jars/eventplane-hadoop.jar
if ! command -v javac >/dev/null 2>&1 || ! command -v jar >/dev/null 2>&1; then
  echo "note: javac not found; $out not built (CDC staging writes will fork chmod)" >&2
  exit 0
fi
jars=$("$py" -c 'import os, pyspark; print(os.path.join(os.path.dirname(pyspark.__file__), "jars"))')
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
# Spark 4 runs on Java 17+: class files for 17 load on every JVM it runs on.
javac -nowarn --release 17 -cp "$jars/*" -d "$build/classes" $(find jvm/src -name '*.java')
mkdir -p "$(dirname "$out")"
jar --create --file "$build/out.jar" -C "$build/classes" .
mv "$build/out.jar" "$out"
