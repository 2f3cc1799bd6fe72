#!/usr/bin/env bash
# One and three bare grpc.aio hops (academus.loadgen.grpc_floor, sequential, no work) with gRPC's EventEngine
# client and listener experiments on (the default) and off, alternating, ROUNDS times. The experiment list is read
# from the environment by every process of the floor. Usage: bash floors.sh [ROUNDS]
for round in $(seq "${1:-2}"); do
  for experiments in "" "-event_engine_client" "-event_engine_listener" "-event_engine_client,-event_engine_listener"; do
    echo "round $round GRPC_EXPERIMENTS=[$experiments]"
    GRPC_EXPERIMENTS="$experiments" python -m academus.loadgen.grpc_floor --requests 1500 --work-ms 0 \
      | grep -o '"hops": [13], [^}]*}' | sed 's/"work_ms": 0.0, "spin": false, "streams": false, //'
  done
done
