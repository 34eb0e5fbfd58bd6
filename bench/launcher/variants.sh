#!/usr/bin/env bash
# Times variants of a kernel file side by side in one run (launcher timing, no torch).
#
#   bench/launcher/variants.sh VARIANTS [OUTDIR]
#
# VARIANTS: lines `name|family|sed script` (family: norm or softmax); the script is applied to a
# copy of csrc/<family>/<family>_kernels.cu (empty: the file as it is; list it twice to see the
# noise), or `@DIR` builds the csrc tree in DIR instead (a baseline: e.g. `git archive` of an
# earlier commit's csrc), or `+PATCH` applies PATCH (a `git diff` of the repository, e.g. one
# kept in bench/lessons/) to a copy of csrc, or `=FILE` runs FILE, a harness binary built
# beforehand (elsewhere, with the same nvcc: no build on the timing machine). Every variant's
# bench/launcher/<family>_timing.cu is built in parallel (a script that changes nothing, or a
# failed build, drops the variant), then run in the listed order. Writes
# <family>.txt (every run) and <family>_table.md (% of copy, one column per variant) to OUTDIR
# (default $OUT, else ./variants_logs), and every build's log (ptxas registers and spills) to
# builds.tar.gz. TIMING_ARCH picks the architecture (default sm_90a); VARIANT_TIMEOUT caps each
# variant's run (seconds, default 300).
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
list="$1"
out="${2:-${OUT:-$PWD/variants_logs}}"
mkdir -p "$out"
work="$(mktemp -d)"
arch="${TIMING_ARCH:-sm_90a}"
nvcc="$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")"

build() {  # name family script
  local dir="$work/$2-$1" file="csrc/$2/$2_kernels.cu"
  mkdir -p "$dir/bench"
  if [[ $3 == =* ]]; then cp "$root/${3#=}" "$dir/timing" && echo "prebuilt ${3#=}" >"$dir/build.log"; return; fi
  cp -r "$root/csrc" "$dir/" && cp -r "$root/bench/launcher" "$dir/bench/"
  if [[ $3 == @* ]]; then
    rm -rf "$dir/csrc" && cp -r "${3#@}" "$dir/csrc" || return 1
  elif [[ $3 == +* ]]; then
    (cd "$dir" && patch -p1 -s <"$root/${3#+}") >"$dir/build.log" 2>&1 || return 1
  elif [[ -n $3 ]]; then
    sed -i -e "$3" "$dir/$file"
    if cmp -s "$root/$file" "$dir/$file"; then echo "$1: the script changes nothing" >"$dir/build.log"; return 1; fi
  fi
  "$nvcc" -O3 --expt-relaxed-constexpr -std=c++17 -arch="$arch" -Xptxas -v "$dir/bench/launcher/$2_timing.cu" \
    -o "$dir/timing" >"$dir/build.log" 2>&1
}

names=() families=()
while IFS='|' read -r name family script; do
  [[ -z $name || $name == \#* ]] && continue
  names+=("$name") families+=("$family")
  build "$name" "$family" "$script" &
done <"$list"
wait

for i in "${!names[@]}"; do
  name="${names[$i]}" family="${families[$i]}" dir="$work/${families[$i]}-${names[$i]}"
  if [[ ! -x $dir/timing ]]; then
    echo "== $family $name: not built"; tail -5 "$dir/build.log"; continue
  fi
  echo "== $family $name" | tee -a "$out/$family.txt"
  timeout "${VARIANT_TIMEOUT:-300}" "$dir/timing" 2>&1 | tee -a "$out/$family.txt"
done
(cd "$work" && tar czf "$out/builds.tar.gz" */build.log)

python3 - "$out" <<'PY'
import collections, os, re, sys
out = sys.argv[1]
for family in ("norm", "softmax"):
    path = os.path.join(out, f"{family}.txt")
    if not os.path.exists(path):
        continue
    table, variants, variant = collections.OrderedDict(), [], None
    for line in open(path):
        if line.startswith("== "):
            variant = line.split()[2]
            variants.append(variant)
        m = re.match(r"(\S+)\s+N=(\d+)\s+[\d.]+ GB/s\s+([\d.]+)%", line)
        if m and variant:
            table.setdefault((m.group(1), int(m.group(2))), {})[variant] = m.group(3)
    with open(os.path.join(out, f"{family}_table.md"), "w") as f:
        f.write("| case | N | " + " | ".join(variants) + " |\n|---|---|" + "---|" * len(variants) + "\n")
        for (case, n), row in table.items():
            f.write(f"| {case} | {n} | " + " | ".join(row.get(v, "") for v in variants) + " |\n")
    print(open(os.path.join(out, f"{family}_table.md")).read())
PY
