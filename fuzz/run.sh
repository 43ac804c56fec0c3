#!/usr/bin/env bash
# fuzz/run.sh - coverage-guided fuzzing of dspark::fuzzing's targets with AFL++ (cargo-afl,
# stable Rust). Not part of CI (tests/fuzz.rs runs the same targets property-based there).
#
#   bash fuzz/run.sh [SECONDS_PER_TARGET [TARGET...]]     # default: 60 s, every target
#
# Installs cargo-afl (which builds AFL++ from source) when it is missing. Prints, per target,
# the executions run and the crashes and hangs found; the crashing inputs are under
# fuzz/out/TARGET/default/crashes/ (reproduce: fuzz/target/release/dspark-fuzz TARGET < FILE).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
secs=${1:-60}
shift || true
if ! cargo afl --version >/dev/null 2>&1; then
    cargo install cargo-afl --locked
fi
cargo afl config --build >/dev/null 2>&1 || true   # "already built" is fine
cargo afl build --release
bin=target/release/dspark-fuzz
rm -rf seeds
"$bin" --seeds seeds >/dev/null 2>&1 || target/release/dspark-fuzz --seeds seeds
targets=("$@")
if [ ${#targets[@]} = 0 ]; then
    mapfile -t targets < <(ls seeds)
fi
export AFL_NO_UI=1 AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 AFL_QUIET=1
status=0
printf '%-22s %12s %8s %6s %6s\n' target execs paths crashes hangs
for t in "${targets[@]}"; do
    rm -rf "out/$t"
    mkdir -p out
    cargo afl fuzz -V "$secs" -i "seeds/$t" -o "out/$t" "$bin" "$t" >"out/$t.log" 2>&1 || true
    stats="out/$t/default/fuzzer_stats"
    get() { awk -F' *: *' -v k="$1" '$1 == k { print $2 }' "$stats" 2>/dev/null; }
    execs=$(get execs_done); paths=$(get corpus_count); crashes=$(get saved_crashes); hangs=$(get saved_hangs)
    printf '%-22s %12s %8s %6s %6s\n' "$t" "${execs:-?}" "${paths:-?}" "${crashes:-?}" "${hangs:-?}"
    if [ "${crashes:-1}" != 0 ] || [ "${hangs:-1}" != 0 ]; then status=1; fi
done
exit $status
