#!/usr/bin/env bash
# Which side of the public hop the setting helps: services started plain (no launcher), the setting given to the
# services only, to the client only, or to neither; ROUNDS rounds, alternating. Usage: bash mesh_plain.sh OUT [ROUNDS]
off=-event_engine_client,-event_engine_listener
for round in $(seq "${2:-2}"); do
  python mesh_sequential.py "$1" --plain GRPC_EXPERIMENTS= | grep p50
  python mesh_sequential.py "$1" --plain GRPC_EXPERIMENTS=$off | grep p50
  GRPC_EXPERIMENTS=-event_engine_client python mesh_sequential.py "$1" --plain GRPC_EXPERIMENTS= | grep p50
done
