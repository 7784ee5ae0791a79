#!/usr/bin/env bash
# Spark 4 needs Java 17+. Install it when we are root; otherwise say exactly how.
set -euo pipefail
need=17
version() { java -version 2>&1 | awk -F'"' '/version/ {print $2}' | awk -F. '{print ($1 == "1") ? $2 : $1}'; }
if command -v java >/dev/null 2>&1 && [ "$(version)" -ge "$need" ] 2>/dev/null; then
  exit 0
fi
fix="sudo apt-get update && sudo apt-get install -y openjdk-17-jre-headless"
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "Java $need+ not found; installing openjdk-17-jre-headless" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless >/dev/null
  exit 0
fi
echo "eventplane needs Java $need+ for Spark, and it was not found. Fix: $fix" >&2
exit 1
