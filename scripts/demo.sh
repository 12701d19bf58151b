#!/usr/bin/env bash
# The main job: set up, then run the demo (train a small K3 on Python source, generate with and without
# speculative decoding). Extra arguments go to `k3nn demo`.
source "$(dirname "$0")/setup.sh"
exec k3nn demo "$@"
