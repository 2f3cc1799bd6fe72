#!/usr/bin/env bash
# The loop-stall runs with the workers yielding while saturated (ACADEMUS_SATURATED_NICE=10, the default) against
# equal shares (0). Usage, from the repository root: bash ab.sh ROUNDS OUTDIR
exec bash "$(dirname "$0")/../2026-12-05-loop-stalls/ab.sh" "$1" "$2" ACADEMUS_SATURATED_NICE saturated 10 0
