// Hopper (wgmma) attention backward for head_dim 128.
#include "attention_bwd_sm90.cuh"

FUSEDOPS_ATTENTION_LAUNCHER(launch_attention_bwd_sm90_hdim, AttentionBwdParams, attention::sm90::launch_bwd_sm90, 128)
