#!/usr/bin/env bash
# Runs a device session's steps one after another, each alone under its own timeout, each logging to $OUT as it
# runs (docs/KERNEL_NOTES.md, "How to spend a GPU call"); timeout kills the whole process group. A steps file has one step a line:
#
#   <timeout seconds> <name> <command...>      (blank lines and lines starting with # are skipped)
#
#   OUT=/tmp/out BUDGET=580 scripts/gpu/run_steps.sh scripts/gpu/session12_call1.steps
#
# BUDGET (seconds, default 580) caps the whole run: a step's limit shrinks to what is left of it, and a step with
# less than 20 s left is skipped, so the call returns before the device tool's 600 s limit kills everything.
#
# Each step's stdout+stderr goes to $OUT/<name>.log; a summary line per step (rc, seconds) goes to $OUT/steps.log and
# stdout. A step that times out is killed with its process group, and the GPU is given a few seconds to drain before
# the next one (a killed process can leave kernels running, IX13).
set -u
steps=${1:?usage: run_steps.sh STEPS_FILE}
out=${OUT:?set OUT}
mkdir -p "$out"
deadline=$(( $(date +%s) + ${BUDGET:-580} ))
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
while IFS= read -r line || [[ -n "$line" ]]; do
    [[ -z "${line// }" || "$line" == \#* ]] && continue
    read -r limit name cmd <<<"$line"
    start=$(date +%s)
    left=$(( deadline - start - 5 ))
    if (( left < 20 )); then
        echo "[$(date +%H:%M:%S)] --- $name skipped: ${left}s left of BUDGET" | tee -a "$out/steps.log"
        continue
    fi
    (( limit > left )) && limit=$left
    echo "[$(date +%H:%M:%S)] >>> $name (limit ${limit}s): $cmd" | tee -a "$out/steps.log"
    timeout --kill-after=10 "$limit" bash -c "$cmd" >"$out/$name.log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    echo "[$(date +%H:%M:%S)] <<< $name rc=$rc ${secs}s" | tee -a "$out/steps.log"
    tail -n 15 "$out/$name.log"
    if [[ $rc -eq 124 || $rc -eq 137 ]]; then sleep 5; fi
done <"$steps"
