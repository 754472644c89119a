#!/bin/bash
# usage: expand.sh SCRIPT OUT ; prints the argv of the python call the script makes, one per line
script=$1; out=$2
bash -c '
out=$1; script=$2
capture() { while [ $# -gt 0 ] && [ "$1" != "-m" ]; do shift; done; shift 2; printf "%s\n" "$@" > "$out"; exit 0; }
python3() { capture "$@"; }
python() { capture "$@"; }
ray() { while [ $# -gt 0 ] && [ "$1" != "--" ]; do shift; done; shift; capture "${@:2}"; }
export HOME=/home/user SLURM_JOB_NUM_NODES=1; conda() { :; }
set --
cd /tmp
source "$script" >/dev/null 2>&1
' _ "$out" "$script"
