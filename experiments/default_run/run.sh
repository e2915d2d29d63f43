#!/usr/bin/env bash
# The default run: the shipped stories260K model, WikiText-2 perplexity on the bundled text, every method in
# `compare` (conf/config.yaml).  Prints the table of README.md and the wall time.
set -euo pipefail
cd "$(dirname "$0")/../.."
time python -m sparse_eval
