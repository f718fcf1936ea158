#!/usr/bin/env bash
# Start the local PostgreSQL and Redis the shared-backend tests use, if they are installed
# but not running. Prints what it did; never fails the caller (tests then skip, or fail
# under CI=true, with a reason).
set -u

if command -v redis-cli >/dev/null 2>&1; then
  if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
    if command -v redis-server >/dev/null 2>&1; then
      echo "ensure-services: starting redis on 127.0.0.1:6379"
      redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
        >/dev/null 2>&1 || echo "ensure-services: could not start redis"
      for _ in $(seq 1 50); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 0.1; done
    fi
  fi
else
  echo "ensure-services: redis is not installed (apt-get install redis-server)"
fi

if command -v pg_ctlcluster >/dev/null 2>&1 && [ -d /etc/postgresql ]; then
  if ! pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; then
    echo "ensure-services: starting postgresql"
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start \
      >/dev/null 2>&1 || echo "ensure-services: could not start postgresql"
  fi
fi
exit 0
