#!/bin/sh
# CANN's environment (pyACL on PYTHONPATH, its libraries and the mounted driver's on LD_LIBRARY_PATH),
# then `gepool start ARGS` in this process's place, so that SIGTERM reaches it.
for env in /usr/local/Ascend/ascend-toolkit/set_env.sh /usr/local/Ascend/cann/set_env.sh; do
  if [ -f "$env" ]; then
    . "$env"
    break
  fi
done
driver=/usr/local/Ascend/driver/lib64
export LD_LIBRARY_PATH="$driver:$driver/common:$driver/driver${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec gepool start "$@"
