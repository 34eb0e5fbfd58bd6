// Hopper (wgmma) attention forward for head_dim 64.
#include "attention_fwd_sm90.cuh"

FUSEDOPS_ATTENTION_SM90_HEAD_DIM(64)
