#!/bin/sh
# The image's entrypoint: pick the GPUs, then run the command.
#   GPUS=all (default) uses every GPU the container was given; GPUS=0,1 uses those (CUDA_VISIBLE_DEVICES),
#   so `tuneledger train` starts one rank per listed GPU.
set -e
case "${GPUS:-all}" in
    all) ;;
    *) CUDA_VISIBLE_DEVICES="$GPUS"; export CUDA_VISIBLE_DEVICES ;;
esac
exec "$@"
