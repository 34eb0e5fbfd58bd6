// Hopper (wgmma) attention forward for head_dim 64.
#include "attention_fwd_sm90.cuh"

FUSEDOPS_ATTENTION_LAUNCHER(launch_attention_fwd_sm90_hdim, AttentionFwdParams, attention::sm90::launch_fwd_sm90, 64)
