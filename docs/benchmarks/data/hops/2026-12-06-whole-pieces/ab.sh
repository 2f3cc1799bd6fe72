#!/usr/bin/env bash
# A reply of up to WHOLE_PIECES pieces' bytes whole, against every reply past one piece in pieces (OLD: a checkout
# of the commit before, laid out as the `academus` package, e.g. /tmp/oldpkg/academus/{shared,services,loadgen,v1}).
# Usage: ab.sh ROUNDS OLD OUT. Each round runs frame_hol --streams and --replies in both arms, the order alternating.
set -euo pipefail
rounds=$1 old=$2 out=$3
mkdir -p "$out"
sizes="0.1875 0.25 0.375 0.5 1 4"
for ((r = 0; r < rounds; r++)); do
  if ((r % 2 == 0)); then order="new old"; else order="old new"; fi
  for arm in $order; do
    for large in streams replies; do
      if [[ $arm == old ]]; then pp=$old; else pp=; fi
      PYTHONPATH=$pp python -m academus.loadgen.probes.frame_hol --$large --sizes-mib $sizes --repeats 9 \
        | tail -1 > "$out/$arm-$large-$r.json"
    done
  done
done
