# Sourced by scripts/device_prepare.sh and scripts/device_session.sh: the steps a session knows, and the
# checkpoints each needs (those must travel in the payload).
STEPS=${STEPS:-lossless gen train}
check_steps() {  # $1: the calling script, named in the message
    local s
    for s in $STEPS; do case $s in lossless|gen|train|pairs|headroom) ;;
        *) echo "$1: unknown step '$s' in STEPS (lossless gen train pairs headroom)" >&2; exit 2 ;;
    esac; done
}
step_ckpts() {  # the checkpoint folders step $1 needs
    case $1 in
      train|pairs) echo "${INIT:-drafters/checkpoints/dflash-smollm2}" ;;
      headroom) echo drafters/checkpoints/dflash-smollm2 drafters/checkpoints/dspark-smollm2 ;;
    esac
}
