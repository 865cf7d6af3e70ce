#!/usr/bin/env bash
# monitor.sh SECONDS: every second, /health's code; every 5 s a text chat (short timeout). Timestamped.
end=$(( $(date +%s) + $1 )); i=0
while [ "$(date +%s)" -lt "$end" ]; do
  h=$(curl -s -o /dev/null -m 3 -w "%{http_code}" http://127.0.0.2:8000/health || true)
  line="$(date +%T) health=$h"
  if [ $((i % 5)) = 0 ]; then
    line="$line text=$(../../.venv/bin/python client.py --timeout 10 | python3 -c 'import sys,json; d=json.load(sys.stdin); print(d["status"], d["latency_s"])')"
  fi
  echo "$line"; i=$((i+1)); sleep 1
done
