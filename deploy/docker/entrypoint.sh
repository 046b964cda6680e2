#!/bin/sh
# PID 1 of the elastictrain image: runs its arguments as a child, forwards SIGTERM, SIGINT,
# SIGUSR1 and SIGHUP to it (a plain `/bin/sh -c` as PID 1 forwards nothing, and PID 1
# ignores signals it has no handler for), and exits with the child's code. With
# ELASTICTRAIN_EXIT_PREEMPTED_AS set, exit 75 ("preempted, final snapshot committed") and
# exit 76 ("preempted, the final snapshot failed": resume from the previous one) become
# that code, for controllers that retry only some codes (Kubeflow's restartPolicy
# ExitCode retries exit codes >= 128).
"$@" &
child=$!
for sig in TERM INT USR1 HUP; do
    trap "kill -$sig $child 2>/dev/null" "$sig"
done
while :; do
    wait "$child"
    rc=$?
    kill -0 "$child" 2>/dev/null || break  # wait returned for a trapped signal: again
done
if { [ "$rc" -eq 75 ] || [ "$rc" -eq 76 ]; } && [ -n "${ELASTICTRAIN_EXIT_PREEMPTED_AS:-}" ]; then
    exit "$ELASTICTRAIN_EXIT_PREEMPTED_AS"
fi
exit "$rc"
