# Sourced by the staging scripts: download_wheels DIR puts into DIR the wheels a GPU node's image lacks, pinned
# as this venv ($PY) has them, for CPython 3.12 on x86-64.
download_wheels() {
  local pins platforms="" p
  pins=$($PY -m pip freeze | grep -i -E '^(grpcio|grpcio-health-checking|grpcio-reflection|protobuf|redis|hdrhistogram|pbr|isal|opentelemetry-[a-z-]+|googleapis-common-protos)==')
  for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=" --platform $p"
  done
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms \
    -d "$1" $pins
}
