#!/usr/bin/env bash
# down.sh: stop the pods up.sh started (each is its own process group), by the PIDs it recorded.
for n in head talker code2wav mooncake-master; do
  f=/tmp/vo-qwen/$n.pid
  [ -f "$f" ] || continue
  pid=$(cat "$f")
  kill -TERM -- "-$pid" 2>/dev/null && echo "stopped $n ($pid)"
done
sleep ${GRACE:-10}
for n in head talker code2wav mooncake-master; do
  f=/tmp/vo-qwen/$n.pid
  [ -f "$f" ] || continue
  pid=$(cat "$f")
  kill -KILL -- "-$pid" 2>/dev/null && echo "killed $n ($pid) after grace"
  rm -f "$f"
done
true
