#!/usr/bin/env bash
# Build daemon/spark/jars/eventplane-hadoop.jar from jvm/src when it is missing or
# older than a source (daemon/spark/jarbuild.py). Optional: without javac (a
# JRE-only machine) it says so and succeeds, and the daemon's staging writes fork
# `chmod` as Hadoop's local file system does (docs/cdc.md, "Step 1's file system").
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${1:-.venv/bin/python}" -m daemon.spark.jarbuild
