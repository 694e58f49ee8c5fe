#!/usr/bin/env bash
# A one-node Slurm cluster on this host for the tests (tests/test_slurm.py): munge, MariaDB,
# slurmdbd (the job accounting that sacct, and so submitit, reads), slurmctld and slurmd, with
# this host as the only node of partition `debug`. Run as root, after installing Debian 12's
# packages (the README's test command):
#     apt-get install -y munge slurmctld slurmd slurm-client slurmdbd mariadb-server
# It installs nothing, starts only what does not already answer, and returns once `sinfo`
# shows the node idle (or running jobs), so it can run again on a host where it already ran.
set -euo pipefail

MARKER="# Written by exporter's tests/slurm/start.sh"
HOST=$(hostname -s)
CLUSTER=exporter-tests
LOGS=/var/log/slurm

if [[ $(id -u) != 0 ]]; then
    echo "start.sh: run as root (it starts munged, mariadbd and Slurm's daemons)" >&2
    exit 1
fi
for command in munged mariadbd slurmdbd slurmctld slurmd sinfo sacctmgr; do
    if ! command -v "$command" >/dev/null; then
        echo "start.sh: $command is missing; install: apt-get install -y munge slurmctld" \
            "slurmd slurm-client slurmdbd mariadb-server" >&2
        exit 1
    fi
done

# Writes $2 into $1 unless the file is someone else's (a real cluster's configuration);
# succeeds where the file changed.
write_config() {
    local path=$1 text="$MARKER"$'\n'"$2"
    if [[ -e $path ]] && ! head -n 1 "$path" | grep -qxF "$MARKER"; then
        echo "start.sh: $path exists and is not this script's; not touching this host's Slurm" >&2
        exit 1
    fi
    if [[ -e $path ]] && [[ $(cat "$path") == "$text" ]]; then
        return 1
    fi
    printf '%s\n' "$text" >"$path"
}

# Whether the process named in pid file $1 runs.
running() {
    [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

# Polls a command once a second for up to a minute, until it succeeds; $1 says what it waits for.
wait_for() {
    local what=$1
    shift
    for _ in $(seq 60); do
        if "$@" >/dev/null 2>&1; then
            return 0
        fi
        sleep 1
    done
    echo "start.sh: $what did not come up; see $LOGS and /var/log/mysql" >&2
    exit 1
}

mkdir -p "$LOGS" /run/munge /var/spool/slurmd /var/lib/slurm/slurmctld /var/log/mysql
chown munge:munge /run/munge
chown slurm:slurm "$LOGS" /var/lib/slurm/slurmctld
chown mysql:mysql /var/log/mysql

# The cluster (every Slurm command reads it). The node is this host as slurmd sees it (CPUs,
# sockets, cores, memory).
NODE=$(slurmd -C | head -n 1)
SLURM_CONF_CHANGED=false
write_config /etc/slurm/slurm.conf "ClusterName=$CLUSTER
SlurmctldHost=$HOST
SlurmUser=slurm
AuthType=auth/munge
# No cgroups where the tests run (containers): processes are tracked by their parent ids.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
# Seconds between a job's SIGTERM at its time limit and SIGKILL (Slurm's default).
KillWait=30
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/none
$NODE State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP" && SLURM_CONF_CHANGED=true

# munge: Slurm's daemons and commands authenticate each other with it.
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    runuser -u munge -- munged
    wait_for munged sh -c 'munge -n </dev/null | unmunge'
fi

# MariaDB, the store of slurmdbd. slurmdbd runs as user slurm and logs in through the Unix
# socket as that user: no password to keep.
if ! mariadb-admin ping >/dev/null 2>&1; then
    setsid mariadbd --user=mysql --innodb-lock-wait-timeout=900 --log-error=/var/log/mysql/error.log </dev/null >/dev/null 2>&1 &
    wait_for mariadbd mariadb-admin ping
fi
mariadb -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED VIA unix_socket;
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"

write_config /etc/slurm/slurmdbd.conf "AuthType=auth/munge
DbdHost=localhost
SlurmUser=slurm
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StorageLoc=slurm_acct_db
PidFile=/run/slurmdbd.pid
LogFile=$LOGS/slurmdbd.log" || true
chown slurm:slurm /etc/slurm/slurmdbd.conf
chmod 600 /etc/slurm/slurmdbd.conf
if ! running /run/slurmdbd.pid; then
    slurmdbd
    wait_for slurmdbd sacctmgr --noheader list cluster
fi

# The cluster must be known to slurmdbd before slurmctld registers with it.
if ! sacctmgr --noheader --parsable2 list cluster format=cluster | grep -qx "$CLUSTER"; then
    sacctmgr --immediate add cluster "$CLUSTER" >/dev/null
fi
if ! running /run/slurmctld.pid; then
    slurmctld
elif $SLURM_CONF_CHANGED; then
    # Daemons of an earlier run read the configuration again.
    scontrol reconfigure
fi
if ! running /run/slurmd.pid; then
    slurmd
fi
# A node left down or drained by an earlier run (its slurmd stopped) takes jobs again.
if sinfo --noheader --nodes="$HOST" --format=%T | grep -qE '^(down|drain)'; then
    scontrol update nodename="$HOST" state=resume
fi
# Idle, or running jobs already (the script ran again while tests ran).
wait_for "node $HOST" sh -c \
    "sinfo --noheader --nodes=$HOST --format=%T | grep -qxE 'idle|mixed|allocated|completing'"
echo "start.sh: Slurm cluster $CLUSTER up: $(sinfo --noheader --format='%P %D node %N %T')"
