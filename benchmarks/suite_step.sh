# Sourced by the GPU suites: step NAME SECONDS COMMAND... runs COMMAND with a time
# limit, its output to $out/NAME.log, then prints its exit code, time and log's tail.
step() {
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  echo "== $name: exit $? in $((SECONDS - start)) s"
  tail -"${STEP_TAIL:-25}" "$out/$name.log"
}
